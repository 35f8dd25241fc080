"""An off-policy-corrected run learns: the arithmetic example with `trainer.offPolicy: tis`, real
processes (`rlfleet run`), as tests/e2e/test_e2e.py runs it without the correction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"


@pytest.mark.slow
def test_the_example_with_truncated_importance_sampling_learns(tmp_path):
    text = EXAMPLE.read_text()
    assert "    maxAsyncLevel: 2\n" in text
    config = tmp_path / "rlrun.yaml"
    # Micro-batches of 64 padded tokens (several per step) and chunked logprobs on the way.
    config.write_text(
        text.replace(
            "    maxAsyncLevel: 2\n",
            "    maxAsyncLevel: 2\n    offPolicy: {mode: tis, cap: 2.0}\n"
            "    microBatchTokens: 64\n    logprobChunk: 16\n",
        )
    )
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=2400,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 150
    # The correction is live: the trainer's own probabilities differ from the claimed ones off-policy
    # (up to maxAsyncLevel versions old), and the weights are reported every step.
    assert all("offpolicy_ratio_mean" in r and "offpolicy_truncated_fraction" in r for r in records)
    assert max(r["offpolicy_ratio_max"] for r in records) > 1.0
    # As the uncorrected example (tests/e2e/test_e2e.py): the policy's sampled reward rises to ~0.9.
    assert summary["sampled_reward_last"] >= 0.85, summary
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= 0.3, summary
