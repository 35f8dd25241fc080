"""A task mixture's per-source reward and counts: the record's `sources` (metrics.jsonl) and their Prometheus
series (trainer/metrics.py), from groups whose task ids name their source."""

from __future__ import annotations

import dataclasses

from prometheus_client import REGISTRY

from rlfleet.fleet.repeats import Tally
from rlfleet.services.trainer.metrics import export_step, source_record
from tests.trainer.test_trainer import group


def of(source: str, rollout_id: str, rewards: list[float]):
    return dataclasses.replace(group(rollout_id, rewards), task_id=f"{source}/{rollout_id}-1")


def test_each_source_gets_its_trained_and_sampled_reward_and_counts():
    trained = [of("math", "a", [1.0, 0.0]), of("math", "b", [1.0, 1.0]), of("code", "c", [0.0, 1.0])]
    read = [(g.task_id, [s.reward for s in g.samples]) for g in trained]
    read += [("code/d-1", [0.0, 0.0]), ("sums/e-1", [1.0, 1.0])]  # dropped ones (e.g. zero advantage)
    record = source_record(True, trained, read, {})
    assert record == {
        "sources": {
            "code": {"reward_mean": 0.5, "groups": 1, "sampled_reward_mean": 0.25, "sampled_groups": 2},
            "math": {"reward_mean": 0.75, "groups": 2, "sampled_reward_mean": 0.75, "sampled_groups": 2},
            "sums": {"reward_mean": None, "groups": 0, "sampled_reward_mean": 1.0, "sampled_groups": 1},
        }
    }
    assert source_record(False, trained, read, {}) == {}, "a single-task run's records carry no sources"
    # Repeats of trained work the workers held back (rlfleet/fleet/repeats.py) are sampled work of their source.
    held_back = {
        "math": Tally(groups=2, samples=4, reward_sum=4.0),
        "poems": Tally(groups=1, samples=2, reward_sum=1.0),
    }
    with_repeats = source_record(True, trained, read, held_back)["sources"]
    assert with_repeats["math"]["sampled_groups"] == 4 and with_repeats["math"]["sampled_reward_mean"] == 7 / 8
    assert with_repeats["poems"] == {"reward_mean": None, "groups": 0, "sampled_reward_mean": 0.5, "sampled_groups": 1}
    assert with_repeats["code"] == record["sources"]["code"]

    before = REGISTRY.get_sample_value("rlfleet_trainer_source_groups_total", {"source": "math", "batch": "sampled"})
    export_step(
        {"step": 1, "policy_version": 1, "reward_mean": 0.5, "sampled_reward_mean": 0.5, "staleness_mean": 0.0,
         "staleness_max": 0, "wall_seconds": 1.0, "samples": 6, "wait_seconds": 0.0, "compute_seconds": 0.0,
         "publish_seconds": 0.0, "accepted": 5, "rejected_by_reason": {}, **record}
    )  # fmt: skip

    def value(name: str, source: str, batch: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"source": source, "batch": batch})

    assert value("rlfleet_trainer_source_reward_mean", "math", "trained") == 0.75
    assert value("rlfleet_trainer_source_reward_mean", "code", "sampled") == 0.25
    assert value("rlfleet_trainer_source_reward_mean", "sums", "trained") is None, "no trained group: no value"
    assert value("rlfleet_trainer_source_groups_total", "math", "sampled") == (before or 0) + 2
    assert value("rlfleet_trainer_source_groups_total", "sums", "trained") == 0
