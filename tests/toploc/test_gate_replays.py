"""Issue 16 item 1: the same work is accepted and trained once, whatever ids a worker puts on it.

The gate's replay guard and the trainer's exactly-once key on what the work is (streams.group_digest:
prompt tokens, sampling parameters, the multiset of completions), not on the rollout id, worker id,
seed or task id a worker chooses.
"""

from __future__ import annotations

import attacks
import pytest
from test_gate import gate_system, rejections, run_gate, verified_ids

from rlfleet.services.rollout.engines.torch_engine import TorchEngine
from rlfleet.services.trainer.main import Trainer


@pytest.fixture
def system(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url) as s:
        yield s


def replays(group, spec) -> dict:
    return {
        "new rollout id": attacks.replay_new_rollout_id(group),
        "new worker id": attacks.replay_new_worker(group),
        "new seed": attacks.replay_new_seed(group),
        "task id with the same prompt": attacks.replay_same_prompt_task(group, spec),
        "samples reordered": attacks.replay_reordered(group),
    }


def test_replays_of_accepted_work_under_new_ids_are_rejected(system):
    ctx, policy, origin_url, tmp = system
    spec = ctx.bundle.run.spec
    engine = TorchEngine(policy, 0)
    original = attacks.honest(engine, spec, 1)
    tampered = replays(original, spec)
    ctx.redis.xadd(ctx.keys.rollouts, original.encode())
    for group in tampered.values():
        ctx.redis.xadd(ctx.keys.rollouts, group.encode())
    run_gate(ctx, origin_url, tmp / "cache", expected=1 + len(tampered))
    assert verified_ids(ctx) == [original.rollout_id]
    got = rejections(ctx)
    assert {name: got.get(g.rollout_id) for name, g in tampered.items()} == {name: "replay" for name in tampered}


def test_the_trainer_trains_the_same_work_once_under_any_ids(system):
    """Copies that reach `verified` anyway (e.g. before the guard existed, or from two gates) train once."""
    ctx, policy, origin_url, tmp = system
    spec, r, keys = ctx.bundle.run.spec, ctx.redis, ctx.keys
    engine = TorchEngine(policy, 0)
    original = attacks.honest(engine, spec, 1)
    for group in [original, *replays(original, spec).values()]:
        r.xadd(keys.verified, group.encode())
    fresh = attacks.honest(engine, spec, 2)
    r.xadd(keys.verified, fresh.encode())
    trainer = Trainer(ctx, output_dir=None)  # batchSize 1
    trained, duplicates = [], 0
    for _ in range(2):
        groups, ack, drops = trainer.collect()
        trainer.step(groups)
        trainer.version += 1
        trainer.commit(*_commit_args(trainer, groups), ack, trainer.version)
        trained += [g.rollout_id for g in groups]
        duplicates += drops["duplicate"]
    assert trained == [original.rollout_id, fresh.rollout_id]
    assert duplicates == 5
    assert r.xlen(keys.verified) == 0


def _commit_args(trainer, groups) -> list:
    """What Trainer.commit records as trained: content digests (rollout ids before issue 16)."""
    try:
        from rlfleet.streams import group_digest
    except ImportError:
        return [[g.rollout_id for g in groups]]
    return [[group_digest(g) for g in groups]]
