"""A rollout worker samples only what the trainer can still train (rlfleet/services/rollout/main.py,
Worker.paused, from the trainer's `demand` hash): a real worker loop with a real engine, an origin over
HTTP and a real Redis; the test plays the trainer's side of the hash and the policy stream."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from rlfleet.config import load_bundle
from rlfleet.fleet.repeats import RepeatTally, Tally
from rlfleet.proofs.toploc import build_proofs_many
from rlfleet.services.rollout import main as rollout_main
from rlfleet.services.rollout.main import RolloutOptions, Worker
from rlfleet.services.rollout.repeats import worth_sending
from rlfleet.services.rollout.work import Work
from rlfleet.services.shardcast.origin import make_app
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, encode_json, group_digest
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import pool, rlrun, write_rlrun
from tests.support import serving, tiny_policy_dir, wait_for


def write_config(path: Path, model: Path, store: Path, level: int) -> Path:
    """The run (batches of 3 groups of 2, `level` versions of asynchrony) and its one pool."""
    run = rlrun(
        "demand",
        model=model,
        task={"maxOperand": 20},
        sampling={"groupSize": 2, "maxTokens": 4},
        trainer={"batchSize": 3, "maxAsyncLevel": level},
        store=store,
    )
    return write_rlrun(path, run, pool("pool", "demand", replicas=1, maxPending=100))


def settled(redis_client, keys, worker: Worker, quiet: float = 1.0, timeout: float = 60.0) -> int:
    """The inbox length once the worker says it is paused and no group has been added for `quiet` seconds;
    a worker that never pauses fails the test after `timeout` seconds instead of running into pytest's
    timeout. Asking the worker matters on a loaded machine: a batch still generating adds nothing for
    a while, and then the worker is not paused (its room is still open)."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while True:
        n = redis_client.xlen(keys.rollouts)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet and worker.paused() is not None:
            return n
        assert time.monotonic() < deadline, f"the worker never paused: {n} groups in the inbox after {timeout:g} s"
        time.sleep(0.05)


