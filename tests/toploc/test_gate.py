"""The verification gate against real parts: redis-server, an origin over HTTP, real TOPLOC proofs.

Here: the service behaviour (exactly-once forwarding across replicas, spot-checking, the ban
policy, config errors); test_gate_tamper.py holds the tamper suite, test_gate_api.py the HTTP API.
The helpers below are shared by those files."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import is_banned, one_worker_stats
from rlfleet.operator.names import TRAINER, VERIFIER
from rlfleet.proofs.toploc import build_proofs
from rlfleet.services.shardcast.origin import make_app
from rlfleet.services.toploc.main import Gate
from rlfleet.services.trainer.main import Trainer
from rlfleet.services.trainer.state import Commit
from rlfleet.tasks import make_task
from rlfleet.tasks.turns import completion_text
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import (
    MESSAGE_FIELD,
    RolloutGroup,
    RunKeys,
    Sample,
    SamplingParams,
    decode_json,
    encode_json,
    group_digest,
)
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import bundle_yaml, rlrun
from tests.support import redis_from_url, serving, tiny_policy_dir


def gate_config(model: Path, store: Path, sampling: str, verifier: str, **spec: str) -> str:
    """The gate tests' RLRun; `sampling`, `verifier` and any other section in `spec` are YAML flow mappings, as
    the tests write them."""
    return bundle_yaml(
        rlrun(
            "gate",
            model=model,
            task={"maxOperand": 20},
            sampling=yaml.safe_load(sampling),
            trainer={"batchSize": 1, "maxAsyncLevel": 1, "learningRate": 1.0e-3},
            verifier=yaml.safe_load(verifier),
            store=store,
            **{section: yaml.safe_load(text) for section, text in spec.items()},
        )
    )


@contextmanager
def gate_system(tmp_path, redis_url, sampling="{groupSize: 4, maxTokens: 4}", verifier="{}", **spec: str):
    """A published version 0 of a tiny policy, an origin serving it, and a run context; `spec`: more sections
    of the run (gate_config)."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    bundle = parse_bundle(gate_config(policy, tmp_path / "store", sampling, verifier, **spec))
    store = open_store(bundle.run.spec.store.uri)
    # The run signs its manifests, as `rlfleet run` does: the gate checks them, the trainer signs.
    key_file, public = generate_keypair(tmp_path / "keys")
    saved = {k: os.environ.get(k) for k in (env.SIGNING_KEY_FILE, env.PUBLIC_KEY)}
    os.environ.update({env.SIGNING_KEY_FILE: str(key_file), env.PUBLIC_KEY: public})
    publish_version(store, "gate", 0, policy, signer=make_signer(load_private_key(key_file)))
    client = redis_from_url(redis_url)
    keys = RunKeys("gate")
    client.xadd(keys.policy, encode_json({"version": 0}))
    ctx = Context(bundle=bundle, redis=client, keys=keys, stop=threading.Event())
    try:
        with serving(make_app(store, "gate")) as origin_url:
            yield ctx, policy, origin_url, tmp_path
    finally:
        ctx.stop.set()  # the gates' liveness probers (rlfleet/services/toploc/health.py)
        client.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def system(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url) as s:
        yield s


def generate_samples(engine: TorchEngine, ctx: Context, prompt_ids: list[int], params: SamplingParams, per_batch: int):
    """G generations of one prompt, `per_batch` rows at a time (the rest of the group in later batches)."""
    g, gens = ctx.bundle.run.spec.sampling.group_size, []
    while len(gens) < g:
        n = min(per_batch, g - len(gens))
        gens += engine.generate(prompt_ids, params, n, first=len(gens))
    return gens


def honest_group(
    engine: TorchEngine,
    ctx: Context,
    index: int,
    version: int = 0,
    worker: str = "w-honest",
    per_batch: int | None = None,
) -> RolloutGroup:
    """A group as an honest worker makes it, with the run's sampling parameters."""
    spec = ctx.bundle.run.spec
    s, t = spec.sampling, spec.verifier.toploc
    task = make_task(spec.task)
    problem = task.problem(f"arith-0-{index}")
    prompt_ids = engine.tokenizer(problem.prompt)["input_ids"]
    params = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, seed=index
    )
    samples = []
    for gen in generate_samples(engine, ctx, prompt_ids, params, per_batch or s.group_size):
        text = completion_text(engine.tokenizer, gen.completion_ids, engine.stop_ids)
        proofs = build_proofs(gen.hidden, len(prompt_ids), decode_batching_size=t.decode_batching_size, topk=t.topk)
        samples.append(Sample(gen.completion_ids, gen.logprobs, proofs, task.reward(problem, text), gen.finish_reason))
    return RolloutGroup(
        task_id=problem.task_id,
        worker_id=worker,
        policy_version=version,
        prompt_ids=prompt_ids,
        sampling=params,
        samples=samples,
    )


def handled(ctx: Context) -> int:
    return sum(int(ctx.redis.hget(ctx.keys.stats, k) or 0) for k in ("accepted", "rejected"))


