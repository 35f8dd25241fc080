"""Run-assigned work (`spec.sampling.assignment: run`): the run, not the worker, picks each group's
task and seed, so a worker cannot grind them (draw many, submit the ones it likes).

A worker asks for a work ticket: `issue_ticket` increments its counter in `RunKeys.tickets`
(directly in Redis, or through the ingest's tickets endpoint for workers outside the cluster, which
binds the worker id to its token). Ticket k of worker w fixes the task id and the group seed,
`assigned_work(task, salt, w, k)` (a hash of the run's task seed, w and k), and the group records k.
The gate accepts a group only if k was issued to its worker, its task id and seed are those of k,
and k was not used before (`ticket_problem` and a one-time guard). A worker can still drop a ticket
whose task it does not like; what it drops shows as issued minus used (`ticket_counts`), and the
seeds stay out of its hands. Replaying k's content under another ticket is the content replay the
digest guard rejects.
"""

from __future__ import annotations

import hashlib

import numpy as np
import redis

from rlfleet.wire.streams import RolloutGroup, RunKeys


def issue_ticket(client: redis.Redis, keys: RunKeys, worker_id: str) -> int:
    """The next work ticket of `worker_id` (0, 1, 2, ...); counted as issued."""
    return int(client.hincrby(keys.tickets, worker_id, 1)) - 1


def issued_tickets(client: redis.Redis, keys: RunKeys, worker_id: str) -> int:
    return int(client.hget(keys.tickets, worker_id) or 0)


def assigned_work(task, salt: int, worker_id: str, ticket: int) -> tuple[str, int]:
    """(task id, group seed) of ticket `ticket` of `worker_id`; `task` is the run's TaskSource, `salt` its seed."""
    digest = hashlib.sha256(f"rlfleet-assign-1\0{salt}\0{worker_id}\0{ticket}".encode()).digest()
    task_id = task.sample_id(np.random.default_rng(int.from_bytes(digest[:16], "little")))
    return task_id, int.from_bytes(digest[16:20], "little") >> 1  # a seed in [0, 2**31), as workers draw


def ticket_problem(client: redis.Redis, keys: RunKeys, task, salt: int, group: RolloutGroup) -> str | None:
    """What is wrong with the ticket of `group` in a run that assigns work, or None (its one-time use is the
    caller's guard, `RunKeys.ticket`)."""
    k = group.ticket
    if k is None:
        return "the run assigns work (spec.sampling.assignment: run) and the group carries no ticket"
    issued = issued_tickets(client, keys, group.worker_id)
    if not 0 <= k < issued:
        return f"ticket {k} was never issued to worker {group.worker_id!r} ({issued} issued)"
    want_task, want_seed = assigned_work(task, salt, group.worker_id, k)
    if (group.task_id, group.sampling.seed) != (want_task, want_seed):
        return (
            f"ticket {k} assigns task {want_task} with seed {want_seed}; "
            f"the group has task {group.task_id} with seed {group.sampling.seed}"
        )
    return None
