"""`rlfleet verifier`: the gate between untrusted workers and the trainer.

Each inbox group goes through the checks of checks.py in order (envelope, prompt, TOPLOC,
sampling, reward); the first failure rejects the whole group with that check's reason. A
`spotCheckFraction` of the groups, drawn unpredictably, gets the prefill checks (TOPLOC, logprobs,
seed replay); every group gets the others. Accepted groups go to `verified` with the trusted rewards
(and, when prefilled, the recomputed logprobs: `forward_trusted`), rejected ones to `rejected` with
the reason and the original message (audit). Entries read together share their prefills (batch.py)
and are committed in order, each with the verdict it would get alone. The prefills run on the
process's device (rlfleet/models/device.py: its GPU when it has one), in the run's spec.model.dtype.
In a LoRA run (trainer.lora) a version is an adapter: the policy the checks use is the run's base model
with that version's adapter merged in (rlfleet/models/adapter.py), and the adapter's signed manifest must
name this base, so a group is verified against exactly base + the adapter version it claims.

Exactly once: the verdict is committed by one Lua script that XACKs the entry first and does
nothing more if the XACK acknowledged nothing (another replica committed it); otherwise it
forwards, deletes the inbox entry, counts the verdict (run stats, worker reputation) and applies
the ban policy, atomically. Replicas share one consumer group; an entry left pending by a dead
(or stalled) replica for `claimIdleMs` is taken over with XAUTOCLAIM, and a stalled replica that
wakes up later commits nothing. A Lua script rather than MULTI because the forward must depend on
the XACK's answer.

Poison messages: whatever the decoder cannot read is a `malformed` rejection like any other. An entry
whose handling still fails (an exception here, or a verifier that died on it: each try is counted in
Redis before it starts) is retried after claimIdleMs, and after `maxAttempts` tries it is moved to the
dead-letter stream and acknowledged, so one message can neither crash-loop the verifier nor block the
inbox. Entries tried before are handled alone, and a batch that raises is tried again entry by
entry, so a poison entry fails by itself and its neighbours pass. Redis errors are not the message's
fault: they go to the process edge.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis

from rlfleet.fleet.reputation import ban_plan, field, on_probation, replay_plan
from rlfleet.fleet.window import AsyncWindow
from rlfleet.models.adapter import load_version, version_signature
from rlfleet.models.device import choose_device
from rlfleet.models.policy import configure_torch_threads
from rlfleet.models.sources import resolve_model_path
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.toploc.batch import handle_batch
from rlfleet.services.toploc.checks import REASONS, Checker, Outcome, Rejection, decode_group
from rlfleet.services.toploc.health import prefill_liveness, watch
from rlfleet.services.toploc.metrics import (
    BANS,
    DEAD_LETTERS,
    DUPLICATES,
    FAILURES,
    LAPS,
    REWARD_MISMATCH,
    TOKENS,
    UNCHECKED,
    VERDICTS,
)
from rlfleet.versions.checkpoint import prune_cache
from rlfleet.versions.signing import run_public_key
from rlfleet.wire import components
from rlfleet.wire.runtime import ComponentOptions, Context, component_context, ensure_group
from rlfleet.wire.streams import RolloutGroup, encode_json, stream_reply

__all__ = ["REASONS", "Gate", "Rejection", "main"]

log = logging.getLogger("rlfleet.verifier")

READ_BATCH = 8  # inbox entries read (and prefilled) together

# KEYS: inbox, out stream, stats, workers, banned, attempts.
# ARGV: group, entry id, maxlen, plan JSON {stats: {f: n}, workers: {f: n}, ban?}, then the out fields.
_COMMIT = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[6], ARGV[2])
  return 0
end
local out = {}
for i = 5, #ARGV do out[#out + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(out))
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[6], ARGV[2])
local plan = cjson.decode(ARGV[4])
for f, n in pairs(plan.stats) do redis.call('HINCRBY', KEYS[3], f, n) end
for f, n in pairs(plan.workers) do redis.call('HINCRBY', KEYS[4], f, n) end
local ban = plan.ban
if ban then
  local count = tonumber(redis.call('HGET', KEYS[4], ban.count_field) or '0')
  for _, f in ipairs(ban.forgiven_fields) do count = count - tonumber(redis.call('HGET', KEYS[4], f) or '0') end
  if ban.now or (ban.max > 0 and count >= ban.max) then
    if redis.call('HSETNX', KEYS[5], ban.worker, ban.record) == 1 then return 2 end
  end
end
local sb = plan.share_ban
if sb then
  local n = tonumber(redis.call('HGET', KEYS[4], sb.positions) or '0')
  local m = tonumber(redis.call('HGET', KEYS[4], sb.mismatches) or '0')
  if n >= sb.min and m > sb.max * n then
    if redis.call('HSETNX', KEYS[5], sb.worker, sb.record) == 1 then return 2 end
  end
end
return 1
"""

