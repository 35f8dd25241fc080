"""What a worker holds back unsent (rlfleet/services/rollout/repeats.py): repeats of trained work and, when the
trainer skips zero-advantage groups, groups of equal rewards; each counted once in the run's tally, which the
trainer folds into the sampled reward (rlfleet/fleet/repeats.py). A real Redis."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from rlfleet.config import load_bundle
from rlfleet.fleet.repeats import RepeatTally, Tally
from rlfleet.services.rollout.repeats import holds_flat, worth_sending
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, group_digest
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import pool, rlrun, write_rlrun
from tests.trainer.test_trainer import group


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_flat_groups_and_repeats_are_held_back_and_counted_once(tmp_path, redis_client):
    run = rlrun("held", trainer={"skipZeroAdvantageGroups": True})
    bundle = load_bundle(write_rlrun(tmp_path / "rlrun.yaml", run, pool("pool", "held")))
    keys = RunKeys("held")
    ctx = Context(bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event())
    mixed, solved, failed, repeat = (
        group("mixed", [1.0, 0.0]),
        group("solved", [1.0, 1.0]),
        group("failed", [0.0, 0.0]),
        group("repeat", [1.0, 0.0]),
    )
    redis_client.zadd(keys.trained, {group_digest(repeat): 1, group_digest(solved): 1})  # solved: also a repeat
    repeats, flat = counted("rlfleet_rollout_repeated_groups_total"), counted("rlfleet_rollout_flat_groups_total")

    sent = worth_sending(redis_client, ctx, [mixed, solved, failed, repeat], hold_flat=True)

    assert [g.rollout_id for g in sent] == ["mixed"]
    # A flat group that is also a repeat counts as a repeat: the trainer would drop it as one first.
    assert counted("rlfleet_rollout_repeated_groups_total") - repeats == 2
    assert counted("rlfleet_rollout_flat_groups_total") - flat == 1
    tally = RepeatTally()
    assert tally.take(redis_client.hgetall(keys.repeats)) == {"": Tally(groups=3, samples=6, reward_sum=3.0, flat=1)}
    assert (tally.total_repeats(), tally.total_flat()) == (2, 1)
    # Without hold_flat (the trainer trains flat groups, or the online filter needs their outcomes) they are sent.
    assert [g.rollout_id for g in worth_sending(redis_client, ctx, [failed, repeat], hold_flat=False)] == ["failed"]
    assert tally.take(redis_client.hgetall(keys.repeats)) == {"": Tally(groups=1, samples=2, reward_sum=1.0)}
    assert (tally.total_repeats(), tally.total_flat()) == (3, 1)
    # Behind an ingest (no Redis to count in) everything is sent.
    assert len(worth_sending(None, ctx, [mixed, solved, failed, repeat], hold_flat=True)) == 4


@pytest.mark.parametrize(
    ("trainer", "sampling", "held"),
    [
        ({"skipZeroAdvantageGroups": True}, {}, True),
        ({}, {}, False),  # the trainer trains flat groups (their rows are not computed: zero advantage)
        ({"skipZeroAdvantageGroups": True}, {"onlineFilter": {}}, False),  # the filter reads their outcomes
    ],
)
def test_a_worker_holds_back_flat_groups_only_when_nothing_needs_them(tmp_path, trainer, sampling, held):
    run = rlrun("held", trainer=trainer, sampling=sampling)
    assert holds_flat(load_bundle(write_rlrun(tmp_path / "rlrun.yaml", run, pool("pool", "held"))).run.spec) is held
