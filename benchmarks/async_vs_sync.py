"""Asynchronous vs synchronous RL on this machine, side by side in one invocation.

Runs the same RLRun twice with `rlfleet run`: `maxAsyncLevel: 0` (workers wait for every new
version, the trainer waits for every batch) and `maxAsyncLevel: K` (generation overlaps
training). Prints samples trained per minute for both and their ratio, the stage times measured
in the synchronous run (G: waiting for a batch = generation + verification; T: training + publish
per step) and the overlap bound (G + T) / max(G, T) that the asynchronous speed-up can reach,
plus the reward of both at equal steps. Steady state only: the first `--skip` steps are left out.

`--balanced`: the arithmetic example with groups of 64 samples, 4 groups per step, 5 updates per
batch (`trainer.epochs`, at a fifth of the example's learning rate) and one worker. Per step the
trainer's work is mostly fixed (publishing, saving its state), and one update of 256 short samples
is a fraction of what generating and verifying them costs; the 5 updates bring training near
generation (bound near 2; the example's own config generates about 3x longer than it trains). It
runs on a fixed core split: the trainer on the first CPU, everything else (worker, verifier, relay,
origin, Redis, the launcher) on the second. Sync leaves each core idle while the other works; async
can use both. Per stage it prints the core's utilisation (CPU seconds of its processes per wall
second, steady state; below 100 % where other processes share the core or the stage waits).

    python benchmarks/async_vs_sync.py [--steps 60] [--async-level 2] [--balanced] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
BALANCED = {"groupSize": 64, "batchSize": 4, "epochs": 5, "learningRate": 2.0e-4, "replicas": 1}


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def is_trainer(pid: int) -> bool:
    try:
        return b"rlfleet.cli\x00trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Split:
    """The core split of a run: everything on `rest` (inherited from the launcher), the trainer moved to
    `trainer` once it appears; samples each side's CPU seconds with the number of steps taken so far."""

    def __init__(self, proc: subprocess.Popen, metrics: Path, trainer_cpu: int | None):
        self.proc, self.metrics, self.trainer_cpu = proc, metrics, trainer_cpu
        self.samples: list[tuple[int, float, float, float]] = []  # (steps, time, trainer cpu s, rest cpu s)
        self.pinned: set[int] = set()
        self.dead_cpu = {"trainer": 0.0, "rest": 0.0}
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            pids = [self.proc.pid, *descendants(self.proc.pid)]
            trainer = [p for p in pids if is_trainer(p)]
            if self.trainer_cpu is not None:
                for p in trainer:
                    if p not in self.pinned:
                        try:
                            os.sched_setaffinity(p, {self.trainer_cpu})
                            self.pinned.add(p)
                        except OSError:
                            pass
            steps = len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0
            t_cpu = sum(cpu_seconds(p) for p in trainer)
            r_cpu = sum(cpu_seconds(p) for p in pids if p not in trainer)
            self.samples.append((steps, time.monotonic(), t_cpu, r_cpu))
            time.sleep(0.25)

    def utilisation(self, skip: int) -> tuple[float, float]:
        """Trainer-side and rest-side CPU seconds per wall second, from the first sample at step `skip` to the
        first at the last step (after it, components exit and their CPU time can no longer be read)."""
        last = max(s[0] for s in self.samples)
        window = [s for s in self.samples if s[0] >= skip]
        end = next(s for s in window if s[0] == last)
        (_, t0, a0, b0), (_, t1, a1, b1) = window[0], end
        if t1 <= t0:
            return float("nan"), float("nan")
        return (a1 - a0) / (t1 - t0), (b1 - b0) / (t1 - t0)


