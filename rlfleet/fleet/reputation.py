"""Worker reputation and bans, kept in Redis so every verifier replica and the ingest share them.

Counters live in one hash (`RunKeys.workers`), field `"{worker}|{counter}"`, counters:
  accepted, rejected, rejected:{reason}, reward_mismatch (samples whose claimed reward was wrong),
  unchecked (accepted groups that skipped the prefill checks by spot-checking),
  replay_positions, replay_mismatches (tokens seed-replayed, and those their seeds do not draw, of
  accepted groups), replay_surprise_milli (1000 x the replay's summed surprise, replay.py: ~0 for an
  honest worker, negative for one that picks likelier tokens than its seeds do).
A worker whose running mismatch share replay_mismatches / replay_positions exceeds the calibrated
`max_running_share` over at least `ban.minReplayPositions` positions is banned (rule `runningReplayShare`,
reason seed_replay): the per-group share (calibration.py) bounds one group, this bounds a worker that
stays just under it on every group.
Worker ids come from untrusted messages and may hold any character; counters never hold `|`, so
a field splits at its last `|`. Bans live in `RunKeys.banned`: worker id -> JSON record of the
rejection that triggered it. The gate writes both inside its commit script
(rlfleet/services/toploc/commit.py), so a verdict, its counters and a ban are applied together, once.

`is_banned` is the check the ingest calls before accepting a submission; the gate repeats it.
"""

from __future__ import annotations

import json
import time
from typing import cast

import redis

from rlfleet.config import BanPolicySpec
from rlfleet.wire.streams import RunKeys


def field(worker_id: str, counter: str) -> str:
    """The reputation hash field of one worker's counter (the only place it is spelled)."""
    return f"{worker_id}|{counter}"


def is_banned(client: redis.Redis, keys: RunKeys, worker_id: str) -> bool:
    """Whether `worker_id` is banned from the run (called by the ingest and by the gate)."""
    return bool(client.hexists(keys.banned, worker_id))


def ban_record(client: redis.Redis, keys: RunKeys, worker_id: str) -> dict | None:
    raw = client.hget(keys.banned, worker_id)
    return json.loads(raw) if raw else None


def ban_plan(policy: BanPolicySpec, worker_id: str, reason: str, detail: str, rollout_id: str | None) -> dict:
    """What the commit script needs to apply the ban policy after counting a rejection."""
    rule = "banOn" if reason in policy.ban_on else "maxRejections"
    record = {"reason": reason, "detail": detail, "rollout_id": rollout_id, "rule": rule, "at": time.time()}
    return {
        "worker": worker_id,
        "now": reason in policy.ban_on,
        "max": policy.max_rejections,
        "count_field": field(worker_id, "rejected"),
        "forgiven_fields": [field(worker_id, f"rejected:{r}") for r in policy.forgiven],
        "record": json.dumps(record),
    }


def worker_stats(client: redis.Redis, keys: RunKeys) -> dict[str, dict]:
    """Every worker seen: `{worker: {"counters": {counter: n}, "banned": record or None}}`."""
    stats: dict[str, dict] = {}
    for raw, value in cast(dict[bytes, bytes], client.hgetall(keys.workers)).items():
        worker, _, counter = raw.decode().rpartition("|")
        stats.setdefault(worker, {"counters": {}, "banned": None})["counters"][counter] = int(value)
    for raw, record in cast(dict[bytes, bytes], client.hgetall(keys.banned)).items():
        stats.setdefault(raw.decode(), {"counters": {}, "banned": None})["banned"] = json.loads(record)
    return stats


def one_worker_stats(client: redis.Redis, keys: RunKeys, worker_id: str) -> dict:
    """Counters and ban record of one worker (zeros when never seen)."""
    counters = {}
    # HSCAN with a pattern reads only this worker's fields; glob characters in the id are escaped.
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in worker_id) + "|*"
    for raw, value in client.hscan_iter(keys.workers, match=pattern):
        worker, _, counter = raw.decode().rpartition("|")
        if worker == worker_id:  # "a|*" also matches the fields of a worker called "a|b"
            counters[counter] = int(value)
    return {"counters": counters, "banned": ban_record(client, keys, worker_id)}


def replay_plan(
    policy: BanPolicySpec, worker_id: str, score, max_running_share: float, rollout_id: str
) -> tuple[dict[str, int], dict | None]:
    """The replay counters one accepted group adds to its worker (`score`: its replay.ReplayScore) and
    the running-share ban the commit script applies after adding them (None when the limit is 0)."""
    counters = {
        "replay_positions": score.positions,
        "replay_mismatches": score.mismatches,
        "replay_surprise_milli": round(1000 * score.surprise),
    }
    workers = {field(worker_id, k): v for k, v in counters.items()}
    if max_running_share <= 0:
        return workers, None
    detail = f"running replay mismatch share over {max_running_share} (>= {policy.min_replay_positions} positions)"
    record = {
        "reason": "seed_replay",
        "detail": detail,
        "rollout_id": rollout_id,
        "rule": "runningReplayShare",
        "at": time.time(),
    }
    share_ban = {
        "worker": worker_id,
        "mismatches": field(worker_id, "replay_mismatches"),
        "positions": field(worker_id, "replay_positions"),
        "max": max_running_share,
        "min": policy.min_replay_positions,
        "record": json.dumps(record),
    }
    return workers, share_ban


def on_probation(client: redis.Redis, keys: RunKeys, worker_id: str, probation_groups: int) -> bool:
    """Whether `worker_id` joined through the ingest's door (`RunKeys.joined`) and has fewer than
    `probation_groups` accepted groups: the gate then gives every one of its groups the prefill checks.
    Workers with operator-written tokens (or direct Redis access) never are. For a joined worker it also
    copies the accepted count to `RunKeys.standing`, where the ingest reads it to widen the worker's rate
    (the ingest may not read the reputation hash: its Redis user would then be able to write it too)."""
    if probation_groups <= 0:
        return False
    pipe = client.pipeline(transaction=False)
    pipe.hexists(keys.joined, worker_id)
    pipe.hget(keys.workers, field(worker_id, "accepted"))
    joined, accepted = pipe.execute()
    if not joined:
        return False
    client.hset(keys.standing, worker_id, int(accepted or 0))
    return int(accepted or 0) < probation_groups
