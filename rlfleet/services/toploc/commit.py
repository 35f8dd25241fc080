"""The verifier's exactly-once commit of one inbox entry's verdict.

One Lua script (`COMMIT_SCRIPT`) XACKs the entry first and does nothing more if the XACK acknowledged
nothing (another replica committed it); otherwise it forwards the group (accepted: to `verified`, with
the trusted rewards; rejected: to `rejected`, with the reason and the original message), deletes the
inbox entry, counts the verdict (run stats, worker reputation) and applies the ban policy, all
atomically. A Lua script rather than MULTI because the forward must depend on the XACK's answer.

What the script counts and whom it may ban is its plan, a JSON argument built here from the verdict:
  stats      run counters to add (accepted, rejected, rejected:{reason}, reward_mismatch, unchecked)
  workers    the worker's reputation counters to add (fleet/reputation.py `field`)
  ban        a rejection's ban rule (fleet/reputation.py `ban_plan`), absent when the worker is unknown
  share_ban  an accepted group's running replay-share rule (fleet/reputation.py `replay_plan`), when it
             was replayed and the rule applies
  ticket_ban an accepted ticketed group's dropped-ticket rule (fleet/assignment.py `dropped_ticket_ban`)
The script answers 0 (committed by another replica), 1 (committed), 2 (committed, and the worker is
banned by it) or 3 (committed, and the worker banned by the dropped-ticket rule); `Committer.commit` gives
its callers 0, 1 or 2.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis

from rlfleet.config import RLRunSpec
from rlfleet.fleet.assignment import dropped_ticket_ban
from rlfleet.fleet.reputation import ban_plan, field, replay_plan
from rlfleet.services.toploc.audit import AUDIT_APPEND_LUA, audit_entry
from rlfleet.services.toploc.checks import Outcome, Rejection
from rlfleet.services.toploc.metrics import BANS, DUPLICATES, LAPS, REWARD_MISMATCH, TOKENS, UNCHECKED, VERDICTS
from rlfleet.wire import components
from rlfleet.wire.streams import RolloutGroup, RunKeys

log = logging.getLogger("rlfleet.verifier")

# KEYS: inbox, out stream, stats, workers, banned, attempts, audit bytes.
# ARGV: group, entry id, maxlen, plan JSON {stats, workers, ban?, share_ban?, ticket_ban?, audit_max_bytes?},
# then the out fields. With audit_max_bytes (a rejection) the out stream is an audit stream (audit.py).
COMMIT_SCRIPT = (
    AUDIT_APPEND_LUA
    + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[6], ARGV[2])
  return 0
end
local out = {}
for i = 5, #ARGV do out[#out + 1] = ARGV[i] end
local plan = cjson.decode(ARGV[4])
if plan.audit_max_bytes then
  audit_append(KEYS[2], KEYS[7], tonumber(ARGV[3]), plan.audit_max_bytes, out)
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(out))
end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[6], ARGV[2])
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
local tb = plan.ticket_ban
if tb then
  local reached = math.max(tonumber(redis.call('HGET', KEYS[4], tb.reached) or '0'), tb.ticket + 1)
  redis.call('HSET', KEYS[4], tb.reached, reached)
  local used = tonumber(redis.call('HGET', KEYS[4], tb.used) or '0')
  if reached - used > tb.allowance + tb.share * reached then
    if redis.call('HSETNX', KEYS[5], tb.worker, tb.record) == 1 then return 3 end
  end
end
return 1
"""
)


def forward_trusted(group: RolloutGroup, outcome: Outcome) -> None:
    """What the trainer gets of an accepted group: the trusted rewards and, where the prefill ran, the
    recomputed token logprobs instead of the worker's (a shift inside the tolerance would skew every
    importance ratio); no TOPLOC proofs, which nobody reads after the gate and which are about half of a
    long group's message (258 bytes per 32 tokens, base64: as many bytes as its token ids and logprobs)."""
    for i, (sample, reward) in enumerate(zip(group.samples, outcome.rewards)):
        sample.reward = reward
        sample.proofs = []
        if outcome.logprobs is not None:
            sample.logprobs = outcome.logprobs[i]


@dataclass(frozen=True)
class Written:
    """What the commit script writes for one verdict: the out stream's fields and the plan (module
    docstring), and how the verdict is counted here."""

    stream: str
    out: dict
    plan: dict
    verdict: str  # accepted | rejected
    reason: str  # the rejection reason; empty when accepted
    worker: str | None


