"""Issue 16 item 1: the same work is accepted and trained once, whatever ids a worker puts on it.

The gate's replay guard and the trainer's exactly-once key on what the work is (streams.group_digest:
prompt tokens, sampling parameters, the multiset of completions), not on the rollout id, worker id,
seed or task id a worker chooses.
"""

from __future__ import annotations

import pytest

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.operator.names import TRAINER
from rlfleet.services.trainer.main import Trainer
from tests.toploc import attacks
from tests.toploc.test_gate import as_, gate_system, rejections, run_gate, verified_ids


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


@pytest.mark.parametrize("spot_check", [1.0, 0.0])
def test_replays_of_accepted_work_under_new_ids_are_rejected(tmp_path, redis_url, spot_check):
    verifier = f"{{spotCheckFraction: {spot_check}}}"
    with gate_system(tmp_path, redis_url, verifier=verifier) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        original = attacks.honest(engine, spec, 1)
        tampered = replays(original, spec)
        for name, group in tampered.items():  # replayed by other workers (the first seed_replay bans)
            group.worker_id = f"w-{name}"
        ctx.redis.xadd(ctx.keys.rollouts, original.encode())
        for group in tampered.values():
            ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=1 + len(tampered))
        assert verified_ids(ctx) == [original.rollout_id]
        got = rejections(ctx)
        want = dict.fromkeys(tampered, "replay")
        if spot_check:  # replayed, another seed does not draw those tokens
            want["new seed"] = "seed_replay"
        assert {name: got.get(g.rollout_id) for name, g in tampered.items()} == want


def test_identical_honest_work_from_other_seeds_is_accepted_and_trained_once(tmp_path, redis_url):
    """A peaked policy (here top-k 1: every seed draws the same tokens) gives identical groups to honest
    workers: the seed replay proves each is what its own seeds draw, so none is refused, and the trainer
    trains the content once. The same group again under a new rollout id is still a replay."""
    with gate_system(tmp_path, redis_url, sampling="{groupSize: 4, maxTokens: 4, topK: 1}") as system:
        ctx, policy, origin_url, tmp = system
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        first = attacks.honest(engine, spec, 1)
        second = attacks.replay_same_prompt_task(first, spec)  # another task id with the same prompt,
        second.sampling.seed = 2
        second = attacks.resampled(engine, second, spec)  # drawn honestly with its own seed 2
        assert attacks.tokens(first) == attacks.tokens(second) and first.sampling.seed != second.sampling.seed
        copy = attacks.replay_new_rollout_id(first)
        for g in (first, second, copy):
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=3)
        assert verified_ids(ctx) == [first.rollout_id, second.rollout_id]
        assert rejections(ctx) == {copy.rollout_id: "replay"}
        trainer = Trainer(as_(ctx, TRAINER), output_dir=None)  # batchSize 1
        batch = trainer.read_batch()
        groups = batch.groups
        _commit(trainer, groups, batch.ack, 1)
        fresh = attacks.honest(engine, spec, 3)
        ctx.redis.xadd(ctx.keys.verified, fresh.encode())
        more = trainer.read_batch()
        assert [g.rollout_id for g in groups + more.groups] == [first.rollout_id, fresh.rollout_id]
        assert more.drops["duplicate"] == 1  # the second copy of the content


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
    trainer = Trainer(as_(ctx, TRAINER), output_dir=None)  # batchSize 1
    trained, duplicates = [], 0
    for _ in range(2):
        batch = trainer.read_batch()
        trainer.step(batch.groups)
        trainer.version += 1
        _commit(trainer, batch.groups, batch.ack, trainer.version)
        trained += [g.rollout_id for g in batch.groups]
        duplicates += batch.drops["duplicate"]
    assert trained == [original.rollout_id, fresh.rollout_id]
    assert duplicates == 5
    assert r.xlen(keys.verified) == 0


def _commit(trainer, groups, ack, version: int) -> None:
    """Record `groups` as trained by `version` and acknowledge them, as the trainer's save does (state.Commit)."""
    from rlfleet.services.trainer.state import Commit
    from rlfleet.wire.streams import group_digest

    commit = Commit()
    commit.add([g.rollout_id for g in groups], [group_digest(g) for g in groups], version, ack)
    trainer.commit(commit)
