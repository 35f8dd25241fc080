"""`rlfleet verifier`: the gate between untrusted workers and the trainer.

Each inbox group goes through the checks of checks.py in order (envelope, prompt, TOPLOC, sampling,
reward); the first failure rejects the whole group with that check's reason. A `spotCheckFraction`
of the groups, drawn unpredictably, gets the prefill checks (TOPLOC, logprobs, seed replay); every
group gets the others. Accepted groups go to `verified` with the trusted rewards (and, when
prefilled, the recomputed logprobs: commit.py `forward_trusted`), rejected ones to `rejected` with
the reason and the original message (audit). Entries read together share their prefills (batch.py)
and are committed in order, each with the verdict it would get alone.

The prefills run on the process's device (rlfleet/models/device.py: its GPU when it has one), in the
run's spec.model.dtype. In a LoRA run (trainer.lora) a version is an adapter: the policy the checks
use is the run's base model with that version's adapter merged in (rlfleet/models/adapter.py), and
the adapter's signed manifest must name this base, so a group is verified against exactly base +
the adapter version it claims.

Exactly once: the verdict is committed by one Lua script that XACKs the entry first and does nothing
more if the XACK acknowledged nothing (another replica committed it); otherwise it forwards, deletes
the inbox entry, counts the verdict (run stats, worker reputation) and applies the ban policy,
atomically (commit.py). Replicas share one consumer group; an entry left pending by a dead (or
stalled) replica for `claimIdleMs` is taken over with XAUTOCLAIM, and a stalled replica that wakes
up later commits nothing.

Poison messages: whatever the decoder cannot read is a `malformed` rejection like any other. An
entry whose handling still fails (an exception here, or a verifier that died on it: each try is
counted in Redis before it starts) is retried after claimIdleMs, and after `maxAttempts` tries it is
moved to the dead-letter stream and acknowledged, so one message can neither crash-loop the verifier
nor block the inbox. Entries tried before are handled alone, and a batch that raises is tried again
entry by entry, so a poison entry fails by itself and its neighbours pass. Redis errors are not the
message's fault: they go to the process edge.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis

from rlfleet.fleet.window import AsyncWindow
from rlfleet.models.adapter import load_version
from rlfleet.models.device import choose_device
from rlfleet.models.policy import configure_torch_threads
from rlfleet.models.sources import resolve_model_path
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.toploc.audit import AUDIT_APPEND_LUA, audit_bounds, audit_entry
from rlfleet.services.toploc.batch import InboxChecks, SpotCheck
from rlfleet.services.toploc.checks import REASONS, Checker, Outcome, Rejection, decode_group
from rlfleet.services.toploc.commit import Committer
from rlfleet.services.toploc.health import prefill_liveness, watch
from rlfleet.services.toploc.metrics import DEAD_LETTERS, FAILURES, LAPS
from rlfleet.services.toploc.resident import Resident, ResidentVersions
from rlfleet.versions.checkpoint import prune_cache
from rlfleet.versions.signing import run_public_key
from rlfleet.wire import components
from rlfleet.wire.runtime import ComponentOptions, Context, component_context, ensure_group
from rlfleet.wire.streams import RolloutGroup, stream_reply

__all__ = ["REASONS", "Gate", "Rejection", "main"]

log = logging.getLogger("rlfleet.verifier")

READ_BATCH = 8  # inbox entries read (and prefilled) together

# KEYS: inbox, dead letter, stats, attempts, audit bytes.
# ARGV: group, entry id, max entries, max bytes, then the dead-letter fields (an audit stream: audit.py).
_DEAD_LETTER = (
    AUDIT_APPEND_LUA
    + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[4], ARGV[2])
  return 0
end
local out = {}
for i = 5, #ARGV do out[#out + 1] = ARGV[i] end
audit_append(KEYS[2], KEYS[5], tonumber(ARGV[3]), tonumber(ARGV[4]), out)
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[3], 'dead_letter', 1)
return 1
"""
)


