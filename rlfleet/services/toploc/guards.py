"""The gate's one-time guards (check 1 of checks.py): the same work, and the same work ticket, are
accepted once. Each guard is a Redis key claimed with SET NX by the inbox entry that first brings it
(with a TTL, so the guards stay bounded); the entry id is stored, so a redelivery of that entry (a
claim after a verifier died) is not a replay.

Work is identified by `streams.group_digest` (prompt, sampling parameters, completions; not the
seed nor any id the worker chooses). One exception keeps honest workers from being refused for
what a peaked policy does: when a torch group's seeds are being replayed (it was spot-checked), a
group with the same completions but *another group seed* than the first one passes the guard; the
seed replay then proves those are the tokens its own seeds draw, i.e. exactly what honest sampling
gives, and the trainer (which dedups by digest too) still trains that content once. Everything
else that repeats a digest is `replay`.
"""

from __future__ import annotations

import redis

from rlfleet.streams import RolloutGroup, RunKeys, group_digest

SEEN_TTL_S = 7 * 24 * 3600


def _claim(client: redis.Redis, key: str, value: str) -> str | None:
    """Claim `key` for `value`; None when claimed now, else what holds it."""
    if client.set(key, value, nx=True, ex=SEEN_TTL_S):
        return None
    held = client.get(key)
    return held.decode() if held is not None else None


def work_replay(
    client: redis.Redis, keys: RunKeys, group: RolloutGroup, msg_id: bytes, seeds_replayed: bool
) -> str | None:
    """Why `group` (inbox entry `msg_id`) repeats accepted work, or None; claims its digest when new."""
    digest = group_digest(group)
    entry, seed = msg_id.decode(), str(group.sampling.seed)
    held = _claim(client, keys.seen(digest), f"{entry}|{seed}")
    if held is None:
        return None
    held_entry, _, held_seed = held.partition("|")
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
    held = _claim(client, keys.ticket(group.worker_id, group.ticket), msg_id.decode())
    if held is None or held == msg_id.decode():
        return None
    return f"ticket {group.ticket} of worker {group.worker_id!r} was already used by entry {held}"
