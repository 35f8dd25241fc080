"""Asynchronous vs synchronous RL on this machine, side by side in one invocation.

Runs the same RLRun twice with `rlfleet run`: `maxAsyncLevel: 0` (workers wait for every new
version, the trainer waits for every batch) and `maxAsyncLevel: K` (generation overlaps
training). Prints samples trained per minute for both and their ratio, the stage times measured
in the synchronous run (G: waiting for a batch = generation + verification; T: training + publish
per step) and the overlap bound (G + T) / max(G, T) that the asynchronous speed-up can reach,
plus the reward of both at equal steps. Steady state only: the first `--skip` steps are left out.

    python benchmarks/async_vs_sync.py [--steps 60] [--async-level 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(config: Path, level: int, steps: int, workdir: Path) -> list[dict]:
    docs = list(yaml.safe_load_all(config.read_text()))
    docs[0]["spec"]["trainer"]["maxAsyncLevel"] = level
    docs[0]["spec"]["trainer"]["steps"] = steps
    path = workdir / f"level{level}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    run_dir = workdir / f"run-level{level}"
    subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "run", str(path), "--run-dir", str(run_dir), "--no-progress"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def throughput(records: list[dict], skip: int) -> float:
    """Samples trained per minute between step `skip` and the last step."""
    steady = records[skip:]
    seconds = steady[-1]["wall_seconds"] - records[skip - 1]["wall_seconds"]
    return sum(r["samples"] for r in steady[1:]) / seconds * 60


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic" / "rlrun.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--async-level", type=int, default=2)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        sync = run(args.config, 0, args.steps, Path(tmp))
        asyn = run(args.config, args.async_level, args.steps, Path(tmp))
    steady = sync[args.skip :]
    g = statistics.median(r["wait_seconds"] for r in steady)
    t = statistics.median(r["compute_seconds"] + r["publish_seconds"] for r in steady)
    bound = (g + t) / max(g, t)
    sync_rate, async_rate = throughput(sync, args.skip), throughput(asyn, args.skip)
    tenth = max(1, args.steps // 10)

    def last_reward(records):
        return statistics.mean(r["reward_mean"] for r in records[-tenth:])

    print(f"{'':24}{'sync (level 0)':>16}{f'async (level {args.async_level})':>18}")
    print(f"{'samples / minute':24}{sync_rate:16.0f}{async_rate:18.0f}")
    print(
        f"{'staleness mean':24}{statistics.mean(r['staleness_mean'] for r in sync):16.2f}"
        f"{statistics.mean(r['staleness_mean'] for r in asyn):18.2f}"
    )
    print(f"{'reward, last tenth':24}{last_reward(sync):16.3f}{last_reward(asyn):18.3f}")
    print(f"G (generation per batch) {g:.3f}s   T (train + publish per step) {t:.3f}s")
    print(
        f"speed-up async/sync {async_rate / sync_rate:.2f}   overlap bound (G+T)/max(G,T) {bound:.2f}   "
        f"fraction of bound {async_rate / sync_rate / bound:.2f} (target >= 0.9)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