class Gate:
    """One verifier replica: reads the inbox as `consumer` of the verifier consumer group, judges and
    commits each entry (`InboxChecks`), retries and dead-letters the entries whose handling fails, and
    holds the policy versions the checks run on (`policy`)."""

    def __init__(self, ctx: Context, consumer: str, origin_url: str, cache_dir: Path):
        self.ctx, self.consumer, self.origin_url, self.cache_dir = ctx, consumer, origin_url, cache_dir
        self.spec = ctx.bundle.run.spec
        self.window = AsyncWindow.of(self.spec)

        # The policy versions the checks run on (`policy`), at most residentVersions of them in memory.
        self.device = choose_device()  # every version's model prefills there, in spec.model.dtype (checks.py)
        self.resident = ResidentVersions(
            self.spec.verifier.resident_versions,
            fetch=self._fetch_version,
            build=self._build_version,
            built=lambda model: watch(self.liveness, model),
            kept=self._prune_cache,
        )
        self.liveness = prefill_liveness(ctx, lambda: self.resident.last_used)
        # Manifests are checked even from the origin.
        self.fetch = FetchSettings.over(
            [self.origin_url],
            ctx.run_name,
            timeout=120,
            min_rate=self.spec.shardcast.min_rate_bytes_per_second,
            stop=ctx.stop,
            public_key=run_public_key(self.spec.shardcast),
        )

        # The checks and the exactly-once commit of their verdicts.
        v = self.spec.verifier
        self.checker = Checker(self.spec, ctx.client, ctx.keys, self.policy, self.resident.describe)
        spot_check = SpotCheck(ctx.client, ctx.keys, self.spec.ingest.admission.probation_groups, v.spot_check_fraction)
        committer = Committer(ctx.client, ctx.keys, self.spec, consumer, self.checker.running_share_limit)
        self.inbox = InboxChecks(self.checker, self.policy, spot_check, committer, v.max_message_bytes)

        # Retries and the dead letter (`attempt`).
        self._dead_letter = ctx.client.register_script(_DEAD_LETTER)
        self._errors: dict[bytes, str] = {}  # entry id -> the last error handling it raised here

        ensure_group(ctx.client, ctx.keys.rollouts, ctx.keys.verifier_group)
        self.liveness.ready()

    def policy(self, version: int):
        """(model, tokenizer) of `version`, fetched from the trusted origin when it is not in memory, and
        leased to the calling thread until its next call or `release` (resident.py)."""
        return self.resident.get(version)

    def release(self) -> None:
        """The calling thread is done with the version `policy` last gave it (resident.py)."""
        self.resident.release()

    def _fetch_version(self, version: int) -> Path:
        with LAPS.part("fetch"):  # whole, or rebuilt from a version held here and deltas
            return fetch_policy(self.fetch, version, self.cache_dir)

    def _build_version(self, path: Path, like: Resident | None):
        """A fetched version's model: its whole weights (a copy of `like` with them loaded, when given), or
        a LoRA adapter merged into the run's base."""
        spec = self.spec
        base = partial(resolve_model_path, spec.model, spec.task, spec.trainer.seed, caller=components.VERIFIER)
        template = None if like is None or like.signature is None else (like.model, like.tokenizer, like.signature)
        with LAPS.part("load"):
            return load_version(path, spec.model.dtype, self.device, base, template)

    def _prune_cache(self, resident: list[int]) -> None:
        """The disk cache keeps what the async window can still ask for and what is in memory (the newest
        version is the base of the next delta); an older group is stale_version anyway."""
        prune_cache(self.cache_dir, min(self.window.oldest(max(resident)), *resident))

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
        finally:
            self.release()

    def handle(self, msg_id: bytes, fields: dict) -> int:
        """Check one inbox entry and commit the verdict; the commit script's answer (0 = already committed)."""
        return self.inbox.handle(msg_id, fields)

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
            self.inbox.handle_batch(fresh)
        except redis.RedisError:
            raise
        except Exception as exc:  # the designed retry: one entry at a time finds the one that fails
            FAILURES.labels(type(exc).__name__).inc()
            log.exception("a batch of %d inbox entries failed; trying them one by one", len(fresh))
            for msg_id, fields in fresh:
                self.attempt(msg_id, fields)

    def attempt(self, msg_id: bytes, fields: dict) -> int:
        """Handle one entry (`handle`'s answer), or dead-letter it once it has failed maxAttempts times
        (-1 when this try failed: the entry stays pending and is claimed again after claimIdleMs)."""
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
        keys = self.ctx.keys
        record = {
            "inbox_id": msg_id.decode(),
            "attempts": tries,
            "last_error": self._errors.pop(msg_id, "the verifier stopped while handling it"),
            components.VERIFIER: self.consumer,
        }
        entry = audit_entry(record, next(iter(fields.values()), b""), self.spec)
        flat = [x for kv in entry.items() for x in kv]
        result = self._dead_letter(
            keys=[keys.rollouts, keys.dead_letter, keys.stats, keys.attempts, keys.audit_bytes],
            args=[keys.verifier_group, msg_id, *audit_bounds(self.spec), *flat],
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
        """Handle the inbox until the process stops: entries left pending elsewhere for claimIdleMs
        first (checked a few times per claimIdleMs), else new ones, up to READ_BATCH at a time."""
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
            try:
                self.attempt_batch([(msg_id, fields) for msg_id, fields in entries if fields])
            finally:
                self.release()  # between batches the API may make room from any version


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
