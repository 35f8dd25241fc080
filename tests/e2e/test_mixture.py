"""A mixed run as a user starts it: `rlfleet run examples/mixture/rlrun.yaml` (math, code and the example user
environment, every source through the builtin model's chat template), real processes; it learns on every source."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO

EXAMPLE = REPO / "examples" / "mixture" / "rlrun.yaml"
STEPS = 60
SOURCES = {"math", "code", "sums"}


@pytest.mark.slow
def test_a_mixture_with_a_chat_template_and_a_user_environment_learns_on_every_source(tmp_path):
    run_dir = tmp_path / "run"
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "examples" / "environments" / "sums"),
                                                            os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress",
            "--steps", str(STEPS)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=environ, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(records) == STEPS and all(set(r["sources"]) <= SOURCES for r in records)
    assert set(summary["sources"]) == SOURCES, summary
    # every source is drawn by its weight (2:1:1) and trained on
    read = {name: sum(r["sources"].get(name, {}).get("sampled_groups", 0) for r in records) for name in SOURCES}
    assert read["math"] > read["code"] > 0 and read["math"] > read["sums"] > 0, read
    assert all(summary["sources"][name]["groups"] > 0 for name in SOURCES), summary["sources"]
    # honest workers: nothing rejected for its content (the templated prompts, the environment's rewards)
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    # the policy gets better on each source: the reward as sampled over the last tenth of steps above the first
    for name in SOURCES:
        source = summary["sources"][name]
        assert source["sampled_reward_last"] > source["sampled_reward_first"], (name, source)
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= 0.1, summary
    assert (run_dir / "reward.png").stat().st_size > 10_000
