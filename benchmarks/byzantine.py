"""Byzantine goodput (issue 29), with a trainer: N honest and M malicious workers, all joined through the door of
a local run's ingest (admission `open`), against the real gate and trainer; what of the malicious work is
trained, what the honest workers lose, how many policy versions a cheat lasts. Default 7 + 3.

Each phase is a whole local run, `rlfleet run` as a user starts it (rlfleet/local/: redis-server, origin,
verifier, ingest, trainer; builtin://tiny-arithmetic, the example's task and trainer settings), whose one
InferencePool has no workers: every group comes from this process, one thread and torch engine per worker.
Each worker joins with `POST /v1/RUN/join` at the URL the run prints (endpoints.json `join`), then makes groups
(tests/toploc/attacks.honest) with the newest announced policy version (read from the run's policy stream and
loaded from its store, as a worker that downloaded it from the relays would hold it) and posts them with its
token. A malicious worker makes an honest group and then, after `--honest-first` honest groups, replaces it by an
attack, switching attack every `--switch` groups through: forced answers proven by a real prefill, a temperature
lie, a dropped EOS, an answer after EOS, a duplicated sample, a replay of its own accepted group, a reward lie,
and a flood (a burst of posts at once). A post refused with 403 (banned) ends the worker. After `--seconds` the
run is stopped (Ctrl-C, as a user would); then the same honest workers run alone in a fresh run for the same
time (the all-honest run).

What is measured, per phase:
  - trained: the groups the trainer's steps name (metrics.jsonl `rollout_ids`), mapped to what was posted. A
    poisoned sample: one of a group whose content an attack changed (a group an attack left token for token as
    honest sampling made it, e.g. no EOS to drop, is honest work), or of a reward lie whose lied rewards reached
    the trainer (an audit thread reads every entry of the `verified` stream, the trainer's only input, before
    the trainer deletes it; the gate replaces claimed rewards by its own, so none should);
  - honest goodput: honest groups the gate accepted within the window after `--warmup` seconds (its counters
    then and when the window ends; the warm-up leaves out the gate's and the trainer's start on a loaded
    machine), per minute, against the all-honest run's;
  - time to ban in policy versions: the version announced when the ban was recorded (its `at`) minus the one
    announced when the cheat posted its first bad group (the policy stream's entry ids are their times);
  - honest workers banned; reward_mean over the first and the last tenth of the steps, and its noise (the
    standard error of the last tenth's per-step means).
`--json PATH` writes the figures. Usage: python benchmarks/byzantine.py [--honest 7] [--malicious 3]
[--seconds 240] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _paths  # noqa: F401  (the root first: tests.toploc.attacks, tests.support)
import redis
import requests
import torch
import yaml

from rlfleet.config import API_VERSION, parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import worker_stats
from rlfleet.services.ingest.client import post_group, rollouts_url
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.versions.checkpoint import prune_cache
from rlfleet.versions.signing import parse_public_key
from rlfleet.wire.streams import MESSAGE_FIELD, RolloutGroup, RunKeys, decode_json, stream_reply
from tests.toploc import attacks

RUN = "byzantine"
KEYS = RunKeys(RUN)
ATTACKS = ["forced", "temperature_lie", "dropped_eos", "answer_after_eos", "duplicated", "replay", "reward_lie"]
ATTACKS += ["flood"]
FLOOD = 20  # posts of one flood burst
KEEP_VERSIONS = 20  # in the workers' shared cache: a worker still loading an older one never loses it


def run_config(workers: int, args) -> str:
    """The run: the example's model, task and trainer settings; joins open to every worker of this process (one
    address, 127.0.0.1: its join budget must cover them all); an InferencePool of no workers."""
    spec = {
        "model": {"path": "builtin://tiny-arithmetic"},
        "task": {"type": "arithmetic", "seed": 0, "maxOperand": 20, "operations": ["+"]},
        "sampling": {"groupSize": args.group_size, "maxTokens": 6, "temperature": 1.0},
        "trainer": {
            "steps": 1_000_000,  # the window ends the run
            "batchSize": args.batch_size,
            "learningRate": 1.0e-3,
            "epsLow": 0.2,
            "epsHigh": 0.28,
            "delta": 4.0,
            "maxGradNorm": 1.0,
            "maxAsyncLevel": 2,
            "checkpointEvery": 50,
        },
        "verifier": {"spotCheckFraction": args.spot_check},
        # Probation stays at its default 20 groups: every group of a new worker is prefill-checked. Its low rate
        # would cap both runs alike; here the CPU, the gate and the trainer are the limit.
        "ingest": {
            # a short inbox (two batches): a group waits at most about two steps for the gate, as workers that
            # pause on the trainer's demand keep it; a full inbox answers 503 and the worker resends within a second
            "maxBacklog": 2 * args.batch_size,
            "admission": {"mode": "open", "joinsPerMinutePerAddress": 4 * workers, "probationRatePerMinute": 600},
        },
    }
    docs = [
        {"apiVersion": API_VERSION, "kind": "RLRun", "metadata": {"name": RUN}, "spec": spec},
        {
            "apiVersion": API_VERSION,
            "kind": "InferencePool",
            "metadata": {"name": "none"},
            "spec": {"run": RUN, "replicas": 0},
        },
    ]
    return yaml.safe_dump_all(docs, sort_keys=False)


@dataclasses.dataclass
class Posted:
    worker: str
    kind: str  # "honest" or the attack
    poisoned: bool  # the attack changed the content (or lied about the reward)
    samples: int
    at: float
    lied_rewards: list[float] | None = None


@dataclasses.dataclass
class WorkerLog:
    malicious: bool
    worker: str = ""
    posted: int = 0
    first_bad: int | None = None  # posts before its first poisoned one
    first_bad_at: float | None = None
    banned_after: int | None = None  # posts when the ban answered
    banned_at: float | None = None
    error: str | None = None


def make_attack(kind: str, engine: TorchEngine, group: RolloutGroup, spec, accepted: list[RolloutGroup]):
    """(the group to post, poisoned?, lied rewards or None)."""
    model, tokenizer = engine.model, engine.tokenizer
    if kind == "forced":
        out = attacks.forced(group, model, tokenizer, spec)
    elif kind == "temperature_lie":
        out = attacks.temperature_lie(engine, group, spec)
    elif kind == "dropped_eos":
        out = attacks.dropped_eos(group, model, tokenizer, spec)
    elif kind == "answer_after_eos":
        out = attacks.answer_after_eos(group, model, tokenizer, spec)
    elif kind == "duplicated":
        out = attacks.duplicated(group)
    elif kind == "replay":
        if not accepted:
            return group, False, None
        return attacks.replay_new_rollout_id(accepted[-1]), True, None
    elif kind == "reward_lie":
        out = copy.deepcopy(group)
        truth = [s.reward for s in out.samples]
        for s in out.samples:
            s.reward = 1.0
        return out, truth != [1.0] * len(truth), [1.0] * len(truth)
    else:
        raise ValueError(kind)
    changed = attacks.tokens(out) != attacks.tokens(group)
    return out, changed, None


class Watcher(threading.Thread):
    """The run's policy stream (each announced version and when: its entry id's milliseconds) and every entry of
    `verified` (rollout id -> worker, rewards), read as they are added; the trainer deletes a verified entry only
    once the step that trained it is committed, so a blocking XREAD sees every one."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
        self.versions: list[tuple[float, int]] = []  # (seconds since the epoch, version), in order
        self.verified: dict[str, tuple[str, list[float]]] = {}
        self.stop = threading.Event()

    @property
    def latest(self) -> int | None:
        return self.versions[-1][1] if self.versions else None

    def version_at(self, when: float) -> int:
        """The newest version announced at `when` (0 before any)."""
        return max([v for at, v in self.versions if at <= when], default=0)

    def run(self) -> None:
        cursor = {KEYS.policy: "0-0", KEYS.verified: "0-0"}
        while not self.stop.is_set():
            for stream, entries in stream_reply(self.client.xread(cursor, count=1000, block=200)):
                name = stream.decode() if isinstance(stream, bytes) else stream
                for entry_id, fields in entries:
                    cursor[name] = entry_id
                    if name == KEYS.policy:
                        ms = int(entry_id.split(b"-")[0])
                        self.versions.append((ms / 1000, int(decode_json(fields)["version"])))
                    else:
                        group = RolloutGroup.decode(fields)
                        self.verified[group.rollout_id] = (group.worker_id, [s.reward for s in group.samples])


