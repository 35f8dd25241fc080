"""The verification gate against real parts: redis-server, an origin over HTTP, real TOPLOC proofs.

Tampered groups land on `rejected` with their reason and never reach the trainer; the honest one
reaches the trainer exactly once, even when delivered twice."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import redis

from rlfleet.checkpoint import publish_version
from rlfleet.config import parse_bundle
from rlfleet.runtime import Context
from rlfleet.services.rollout.engine import TorchEngine
from rlfleet.services.shardcast.origin import make_app
from rlfleet.services.toploc.gate import Gate
from rlfleet.services.toploc.proof import build_proofs
from rlfleet.services.trainer.main import Trainer
from rlfleet.store import open_store
from rlfleet.streams import RolloutGroup, RunKeys, Sample, SamplingParams, decode_json, encode_json
from rlfleet.tasks.base import make_task
from support import serving, tiny_policy_dir

CONFIG = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: gate}}
spec:
  model: {{path: "{model}"}}
  task: {{type: arithmetic, maxOperand: 20}}
  sampling: {{groupSize: 4, maxTokens: 4}}
  trainer: {{batchSize: 1, maxAsyncLevel: 1, learningRate: 1.0e-3}}
  store: {{uri: "file://{store}"}}
"""


@pytest.fixture
def system(tmp_path, redis_url):
    """A published version 0 of a tiny policy, an origin serving it, and a run context."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    bundle = parse_bundle(CONFIG.format(model=policy, store=tmp_path / "store"))
    store = open_store(bundle.run.spec.store.uri)
    publish_version(store, "gate", 0, policy)
    client = redis.Redis.from_url(redis_url)
    keys = RunKeys("gate")
    client.xadd(keys.policy, encode_json({"version": 0}))
    ctx = Context(bundle=bundle, redis=client, keys=keys, stop=threading.Event())
    with serving(make_app(store, "gate")) as origin_url:
        yield ctx, policy, origin_url, tmp_path
    client.close()


def honest_group(engine: TorchEngine, ctx: Context, index: int, version: int = 0) -> RolloutGroup:
    spec = ctx.bundle.run.spec
    task = make_task(spec.task)
    problem = task.problem(f"arith-0-{index}")
    prompt_ids = engine.tokenizer(problem.prompt)["input_ids"]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=spec.sampling.max_tokens, seed=index)
    samples = []
    for gen in engine.generate(prompt_ids, params, spec.sampling.group_size):
        text = engine.tokenizer.decode(gen.completion_ids, skip_special_tokens=True)
        samples.append(Sample(gen.completion_ids, gen.logprobs, build_proofs(gen.hidden, len(prompt_ids)),
                              task.reward(problem, text), gen.finish_reason))
    return RolloutGroup(task_id=problem.task_id, worker_id="w-honest", policy_version=version,
                        prompt_ids=prompt_ids, sampling=params, samples=samples)


def run_gate(ctx: Context, origin_url: str, cache, expected: int) -> None:
    """Run a real gate loop until `expected` groups have been handled."""
    gate = Gate(ctx, "verifier-0", origin_url, cache)
    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while sum(int(ctx.redis.hget(ctx.keys.stats, k) or 0) for k in ("accepted", "rejected")) < expected:
        assert thread.is_alive(), "the gate died"
        assert time.monotonic() < deadline, "the gate did not handle every group in time"
        time.sleep(0.05)
    ctx.stop.set()
    thread.join(10)
    ctx.stop.clear()


def test_tampered_groups_are_rejected_and_the_honest_one_trains_once(system):
    ctx, policy, origin_url, tmp = system
    keys, r = ctx.keys, ctx.redis
    engine = TorchEngine(policy, 0)
    honest = honest_group(engine, ctx, 1)

    altered_tokens = copy.deepcopy(honest)
    altered_tokens.rollout_id = "altered-tokens"
    first = altered_tokens.samples[0]
    first.completion_ids[0] = (first.completion_ids[0] + 1) % len(engine.tokenizer)  # another valid token
    other_weights = honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2)
    other_weights.rollout_id = "other-weights"
    altered_prompt = copy.deepcopy(honest)
    altered_prompt.rollout_id, altered_prompt.task_id = "altered-prompt", "arith-0-999"
    forged_version = copy.deepcopy(honest)
    forged_version.rollout_id, forged_version.policy_version = "forged-version", 7
    inflated = honest_group(engine, ctx, 3)
    inflated.rollout_id = "inflated-reward"
    for s in inflated.samples:
        s.reward = 1.0

    for group in (honest, altered_tokens, other_weights, altered_prompt, forged_version, inflated):
        r.xadd(keys.rollouts, group.encode())
    r.xadd(keys.rollouts, honest.encode())  # replayed submission
    r.xadd(keys.rollouts, {b"m": b"{not json"})  # malformed: dead-lettered, the gate keeps running
    run_gate(ctx, origin_url, tmp / "cache", expected=8)

    rejected = {}
    for _, fields in r.xrange(keys.rejected):
        record = decode_json(fields)
        rejected[record["rollout_id"]] = record["reason"]
    assert rejected.pop("altered-tokens") in ("toploc", "logprob_mismatch")
    assert rejected.pop("other-weights") == "toploc"
    assert rejected.pop("altered-prompt") == "prompt_mismatch"
    assert rejected.pop("forged-version") == "unknown_version"
    assert rejected.pop(honest.rollout_id) == "replay"
    assert rejected == {None: "malformed"}
    assert r.xlen(keys.rollouts) == 0, "every handled inbox entry is deleted"

    verified = [RolloutGroup.decode(f) for _, f in r.xrange(keys.verified)]
    assert sorted(g.rollout_id for g in verified) == sorted([honest.rollout_id, "inflated-reward"])
    trusted = next(g for g in verified if g.rollout_id == "inflated-reward")
    task = make_task(ctx.bundle.run.spec.task)
    problem = task.problem(trusted.task_id)
    assert [s.reward for s in trusted.samples] == [
        task.reward(problem, engine.tokenizer.decode(s.completion_ids, skip_special_tokens=True)) for s in trusted.samples]

    # The trainer sees each verified group once; a redelivered copy of a trained group is skipped.
    trainer = Trainer(ctx, output_dir=None)
    trained = []
    for _ in range(2):
        groups, ack, _ = trainer.collect()
        trainer.step(groups)
        trainer.version += 1
        trainer.commit(groups, ack, trainer.version)
        trained += [g.rollout_id for g in groups]
    assert sorted(trained) == sorted([honest.rollout_id, "inflated-reward"])
    r.xadd(keys.verified, honest.encode())
    r.xadd(keys.verified, inflated.encode())
    inflated.rollout_id, inflated.policy_version = "fresh", trainer.version
    r.xadd(keys.verified, inflated.encode())
    groups, _, drops = trainer.collect()
    assert [g.rollout_id for g in groups] == ["fresh"]
    assert drops["duplicate"] == 2


def test_stale_groups_are_rejected(system):
    ctx, policy, origin_url, tmp = system
    engine = TorchEngine(policy, 0)
    for v in (1, 2):
        ctx.redis.xadd(ctx.keys.policy, encode_json({"version": v}))
    ctx.redis.xadd(ctx.keys.rollouts, honest_group(engine, ctx, 5).encode())  # version 0, two behind, maxAsyncLevel 1
    run_gate(ctx, origin_url, tmp / "cache", expected=1)
    [(_, fields)] = ctx.redis.xrange(ctx.keys.rejected)
    assert decode_json(fields)["reason"] == "stale_version"
