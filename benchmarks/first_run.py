"""First run of every example as a new user makes it: seconds from the command to the first trainer step.

For each example, `rlfleet run EXAMPLE --steps N` starts with an empty `RLFLEET_CACHE` (a fresh
temporary directory: nothing built or downloaded before), from the repository root. Reported per
example: seconds until the launcher's "model ... ready" line, until the first line of metrics.jsonl
(the first trainer step), and until the run exits; the longest silence on stderr (progress output
counts), and the reward of the steps taken. Examples whose engine is not installed are skipped.

    python benchmarks/first_run.py [--examples examples/arithmetic/rlrun.yaml,...] [--steps 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 60.0


def engines_of(example: Path) -> set[str]:
    return {
        d["spec"].get("engine", "torch")
        for d in yaml.safe_load_all(example.read_text())
        if d["kind"] == "InferencePool"
    }


def first_run(example: Path, steps: int, work: Path) -> dict:
    """Run `example` once with an empty cache; timings of its milestones."""
    run_dir, cache = work / "run", work / "cache"
    cache.mkdir()
    env = {**os.environ, "RLFLEET_CACHE": str(cache)}
    metrics = run_dir / "metrics.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(example), "--steps", str(steps), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    marks = {"model_ready_s": None, "first_step_s": None}
    last_output, silences = [t0], []

    def read_stderr():  # progress bars rewrite their line with \r, so read raw chunks
        while chunk := proc.stderr.read1(4096):
            now = time.monotonic()
            silences.append(now - last_output[0])
            last_output[0] = now
            if marks["model_ready_s"] is None and b"ready at" in chunk:
                marks["model_ready_s"] = now - t0

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    while proc.poll() is None:
        if marks["first_step_s"] is None and metrics.exists() and metrics.read_text().strip():
            marks["first_step_s"] = time.monotonic() - t0
        time.sleep(0.1)
    reader.join(5)
    end = time.monotonic() - t0
    if marks["first_step_s"] is None and metrics.exists() and metrics.read_text().strip():
        marks["first_step_s"] = end
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "example": str(example.relative_to(ROOT)),
        "exit_code": proc.returncode,
        **marks,
        "exit_s": end,
        "longest_silence_s": max(silences + [end - last_output[0]]),
        "steps": len(records),
        "rewards": [round(r["reward_mean"], 3) for r in records],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--examples",
        default="examples/arithmetic/rlrun.yaml,examples/math/rlrun.yaml,examples/math/rlrun-vllm.yaml",
        help="comma-separated RLRun files, relative to the repository root",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for name in args.examples.split(","):
        example = ROOT / name
        if "vllm" in engines_of(example):
            try:
                import vllm  # noqa: F401
            except ImportError:
                print(f"skipped {name}: vllm is not installed", file=sys.stderr)
                continue
        with tempfile.TemporaryDirectory(prefix="rlfleet-first-run-") as tmp:
            load = os.getloadavg()[0]
            results.append({**first_run(example, args.steps, Path(tmp)), "load_average": load})
    print(f"{os.cpu_count()} CPUs; target: first trainer step within {TARGET_S:.0f} s of the command")
    print(
        f"{'example':36} {'model ready s':>13} {'1st step s':>10} {'exit s':>7} {'silence s':>9} {'load':>5}  rewards"
    )
    for r in results:
        first = f"{r['first_step_s']:.1f}" if r["first_step_s"] is not None else "-"
        ready = f"{r['model_ready_s']:.1f}" if r["model_ready_s"] is not None else "-"
        print(
            f"{r['example']:36} {ready:>13} {first:>10} {r['exit_s']:>7.1f} {r['longest_silence_s']:>9.1f} "
            f"{r['load_average']:>5.2f}  {r['rewards']}" + ("" if r["exit_code"] == 0 else f"  (exit {r['exit_code']})")
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