def as_(ctx: Context, component: str) -> Context:
    """The context as `component`'s process gets it: the file read through that component's view."""
    return dataclasses.replace(ctx, bundle=view_bundle(ctx.bundle, VIEWS[component]))


def run_gate(
    ctx: Context, origin_url: str, cache, expected: int, consumer: str = "verifier-0", timeout: float = 60
) -> Gate:
    """Run a real gate loop until `expected` groups have been handled in total."""
    gate = Gate(as_(ctx, VERIFIER), consumer, origin_url, cache)
    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while handled(ctx) < expected:
            assert thread.is_alive(), "the gate died"
            assert time.monotonic() < deadline, "the gate did not handle every group in time"
            time.sleep(0.05)
    finally:
        ctx.stop.set()
        thread.join(30)
        ctx.stop.clear()
    return gate


def rejections(ctx: Context) -> dict:
    """rollout id -> reason of everything on the rejected stream."""
    return {decode_json(f)["rollout_id"]: decode_json(f)["reason"] for _, f in ctx.redis.xrange(ctx.keys.rejected)}


def verified_ids(ctx: Context) -> list[str]:
    return [RolloutGroup.decode(f).rollout_id for _, f in ctx.redis.xrange(ctx.keys.verified)]


def test_verified_groups_train_once_even_when_redelivered(system):
    ctx, policy, origin_url, tmp = system
    keys, r = ctx.keys, ctx.redis
    engine = TorchEngine(policy, 0)
    honest, other = honest_group(engine, ctx, 1), honest_group(engine, ctx, 3)
    for group in (honest, other, honest):  # the second `honest` is a replayed submission
        r.xadd(keys.rollouts, group.encode())
    run_gate(ctx, origin_url, tmp / "cache", expected=3)
    assert rejections(ctx) == {honest.rollout_id: "replay"}
    assert sorted(verified_ids(ctx)) == sorted([honest.rollout_id, other.rollout_id])
    assert r.xlen(keys.rollouts) == 0, "every handled inbox entry is deleted"
    # What the trainer reads: the checked tokens without their proofs, which nobody reads after the gate.
    for _, fields in r.xrange(keys.verified):
        verified = RolloutGroup.decode(fields)
        sent = {g.rollout_id: g for g in (honest, other)}[verified.rollout_id]
        assert all(s.proofs == [] for s in verified.samples) and all(s.proofs for s in sent.samples)
        assert [s.completion_ids for s in verified.samples] == [s.completion_ids for s in sent.samples]
        assert len(fields[MESSAGE_FIELD]) < len(sent.encode()[MESSAGE_FIELD])

    # The trainer sees each verified group once; a redelivered copy of a trained group is skipped.
    trainer = Trainer(as_(ctx, TRAINER), output_dir=None)
    trained = []
    for _ in range(2):
        batch = trainer.read_batch()
        groups, ack = batch.groups, batch.ack
        trainer.step(groups)
        trainer.version += 1
        commit = Commit()
        commit.add([g.rollout_id for g in groups], [group_digest(g) for g in groups], trainer.version, ack)
        trainer.commit(commit)
        trained += [g.rollout_id for g in groups]
    assert sorted(trained) == sorted([honest.rollout_id, other.rollout_id])
    r.xadd(keys.verified, honest.encode())
    r.xadd(keys.verified, other.encode())
    fresh = honest_group(engine, ctx, 5)
    fresh.policy_version = trainer.version
    r.xadd(keys.verified, fresh.encode())
    batch = trainer.read_batch()
    assert [g.rollout_id for g in batch.groups] == [fresh.rollout_id]
    assert batch.drops["duplicate"] == 2


def test_stale_groups_are_rejected(system):
    ctx, policy, origin_url, tmp = system
    engine = TorchEngine(policy, 0)
    for v in (1, 2):
        ctx.redis.xadd(ctx.keys.policy, encode_json({"version": v}))
    ctx.redis.xadd(ctx.keys.rollouts, honest_group(engine, ctx, 5).encode())  # version 0, two behind, maxAsyncLevel 1
    run_gate(ctx, origin_url, tmp / "cache", expected=1)
    [(_, fields)] = ctx.redis.xrange(ctx.keys.rejected)
    assert decode_json(fields)["reason"] == "stale_version"


def test_a_dead_replicas_groups_are_claimed_and_verified_exactly_once(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, verifier="{claimIdleMs: 300}") as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        groups = [honest_group(engine, ctx, i) for i in range(3)]
        for g in groups:
            r.xadd(keys.rollouts, g.encode())
        replica_a = Gate(as_(ctx, VERIFIER), "verifier-a", origin_url, tmp / "cache-a")
        taken = replica_a.read(count=10)  # A holds all three pending, then dies without acking
        assert len(taken) == 3
        assert replica_a.read(count=10, block_ms=10) == []
        run_gate(ctx, origin_url, tmp / "cache-b", expected=3, consumer="verifier-b")
        assert sorted(verified_ids(ctx)) == sorted(g.rollout_id for g in groups)
        assert r.xpending(keys.rollouts, keys.verifier_group)["pending"] == 0
        # A comes back and commits its verdicts late: the entries were committed, nothing is forwarded twice.
        assert [replica_a.handle(msg_id, fields) for msg_id, fields in taken] == [0, 0, 0]
        assert r.xlen(keys.verified) == 3 and rejections(ctx) == {}


