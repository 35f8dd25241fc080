"""The off-policy correction's effect on a run whose sampler and trainer disagree.

Runs the arithmetic example twice with `model.dtype: bfloat16`, once per `trainer.offPolicy.mode`
(`none`, `tis` with cap 2): the workers sample with the published bf16 weights while the trainer
keeps fp32 master weights (the default `masterWeights`) and computes under bf16 autocast, so the
sampler's and the trainer's probabilities differ by the bf16 rounding of the weights, the numerics
of the two forwards, and the policy lag (maxAsyncLevel 2). Prints the policy's reward as sampled
(`sampled_reward_mean`, 15-step means) against steps for both, and for tis the importance ratio's
mean, its largest value and the share of tokens truncated.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/off_policy.py [--modes none,tis,mis]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/off_policy.py --run-dir runs/none --run-dir runs/tis  # finished runs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _paths import ROOT

from rlfleet.wire.run_summary import read_metrics

WINDOW = 15


def config(mode: str) -> str:
    text = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    text = text.replace(
        "    path: builtin://tiny-arithmetic", "    dtype: bfloat16\n    path: builtin://tiny-arithmetic", 1
    )
    return text.replace(
        "    maxAsyncLevel: 2\n", f"    maxAsyncLevel: 2\n    offPolicy: {{mode: {mode}, cap: 2.0}}\n", 1
    )


def report(name: str, records: list[dict]) -> None:
    means = [
        sum(r["sampled_reward_mean"] for r in records[max(0, i - WINDOW) : i]) / len(records[max(0, i - WINDOW) : i])
        for i in range(WINDOW, len(records) + 1, WINDOW)
    ]
    print(f"{name:<6} sampled reward by {WINDOW} steps: {' '.join(f'{m:.3f}' for m in means)}")
    if "offpolicy_ratio_mean" in records[0]:
        share = (
            "offpolicy_truncated_fraction"
            if "offpolicy_truncated_fraction" in records[0]
            else "offpolicy_masked_fraction"
        )
        print(
            f"{'':<6} ratio mean {sum(r['offpolicy_ratio_mean'] for r in records) / len(records):.4f}, "
            f"max {max(r['offpolicy_ratio_max'] for r in records):.2f}, {share} mean "
            f"{sum(r[share] for r in records) / len(records):.4f} "
            f"(largest in a step {max(r[share] for r in records):.4f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="none,tis")
    parser.add_argument("--run-dir", type=Path, action="append", default=[])
    args = parser.parse_args()
    if args.run_dir:
        for run_dir in args.run_dir:
            report(run_dir.name, read_metrics(run_dir / "metrics.jsonl"))
        return
    with tempfile.TemporaryDirectory(prefix="rlfleet-offpolicy-") as tmp:
        for mode in args.modes.split(","):
            path = Path(tmp) / f"{mode}.yaml"
            path.write_text(config(mode))
            run_dir = Path(tmp) / mode
            subprocess.run(
                [sys.executable, "-m", "rlfleet.cli", "run", str(path), "--run-dir", str(run_dir), "--no-progress"],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )
            report(mode, read_metrics(run_dir / "metrics.jsonl"))


if __name__ == "__main__":
    main()
