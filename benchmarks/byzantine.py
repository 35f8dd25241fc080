"""Byzantine goodput (issue 29): N honest and M malicious workers, all joined through the ingest's door
(admission `open`), against the real gate; what of the malicious work gets through, what the honest
workers lose, and how fast the cheats are banned. Default 7 + 3.

One process, real parts on 127.0.0.1: an embedded redis-server, a signed policy version served by an
origin over HTTP, the ingest (door and submissions over HTTP, per-worker tokens, probation), the gate's
own loop (rlfleet/services/toploc/gate.py) in a thread, and one thread per worker with its own torch
engine (a random tiny Qwen2, tests/support.tiny_policy_dir; fp32 on CPU). Each worker joins with
`POST /v1/RUN/join`, then makes groups (tests/toploc/attacks.honest) and posts them with its token.
A malicious worker makes an honest group and then, after `--honest-first` honest groups, replaces it
by an attack, switching attack every `--switch` groups through: forced answers proven by a real prefill,
a temperature lie, a dropped EOS, an answer after EOS, a duplicated sample, a replay of its own accepted
group, a reward lie, and a flood (a burst of posts at once). A post refused with 403 (banned) ends the worker.
Then the same honest workers run alone for the same time (the all-honest run).

Scope of this version: no trainer runs, so the policy stays at version 0: "poisoned samples trained" is
measured as poisoned samples that reached `verified` (the trainer's only input), "time to ban" in groups
the worker posted after its first bad one and in seconds, not in policy versions, and the reward curve is
not measured. A poisoned sample: one of a group whose content an attack changed (a group an attack left
token for token as honest sampling made it, e.g. no EOS to drop, is honest work), or a reward lie whose
lied reward reached `verified` (the gate replaces claimed rewards by its own, so none should).
`--json PATH` writes the figures. Usage: python benchmarks/byzantine.py [--honest 7] [--malicious 3]
[--seconds 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import _paths  # noqa: F401  (the root first: tests.toploc.attacks, tests.support)
import requests
import torch
import yaml

from rlfleet.config import parse_bundle
from rlfleet.local.redis_server import EmbeddedRedis, free_port
from rlfleet.services.ingest.app import make_app
from rlfleet.services.ingest.client import join_url, post_group, rollouts_url
from rlfleet.services.ingest.door import make_door
from rlfleet.services.rollout.engines.torch_engine import TorchEngine
from rlfleet.services.shardcast import origin
from rlfleet.services.toploc.gate import Gate
from rlfleet.services.toploc.reputation import worker_stats
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import FileStore
from rlfleet.wire import components
from rlfleet.wire.asgi import BackgroundServer
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import MESSAGE_FIELD, RolloutGroup, RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import redis_from_url, serving, tiny_policy_dir
from tests.toploc import attacks

RUN = "byzantine"
ATTACKS = ["forced", "temperature_lie", "dropped_eos", "answer_after_eos", "duplicated", "replay", "reward_lie"]
ATTACKS += ["flood"]
FLOOD = 20  # posts of one flood burst


def run_config(policy: Path, store: Path, public: str, relay: str, workers: int) -> str:
    spec = {
        "model": {"path": str(policy)},
        "task": {"type": "arithmetic", "maxOperand": 20},
        "sampling": {"groupSize": 4, "maxTokens": 6},
        "trainer": {"batchSize": 1, "maxAsyncLevel": 1},
        "verifier": {"spotCheckFraction": 0.25},
        "shardcast": {"publicKey": public},
        "store": {"uri": f"file://{store}"},
        # one address (127.0.0.1) for every worker here: its join budget must cover them all. Probation stays
        # at its default 20 groups: every group of a new worker is prefill-checked
        "ingest": {
            "maxBacklog": 200,
            "ratePerMinute": 600,
            "admission": {
                "mode": "open",
                "relayUrls": [relay],
                "joinsPerMinutePerAddress": 4 * workers,
                # probation's low rate would cap both runs alike; here the CPU and the gate are the limit
                "probationRatePerMinute": 600,
            },
        },
    }
    return yaml.safe_dump(
        {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLRun", "metadata": {"name": RUN}, "spec": spec}
    )


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


def worker_loop(log: WorkerLog, engine, base: str, spec, stop: threading.Event, posted: dict, lock, tasks, args):
    """One worker: join, then make and post groups until `stop` or its ban (`tasks`: the run's task counter,
    shared, so no two workers draw the same prompt and seed). An exception is kept in `log.error`."""
    try:
        _work(log, engine, base, spec, stop, posted, lock, tasks, args)
    except Exception as exc:  # reported by run_phase: a benchmark whose worker died measures nothing
        log.error = f"{type(exc).__name__}: {exc}"


def _work(log: WorkerLog, engine, base: str, spec, stop: threading.Event, posted: dict, lock, tasks, args):
    torch.set_num_threads(1)
    answer = requests.post(join_url(base, RUN), json={}, timeout=30)
    answer.raise_for_status()
    log.worker, token = answer.json()["worker_id"], answer.json()["token"]
    session, url = requests.Session(), rollouts_url(base, RUN)
    mine: list[RolloutGroup] = []
    for n in itertools.count():
        if stop.is_set():
            return
        with lock:
            index = next(tasks)
        group = attacks.honest(engine, spec, index, worker=log.worker)
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
                done = post_group(session, url, token, sent.encode()[MESSAGE_FIELD], stop, on_wait=lambda _: None)
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


def run_phase(tmp: Path, policy: Path, store: FileStore, public: str, honest: int, malicious: int, args) -> dict:
    with EmbeddedRedis(tmp / f"redis-{honest}-{malicious}") as url, serving(origin.make_app(store, RUN)) as relay:
        client = redis_from_url(url)
        keys = RunKeys(RUN)
        client.xadd(keys.policy, encode_json({"version": 0}))
        bundle = parse_bundle(run_config(policy, tmp / "store", public, relay, honest + malicious))
        spec = bundle.run.spec
        door = make_door(view_bundle(bundle, VIEWS[components.INGEST]).run, client, None)
        server = BackgroundServer(make_app(RUN, spec.ingest, client, {}, door), "127.0.0.1", free_port(), "ingest")
        server.start()
        base = f"http://127.0.0.1:{server.server.config.port}"
        ctx = Context(
            bundle=view_bundle(bundle, VIEWS[components.VERIFIER]), redis=client, keys=keys, stop=threading.Event()
        )
        gate = Gate(ctx, "verifier-0", relay, tmp / f"gate-cache-{malicious}")
        gate_thread = threading.Thread(target=gate.run, daemon=True)
        gate_thread.start()
        stop, lock, posted, tasks = threading.Event(), threading.Lock(), {}, itertools.count()
        logs = [WorkerLog(malicious=i >= honest) for i in range(honest + malicious)]
        shared = (base, spec, stop, posted, lock, tasks, args)
        engines = [TorchEngine(policy, 0) for _ in logs]  # loaded one by one: loading is not thread-safe
        gate.policy(0)
        threads = [
            threading.Thread(target=worker_loop, args=(log, engine, *shared), daemon=True)
            for log, engine in zip(logs, engines)
        ]
        start = time.time()
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(60)
        window = time.time() - start
        deadline = time.time() + 300  # the gate drains what was posted
        while client.xlen(keys.rollouts) > 0 and time.time() < deadline:
            time.sleep(0.5)
        ctx.stop.set()
        gate_thread.join(60)
        server.stop()
        errors = [f"{log.worker or 'a worker'}: {log.error}" for log in logs if log.error]
        if errors:
            raise SystemExit("byzantine: workers failed: " + "; ".join(errors))
        verified = [RolloutGroup.decode(f) for _, f in client.xrange(keys.verified)]
        stats = worker_stats(client, keys)
        client.close()
    return summarize(logs, posted, verified, stats, window)


def summarize(logs: list[WorkerLog], posted: dict, verified: list[RolloutGroup], stats: dict, window: float) -> dict:
    poisoned_samples = honest_groups = 0
    poisoned_by_attack: dict[str, int] = {}
    honest_ids = {log.worker for log in logs if not log.malicious}
    for g in verified:
        p = posted.get(g.rollout_id)
        if p is None:
            continue
        if p.poisoned and (p.lied_rewards is None or [s.reward for s in g.samples] == p.lied_rewards):
            poisoned_samples += len(g.samples)
            poisoned_by_attack[p.kind] = poisoned_by_attack.get(p.kind, 0) + len(g.samples)
        if g.worker_id in honest_ids:
            honest_groups += 1
    bad = [log for log in logs if log.malicious]
    return {
        "window_s": round(window, 1),
        "verified_groups": len(verified),
        "verified_samples": sum(len(g.samples) for g in verified),
        "poisoned_samples_verified": poisoned_samples,
        "poisoned_samples_by_attack": poisoned_by_attack,
        "honest_groups_accepted": honest_groups,
        "honest_goodput_per_min": round(60 * honest_groups / window, 2),
        "honest_banned": sum(1 for log in logs if not log.malicious and stats.get(log.worker, {}).get("banned")),
        "malicious_banned": sum(1 for log in bad if stats.get(log.worker, {}).get("banned")),
        "malicious": len(bad),
        "posts_from_first_bad_to_ban": [
            None if log.first_bad is None or log.banned_after is None else log.banned_after - log.first_bad
            for log in bad
        ],
        "seconds_from_first_bad_to_ban": [
            None if log.first_bad_at is None or log.banned_at is None else round(log.banned_at - log.first_bad_at, 1)
            for log in bad
        ],
        "ban_reasons": sorted({(stats.get(log.worker, {}).get("banned") or {}).get("reason", "-") for log in bad}),
        "attacks_posted": sorted({p.kind for p in posted.values() if p.kind != "honest"}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=7)
    parser.add_argument("--malicious", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0, help="each run's window (both runs)")
    parser.add_argument("--honest-first", type=int, default=0, help="honest groups a cheat posts before attacking")
    parser.add_argument("--switch", type=int, default=1, help="groups per attack before a cheat switches")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        policy = tiny_policy_dir(tmp / "policy", seed=0)
        key_file, public = generate_keypair(tmp / "keys")
        store = FileStore(tmp / "store")
        publish_version(store, RUN, 0, policy, signer=make_signer(load_private_key(key_file)))
        mixed = run_phase(tmp, policy, store, public, args.honest, args.malicious, args)
        alone = run_phase(tmp, policy, store, public, args.honest, 0, args)
    result = {
        "honest": args.honest,
        "malicious": args.malicious,
        "seconds": args.seconds,
        "mixed": mixed,
        "all_honest": alone,
        "honest_goodput_ratio": round(mixed["honest_goodput_per_min"] / max(alone["honest_goodput_per_min"], 1e-9), 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
