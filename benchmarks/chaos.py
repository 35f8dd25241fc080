"""Chaos: a local run whose components are SIGKILLed at random, restarted as Kubernetes would, audited.

    python benchmarks/chaos.py --minutes 10 --json chaos.json

`rlfleet run` (the launcher restarts what dies, with back-off) trains the arithmetic example while
this script SIGKILLs a random component every ~`--interval` seconds: a rollout worker, the
verifier, a relay, the origin, the trainer or Redis. An auditor follows the `verified` stream the
whole time (a plain XREAD, no consumer group, so it takes nothing from the trainer) and records
every accepted group as it is forwarded. At the end the run is stopped, Redis is started once more
on the run's append-only file, and the audit compares:
  accepted      groups the gate forwarded (seen by the auditor)
  trained       rollout ids in metrics.jsonl, one record per optimizer step
  dropped       ids the trainer dropped by design (too stale for maxAsyncLevel, duplicate, zero advantage)
  queued        entries still in `verified` (pending or new) after the stop
  lost          accepted, neither trained, dropped nor queued   (must be 0)
  trained_twice a rollout id, or the same work under two ids, in two steps (must be 0)
  versions      every step's policy version is the step number: no version lost or repeated
It also samples Redis's used memory and the run directory's size, and prints the reward of the
first and last tenth of steps. The identity of "the same work" is the group's content digest
(rlfleet.wire.streams.group_digest) where the streams module has one, else the rollout id.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis
from _paths import ROOT

from rlfleet.config import load_bundle
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.wire import streams
from rlfleet.wire.run_summary import read_metrics, summarize
from rlfleet.wire.streams import RolloutGroup, RunKeys

KINDS = ("rollout", "verifier", "relay", "origin", "trainer", "redis")


def identity(group: RolloutGroup) -> str:
    digest = getattr(streams, "group_digest", None)
    return digest(group) if digest else group.rollout_id


def run_processes(run_dir: Path) -> dict[str, list[int]]:
    """Live processes of the run by kind (a component's command line names the run's config; Redis
    renames its command line, so it is found by its working directory)."""
    config, found = str(run_dir / "rlrun.yaml"), {k: [] for k in KINDS}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
            cwd = (entry / "cwd").resolve() if "redis" in argv[0] else None
        except (OSError, IndexError):
            continue
        if state == "Z":
            continue
        if config in argv and len(argv) > 3 and argv[3] in KINDS:
            found[argv[3]].append(int(entry.name))
        elif cwd == (run_dir / "redis").resolve():
            found["redis"].append(int(entry.name))
    return found


class Auditor(threading.Thread):
    """Follows `verified` with XREAD from the start, through Redis restarts; records each group once."""

    def __init__(self, url: str, run: str, stop: threading.Event):
        super().__init__(daemon=True, name="auditor")
        self.url, self.keys, self.stop = url, RunKeys(run), stop
        self.accepted: dict[str, str] = {}  # identity -> rollout id
        self.peak_redis_bytes = 0

    def run(self) -> None:
        last = "0-0"
        client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)
        while not self.stop.is_set():
            try:
                for _, entries in client.xread({self.keys.verified: last}, block=200, count=500) or []:
                    for msg_id, fields in entries:
                        last = msg_id
                        group = RolloutGroup.decode(fields)
                        self.accepted.setdefault(identity(group), group.rollout_id)
                self.peak_redis_bytes = max(self.peak_redis_bytes, int(client.info("memory")["used_memory"]))
            except redis.RedisError:
                self.stop.wait(0.2)  # Redis is being restarted; its append-only file keeps the stream


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path` (files and directories may vanish while it walks)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def leftovers(run_dir: Path, run: str) -> set[str]:
    """Identities still in `verified` after the run stopped (Redis started once more on its file)."""
    with EmbeddedRedis(run_dir / "redis", persistent=True) as url:
        client = redis.Redis.from_url(url)
        return {identity(RolloutGroup.decode(f)) for _, f in client.xrange(RunKeys(run).verified)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=20.0, help="mean seconds between kills")
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arithmetic" / "rlrun.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="rlfleet-chaos-"))) / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(args.config), "--run-dir", str(run_dir), "--no-progress",
         "--steps", "1000000"],
        stdout=open(run_dir.parent / "launcher.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    endpoints = run_dir / "endpoints.json"
    while not endpoints.exists():
        assert launcher.poll() is None, (run_dir.parent / "launcher.log").read_text()
        time.sleep(0.5)
    run = load_bundle(args.config).run.metadata.name
    stop = threading.Event()
    auditor = Auditor(json.loads(endpoints.read_text())["redis"], str(run), stop)
    auditor.start()
    while not read_metrics(run_dir / "metrics.jsonl"):  # kills start once the run trains
        assert launcher.poll() is None, (run_dir.parent / "launcher.log").read_text()
        time.sleep(1)
    kills: Counter[str] = Counter()
    peak_disk, started = 0, time.monotonic()
    next_kill = started + rng.expovariate(1 / args.interval)
    while time.monotonic() - started < args.minutes * 60:
        assert launcher.poll() is None, "the run stopped: " + (run_dir.parent / "launcher.log").read_text()[-2000:]
        if time.monotonic() >= next_kill:
            live = run_processes(run_dir)
            candidates = [k for k in KINDS if live[k]]  # all may be restarting at this very moment
            if candidates:
                kind = rng.choice(candidates)
                os.kill(rng.choice(live[kind]), signal.SIGKILL)
                kills[kind] += 1
                print(f"{time.monotonic() - started:7.1f}s  killed {kind}", flush=True)
            next_kill = time.monotonic() + rng.expovariate(1 / args.interval)
        peak_disk = max(peak_disk, disk_bytes(run_dir))
        time.sleep(1)
    launcher.send_signal(signal.SIGINT)
    launcher.wait(300)
    stop.set()
    auditor.join(10)

    records = read_metrics(run_dir / "metrics.jsonl")
    trained = Counter(rid for r in records for rid in r["rollout_ids"])
    by_id = {rid: ident for ident, rid in auditor.accepted.items()}
    trained_idents = Counter(by_id.get(rid, rid) for rid in trained.elements())
    dropped = {by_id.get(rid, rid) for r in records for ids in r.get("dropped_rollout_ids", {}).values() for rid in ids}
    queued = leftovers(run_dir, str(run))
    lost = [i for i in auditor.accepted if i not in trained_idents and i not in dropped and i not in queued]
    twice = [i for i, n in trained_idents.items() if n > 1]
    versions_ok = (
        [r["policy_version"] for r in records] == [r["step"] for r in records] == list(range(1, len(records) + 1))
    )
    summary = summarize(records, time.monotonic() - started)
    result = {
        "minutes": args.minutes,
        "kills": dict(kills),
        "steps": len(records),
        "accepted": len(auditor.accepted),
        "trained": len(trained),
        "dropped": len(dropped),
        "queued": len(queued),
        "lost": len(lost),
        "trained_twice": len(twice),
        "versions_in_order": versions_ok,
        "reward_first": summary["reward_first"],
        "reward_last": summary["reward_last"],
        "redis_peak_bytes": auditor.peak_redis_bytes,
        "disk_peak_bytes": peak_disk,
        "run_dir": str(run_dir),
    }
    print(f"\n{'kills':24s} {dict(kills)}")
    for key in ("steps", "accepted", "trained", "dropped", "queued", "lost", "trained_twice", "versions_in_order",
                "reward_first", "reward_last", "redis_peak_bytes", "disk_peak_bytes"):  # fmt: skip
        print(f"{key:24s} {result[key]}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not lost and not twice and versions_ok else 1


if __name__ == "__main__":
    sys.exit(main())
