"""Trainer behaviour on a real Redis `verified` stream with a tiny real policy."""

from __future__ import annotations

import dataclasses
import math
import threading
import zlib

import pytest
import torch

from rlfleet.config import parse_bundle
from rlfleet.services.trainer.batches import KEPT_SHARE_FLOOR
from rlfleet.services.trainer.loss import LossInput, LossSettings, grpo_loss
from rlfleet.services.trainer.main import Trainer
from rlfleet.services.trainer.schedule import lr_factor
from rlfleet.services.trainer.update import UpdateSettings, grpo_update
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import redis_from_url, tiny_policy_dir, trainer_run_config, wait_for

TRAINER = (
    "{batchSize: 2, maxAsyncLevel: 1, learningRate: 1.0e-2, skipZeroAdvantageGroups: true, entropyCoef: 0.01, "
    "klCoef: 0.1}"
)


@pytest.fixture
def trainer(tmp_path, redis_url):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    bundle = parse_bundle(trainer_run_config(policy, tmp_path / "store", TRAINER))
    client = redis_from_url(redis_url)
    yield Trainer(
        Context(bundle=view_bundle(bundle, VIEWS["trainer"]), redis=client, keys=RunKeys("tr"), stop=threading.Event()),
        output_dir=None,
    )
    client.close()


