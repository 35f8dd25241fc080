"""The gate's one-time guards (check 1 of checks.py): the same work, and the same work ticket, are
accepted once. A guard is claimed by the inbox entry that first brings it, atomically (a Lua script);
the entry id is stored, so a redelivery of that entry (a claim after a verifier died) is not a replay.

Work is identified by `streams.group_digest` (prompt, sampling parameters, completions; not the
seed nor any id the worker chooses). One exception keeps honest workers from being refused for
what a peaked policy does: when a group's seeds are being replayed (it was spot-checked; any engine), a
group with the same completions but *another group seed* than the first one passes the guard; the
seed replay then proves those are the tokens its own seeds draw, i.e. exactly what honest sampling
gives, and the trainer (which dedups by digest too) still trains that content once. Everything
else that repeats a digest is `replay`.

Bounds. Work guards live as long as the async window can still accept their work: `RunKeys.seen`
(digest -> entry|seed) with `RunKeys.seen_versions` (digest -> the newest policy version it was
claimed under); each claim first drops up to PRUNE_BATCH guards older than newest - maxAsyncLevel,
so the guards held are those of the window (a group of an older version is `stale_version` before
it gets here). Work older than the window replayed under a current version is past the guard: it
must pass the prefill checks with that version, and the trainer's digest set refuses what it already
trained. A ticket never expires, so its guard (`RunKeys.tickets_used`, one hash field per ticket
used, ~70 bytes) lives as long as the run's keys.
"""

from __future__ import annotations

import redis

from rlfleet.wire.streams import RolloutGroup, RunKeys, group_digest

PRUNE_BATCH = 64  # guards dropped per claim at most (each claim adds one, so the backlog shrinks)

# KEYS: seen (hash), seen_versions (zset). ARGV: digest, value, version, oldest version in the window, batch.
_CLAIM_WORK = """
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4], 'LIMIT', 0, tonumber(ARGV[5]))
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('ZADD', KEYS[2], 'GT', ARGV[3], ARGV[1])
return held
"""

# KEYS: tickets_used (hash). ARGV: field, entry id.
_CLAIM_TICKET = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return false end
return redis.call('HGET', KEYS[1], ARGV[1])
"""


def work_replay(
    client: redis.Redis, keys: RunKeys, group: RolloutGroup, msg_id: bytes, seeds_replayed: bool, oldest: int
) -> str | None:
    """Why `group` (inbox entry `msg_id`) repeats accepted work, or None; claims its digest when new.
    `oldest`: the oldest policy version the async window still accepts (newest - maxAsyncLevel)."""
    digest = group_digest(group)
    entry, seed = msg_id.decode(), str(group.sampling.seed)
    held = client.register_script(_CLAIM_WORK)(
        keys=[keys.seen, keys.seen_versions],
        args=[digest, f"{entry}|{seed}", group.policy_version, oldest, PRUNE_BATCH],
    )
    if held is None:
        return None
    held_entry, _, held_seed = held.decode().partition("|")
    if held_entry == entry:
        return None  # a redelivery of the entry that claimed it
    if seeds_replayed and held_seed != seed:
        return None  # the same tokens from another seed: the seed replay decides (module docstring)
    return (
        f"the same work (prompt, sampling, completions; digest {digest[:16]}) was already submitted "
        f"as entry {held_entry}"
    )


def ticket_replay(client: redis.Redis, keys: RunKeys, group: RolloutGroup, msg_id: bytes) -> str | None:
    """Why `group`'s work ticket was already used by another entry, or None; claims it when new."""
    held = client.register_script(_CLAIM_TICKET)(
        keys=[keys.tickets_used], args=[f"{group.ticket}:{group.worker_id}", msg_id.decode()]
    )
    if held is None or held.decode() == msg_id.decode():
        return None
    return f"ticket {group.ticket} of worker {group.worker_id!r} was already used by entry {held.decode()}"
