"""Every field of the trainer's metrics.jsonl record has a Prometheus series with the same value
on the trainer's /metrics, scraped over HTTP from a real trainer process after a real step."""

from __future__ import annotations

import json
import time

import pytest

from rlfleet.services.trainer.split import BACKGROUND_PARTS, SPLIT_PARTS
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys
from tests.support import scrape, start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group

TRAINER = (
    "{batchSize: 2, maxAsyncLevel: 1, learningRate: 1.0e-3, steps: 2, skipZeroAdvantageGroups: true, "
    "entropyCoef: 0.01, klCoef: 0.1, offPolicy: {mode: tis, cap: 2.0}, microBatchTokens: 16, logprobChunk: 4}"
)

BATCH_STATS = (
    "loss",
    "grad_norm",
    "accuracy",
    "learning_rate",
    "clip_fraction",
    "ratio_mean",
    "entropy_mean",
    "kl_mean",
    "completion_tokens_mean",
    "turns_mean",
    "offpolicy_ratio_mean",
    "offpolicy_ratio_max",
    "offpolicy_truncated_fraction",
)
# Field of metrics.jsonl -> (sample name, labels) that carries it after one step.
SERIES = {
    "step": ("rlfleet_trainer_step", {}),
    "policy_version": ("rlfleet_trainer_policy_version", {}),
    "reward_mean": ("rlfleet_trainer_reward_mean", {}),
    "sampled_reward_mean": ("rlfleet_trainer_sampled_reward_mean", {}),
    "staleness_mean": ("rlfleet_trainer_staleness_mean", {}),
    "staleness_max": ("rlfleet_trainer_staleness_max", {}),
    "repeated_groups": ("rlfleet_trainer_repeated_groups", {}),
    "flat_groups_held_back": ("rlfleet_trainer_flat_groups_held_back", {}),
    "samples": ("rlfleet_trainer_samples_total", {}),
    "wall_seconds": ("rlfleet_trainer_elapsed_seconds", {}),
    "accepted": ("rlfleet_trainer_verifier_groups", {"verdict": "accepted", "reason": ""}),
    **{stat: ("rlfleet_trainer_batch_stat", {"stat": stat}) for stat in BATCH_STATS},
    **{
        f"dropped_{r}": ("rlfleet_trainer_dropped_groups_total", {"reason": r})
        for r in ("stale", "duplicate", "malformed", "zero_advantage")
    },
    # One observation so far: the histogram's sum is the step's wall time (each split part's: below).
    "step_seconds": ("rlfleet_trainer_step_wall_seconds_sum", {}),
}
# Sums of split parts, which are on /metrics one by one.
COARSE = {"wait_seconds", "compute_seconds", "publish_seconds"}


def test_every_metrics_jsonl_field_is_on_the_trainers_metrics_endpoint(tmp_path, redis_url, redis_client):
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    keys = RunKeys("tr")
    # One duplicate and one zero-advantage group are dropped; p and q make the batch.
    for g in (group("p", [1.0, 0.0]), group("p", [1.0, 0.0]), group("flat", [1.0, 1.0]), group("q", [0.0, 1.0])):
        redis_client.xadd(keys.verified, g.encode())
    redis_client.hset(keys.stats, mapping={"accepted": 4, "rejected": 2, "rejected:toploc": 1, "rejected:replay": 1})
    # Workers held back 3 groups (6 samples, all rewarded 1): 2 repeats of trained work, 1 flat (fleet/repeats.py).
    redis_client.hset(keys.repeats, mapping={"groups|": 3, "samples|": 6, "reward_sum|": 6.0, "flat|": 1})
    port = free_port()
    # Two steps asked for and data for one: after step 1 the trainer waits, still serving /metrics.
    proc = start_trainer(config, redis_url, tmp_path, "--metrics-port", str(port), env={"RLFLEET_LOCAL": "1"})
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().endswith("\n"):
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()
            assert time.monotonic() < deadline, "no step in time"
            time.sleep(0.1)
        record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.terminate()
        proc.wait(60)

    assert (
        record["rollout_ids"] == ["p", "q"]
        and record["worker_ids"] == ["w", "w"]
        and record["dropped_duplicate"] == 1
        and record["dropped_zero_advantage"] == 1
    )
    # p and q are trained (reward 0.5); the sampled reward counts the dropped duplicate and flat group too, and the
    # groups held back
    assert record["reward_mean"] == 0.5 and record["sampled_reward_mean"] == (5 + 6) / (8 + 6)
    assert record["repeated_groups"] == 2 and record["flat_groups_held_back"] == 1
    unmapped = (
        set(record)
        - set(SERIES)
        - COARSE
        - {"rejected", "rejected_by_reason", "rollout_ids", "worker_ids", "dropped_rollout_ids", "split"}
        - {"background_split"}
    )
    assert not unmapped, f"metrics.jsonl fields without a Prometheus series in this test: {sorted(unmapped)}"
    for field, (name, labels) in SERIES.items():
        key = (name, frozenset(labels.items()))
        assert key in samples, f"{field}: no series {name}{labels} on /metrics"
        assert samples[key] == pytest.approx(record[field], rel=1e-6, abs=1e-9), field
    # Every part of the step's split: one observation so far, the histogram's sum is that part's seconds.
    assert set(record["split"]) == set(SPLIT_PARTS)
    for part, seconds in record["split"].items():
        key = ("rlfleet_trainer_step_seconds_sum", frozenset({"phase": part}.items()))
        assert samples[key] == pytest.approx(seconds, rel=1e-6, abs=1e-9), part
    # And every part of the background publish's (a counter: one record so far, so its seconds).
    assert set(record["background_split"]) == set(BACKGROUND_PARTS)
    for part, seconds in record["background_split"].items():
        key = ("rlfleet_trainer_publish_background_seconds_total", frozenset({"part": part}.items()))
        assert samples[key] == pytest.approx(seconds, rel=1e-6, abs=1e-9), part
    rejected = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "rlfleet_trainer_verifier_groups" and dict(labels)["verdict"] == "rejected"
    }
    assert {r: v for r, v in rejected.items() if v} == record["rejected_by_reason"] == {"toploc": 1, "replay": 1}
    assert sum(rejected.values()) == record["rejected"] == 2
    assert "stale_version" in rejected, "every known rejection reason has a series, at 0 until it happens"