def group(rollout_id: str, rewards: list[float], version: int = 0) -> RolloutGroup:
    """Each rollout id gets its own content, as the trainer dedups on it (streams.group_digest): its
    characters spelled out after the prompt (a one-to-one map for the ids the tests use), and
    completions of its own where 169 pairs allow."""
    c = zlib.crc32(rollout_id.encode())
    ids = [3 + c % 13, 3 + (c // 13) % 13, 2]
    samples = [Sample(completion_ids=ids, logprobs=[-2.0, -2.0, -2.0], proofs=[], reward=r) for r in rewards]
    return RolloutGroup(
        task_id="arith-0-1",
        worker_id="w",
        policy_version=version,
        prompt_ids=[1, 4, 13, 5, 15, *(3 + b % 13 for b in rollout_id.encode())],
        sampling=SamplingParams(1.0, 1.0, 0, 4, 0),
        samples=samples,
        rollout_id=rollout_id,
    )


def test_zero_advantage_and_stale_groups_are_dropped_and_the_batch_still_fills(trainer):
    keys, r = trainer.ctx.keys, trainer.ctx.redis
    trainer.version = 2
    for g in (
        group("flat", [1.0, 1.0], 2),
        group("stale", [1.0, 0.0], 0),
        group("a", [1.0, 0.0], 2),
        group("flat0", [0.0, 0.0], 1),
        group("b", [0.0, 1.0], 1),
    ):
        r.xadd(keys.verified, g.encode())
    batch = trainer.read_batch()
    assert [g.rollout_id for g in batch.groups] == ["a", "b"]
    assert batch.drops["zero_advantage"] == 2 and batch.drops["stale"] == 1
    assert batch.dropped_ids == {"stale": ["stale"], "duplicate": [], "zero_advantage": ["flat", "flat0"]}
    assert len(batch.ack) == 5, "dropped messages are acknowledged too"


def test_a_step_with_entropy_and_kl_moves_the_policy_away_from_the_reference(trainer):
    stats = [trainer.step([group(f"g{i}", [1.0, 0.0]), group(f"h{i}", [0.0, 1.0])]) for i in range(3)]
    assert stats[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6), "the first step starts at the reference"
    assert stats[-1]["kl_mean"] > 0.0
    assert stats[0]["entropy_mean"] > 0.0
    assert all(math.isfinite(s["loss"]) for s in stats)


def test_learning_rate_schedules():
    warm = lr_factor(warmup=4, schedule="cosine", total=14)
    assert [warm(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warm(9) == pytest.approx(0.5)
    assert warm(14) == pytest.approx(0.0)
    assert lr_factor(0, "linear", 10)(5) == pytest.approx(0.5)
    assert lr_factor(0, "constant", 10)(9) == 1.0


def test_loss_options_match_a_direct_formula():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    ent = torch.tensor([[0.7, 0.2, 9.0], [0.4, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(
        LossInput(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, entropy=ent, ref_logprobs=ref),
        LossSettings(eps_low=0.2, eps_high=0.28, delta=4.0, normalization="sequence", entropy_coef=0.1, kl_coef=0.5),
    )

    def token(logp, o, rf, e, a):
        r = math.exp(logp - o)
        obj = min(r * a, min(max(r, 0.8), 1.28) * a)
        if a < 0:
            obj = max(obj, 4.0 * a)
        k3 = min(max(math.exp(rf - logp) - (rf - logp) - 1, 0.0), 10.0)
        return -obj - 0.1 * e + 0.5 * k3

    seq0 = (token(-1.0, -1.1, -1.5, 0.7, 1.0) + token(-2.0, -2.0, -1.0, 0.2, 1.0)) / 2
    seq1 = token(-0.5, -0.5, -0.5, 0.4, -1.0)
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, rel=1e-5)
    assert stats["kl_mean"] > 0
    loss.backward()
    assert lp.grad[0, 2] == 0 and lp.grad[1, 1] == 0, "masked tokens get no gradient"


def test_a_restarted_trainer_holding_fewer_pending_messages_than_a_batch_goes_on_to_new_ones(trainer):
    """A trainer pod restarted with Redis alive: its consumer still holds 1 unacknowledged message,
    fewer than batchSize 2. It must take that one and then read new ones, not re-read it forever."""
    keys, r = trainer.ctx.keys, trainer.ctx.redis
    r.xadd(keys.verified, group("held", [1.0, 0.0]).encode())
    r.xreadgroup(keys.trainer_group, trainer.reader.consumer, {keys.verified: ">"}, count=1)  # the dead trainer's read
    r.xadd(keys.verified, group("new", [0.0, 1.0]).encode())
    result = {}
    worker = threading.Thread(target=lambda: result.update(batch=trainer.read_batch().groups), daemon=True)
    worker.start()
    worker.join(60)
    trainer.ctx.stop.set()  # ends a livelocked collect() so the test can report it
    worker.join(5)
    assert [g.rollout_id for g in result.get("batch", [])] == ["held", "new"], "collect() never filled the batch"


def test_the_trainer_tells_the_workers_what_it_still_wants(tmp_path, redis_url):
    """keys.demand (read by the workers, rollout/main.py Worker.paused): while collecting, the oldest
    version it trains, the groups its step lacks and the verified entries it holds; once the batch is
    held, the next step's oldest; and a trainer restarted from an older state lowers what a later one
    had raised."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    bundle = parse_bundle(trainer_run_config(policy, tmp_path / "store", "{batchSize: 2, maxAsyncLevel: 0}"))
    client = redis_from_url(redis_url)
    keys = RunKeys("tr")

    def demand() -> dict[str, int]:  # the share kept has its own test
        return {k.decode(): int(v) for k, v in client.hgetall(keys.demand).items() if k != b"kept"}

    def run(trainer: Trainer, steps: int) -> threading.Thread:
        thread = threading.Thread(target=trainer.run, args=(steps,), daemon=True)
        thread.start()
        return thread

    first = Trainer(
        Context(bundle=view_bundle(bundle, VIEWS["trainer"]), redis=client, keys=keys, stop=threading.Event()),
        output_dir=None,
    )
    thread = run(first, 1)
    wait_for("the first demand", lambda: demand() == {"oldest": 0, "need": 2, "held": 0}, 60)
    client.xadd(keys.verified, group("a", [1.0, 0.0]).encode())
    wait_for("one group taken", lambda: demand() == {"oldest": 0, "need": 1, "held": 1})
    client.xadd(keys.verified, group("b", [0.0, 1.0]).encode())
    thread.join(60)
    assert not thread.is_alive() and first.version == 1
    assert demand() == {"oldest": 1, "need": 2, "held": 2}, "version 0 is not wanted once step 1 holds its batch"

    client.hset(keys.demand, "oldest", 7)  # left by a trainer whose later state was lost
    second = Trainer(
        Context(bundle=view_bundle(bundle, VIEWS["trainer"]), redis=client, keys=keys, stop=threading.Event()),
        output_dir=None,
    )
    thread = run(second, 3)
    try:
        wait_for("the resumed trainer's demand", lambda: demand() == {"oldest": 1, "need": 2, "held": 0}, 60)
    finally:
        second.ctx.stop.set()
        thread.join(30)
    client.close()


def test_the_demand_tells_the_workers_the_share_of_what_it_reads_that_the_trainer_keeps(trainer):
    """A step that reads 3 groups and drops 1 as a repeat of trained work keeps 2/3; the demand's `kept` is the
    running mean (batches.KEPT_SHARE_WEIGHT) a worker divides its need by (rollout/main.py Worker.room)."""
    keys, r = trainer.ctx.keys, trainer.ctx.redis
    trainer.reader.set_demand(0, 2, 0)
    assert r.hget(keys.demand, "kept") == b"1.0000", "nothing read yet: every group counts"
    repeat = dataclasses.replace(group("a", [1.0, 0.0]), rollout_id="a-again")  # the same content, another id
    for g in (group("a", [1.0, 0.0]), repeat, group("b", [0.0, 1.0])):
        r.xadd(keys.verified, g.encode())
    batch = trainer.read_batch()
    assert [g.rollout_id for g in batch.groups] == ["a", "b"] and batch.drops["duplicate"] == 1
    assert batch.dropped_ids["duplicate"] == ["a-again"]
    assert trainer.reader.kept_share == pytest.approx(0.5 * 1.0 + 0.5 * 2 / 3)
    trainer.reader.set_demand(1, 2, 0)
    assert float(r.hget(keys.demand, "kept")) == pytest.approx(0.8333, abs=1e-4)
    for _ in range(20):  # a long run of nothing but repeats stops at the floor
        trainer.reader.update_kept_share(0, 5)
    assert trainer.reader.kept_share == KEPT_SHARE_FLOOR


def test_epochs_are_that_many_updates_on_the_same_batch(tmp_path, redis_url):
    """trainer.epochs: 2 updates in one step equal two steps of 1 update on the same groups (same
    sampling logprobs, the optimizer's state carried), and differ from one."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    client = redis_from_url(redis_url)

    def make(epochs: int) -> Trainer:
        config = trainer_run_config(policy, tmp_path / f"store{epochs}", f"{{batchSize: 2, epochs: {epochs}}}")
        ctx = Context(
            bundle=view_bundle(parse_bundle(config), VIEWS["trainer"]),
            redis=client,
            keys=RunKeys(f"e{epochs}"),
            stop=threading.Event(),
        )
        return Trainer(ctx, output_dir=None)

    def settings(trainer: Trainer) -> UpdateSettings:
        return UpdateSettings.of(trainer.spec.trainer, 1.0, trainer.tokenizer.pad_token_id)

    groups = [group("a", [1.0, 0.0]), group("b", [0.0, 1.0, 1.0])]
    once, twice = make(1), make(2)
    assert twice.spec.trainer.epochs == 2
    for _ in range(2):
        grpo_update(once.prefill, once.optimizer, groups, settings(once))
    first = dict(once.model.state_dict())
    stats = grpo_update(twice.prefill, twice.optimizer, groups, settings(twice))
    assert stats["samples"] == 5
    for name, tensor in twice.model.state_dict().items():
        torch.testing.assert_close(tensor, first[name], rtol=0, atol=0)
    single = make(1)
    grpo_update(single.prefill, single.optimizer, groups, settings(single))
    assert any(not torch.equal(t, first[n]) for n, t in single.model.state_dict().items())
    client.close()
