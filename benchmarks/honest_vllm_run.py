"""Honest vLLM-CPU groups in a whole local run (issue 27): bf16 workers, an fp32 verifier, 0 false rejections.

The vLLM math example (examples/math/rlrun-vllm.yaml: builtin://tiny-math, head size 32, one vLLM-CPU
worker) run by `rlfleet run` as a user runs it (embedded redis-server, origin, relay, gate, trainer),
with the trainer and the verifier in fp32 (`spec.model.dtype: float32`) and the workers declared and
computing in bf16 (`spec.verifier.workerDtype: bfloat16`, the pool's `spec.dtype: bfloat16`), every
group spot-checked (prefill, TOPLOC, logprobs, seed replay). Steps are sized so that the gate judges
at least `--groups` groups (batchSize 16 per step).

What is reported is read from the run itself: while it runs, the gate's counters in the run's Redis
(the address in RUN_DIR/endpoints.json): groups accepted and rejected by reason, each worker's replayed
positions and mismatches (the running replay share the bf16 row bans above) and bans; after it, the
trainer's summary.json. False rejections = rejections other than `stale_version` (a group that outlived
maxAsyncLevel: the async window, not a verdict on its content); every worker is honest here, so each
of those would be a false one.

Usage: .venv/bin/python benchmarks/honest_vllm_run.py [--groups 1000] [--json out.json] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _paths  # noqa: F401  (the repository root first)
import redis
import yaml

from rlfleet.fleet.reputation import worker_stats
from rlfleet.wire.streams import RunKeys

ROOT = _paths.ROOT
EXAMPLE = ROOT / "examples" / "math" / "rlrun-vllm.yaml"
NOT_A_VERDICT = {"stale_version"}  # rejected for the async window, not for what the group holds


def run_file(dest: Path) -> tuple[Path, str, int]:
    """The example with fp32 trainer and verifier and bf16 workers: (its path, the run's name, batchSize)."""
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    for doc in docs:
        spec = doc["spec"]
        if doc["kind"] == "RLRun":
            run_name, batch = doc["metadata"]["name"], spec["trainer"]["batchSize"]
            spec["model"]["dtype"] = "float32"
            spec["verifier"].update(workerDtype="bfloat16", spotCheckFraction=1.0)
        elif doc["kind"] == "InferencePool":
            spec["dtype"] = "bfloat16"
    dest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return dest, run_name, batch


class GateCounters(threading.Thread):
    """Reads the gate's counters from the run's Redis every `every` seconds; `last` is the newest reading."""

    def __init__(self, run_dir: Path, run_name: str, every: float = 2.0):
        super().__init__(daemon=True)
        self.run_dir, self.keys, self.every = run_dir, RunKeys(run_name), every
        self.last: dict | None = None
        self.done = threading.Event()

    def run(self) -> None:
        client = None
        while not self.done.is_set():
            try:
                if client is None and (self.run_dir / "endpoints.json").exists():
                    url = json.loads((self.run_dir / "endpoints.json").read_text())["redis"]
                    client = redis.Redis.from_url(url, socket_timeout=5)
                if client is not None:
                    counts = {k.decode(): int(v) for k, v in client.hgetall(self.keys.stats).items()}
                    self.last = {"counts": counts, "workers": worker_stats(client, self.keys)}
            except (redis.RedisError, OSError, ValueError):
                pass  # not up yet, or already stopped: keep the last reading
            self.done.wait(self.every)


def worker_row(stats: dict) -> dict:
    """One worker's verdicts and replay counters (reputation.worker_stats' entry)."""
    c = stats["counters"]
    positions, mismatches = c.get("replay_positions", 0), c.get("replay_mismatches", 0)
    return {
        "accepted": c.get("accepted", 0),
        "rejected": c.get("rejected", 0),
        "replay_positions": positions,
        "replay_mismatches": mismatches,
        "replay_share": mismatches / max(1, positions),
        "banned": stats["banned"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1000, help="groups the gate must judge at least (default 1000)")
    ap.add_argument("--run-dir", type=Path, default=None, help="the run's directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlfleet-honest-vllm-"))
    run_dir = args.run_dir or work / "run"
    path, run_name, batch = run_file(work / "rlrun-vllm-bf16-workers.yaml")
    steps = math.ceil(args.groups / batch)
    command = [sys.executable, "-m", "rlfleet.cli", "run", str(path), "--steps", str(steps)]
    command += ["--run-dir", str(run_dir), "--no-progress"]
    counters = GateCounters(run_dir, run_name)
    counters.start()
    t0 = time.monotonic()
    log = work / "run.log"
    with log.open("w") as out:
        rc = subprocess.run(command, cwd=ROOT, env=os.environ, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    counters.done.set()
    counters.join(10)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    gate = counters.last or {"counts": {}, "workers": {}}
    counts = gate["counts"]
    by_reason = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("rejected:")}
    accepted = counts.get("accepted", summary.get("accepted", 0))
    false_rejections = sum(v for k, v in by_reason.items() if k not in NOT_A_VERDICT)
    workers = {w: worker_row(s) for w, s in gate["workers"].items()}
    result = {
        "command": " ".join(command),
        "exit_code": rc,
        "worker_dtype": "bfloat16",
        "verifier_dtype": "float32",
        "engine": "vllm (CPU)",
        "steps": summary.get("steps"),
        "wall_seconds": round(wall, 1),
        "judged": accepted + sum(by_reason.values()),
        "accepted": accepted,
        "rejected_by_reason": by_reason,
        "false_rejections": false_rejections,
        "target_groups": args.groups,
        "target_met": accepted + sum(by_reason.values()) >= args.groups,
        "workers": workers,
        "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"),
        "summary_accepted": summary.get("accepted"),
        "summary_rejected_by_reason": summary.get("rejected_by_reason"),
        "log": str(log),
        "run_dir": str(run_dir),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "workers"}, indent=1))
    for w, s in workers.items():
        print(
            f"worker {w}: accepted {s['accepted']}, rejected {s['rejected']}, replayed {s['replay_positions']} "
            f"positions, {s['replay_mismatches']} mismatched (share {s['replay_share']:.4f}), banned: {s['banned']}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if rc == 0 and false_rejections == 0 and result["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