class Committer:
    """Commits verdicts of one run's inbox entries exactly once (module docstring), as replica `consumer`
    of the verifier consumer group. `share_limit(group)`: the running replay-share limit of the group's
    calibration (checks.Checker.running_share_limit)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        spec: RLRunSpec,
        consumer: str,
        share_limit: Callable[[RolloutGroup], float],
    ):
        self.keys, self.spec, self.consumer, self.share_limit = keys, spec, consumer, share_limit
        self._script = client.register_script(COMMIT_SCRIPT)

    @LAPS.part("commit")
    def commit(self, msg_id: bytes, fields: dict, group: RolloutGroup | None, result: Outcome | Rejection) -> int:
        """Commit one entry's verdict; the script's answer: 0 already committed, 1 committed, 2 banned."""
        if isinstance(result, Rejection):
            written = self.rejection(msg_id, fields, group, result)
        else:
            assert group is not None  # an Outcome comes only with the group it checked
            written = self.acceptance(group, result)

        k = self.keys
        flat = [x for kv in written.out.items() for x in kv]
        answer = self._script(
            keys=[k.rollouts, written.stream, k.stats, k.workers, k.banned, k.attempts, k.audit_bytes],
            args=[k.verifier_group, msg_id, self.spec.redis.stream_max_len, json.dumps(written.plan), *flat],
        )
        if answer == 0:
            DUPLICATES.inc()
            log.info("entry %s was committed by another replica; dropped this verdict", msg_id.decode())
            return 0

        VERDICTS.labels(written.verdict, written.reason).inc()
        if isinstance(result, Outcome):
            REWARD_MISMATCH.inc(result.reward_mismatches)
            UNCHECKED.inc(0 if result.prefill_checked else 1)
            TOKENS.labels(str(result.prefill_checked).lower()).inc(result.tokens)
        if answer in (2, 3):
            # An accepted group's ban is its worker's running replay share (2) or its dropped tickets (3).
            reason = written.reason or ("seed_replay" if answer == 2 else "assignment")
            BANS.labels(reason).inc()
            log.warning("banned worker %s (%s)", written.worker, reason)
            return 2
        return int(answer)

    def rejection(self, msg_id: bytes, fields: dict, group: RolloutGroup | None, exc: Rejection) -> Written:
        """A rejected entry: the reason and the original message to the audit stream `rejected` (audit.py),
        counted for the run and, when known, for the worker, whose ban rule it may trigger."""
        v = self.spec.verifier
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
        out = audit_entry(record, next(iter(fields.values()), b""), self.spec)
        plan: dict = {
            "stats": {"rejected": 1, f"rejected:{exc.reason}": 1},
            "workers": {},
            "audit_max_bytes": self.spec.redis.audit_stream_max_bytes,
        }
        if worker is not None:
            plan["workers"] = {field(worker, "rejected"): 1, field(worker, f"rejected:{exc.reason}"): 1}
            plan["ban"] = ban_plan(v.ban, worker, exc.reason, exc.detail, record["rollout_id"])
        return Written(self.keys.rejected, out, plan, "rejected", exc.reason, worker)

    def acceptance(self, group: RolloutGroup, outcome: Outcome) -> Written:
        """An accepted group, with its trusted rewards (and recomputed logprobs) to `verified`; its
        counters, and the running-share ban rule when its seeds were replayed."""
        forward_trusted(group, outcome)
        w = group.worker_id
        plan: dict = {"stats": {"accepted": 1}, "workers": {field(w, "accepted"): 1}}
        if group.ticket is not None and self.spec.sampling.assignment == "run":
            plan["workers"][field(w, "tickets_used")] = 1
            ticket_ban = dropped_ticket_ban(self.spec.verifier.ban, w, group.ticket, group.rollout_id)
            if ticket_ban is not None:
                plan["ticket_ban"] = ticket_ban
        if outcome.reward_mismatches:
            plan["stats"]["reward_mismatch"] = plan["workers"][field(w, "reward_mismatch")] = outcome.reward_mismatches

        if outcome.replay is not None:  # the seed replay's score: reputation, and the running-share ban
            counters, share_ban = replay_plan(
                self.spec.verifier.ban, w, outcome.replay, self.share_limit(group), group.rollout_id
            )
            plan["workers"].update(counters)
            if share_ban is not None:  # absent rather than null: cjson's null is a truthy userdata
                plan["share_ban"] = share_ban
        if not outcome.prefill_checked:
            plan["stats"]["unchecked"] = plan["workers"][field(w, "unchecked")] = 1
        return Written(self.keys.verified, group.encode(), plan, "accepted", "", w)
