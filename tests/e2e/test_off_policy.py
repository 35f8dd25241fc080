"""An off-policy-corrected run learns: the arithmetic example with `trainer.offPolicy` tis (truncated) and
mis (masked importance sampling), real processes (`rlfleet run`), as tests/e2e/test_e2e.py runs it
without the correction."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_the_example_with_importance_sampling_correction_learns(tmp_path, mode):
    text = EXAMPLE.read_text()
    assert "    maxAsyncLevel: 2\n" in text
    config = tmp_path / "rlrun.yaml"
    # Micro-batches of 64 padded tokens (several per step) and chunked logprobs on the way.
    config.write_text(
        text.replace(
            "    maxAsyncLevel: 2\n",
            f"    maxAsyncLevel: 2\n    offPolicy: {{mode: {mode}, cap: 2.0}}\n"
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
    share = "offpolicy_truncated_fraction" if mode == "tis" else "offpolicy_masked_fraction"
    assert all("offpolicy_ratio_mean" in r and share in r for r in records)
    assert max(r["offpolicy_ratio_max"] for r in records) > 1.0
    # tis as the uncorrected example (tests/e2e/test_e2e.py): the policy's sampled reward rises to ~0.9
    # (0.45 -> 0.96 measured). mis learns more slowly and less evenly: at maxAsyncLevel 2 the trainer's
    # probability of a token sampled two versions back can exceed the sampler's by more than cap, and mis
    # drops exactly those tokens, which are often the ones the policy is learning to favour. Seven runs on
    # 2 cores (2026-12-06, alone and beside other runs) ended at 0.62-0.79 from 0.45 (mean 0.70), so its
    # bar is that it clearly learns, not how far.
    last, rise = (0.85, 0.3) if mode == "tis" else (0.55, 0.1)
    assert summary["sampled_reward_last"] >= last, summary
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= rise, summary
