"""A rollout worker keeps several groups in flight (rlfleet/services/rollout/main.py: `maxGroupsInFlight`
groups per engine call): a real worker loop with a real torch engine, an origin over HTTP and a real
Redis. Batches take no more than the trainer still wants, less what the pool's other workers are sampling
(rlfleet/services/rollout/backpressure.py), and no group mixes versions across a swap."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rlfleet.config import load_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.policy import load_policy, score
from rlfleet.services.rollout.backpressure import RECORD_FLOOR_SECONDS, record_value
from rlfleet.services.rollout.main import RolloutOptions, Worker
from rlfleet.services.shardcast.origin import make_app
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.rollout.test_worker_demand import settled
from tests.runs import pool, rlrun, write_rlrun
from tests.support import serving, tiny_policy_dir, wait_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingEngine(TorchEngine):
    """The torch engine, recording each call's batch size; `during_batch` runs inside the next call
    (before any token is drawn), e.g. to announce a version while a batch is generating."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int, int]] = []  # (groups, version) per call
        self.during_batch = None

    def generate_groups(self, requests):
        hook, self.during_batch = self.during_batch, None
        if hook:
            hook()
        self.batches.append((len(requests), self.version))
        return super().generate_groups(requests)


def start(tmp_path: Path, redis_client, monkeypatch, max_pending: int, in_flight: int = 3):
    """Versions 0 and 1 of a tiny policy published, version 0 announced; a worker (not yet running) of a
    pool with maxGroupsInFlight `in_flight` on a recording engine."""
    run = rlrun(
        "batch",
        model=tmp_path / "not-here",
        task={"maxOperand": 999},
        sampling={"groupSize": 2, "maxTokens": 6},
        trainer={"batchSize": 4, "maxAsyncLevel": 1},
        store=tmp_path / "store",
    )
    config = write_rlrun(
        tmp_path / "rlrun.yaml",
        run,
        pool("pool", "batch", replicas=1, maxPending=max_pending, maxGroupsInFlight=in_flight),
    )
    bundle = load_bundle(config)
    key_file, public = generate_keypair(tmp_path / "keys")
    monkeypatch.setenv(env.PUBLIC_KEY, public)
    store = open_store(bundle.run.spec.store.uri)
    signer = make_signer(load_private_key(key_file))
    dirs = [tiny_policy_dir(tmp_path / f"v{v}", seed=v) for v in (0, 1)]
    for v, d in enumerate(dirs):
        publish_version(store, "batch", v, d, signer=signer)
    keys = RunKeys("batch")
    ctx = Context(bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event())
    redis_client.xadd(keys.policy, encode_json({"version": 0}))
    return ctx, config, store, dirs


def running(ctx, config, origin_url, tmp_path, engine, made: list | None = None):
    worker = Worker(
        ctx, RolloutOptions(config=config, worker_id="w", cache_dir=tmp_path / "cache", relay_urls=[origin_url])
    )
    worker.engine = engine  # loads the first announced version into it (wait_first_version)
    if made is not None:
        made.append(worker)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_for("the worker's engine on version 0", lambda: engine.version == 0, 60)
    return worker, thread


def test_a_batch_takes_k_groups_but_never_more_than_the_trainer_still_wants(tmp_path, redis_client, monkeypatch):
    ctx, config, store, dirs = start(tmp_path, redis_client, monkeypatch, max_pending=100)
    keys = ctx.keys
    redis_client.hset(keys.demand, mapping={"oldest": 0, "need": 7})  # 7 groups of version 0, none later
    engine = RecordingEngine(dirs[0], -1)
    with serving(make_app(store, "batch")) as origin_url:
        worker, thread = running(ctx, config, origin_url, tmp_path, engine)
        try:
            assert settled(redis_client, keys, worker) == 7, (engine.batches, worker.room(), thread.is_alive())
            assert worker.paused() == "enough_queued"
            assert [n for n, _ in engine.batches] == [3, 3, 1], "K = 3 per call, the last one the 1 still wanted"
            redis_client.hset(keys.demand, "need", 9)
            assert settled(redis_client, keys, worker) == 9
            assert [n for n, _ in engine.batches][3:] == [2]
        finally:
            ctx.stop.set()
            thread.join(30)
    assert not thread.is_alive()
    groups = [RolloutGroup.decode(m) for _, m in redis_client.xrange(keys.rollouts)]
    assert len({g.rollout_id for g in groups}) == 9 and all(len(g.samples) == 2 for g in groups)
    assert len({(g.task_id, g.sampling.seed) for g in groups}) == 9, "every group of a batch is its own work"