def test_the_worker_samples_only_what_the_trainer_can_still_take(tmp_path, redis_client, monkeypatch):
    config = write_config(tmp_path / "rlrun.yaml", tmp_path / "not-here", tmp_path / "store", level=1)
    bundle = load_bundle(config)
    key_file, public = generate_keypair(tmp_path / "keys")
    monkeypatch.setenv(env.PUBLIC_KEY, public)
    store = open_store(bundle.run.spec.store.uri)
    signer = make_signer(load_private_key(key_file))
    for v in (0, 1):
        publish_version(store, "demand", v, tiny_policy_dir(tmp_path / f"v{v}", seed=v), signer=signer)
    keys = RunKeys("demand")
    ctx = Context(bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event())
    # The trainer holds its batch for the step that trains version 0 last: version 0 is no longer wanted.
    redis_client.hset(keys.demand, mapping={"oldest": 1, "need": 3})
    redis_client.xadd(keys.policy, encode_json({"version": 0}))
    with serving(make_app(store, "demand")) as origin_url:
        options = RolloutOptions(config=config, worker_id="w", cache_dir=tmp_path / "cache", relay_urls=[origin_url])
        worker = Worker(ctx, options)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            wait_for("the worker's engine on version 0", lambda: worker.engine and worker.engine.version == 0, 60)
            assert worker.paused() == "batch_full"
            assert settled(redis_client, keys, worker) == 0, (
                "no group is sampled on a version the trainer will not train"
            )

            redis_client.xadd(keys.policy, encode_json({"version": 1}))
            wait_for("the swap to version 1", lambda: worker.engine.version == 1, 60)
            # Version 1 is the oldest the next step trains and no later step will: its 3 groups only.
            assert settled(redis_client, keys, worker) == 3
            assert worker.paused() == "enough_queued"
            # A trainer collecting at version 1 (maxAsyncLevel 1: oldest 0) trains version 1 for one
            # more step: this step's 3 groups and one more batch of 3, then the worker waits.
            redis_client.hset(keys.demand, "oldest", 0)
            assert settled(redis_client, keys, worker) == 6
            assert worker.paused() == "enough_queued"

            redis_client.hset(keys.demand, "need", 1)  # the trainer took 2 of its step's groups from elsewhere
            assert worker.paused() == "enough_queued", "the 6 queued cover 1 + one batch"
            redis_client.xtrim(keys.rollouts, maxlen=2, approximate=False)  # the gate took 4 of them
            assert settled(redis_client, keys, worker) == 4
            versions = [RolloutGroup.decode(m).policy_version for _, m in redis_client.xrange(keys.rollouts)]
            assert versions == [1, 1, 1, 1]
            # Verified groups the trainer has not taken count as queued; those it holds do not.
            redis_client.xadd(keys.verified, {b"m": b"held by the trainer"})
            redis_client.xadd(keys.verified, {b"m": b"waiting for the trainer"})
            redis_client.hset(keys.demand, "held", 1)
            redis_client.xtrim(keys.rollouts, maxlen=2, approximate=False)
            assert settled(redis_client, keys, worker) == 3, "2 in the inbox + 1 verified waiting cover 1 + one batch"
            # The trainer keeps half of what it reads (the rest repeats trained work): the 4 queued count as 2
            # kept, so the worker samples until 8 are queued (1 + one batch, divided by 1/2): 7 in the inbox.
            redis_client.hset(keys.demand, "kept", "0.5000")
            assert settled(redis_client, keys, worker) == 7
            assert worker.paused() == "enough_queued"
        finally:
            ctx.stop.set()
            thread.join(30)
    assert not thread.is_alive()
    # A group whose content the trainer already trained is not sent (repeats.worth_sending): one ZMSCORE of the
    # trained set, which the worker's read user may do (rlfleet/wire/redis_acl.py).
    sent = [RolloutGroup.decode(m) for _, m in redis_client.xrange(keys.rollouts)]
    redis_client.zadd(keys.trained, {group_digest(sent[1]): 1, group_digest(sent[4]): 2})

    def repeats() -> float:
        return REGISTRY.get_sample_value("rlfleet_rollout_repeated_groups_total") or 0.0

    before = repeats()
    fresh = worth_sending(worker.reader, ctx, sent, hold_flat=False)
    assert [g.rollout_id for g in fresh] == [g.rollout_id for i, g in enumerate(sent) if i not in (1, 4)]
    assert repeats() - before == 2
    # ... and counted where the trainer reads them for the sampled reward (rlfleet/fleet/repeats.py).
    tally = RepeatTally()
    held_back = tally.take(redis_client.hgetall(keys.repeats))
    rewards = [s.reward for i in (1, 4) for s in sent[i].samples]
    assert held_back == {"": Tally(groups=2, samples=len(rewards), reward_sum=pytest.approx(sum(rewards)))}
    assert tally.take(redis_client.hgetall(keys.repeats)) == {}, "each repeat is counted once"
    assert len(worth_sending(worker.reader, ctx, sent[:2], hold_flat=False)) == 1
    assert tally.take(redis_client.hgetall(keys.repeats))[""].groups == 1 and tally.total_repeats() == 3
    # The worker asks before it builds proofs: a repeat costs its sampling, never its proofs (the digest does not
    # cover them). The real build_proofs_many, counted.
    built: list[int] = []

    def counted(activations, *args, **kwargs):
        built.append(len(activations))
        return build_proofs_many(activations, *args, **kwargs)

    monkeypatch.setattr(rollout_main, "build_proofs_many", counted)
    work = [Work(sent[0].task_id, 7), Work(sent[2].task_id, 8)]
    first = worker.make_groups(work)
    assert len(first) == 2 and built == [4], "two groups of 2 samples, one vectorised pass"
    assert all(len(s.proofs) == 2 for g in first for s in g.samples), "a prompt chunk and a decode chunk each"
    redis_client.zadd(keys.trained, {group_digest(first[0]): 3})
    before = repeats()
    again = worker.make_groups(work)  # the same seeds on the same version: the same completions
    assert [group_digest(g) for g in again] == [group_digest(first[1])] and repeats() - before == 1
    assert built == [4, 2], "proofs built for the one group sent"
    assert [s.proofs for s in again[0].samples] == [s.proofs for s in first[1].samples]
    worker.engine.close()
