"""What broadcast.py and its WAN modules (broadcast_wan.py, wan_runs.py, wan_delta.py) share: the run and
file names, the RLRun config their servers read, and reading the one-line reports of the role processes
(`broadcast.py --client ...`, which print "waiting" when idle and one JSON line when done).

It imports no other benchmark but _paths, so the broadcast modules' imports form a tree: broadcast ->
broadcast_wan -> wan_delta -> wan_runs -> {wan_topology, broadcast_common} (and delta.py for the delta
series); nothing below imports anything above."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from _paths import ROOT

RUN = "bench"
FILE = "model.safetensors"
REFERENCE_DUMMY = "data1.bin"  # every shardcast server must serve it: its clients time it at start-up
BROADCAST = ROOT / "benchmarks" / "broadcast.py"  # the script whose first argument names a role


def write_bench_rlrun(work: Path) -> Path:
    """work/rlrun.yaml: the RLRun the origin and relays read (the run name and the file store in `work`)."""
    path = work / "rlrun.yaml"
    path.write_text(
        f"apiVersion: rlfleet.io/v1alpha1\nkind: RLRun\nmetadata: {{name: {RUN}}}\nspec:\n"
        f"  model: {{path: 'builtin://tiny-arithmetic'}}\n  task: {{type: arithmetic}}\n"
        f"  store: {{uri: 'file://{work / 'store'}'}}\n"
    )
    return path


def expect_line(proc: subprocess.Popen, what: str) -> dict | str:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"{what} exited (code {proc.wait()}) before saying anything; see its log")
    line = line.strip()
    return json.loads(line) if line.startswith("{") else line


def finish_times(clients: list[subprocess.Popen], timeout: float) -> list[float]:
    """Each client's reported finish time; those not done within `timeout` s are left out."""
    return [r["done"] for r in finish_reports(clients, timeout)]


def finish_reports(clients: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each client's final report ({"done": monotonic time, ...}); those not done within `timeout`
    s are left out."""
    done: dict[int, dict] = {}

    def read(i: int, proc: subprocess.Popen) -> None:
        line = proc.stdout.readline().strip()
        if line.startswith("{"):
            done[i] = json.loads(line)

    threads = [threading.Thread(target=read, args=(i, c), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return list(done.values())