def run(config: Path, level: int, steps: int, workdir: Path, balanced: bool) -> tuple[list[dict], tuple]:
    docs = list(yaml.safe_load_all(config.read_text()))
    docs[0]["spec"]["trainer"]["maxAsyncLevel"] = level
    docs[0]["spec"]["trainer"]["steps"] = steps
    if balanced:
        docs[0]["spec"]["sampling"]["groupSize"] = BALANCED["groupSize"]
        docs[0]["spec"]["trainer"]["batchSize"] = BALANCED["batchSize"]
        docs[0]["spec"]["trainer"]["epochs"] = BALANCED["epochs"]
        docs[0]["spec"]["trainer"]["learningRate"] = BALANCED["learningRate"]
        for d in docs:
            if d["kind"] == "InferencePool":
                d["spec"]["replicas"] = BALANCED["replicas"]
    path = workdir / f"level{level}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    run_dir = workdir / f"run-level{level}"
    cpus = sorted(os.sched_getaffinity(0))
    pin = balanced and len(cpus) >= 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(path), "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, {cpus[1]})) if pin else None,
    )
    split = Split(proc, run_dir / "metrics.jsonl", cpus[0] if pin else None)
    if proc.wait() != 0:
        raise SystemExit(f"rlfleet run failed (level {level}); see {run_dir / 'logs'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, split


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
    parser.add_argument("--balanced", action="store_true", help="balanced stages on a fixed core split")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        sync, sync_split = run(args.config, 0, args.steps, Path(tmp), args.balanced)
        asyn, async_split = run(args.config, args.async_level, args.steps, Path(tmp), args.balanced)
    load.append(os.getloadavg()[0])
    steady = sync[args.skip :]
    g = statistics.median(r["wait_seconds"] for r in steady)
    t = statistics.median(r["compute_seconds"] + r["publish_seconds"] for r in steady)
    bound = (g + t) / max(g, t)
    sync_rate, async_rate = throughput(sync, args.skip), throughput(asyn, args.skip)
    tenth = max(1, args.steps // 10)

    def last_reward(records):
        return statistics.mean(r["reward_mean"] for r in records[-tenth:])

    cpus = sorted(os.sched_getaffinity(0))
    if args.balanced and len(cpus) >= 2:
        print(
            f"core split: CPU {cpus[0]} trainer; CPU {cpus[1]} rollout worker, verifier, relay, origin, Redis, "
            f"launcher (groupSize {BALANCED['groupSize']}, batchSize {BALANCED['batchSize']}, "
            f"epochs {BALANCED['epochs']}, learningRate {BALANCED['learningRate']}, 1 worker)"
        )
    else:
        print(f"no core split: every process on CPUs {cpus}")
    print(f"load average {load[0]:.2f} -> {load[1]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'':30}{'sync (level 0)':>16}{f'async (level {args.async_level})':>18}")
    print(f"{'samples / minute':30}{sync_rate:16.0f}{async_rate:18.0f}")
    print(
        f"{'staleness mean':30}{statistics.mean(r['staleness_mean'] for r in sync):16.2f}"
        f"{statistics.mean(r['staleness_mean'] for r in asyn):18.2f}"
    )
    print(f"{'reward, last tenth':30}{last_reward(sync):16.3f}{last_reward(asyn):18.3f}")
    stale = [sum(r["dropped_stale"] for r in records) for records in (sync, asyn)]
    print(f"{'stale groups dropped':30}{stale[0]:16d}{stale[1]:18d}")
    sync_util, async_util = sync_split.utilisation(args.skip), async_split.utilisation(args.skip)
    print(f"{'trainer core utilisation':30}{sync_util[0]:16.0%}{async_util[0]:18.0%}")
    print(f"{'generation core utilisation':30}{sync_util[1]:16.0%}{async_util[1]:18.0%}")
    print(f"G (generation per batch) {g:.3f}s   T (train + publish per step) {t:.3f}s")
    print(
        f"speed-up async/sync {async_rate / sync_rate:.2f}   overlap bound (G+T)/max(G,T) {bound:.2f}   "
        f"fraction of bound {async_rate / sync_rate / bound:.2f} (target >= 0.9)"
    )
    if args.json:
        figures = {
            "speedup": async_rate / sync_rate,
            "bound": bound,
            "fraction_of_bound": async_rate / sync_rate / bound,
            "reward_last_async": last_reward(asyn),
            "reward_last_sync": last_reward(sync),
            "g_seconds": g,
            "t_seconds": t,
            "samples_per_minute_sync": sync_rate,
            "samples_per_minute_async": async_rate,
            "utilisation": {"sync": sync_util, "async": async_util},
            "balanced": args.balanced,
            "load_average": load,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