def redis_now(redis_client) -> float:
    seconds, micros = redis_client.time()
    return seconds + micros / 1e6


def test_a_batch_leaves_out_what_the_other_workers_are_sampling(tmp_path, redis_client, monkeypatch):
    ctx, config, store, dirs = start(tmp_path, redis_client, monkeypatch, max_pending=100)
    keys = ctx.keys
    # Another worker is sampling a batch it expects 4 groups from; a third died mid-batch long ago.
    redis_client.hset(keys.sampling, "other", record_value(4, redis_now(redis_client) + 600))
    redis_client.hset(keys.sampling, "gone", record_value(8, redis_now(redis_client) - 1))
    redis_client.hset(keys.demand, mapping={"oldest": 0, "need": 7})  # 7 groups of version 0, none later
    engine = RecordingEngine(dirs[0], -1)
    records: list[tuple[float, float, float]] = []  # (groups, deadline, Redis time) of this worker's own record

    def own_record():
        groups, deadline = (float(x) for x in redis_client.hget(keys.sampling, "w").split())
        records.append((groups, deadline, redis_now(redis_client)))

    engine.during_batch = own_record
    with serving(make_app(store, "batch")) as origin_url:
        worker, thread = running(ctx, config, origin_url, tmp_path, engine)
        try:
            assert settled(redis_client, keys, worker) == 3, "7 wanted, 4 of them coming from the other worker"
            assert [n for n, _ in engine.batches] == [3]
            groups, deadline, now = records[0]
            assert groups == 3, "every group sampled is expected (none of them repeats trained work yet)"
            assert now + RECORD_FLOOR_SECONDS - 2 < deadline <= now + RECORD_FLOOR_SECONDS + 1, "in Redis's clock"
            assert not redis_client.hexists(keys.sampling, "w"), "deleted after the batch's last send"
            redis_client.hdel(keys.sampling, "other")  # the other worker's batch is in the inbox now
            assert settled(redis_client, keys, worker) == 7
            assert [n for n, _ in engine.batches] == [3, 3, 1]
        finally:
            ctx.stop.set()
            thread.join(30)
    assert not thread.is_alive()


def _logprob_error(model, group: RolloutGroup) -> float:
    with torch.inference_mode():
        scored = score(model, [group.prompt_ids + s.completion_ids for s in group.samples], 1.0, 0)
    p = len(group.prompt_ids)
    return max(
        (scored.logprobs[i][p - 1 :] - torch.tensor(s.logprobs)).abs().max().item() for i, s in enumerate(group.samples)
    )


def test_no_group_of_a_batch_mixes_versions_across_a_swap_announced_while_it_generates(
    tmp_path, redis_client, monkeypatch
):
    ctx, config, store, dirs = start(tmp_path, redis_client, monkeypatch, max_pending=5)
    keys = ctx.keys
    engine = RecordingEngine(dirs[0], -1)
    workers: list[Worker] = []

    def announce_and_wait_for_the_download():  # version 1 is ready to load while the first batch generates
        redis_client.xadd(keys.policy, encode_json({"version": 1}))
        wait_for("version 1 downloaded", lambda: (workers[0].follower.ready or (0,))[0] == 1, 60)

    engine.during_batch = announce_and_wait_for_the_download
    with serving(make_app(store, "batch")) as origin_url:
        worker, thread = running(ctx, config, origin_url, tmp_path, engine, workers)
        try:
            # inbox bounded by maxPending 5: a batch of 3 on version 0, then one of 3 on version 1
            assert settled(redis_client, keys, worker) == 6
        finally:
            ctx.stop.set()
            thread.join(30)
    assert engine.batches == [(3, 0), (3, 1)], "the swap waited for the batch in flight"
    groups = [RolloutGroup.decode(m) for _, m in redis_client.xrange(keys.rollouts)]
    assert [g.policy_version for g in groups] == [0, 0, 0, 1, 1, 1]
    models = {v: load_policy(d)[0] for v, d in enumerate(dirs)}
    for g in groups:  # every token of a group comes from the version it records, none from the other
        assert _logprob_error(models[g.policy_version], g) < 1e-4
        assert _logprob_error(models[1 - g.policy_version], g) > 1e-2