class Follower(threading.Thread):
    """Downloads each version the watcher sees announced from the relays the run document names (manifests
    checked with its key; a delta rebuilt from the version held), as one joined worker's follower does, into one
    cache the benchmark's workers share; `ready` is the newest on disk. Keeps the newest KEEP_VERSIONS."""

    def __init__(self, watcher: Watcher, document: dict, cache_dir: Path):
        super().__init__(daemon=True)
        self.watcher, self.cache_dir, self.stop = watcher, cache_dir, threading.Event()
        key = parse_public_key(document["publicKey"])
        self.settings = FetchSettings.over(document["relayUrls"], RUN, public_key=key, stop=self.stop)
        self.ready: tuple[int, Path] | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                newest = self.watcher.latest
                if newest is None or (self.ready and newest <= self.ready[0]):
                    time.sleep(0.05)
                    continue
                self.ready = (newest, fetch_policy(self.settings, newest, self.cache_dir))
                prune_cache(self.cache_dir, newest - KEEP_VERSIONS + 1)
        except Exception as exc:  # reported by run_phase
            self.error = f"{type(exc).__name__}: {exc}"


class LocalRun:
    """One phase's `rlfleet run`, started in `directory`; its admin Redis URL, join URL and store once up."""

    def __init__(self, directory: Path, workers: int, args):
        directory.mkdir(parents=True)
        config = directory / "rlrun.yaml"
        config.write_text(run_config(workers, args))
        parse_bundle(config.read_text())  # a bad config fails here, not in a process
        self.path, self.log = directory / "run", open(directory / "launcher.log", "wb")
        argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(self.path), "--no-progress"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        endpoints = self.path / "endpoints.json"
        while not endpoints.exists():
            self.check(deadline, "no endpoints.json")
            time.sleep(0.5)
        found = json.loads(endpoints.read_text())
        self.redis_url, self.join = found["redis"], found["join"]
        verifier = found["metrics"]["verifier/0"].removesuffix("/metrics") + "/healthz"
        self.base = self.join.rsplit("/v1/", 1)[0]
        client = redis.Redis.from_url(self.redis_url, socket_timeout=10)
        while True:  # the trainer has published version 0 and the ingest serves the door
            self.check(deadline, "version 0 never announced or the ingest never answered")
            try:
                answer = requests.get(self.join, timeout=5)
                gate = requests.get(verifier, timeout=5).status_code == 200  # both runs' workers start with it up
                if client.xlen(KEYS.policy) and answer.status_code == 200 and gate:
                    self.document = answer.json()  # the run document, as `rlfleet join` reads it
                    break
            except (redis.RedisError, requests.RequestException):
                pass
            time.sleep(0.5)
        client.close()

    def check(self, deadline: float, what: str) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"byzantine: {what}; see {self.log.name}")

    def stop(self) -> None:
        """Ctrl-C, as a user stops a run: every component stops, the reports are written."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(180)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # a second Ctrl-C kills what is left
            self.proc.wait(60)
        self.log.close()

    def records(self) -> list[dict]:
        metrics = self.path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]


def worker_loop(log: WorkerLog, engine: TorchEngine, run: LocalRun, follower: Follower, spec, shared, args) -> None:
    """One worker: join, then make and post groups until `stop` or its ban (`tasks`: the run's task counter,
    shared, so no two workers draw the same prompt and seed). An exception is kept in `log.error`."""
    try:
        _work(log, engine, run, follower, spec, shared, args)
    except Exception as exc:  # reported by run_phase: a benchmark whose worker died measures nothing
        log.error = f"{type(exc).__name__}: {exc}"


def _work(log: WorkerLog, engine: TorchEngine, run: LocalRun, follower: Follower, spec, shared, args) -> None:
    stop, posted, lock, tasks = shared
    torch.set_num_threads(1)
    answer = requests.post(run.join.rstrip("/") + "/join", json={}, timeout=30)
    answer.raise_for_status()
    log.worker, token = answer.json()["worker_id"], answer.json()["token"]
    session, url = requests.Session(), rollouts_url(run.base, RUN)
    mine: list[RolloutGroup] = []
    for n in itertools.count():
        if stop.is_set():
            return
        ready = follower.ready
        if ready is not None and ready[0] > engine.version:  # the newest version downloaded, as a worker follows
            engine.load_weights(ready[1], ready[0])
        with lock:
            index = next(tasks)
        group = attacks.honest(engine, spec, index, worker=log.worker, version=engine.version)
        kind, poisoned, lied, burst = "honest", False, None, 1
        if log.malicious and n >= args.honest_first:
            kind = ATTACKS[((n - args.honest_first) // args.switch) % len(ATTACKS)]
            if kind == "flood":
                burst = FLOOD
            else:
                group, poisoned, lied = make_attack(kind, engine, group, spec, mine)
        for k in range(burst):
            sent = group if k == 0 else attacks.replay_new_rollout_id(group)
            with lock:
                posted[sent.rollout_id] = Posted(log.worker, kind, poisoned, len(sent.samples), time.time(), lied)
            if poisoned and log.first_bad is None:
                log.first_bad, log.first_bad_at = log.posted, time.time()
            try:
                done = post_group(session, url, token, sent.encode()[MESSAGE_FIELD], stop, 1.0, lambda _: None)
            except RuntimeError as exc:  # 403: banned (the only refusal an honest post can get here)
                if "banned" in str(exc):
                    log.banned_after, log.banned_at = log.posted, time.time()
                    return
                raise
            if done is None:
                return
            log.posted += 1
        if not poisoned:
            mine.append(group)


def run_phase(tmp: Path, honest: int, malicious: int, args) -> dict:
    """One local run with `honest` + `malicious` joined workers for args.seconds; its figures (summarize)."""
    run = LocalRun(tmp / f"run-{honest}-{malicious}", honest + malicious, args)
    watcher = Watcher(run.redis_url)
    follower = Follower(watcher, run.document, run.path.parent / "cache")
    client = redis.Redis.from_url(run.redis_url, socket_timeout=30)
    try:
        spec = parse_bundle(run_config(honest + malicious, args)).run.spec
        watcher.start()
        follower.start()
        while follower.ready is None and follower.error is None:  # version 0, as every worker starts from it
            time.sleep(0.1)
        stop, lock, posted, tasks = threading.Event(), threading.Lock(), {}, itertools.count()
        logs = [WorkerLog(malicious=i >= honest) for i in range(honest + malicious)]
        engines = [
            TorchEngine(follower.ready[1], follower.ready[0]) for _ in logs
        ]  # loaded one by one: not thread-safe
        threads = [
            threading.Thread(
                target=worker_loop,
                args=(log, engine, run, follower, spec, (stop, posted, lock, tasks), args),
                daemon=True,
            )
            for log, engine in zip(logs, engines)
        ]
        start = time.time()
        for t in threads:
            t.start()
        at_warm = None
        while time.time() < start + args.seconds:
            run.check(float("inf"), "the run stopped during the window")
            if at_warm is None and time.time() >= start + args.warmup:
                at_warm, warm_at = worker_stats(client, KEYS), time.time()
            time.sleep(1)
        at_end = worker_stats(client, KEYS)  # the goodput's counters: the groups accepted after the warm-up
        window = time.time() - start
        measured = time.time() - warm_at
        stop.set()
        for t in threads:
            t.join(120)
        deadline = time.time() + 120  # the gate judges what was posted (the trainer goes on training it)
        while client.xlen(KEYS.rollouts) > 0 and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(5)  # the trainer's step on the last groups
        stats = worker_stats(client, KEYS)
    finally:
        watcher.stop.set()
        follower.stop.set()
        client.close()
        run.stop()
    errors = [f"{log.worker or 'a worker'}: {log.error}" for log in logs if log.error]
    errors += [f"version follower: {follower.error}"] if follower.error else []
    if errors:
        raise SystemExit("byzantine: workers failed: " + "; ".join(errors))
    return summarize(logs, posted, watcher, (at_warm, at_end, measured), stats, run.records(), window)


def mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def summarize(logs, posted: dict, watcher: Watcher, goodput: tuple, stats: dict, records: list[dict], window: float):
    """The phase's figures (module docstring); `goodput`: the workers' counters after the warm-up and at the end of
    the window, and the seconds between them."""
    poisoned_samples = unaudited = 0
    poisoned_by_attack: dict[str, int] = {}
    honest_ids = {log.worker for log in logs if not log.malicious}
    trained = [rid for r in records for rid in r["rollout_ids"]]
    for rid in trained:
        p = posted[rid]  # every group of this run was posted here
        if not p.poisoned:
            continue
        if p.lied_rewards is not None:
            if rid not in watcher.verified:
                unaudited += 1
                continue
            if watcher.verified[rid][1] != p.lied_rewards:
                continue  # the gate's rewards replaced the lie
        poisoned_samples += p.samples
        poisoned_by_attack[p.kind] = poisoned_by_attack.get(p.kind, 0) + p.samples
    at_warm, at_end, measured = goodput

    def accepted(snapshot: dict) -> int:
        return sum(snapshot.get(w, {}).get("counters", {}).get("accepted", 0) for w in honest_ids)

    honest_accepted = accepted(at_end) - accepted(at_warm)
    bad = [log for log in logs if log.malicious]

    def versions_to_ban(log: WorkerLog) -> int | None:
        ban = stats.get(log.worker, {}).get("banned")
        if log.first_bad_at is None or not ban:
            return None
        return watcher.version_at(float(ban["at"])) - watcher.version_at(log.first_bad_at)

    rewards = [r["reward_mean"] for r in records]
    tenth = max(1, len(rewards) // 10)
    last = rewards[-tenth:]
    return {
        "window_s": round(window, 1),
        "steps": len(records),
        "trained_groups": len(trained),
        "trained_samples": sum(r["samples"] for r in records),
        "poisoned_samples_trained": poisoned_samples,
        "poisoned_samples_by_attack": poisoned_by_attack,
        "reward_lies_trained_unaudited": unaudited,
        "honest_groups_trained": sum(1 for r in records for w in r["worker_ids"] if w in honest_ids),
        "honest_groups_accepted": honest_accepted,
        "goodput_seconds": round(measured, 1),
        "honest_goodput_per_min": round(60 * honest_accepted / measured, 2),
        "honest_banned": sum(1 for w in honest_ids if stats.get(w, {}).get("banned")),
        "malicious_banned": sum(1 for log in bad if stats.get(log.worker, {}).get("banned")),
        "malicious": len(bad),
        "versions_from_first_bad_to_ban": [versions_to_ban(log) for log in bad],
        "seconds_from_first_bad_to_ban": [
            None if log.first_bad_at is None or log.banned_at is None else round(log.banned_at - log.first_bad_at, 1)
            for log in bad
        ],
        "ban_reasons": sorted({(stats.get(log.worker, {}).get("banned") or {}).get("reason", "-") for log in bad}),
        "attacks_posted": sorted({p.kind for p in posted.values() if p.kind != "honest"}),
        "reward_first_tenth": mean(rewards[:tenth]),
        "reward_last_tenth": mean(last),
        "reward_last_tenth_stderr": round(statistics.stdev(last) / len(last) ** 0.5, 4) if len(last) > 1 else None,
    }


def targets(mixed: dict, alone: dict, ratio: float) -> dict:
    """The issue's done-when targets, each met or not."""
    versions = mixed["versions_from_first_bad_to_ban"]
    noise = (mixed["reward_last_tenth_stderr"] or 0) + (alone["reward_last_tenth_stderr"] or 0)
    return {
        "zero_poisoned_over_10000_trained": mixed["poisoned_samples_trained"] == 0
        and mixed["trained_samples"] >= 10_000,
        "honest_goodput_at_least_90_percent": ratio >= 0.9,
        "every_cheat_banned_within_2_versions": all(v is not None and v <= 2 for v in versions),
        "no_honest_banned": mixed["honest_banned"] == 0,
        "reward_no_worse_than_all_honest": (mixed["reward_last_tenth"] or 0)
        >= (alone["reward_last_tenth"] or 0) - noise,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=7)
    parser.add_argument("--malicious", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=240.0, help="each run's window (both runs)")
    parser.add_argument(
        "--warmup", type=float, default=40.0, help="seconds of the window before goodput is counted (start-up)"
    )
    parser.add_argument("--honest-first", type=int, default=0, help="honest groups a cheat posts before attacking")
    parser.add_argument("--switch", type=int, default=1, help="groups per attack before a cheat switches")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="groups per trainer step")
    parser.add_argument("--spot-check", type=float, default=0.25, help="verifier spotCheckFraction")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep both runs' directories here (default: a temp)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("RLFLEET_TORCH_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp = args.work_dir or Path(d)
        mixed = run_phase(tmp, args.honest, args.malicious, args)
        alone = run_phase(tmp, args.honest, 0, args)
    ratio = round(mixed["honest_goodput_per_min"] / max(alone["honest_goodput_per_min"], 1e-9), 3)
    result = {
        "honest": args.honest,
        "malicious": args.malicious,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup,
        "group_size": args.group_size,
        "batch_size": args.batch_size,
        "spot_check_fraction": args.spot_check,
        "mixed": mixed,
        "all_honest": alone,
        "honest_goodput_ratio": ratio,
        "targets": targets(mixed, alone, ratio),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
