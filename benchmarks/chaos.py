"""Chaos: a local run whose components are SIGKILLed at random, restarted as Kubernetes would, audited.

    python benchmarks/chaos.py --minutes 10 --json chaos.json

`rlfleet run` (the launcher restarts what dies, with back-off) trains the arithmetic example while
this script SIGKILLs a random component every ~`--interval` seconds: a rollout worker, the
verifier, a relay, the origin, the trainer or Redis. It finds them in the run's record of what the
launcher started (RUN_DIR/processes.json, rewritten on each restart); a kind of process the run has
that it cannot find for PATIENCE_S stops it with exit status 1 and a message naming the kind.
An auditor follows the `verified` stream the whole time (a plain XREAD, no consumer group, so it
takes nothing from the trainer) and records every accepted group as it is forwarded. At the end the
run is stopped, Redis is started once more on the run's append-only file, and the audit compares:
  accepted      groups the gate forwarded (seen by the auditor)
  trained       rollout ids in metrics.jsonl, one record per optimizer step
  dropped       ids the trainer dropped by design (too stale for maxAsyncLevel, duplicate, zero advantage)
  queued        entries still in `verified` (pending or new) after the stop
  lost          accepted, neither trained, dropped nor queued   (must be 0)
  trained_twice a rollout id, or the same work under two ids, in two steps (must be 0)
  versions      steps 1..N, each once, each at a policy version above the one before: none repeated
                or out of order (a version may run ahead of its step after the trainer restarts between
                two resume saves: the restored weights are published as the next version, as
                docs/local-runs.md says)
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
from rlfleet.local.supervisor import RECORD, run_processes
from rlfleet.wire import streams
from rlfleet.wire.run_summary import read_metrics, summarize
from rlfleet.wire.streams import RolloutGroup, RunKeys

# Seconds a kind of process the run has may go unseen (restarting after a kill, with its back-off of up to 30 s,
# then starting up) before the benchmark stops: a kind it cannot find is a kind it never kills.
PATIENCE_S = 120.0


def identity(group: RolloutGroup) -> str:
    digest = getattr(streams, "group_digest", None)
    return digest(group) if digest else group.rollout_id


class Finder:
    """The run's live processes by kind, read from the run's record of what it started (RUN_DIR/processes.json,
    rewritten by the supervisor on each start: rlfleet/local/supervisor.py). Every kind the record names is a key,
    with an empty list while none of its processes runs; when a kind has had none for `patience_s`, or the run
    kept no record, the benchmark stops with a message naming what it could not find (SystemExit: exit status 1)."""

    def __init__(self, run_dir: Path, patience_s: float = PATIENCE_S):
        self.run_dir, self.patience_s = run_dir, patience_s
        self.last_seen: dict[str, float] = {}

    def live(self) -> dict[str, list[int]]:
        processes, now = run_processes(self.run_dir), time.monotonic()
        if not processes:
            raise SystemExit(f"chaos: no record of the run's processes in {self.run_dir / RECORD}")
        found: dict[str, list[int]] = {}
        for name, pid in processes.items():
            found.setdefault(name.split("/")[0], []).extend([pid] if pid is not None else [])
        for kind, pids in found.items():
            if pids:
                self.last_seen[kind] = now
            elif now - self.last_seen.setdefault(kind, now) > self.patience_s:
                raise SystemExit(
                    f"chaos: no live {kind} process of the run for {self.patience_s:.0f}s "
                    f"(the run's record: {self.run_dir / RECORD}); it cannot be killed"
                )
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


def versions_in_order(records: list[dict]) -> bool:
    """Steps 1..N each once, at strictly increasing policy versions, none below its step."""
    steps, versions = [r["step"] for r in records], [r["policy_version"] for r in records]
    increasing = all(earlier < later for earlier, later in zip(versions, versions[1:]))
    return steps == list(range(1, len(records) + 1)) and increasing and all(v >= s for v, s in zip(versions, steps))


def kill_at_random(
    run_dir: Path, launcher: subprocess.Popen, seconds: float, interval: float, rng: random.Random
) -> tuple[Counter[str], int]:
    """SIGKILL a random live process of a random kind every ~`interval` seconds for `seconds`; the kills by kind
    and the run directory's peak size. Every kind the run has must be found (Finder), or this exits."""
    finder, kills, peak_disk = Finder(run_dir), Counter[str](), 0
    started = time.monotonic()
    next_kill = started + rng.expovariate(1 / interval)
    while time.monotonic() - started < seconds:
        assert launcher.poll() is None, "the run stopped: " + (run_dir.parent / "launcher.log").read_text()[-2000:]
        live = finder.live()
        if time.monotonic() >= next_kill:
            candidates = sorted(kind for kind, pids in live.items() if pids)  # a kind may be restarting just now
            if candidates:
                kind = rng.choice(candidates)
                os.kill(rng.choice(live[kind]), signal.SIGKILL)
                kills[kind] += 1
                print(f"{time.monotonic() - started:7.1f}s  killed {kind}", flush=True)
            next_kill = time.monotonic() + rng.expovariate(1 / interval)
        peak_disk = max(peak_disk, disk_bytes(run_dir))
        time.sleep(1)
    return kills, peak_disk


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
    started = time.monotonic()
    try:
        kills, peak_disk = kill_at_random(run_dir, launcher, args.minutes * 60, args.interval, rng)
    finally:  # stopped by a failure too: no run is left behind
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
    versions_ok = versions_in_order(records)
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
