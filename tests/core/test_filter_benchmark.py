"""benchmarks/online_filter.py's pure parts: the wasted share it reads from a run's records, and the filtered
variant of a config it writes (the runs themselves, minutes each, are the benchmark, not a test)."""

from __future__ import annotations

import json

import pytest
import yaml

from rlfleet.config import parse_bundle
from tests.support import REPO, benchmark_module

SMOLLM2 = REPO / "examples" / "smollm2" / "rlrun.yaml"


@pytest.fixture
def bench(monkeypatch):
    return benchmark_module(monkeypatch, "online_filter")


def record(step: int, trained: int, flat: int, repeated: int = 0, **drops) -> dict:
    """One metrics.jsonl record: `trained` groups, counters of held-back groups since the start, this step's drops."""
    return {
        "step": step,
        "wall_seconds": 10.0 * step,
        "rollout_ids": [f"g{step}-{i}" for i in range(trained)],
        "flat_groups_held_back": flat,
        "repeated_groups": repeated,
        "reward_mean": 0.5,
        "sampled_reward_mean": 0.2,
        "rejected_by_reason": {},
        **drops,
    }


def test_wasted_share_counts_held_back_groups_once_and_every_drop_of_the_run(bench):
    # Held-back counters are cumulative: the last record's 9 flat + 1 repeat, not their sum over records.
    records = [
        record(1, 4, flat=5, dropped_zero_advantage=1),
        record(2, 4, flat=7, dropped_duplicate=2),
        record(3, 4, flat=9, repeated=1, dropped_stale=1),
    ]
    records[1]["eval/score"], records[2]["eval/score"] = 0.2, 0.6
    got = bench.measure(records)
    assert got["wasted_groups"] == 1 + 2 + 1 + 9 + 1
    assert got["trained_groups"] == 12
    assert got["wasted_share"] == pytest.approx(14 / 26)
    assert (got["eval_score_first"], got["eval_score_last"]) == (0.2, 0.6)


def test_the_offline_band_variant_trains_on_the_rated_rows_within_the_band(bench, tmp_path):
    rows = [json.loads(line) for line in (REPO / "examples" / "smollm2" / "train.jsonl").read_text().splitlines()[:6]]
    rates = [0.0, 0.125, 0.5, 1.0, 0.875, 0.0]
    rated = tmp_path / "rated.jsonl"
    rated.write_text("".join(json.dumps({**row, "solve_rate": rate}) + "\n" for row, rate in zip(rows, rates)))
    assert bench.band_rows(rated, 0.125, 0.875) == 3

    docs = list(yaml.safe_load_all(SMOLLM2.read_text()))
    band = {"path": str(rated), "min": 0.125, "max": 0.875}
    text = bench.variant(docs, docs[0]["spec"]["eval"], band=band)
    spec = parse_bundle(text).run.spec
    assert spec.task.dataset.path == str(rated) and spec.task.chat_template, "the rest of the task is kept"
    assert (spec.task.solve_rate_min, spec.task.solve_rate_max) == (0.125, 0.875)
    assert spec.sampling.online_filter is None and spec.eval.dataset.path == "examples/smollm2/held-out.jsonl"
    assert docs == list(yaml.safe_load_all(SMOLLM2.read_text())), "the documents given are not changed"


def test_the_online_variant_sets_the_filter_and_keeps_the_dataset(bench):
    docs = list(yaml.safe_load_all(SMOLLM2.read_text()))
    spec = parse_bundle(bench.variant(docs, docs[0]["spec"]["eval"], online_filter={"window": 3})).run.spec
    assert spec.sampling.online_filter is not None and spec.sampling.online_filter.window == 3
    assert spec.task.dataset.path == "examples/smollm2/train.jsonl" and spec.task.solve_rate_min is None
