"""Run-assigned work (`spec.sampling.assignment: run`): the run, not the worker, picks each group's
task and seed, so a worker cannot grind them (draw many, submit the ones it likes).

A worker asks for a work ticket: `issue_ticket` increments its counter in `RunKeys.tickets`
(directly in Redis, or through the ingest's tickets endpoint for workers outside the cluster, which
binds the worker id to its token). Ticket k of worker w fixes the task id and the group seed,
`assigned_work(task, salt, w, k)` (a hash of the run's task seed, w and k), and the group records k.
The gate accepts a group only if k was issued to its worker, its task id and seed are those of k,
and k was not used before (`ticket_problem` and a one-time guard). Replaying k's content under
another ticket is the content replay the digest guard rejects.

Redraws. With `spec.sampling.onlineFilter` a worker skips prompts the trainer retired
(rlfleet/fleet/prompt_filter.py) without spending tickets: ticket k has a sequence of draws
d = 0, 1, ... (`assigned_work(..., draw=d)`, up to the filter's maxRedraws), and the worker takes the
first whose prompt is not retired; the group records d (`ticket_draw`). The gate checks the group's task
and seed against draw d and requires the prompt of every draw before d to be retired (the list only grows,
so what the worker saw retired still is): the worker has no choice among the draws of a ticket.

Dropped tickets. A worker can still drop a ticket whose group it does not like (a low reward) and so
pick what the trainer sees. Each accepted group counts its ticket (`tickets_used` in the worker's
reputation counters) and raises `tickets_reached` to its ticket + 1 (a worker's tickets are numbered in the
order it takes them, and it sends their groups in that order); a worker whose reached minus used tickets exceed
`verifier.ban.droppedTicketAllowance` plus `maxDroppedTicketShare` of those reached is banned at that accepted
group (rule `droppedTickets`, applied by the gate's commit script: rlfleet/services/toploc/commit.py). Only
tickets before the latest accepted one count: the tickets of groups still generating, in the inbox, or never
sent because the run ended are not drops (counted against all issued tickets, an honest worker ahead of a slow
gate was banned); a dropped ticket counts as soon as a later ticket's group is accepted. The allowance covers
the groups a worker's later tickets overtake at several gate replicas, and its stale and rejected groups.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import redis

from rlfleet.fleet.reputation import field
from rlfleet.wire.streams import RolloutGroup, RunKeys


def issue_ticket(client: redis.Redis, keys: RunKeys, worker_id: str) -> int:
    """The next work ticket of `worker_id` (0, 1, 2, ...); counted as issued."""
    return int(client.hincrby(keys.tickets, worker_id, 1)) - 1


def issued_tickets(client: redis.Redis, keys: RunKeys, worker_id: str) -> int:
    return int(client.hget(keys.tickets, worker_id) or 0)


def assigned_work(task, salt: int, worker_id: str, ticket: int, draw: int = 0) -> tuple[str, int]:
    """(task id, group seed) of draw `draw` of ticket `ticket` of `worker_id`; `task` is the run's TaskSource,
    `salt` its seed. Draw 0 is the ticket's work; later draws are the online filter's redraws."""
    text = f"rlfleet-assign-1\0{salt}\0{worker_id}\0{ticket}" + (f"\0{draw}" if draw else "")
    digest = hashlib.sha256(text.encode()).digest()
    task_id = task.sample_id(np.random.default_rng(int.from_bytes(digest[:16], "little")))
    return task_id, int.from_bytes(digest[16:20], "little") >> 1  # a seed in [0, 2**31), as workers draw


def ticket_problem(client: redis.Redis, keys: RunKeys, task, salt: int, group: RolloutGroup, draws: int) -> str | None:
    """What is wrong with the ticket of `group` in a run that assigns work, or None (its one-time use is the
    caller's guard, `RunKeys.ticket`; that the draws before the group's were retired, the caller's too: it
    needs the version's tokenizer). `draws`: how many draws a ticket has (the online filter's maxRedraws, else 1)."""
    k, draw = group.ticket, group.ticket_draw
    if k is None:
        return "the run assigns work (spec.sampling.assignment: run) and the group carries no ticket"
    if not 0 <= draw < draws:
        return f"ticket_draw {draw} is past the {draws} draws a ticket has (spec.sampling.onlineFilter.maxRedraws)"
    issued = issued_tickets(client, keys, group.worker_id)
    if not 0 <= k < issued:
        return f"ticket {k} was never issued to worker {group.worker_id!r} ({issued} issued)"
    want_task, want_seed = assigned_work(task, salt, group.worker_id, k, draw)
    if (group.task_id, group.sampling.seed) != (want_task, want_seed):
        return (
            f"draw {draw} of ticket {k} assigns task {want_task} with seed {want_seed}; "
            f"the group has task {group.task_id} with seed {group.sampling.seed}"
        )
    return None


def dropped_ticket_ban(policy, worker_id: str, ticket: int, rollout_id: str) -> dict | None:
    """The commit script's dropped-ticket rule for an accepted group of `worker_id` on ticket `ticket` (module
    docstring; `policy`: spec.verifier.ban), None when the rule is off (share 1)."""
    if policy.max_dropped_ticket_share >= 1:
        return None
    detail = (
        f"more than {policy.dropped_ticket_allowance} + {policy.max_dropped_ticket_share} x reached of its work "
        "tickets before its latest accepted one were never used by an accepted group"
    )
    record = {
        "reason": "assignment",
        "detail": detail,
        "rollout_id": rollout_id,
        "rule": "droppedTickets",
        "at": time.time(),
    }
    return {
        "worker": worker_id,
        "ticket": ticket,
        "used": field(worker_id, "tickets_used"),
        "reached": field(worker_id, "tickets_reached"),
        "allowance": policy.dropped_ticket_allowance,
        "share": policy.max_dropped_ticket_share,
        "record": json.dumps(record),
    }
