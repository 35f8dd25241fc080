"""Learning curves: reward against trainer steps and against wall time, as a table and a picture.

Runs each given RLRun with `rlfleet run` (or reads finished run directories with --run-dir) and
prints, per run, the reward (mean over a window of steps) at evenly spaced steps with the wall
time at which it was reached; draws both curves into one PNG (reward vs step, reward vs seconds).

    python benchmarks/learning.py                                  # the arithmetic and the math example
    python benchmarks/learning.py --config my-run.yaml ...        # any RLRun
    python benchmarks/learning.py --run-dir runs/arithmetic-...   # an existing run

Runs start from the repository root (data set paths in the examples are relative to it); the
builtin models are built (or taken from the cache) before a run's clock starts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _paths import ROOT

from rlfleet.wire.run_summary import read_metrics


def smooth(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def table(name: str, records: list[dict], rows: int, window: int) -> None:
    reward = smooth([r["reward_mean"] for r in records], window)
    print(f"\n{name}: {len(records)} steps in {records[-1]['wall_seconds']:.0f}s (reward: {window}-step mean)")
    print(f"{'step':>6}{'wall s':>9}{'reward':>9}{'samples':>10}")
    for i in sorted({int(k * (len(records) - 1) / (rows - 1)) for k in range(rows)}):
        r = records[i]
        print(
            f"{r['step']:6d}{r['wall_seconds']:9.1f}{reward[i]:9.3f}{sum(x['samples'] for x in records[: i + 1]):10d}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, action="append", default=[])
    parser.add_argument("--run-dir", type=Path, action="append", default=[])
    parser.add_argument("--steps", type=int, default=None, help="override each run's spec.trainer.steps")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("learning.png"))
    args = parser.parse_args()
    if not args.config and not args.run_dir:
        args.config = [ROOT / "examples" / "arithmetic" / "rlrun.yaml", ROOT / "examples" / "math" / "rlrun.yaml"]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-learning-") as tmp:
        for i, config in enumerate(args.config):
            run_dir = Path(tmp) / f"run{i}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rlfleet.cli",
                    "run",
                    str(config.resolve()),
                    "--run-dir",
                    str(run_dir),
                    "--no-progress",
                    *(["--steps", str(args.steps)] if args.steps else []),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                cwd=ROOT,
            )
            runs[config.stem if config.stem != "rlrun" else config.parent.name] = read_metrics(
                run_dir / "metrics.jsonl"
            )
    for run_dir in args.run_dir:
        runs[run_dir.name] = read_metrics(run_dir / "metrics.jsonl")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), dpi=100, sharey=True)
    for name, records in runs.items():
        table(name, records, args.rows, args.window)
        reward = smooth([r["reward_mean"] for r in records], args.window)
        by_step.plot([r["step"] for r in records], reward, label=name)
        by_time.plot([r["wall_seconds"] for r in records], reward, label=name)
    by_step.set_xlabel("trainer step")
    by_time.set_xlabel("wall seconds")
    by_step.set_ylabel(f"reward ({args.window}-step mean)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"\npicture: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