# KEYS: inbox, dead letter, stats, attempts. ARGV: group, entry id, maxlen, then the dead-letter fields.
_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[4], ARGV[2])
  return 0
end
local out = {}
for i = 4, #ARGV do out[#out + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(out))
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[3], 'dead_letter', 1)
return 1
"""


def forward_trusted(group: RolloutGroup, outcome: Outcome) -> None:
    """What the trainer gets of an accepted group: the trusted rewards and, where the prefill ran, the
    recomputed token logprobs instead of the worker's (a shift inside the tolerance would skew every
    importance ratio)."""
    for i, (sample, reward) in enumerate(zip(group.samples, outcome.rewards)):
        sample.reward = reward
        if outcome.logprobs is not None:
            sample.logprobs = outcome.logprobs[i]


class Gate:
    def __init__(self, ctx: Context, consumer: str, origin_url: str, cache_dir: Path):
        self.ctx, self.consumer, self.origin_url, self.cache_dir = ctx, consumer, origin_url, cache_dir
        self.spec = ctx.bundle.run.spec
        self.window = AsyncWindow.of(self.spec)
        self.models: OrderedDict[int, tuple] = OrderedDict()
        self._like: tuple | None = None  # (model, tokenizer, signature) of the last version loaded (load_version)
        self.device = choose_device()  # every version's model prefills there, in spec.model.dtype (checks.py)
        self._models_lock = threading.Lock()  # the HTTP API verifies from another thread
        self.last_used: tuple | None = None  # the (model, tokenizer) of the newest policy() call: what /healthz probes
        self.liveness = prefill_liveness(ctx, lambda: self.last_used)
        self.checker = Checker(self.spec, ctx.client, ctx.keys, self.policy)
        self._commit = ctx.client.register_script(_COMMIT)
        self._dead_letter = ctx.client.register_script(_DEAD_LETTER)
        self._errors: dict[bytes, str] = {}  # entry id -> the last error handling it raised here
        self._draw = random.SystemRandom()  # workers must not predict which groups get the prefill
        # manifests are checked even from the origin
        self.fetch = FetchSettings.over(
            [self.origin_url], ctx.run_name, timeout=120, stop=ctx.stop, public_key=run_public_key(self.spec.shardcast)
        )
        ensure_group(ctx.client, ctx.keys.rollouts, ctx.keys.verifier_group)
        self.liveness.ready()

    def policy(self, version: int):
        """(model, tokenizer) of `version`, fetched from the trusted origin; the async window's versions to keep
        (rlfleet/fleet/window.py) are kept in memory, and on disk those and the versions of the window."""
        with self._models_lock:
            if version not in self.models:
                # whole, or rebuilt from a version held here and deltas; a LoRA adapter merged into this base
                with LAPS.part("fetch"):
                    path = fetch_policy(self.fetch, version, self.cache_dir)
                spec = self.spec
                base = partial(resolve_model_path, spec.model, spec.task, spec.trainer.seed, caller=components.VERIFIER)
                with LAPS.part("load"):  # a copy of the last whole version loaded, when only the weights differ
                    self.models[version] = load_version(path, spec.model.dtype, self.device, base, self._like)
                    self._like = (*self.models[version], version_signature(path))
                watch(self.liveness, self.models[version][0])
                while len(self.models) > self.window.versions_to_keep():
                    self.models.popitem(last=False)
                # The disk cache keeps what the async window can still ask for and what is loaded (the
                # newest version is the base of the next delta); an older group is stale_version anyway.
                prune_cache(self.cache_dir, min(self.window.oldest(max(self.models)), *self.models))
            self.models.move_to_end(version)
            self.last_used = self.models[version]  # the newest kept, so never one evicted
            return self.models[version]

    def verify(self, fields: dict) -> tuple[RolloutGroup | None, Outcome | Rejection]:
        """Out-of-band verification of one message (every check but the replay guard; nothing written)."""
        try:
            group = decode_group(fields, self.spec.verifier.max_message_bytes)
        except Rejection as exc:
            return None, exc
        try:
            return group, self.checker.check(group, None, prefill=True)
        except Rejection as exc:
            return group, exc

    def spot_checked(self, worker_id: str) -> bool:
        """Whether a group gets the prefill checks: every group of a worker on probation (a joined worker with few
        accepted groups, reputation.on_probation), else when an unpredictable draw is below spotCheckFraction."""
        probation = on_probation(self.ctx.client, self.ctx.keys, worker_id, self.spec.ingest.admission.probation_groups)
        return probation or self._draw.random() < self.spec.verifier.spot_check_fraction

    def handle(self, msg_id: bytes, fields: dict) -> int:
        """Check one inbox entry and commit the verdict; the commit script's answer (0 = already committed)."""
        return self.commit(msg_id, fields, *self.judge(msg_id, fields))

    def judge(self, msg_id: bytes, fields: dict) -> tuple[RolloutGroup | None, Outcome | Rejection]:
        """The verdict on one inbox entry, nothing committed: (the group if it decoded, Outcome or Rejection)."""
        group = None
        try:
            group = decode_group(fields, self.spec.verifier.max_message_bytes)
            return group, self.checker.check(group, msg_id, self.spot_checked(group.worker_id))
        except Rejection as exc:
            return group, exc

    @LAPS.part("commit")
    def commit(self, msg_id: bytes, fields: dict, group: RolloutGroup | None, result: Outcome | Rejection) -> int:
        """Commit one entry's verdict (module docstring); the script's answer: 0 already committed, 2 banned."""
        keys, v = self.ctx.keys, self.spec.verifier
        if isinstance(result, Rejection):
            exc = result
            worker = exc.worker_id
            log.warning("rejected %s from %s: %s: %s", msg_id.decode(), worker, exc.reason, exc.detail)
            record = {
                "reason": exc.reason,
                "detail": exc.detail,
                "worker_id": worker,
                "inbox_id": msg_id.decode(),
                "rollout_id": group.rollout_id if group else None,
                components.VERIFIER: self.consumer,
            }
            original = next(iter(fields.values()), b"")[: v.max_message_bytes]  # an oversize one is cut
            out = {**encode_json(record), b"original": original}
            plan: dict = {"stats": {"rejected": 1, f"rejected:{exc.reason}": 1}, "workers": {}}
            if worker is not None:
                plan["workers"] = {field(worker, "rejected"): 1, field(worker, f"rejected:{exc.reason}"): 1}
                plan["ban"] = ban_plan(v.ban, worker, exc.reason, exc.detail, record["rollout_id"])
            stream, verdict, reason = keys.rejected, "rejected", exc.reason
        else:
            outcome = result
            assert group is not None  # judge() gives an Outcome only with the group it checked
            forward_trusted(group, outcome)
            w = group.worker_id
            plan = {"stats": {"accepted": 1}, "workers": {field(w, "accepted"): 1}}
            if group.ticket is not None and self.spec.sampling.assignment == "run":
                plan["workers"][field(w, "tickets_used")] = 1
            if outcome.reward_mismatches:
                plan["stats"]["reward_mismatch"] = plan["workers"][field(w, "reward_mismatch")] = (
                    outcome.reward_mismatches
                )
            if outcome.replay is not None:  # the seed replay's score: reputation, and the running-share ban
                counters, share_ban = replay_plan(
                    v.ban, w, outcome.replay, self.checker.running_share_limit(group), group.rollout_id
                )
                plan["workers"].update(counters)
                if share_ban is not None:  # absent rather than null: cjson's null is a truthy userdata
                    plan["share_ban"] = share_ban
            if not outcome.prefill_checked:
                plan["stats"]["unchecked"] = plan["workers"][field(w, "unchecked")] = 1
            out, stream, verdict, reason, worker = group.encode(), keys.verified, "accepted", "", w
        flat = [x for kv in out.items() for x in kv]
        answer = self._commit(
            keys=[keys.rollouts, stream, keys.stats, keys.workers, keys.banned, keys.attempts],
            args=[keys.verifier_group, msg_id, self.spec.redis.stream_max_len, json.dumps(plan), *flat],
        )
        if answer == 0:
            DUPLICATES.inc()
            log.info("entry %s was committed by another replica; dropped this verdict", msg_id.decode())
            return 0
        VERDICTS.labels(verdict, reason).inc()
        if verdict == "accepted":
            REWARD_MISMATCH.inc(outcome.reward_mismatches)
            UNCHECKED.inc(0 if outcome.prefill_checked else 1)
            TOKENS.labels(str(outcome.prefill_checked).lower()).inc(outcome.tokens)
        if answer == 2:
            reason = reason or "seed_replay"  # an accepted group's ban: the running replay share
            BANS.labels(reason).inc()
            log.warning("banned worker %s (%s)", worker, reason)
        return int(answer)

    def attempt_batch(self, entries: list[tuple[bytes, dict]]) -> None:
        """Entries read together: those tried before (and not committed) one by one with `attempt`, so a
        poison entry fails alone; the others in one `handle_batch`, each counted as tried first. A batch
        that raises is tried again entry by entry at once."""
        keys = self.ctx.keys
        held = self.ctx.client.hmget(keys.attempts, [m for m, _ in entries]) if entries else []
        fresh = [e for e, tries in zip(entries, held) if tries is None]
        for msg_id, fields in (e for e, tries in zip(entries, held) if tries is not None):
            self.attempt(msg_id, fields)
        if not fresh:
            return
        with self.ctx.client.pipeline(transaction=False) as pipe:
            for msg_id, _ in fresh:
                pipe.hincrby(keys.attempts, msg_id, 1)
            pipe.execute()
        try:
            handle_batch(self, fresh)
        except redis.RedisError:
            raise
        except Exception as exc:  # the designed retry: one entry at a time finds the one that fails
            FAILURES.labels(type(exc).__name__).inc()
            log.exception("a batch of %d inbox entries failed; trying them one by one", len(fresh))
            for msg_id, fields in fresh:
                self.attempt(msg_id, fields)

    def attempt(self, msg_id: bytes, fields: dict) -> int:
        """Handle one entry (`handle`'s answer), or dead-letter it once it has failed maxAttempts times (-1 when
        this try failed: the entry stays pending and is claimed again after claimIdleMs)."""
        keys, v = self.ctx.keys, self.spec.verifier
        tries = self.ctx.client.hincrby(keys.attempts, msg_id, 1)  # counted first, so a crash on it counts too
        if tries > v.max_attempts:
            return self.dead_letter(msg_id, fields, tries - 1)
        try:
            result = self.handle(msg_id, fields)
        except redis.RedisError:
            raise
        except Exception as exc:  # a designed retry and dead letter: the process keeps serving the others
            FAILURES.labels(type(exc).__name__).inc()
            self._errors[msg_id] = f"{type(exc).__name__}: {str(exc)[:500]}"
            if len(self._errors) > 1024:  # entries another replica finished; forget the oldest
                self._errors.pop(next(iter(self._errors)))
            log.exception("inbox entry %s failed (try %d of %d)", msg_id.decode(), tries, v.max_attempts)
            return -1
        self._errors.pop(msg_id, None)
        return result

    def dead_letter(self, msg_id: bytes, fields: dict, tries: int) -> int:
        """Move an entry no try could handle to the dead-letter stream, with what is known of why."""
        keys, v = self.ctx.keys, self.spec.verifier
        record = {
            "inbox_id": msg_id.decode(),
            "attempts": tries,
            "last_error": self._errors.pop(msg_id, "the verifier stopped while handling it"),
            components.VERIFIER: self.consumer,
        }
        original = next(iter(fields.values()), b"")[: v.max_message_bytes]
        flat = [x for kv in {**encode_json(record), b"original": original}.items() for x in kv]
        result = self._dead_letter(
            keys=[keys.rollouts, keys.dead_letter, keys.stats, keys.attempts],
            args=[keys.verifier_group, msg_id, self.spec.redis.stream_max_len, *flat],
        )
        if result:
            DEAD_LETTERS.inc()
            log.error("inbox entry %s dead-lettered after %d failed tries: %s", msg_id.decode(), tries, record)
        return int(result)

    def read(self, count: int = 4, block_ms: int = 500) -> list[tuple[bytes, dict]]:
        """New entries for this consumer (they stay pending here until committed)."""
        resp = stream_reply(
            self.ctx.client.xreadgroup(
                self.ctx.keys.verifier_group, self.consumer, {self.ctx.keys.rollouts: ">"}, count=count, block=block_ms
            )
        )
        return [e for _, batch in resp or [] for e in batch]

    def claim(self, count: int = 16) -> list[tuple[bytes, dict]]:
        """Entries pending at any consumer for longer than claimIdleMs, now pending here."""
        keys = self.ctx.keys
        # Redis 6.2 answers [cursor, entries], 7.x adds the deleted ids.
        return self.ctx.client.xautoclaim(
            keys.rollouts, keys.verifier_group, self.consumer, self.spec.verifier.claim_idle_ms, count=count
        )[1]

    def run(self) -> None:
        idle_s = self.spec.verifier.claim_idle_ms / 1000
        next_claim = 0.0
        while not self.ctx.stop.is_set():
            entries = []
            if time.monotonic() >= next_claim:
                entries = self.claim()
                next_claim = time.monotonic() + idle_s / 3
            if not entries:
                entries = self.read(count=READ_BATCH, block_ms=int(min(500, max(10, idle_s * 1000 / 3))))
            # A claimed entry trimmed meanwhile has no fields. Entries read together share prefills (batch.py).
            self.attempt_batch([(msg_id, fields) for msg_id, fields in entries if fields])


@dataclass(frozen=True, kw_only=True)
class VerifierOptions(ComponentOptions):
    consumer: str  # this replica's name in the verifier consumer group
    origin_url: str  # the trusted checkpoint source (origin or relay base URL)
    cache_dir: Path
    api_port: int = 0  # HTTP API port; 0 = none
    api_host: str = "127.0.0.1"  # HTTP API bind address (0.0.0.0 in a pod)


def main(options: VerifierOptions) -> int:
    ctx = component_context(options, components.VERIFIER, health_check=True)  # the gate's prefill liveness
    configure_torch_threads()
    gate = Gate(ctx, options.consumer, options.origin_url, options.cache_dir)
    if options.api_port:
        from rlfleet.services.toploc.api import serve_in_thread

        serve_in_thread(gate, options.api_host, options.api_port)
    gate.run()
    return 0