def test_spot_checking_skips_only_the_prefill_checks(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, verifier="{spotCheckFraction: 0.0}") as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        other_weights = honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2, worker="w-other")
        for s in other_weights.samples:
            s.reward = 1.0  # inflated: the trusted reward is still computed
        altered_prompt = honest_group(engine, ctx, 3, worker="w-prompt")
        altered_prompt.task_id = "arith-0-999"
        no_proofs = honest_group(engine, ctx, 4, worker="w-lazy")
        no_proofs.samples[0].proofs = no_proofs.samples[0].proofs[:1]
        for g in (other_weights, altered_prompt, no_proofs):
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=3)
        assert rejections(ctx) == {altered_prompt.rollout_id: "prompt_mismatch", no_proofs.rollout_id: "toploc"}
        [verified] = [RolloutGroup.decode(f) for _, f in r.xrange(keys.verified)]
        assert verified.rollout_id == other_weights.rollout_id  # not prefilled, so the other weights pass
        task = make_task(ctx.bundle.run.spec.task)
        problem = task.problem(verified.task_id)
        trusted = [
            task.reward(problem, engine.tokenizer.decode(s.completion_ids, skip_special_tokens=True))
            for s in verified.samples
        ]
        assert [s.reward for s in verified.samples] == trusted
        counters = one_worker_stats(r, keys, "w-other")["counters"]
        assert counters["unchecked"] == 1 and counters["reward_mismatch"] == trusted.count(0.0)
        assert int(r.hget(keys.stats, "unchecked")) == 1


def test_max_rejections_bans_a_worker_and_the_gate_enforces_it(tmp_path, redis_url):
    verifier = "{ban: {banOn: [], maxRejections: 2}}"
    with gate_system(tmp_path, redis_url, verifier=verifier) as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        bad = [honest_group(engine, ctx, i, worker="w-sloppy") for i in range(3)]
        for g in bad[:2]:
            g.task_id = "arith-0-999"
        groups = [*bad, honest_group(engine, ctx, 7)]
        for g in groups:
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=4)
        assert rejections(ctx) == {
            bad[0].rollout_id: "prompt_mismatch",
            bad[1].rollout_id: "prompt_mismatch",
            bad[2].rollout_id: "banned",
        }
        assert verified_ids(ctx) == [groups[3].rollout_id]
        assert is_banned(r, keys, "w-sloppy") and not is_banned(r, keys, "w-honest")
        stats = one_worker_stats(r, keys, "w-sloppy")
        assert stats["banned"]["rule"] == "maxRejections" and stats["banned"]["reason"] == "prompt_mismatch"
        assert stats["counters"] == {"rejected": 3, "rejected:prompt_mismatch": 2, "rejected:banned": 1}


@pytest.mark.parametrize("forgiven", [None, "[]"])
def test_stale_rejections_are_forgiven_by_max_rejections(tmp_path, redis_url, forgiven):
    """An honest worker behind a slow link outlives maxAsyncLevel; by default that alone must not ban it."""
    ban = "{banOn: [], maxRejections: 2" + (f", forgiven: {forgiven}" if forgiven else "") + "}"
    with gate_system(tmp_path, redis_url, verifier="{ban: " + ban + "}") as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        wrong = honest_group(engine, ctx, 0, worker="w-slow")
        wrong.task_id = "arith-0-999"
        r.xadd(keys.rollouts, wrong.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=1)
        for v in (1, 2):
            r.xadd(keys.policy, encode_json({"version": v}))
        stale = [honest_group(engine, ctx, i, worker="w-slow") for i in range(1, 4)]  # version 0, two behind
        for g in stale:
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=4)
        reasons = rejections(ctx)
        assert reasons[wrong.rollout_id] == "prompt_mismatch"
        assert [reasons[g.rollout_id] for g in stale] == ["stale_version"] * 3
        if forgiven is None:
            assert not is_banned(r, keys, "w-slow")
        else:  # counted: the first stale group is the second rejection and bans the worker
            assert one_worker_stats(r, keys, "w-slow")["banned"]["rollout_id"] == stale[0].rollout_id


def test_bad_verifier_config_names_the_field(tmp_path):
    def problems(verifier: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_bundle(gate_config(tmp_path, tmp_path, "{}", verifier))
        return info.value.report()

    assert "spec.verifier.spotCheckFraction" in problems("{spotCheckFraction: 1.5}")
    assert "spec.verifier.ban.banOn.0" in problems("{ban: {banOn: [proof]}}")
    assert "spec.verifier.claimIdleMs" in problems("{claimIdleMs: 0}")
