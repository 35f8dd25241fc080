"""What a worker samples next (rlfleet/services/rollout/main.py's Worker draws through this): a task id and a
group seed, drawn by the worker (`spec.sampling.assignment: worker`) or assigned by the run through a work
ticket (`assignment: run`, from Redis or the ingest; rlfleet/fleet/assignment.py), and with
`spec.sampling.onlineFilter` redrawn while its prompt is retired (rlfleet/fleet/prompt_filter.py): a worker's
own draws are redrawn freely, a ticket's along the ticket's own sequence of draws, so a redraw costs no ticket.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import redis
import requests
from prometheus_client import Counter

from rlfleet.fleet.assignment import assigned_work, issue_ticket
from rlfleet.fleet.prompt_filter import RetiredPrompts, draw_unretired, prompt_key
from rlfleet.services.ingest.client import request_ticket
from rlfleet.tasks.base import TaskSource
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.wire.runtime import Context

if TYPE_CHECKING:  # the worker's engine loads transformers; this module needs only the name
    from transformers import PreTrainedTokenizerBase

FILTERED = Counter("rlfleet_rollout_filtered_draws_total", "Draws skipped: the online filter retired their prompt")


class Work(NamedTuple):
    """One group's work: its task and group seed and, when the run assigns work, the ticket and which of the
    ticket's draws they are (rlfleet/fleet/assignment.py)."""

    task_id: str
    seed: int
    ticket: int | None = None
    draw: int = 0


@dataclass(frozen=True)
class IngestLink:
    """How a worker of a pool with `ingestUrl` reaches its run's ingest: it never touches Redis, and sends its groups
    and asks for its work tickets over HTTP with its own token (rlfleet/services/ingest/)."""

    session: requests.Session  # the ingest's connections (no socket opens until one is used)
    rollouts_url: str
    tickets_url: str
    token: str


class WorkSource:
    """A worker's draws: the next pieces of work (task id, group seed, ticket), redrawn past retired prompts.

    `tickets` is the worker's Redis user for run-assigned work and `reader` the one it reads the retired prompts
    with; a worker behind an ingest has neither and takes its tickets through `ingest`."""

    def __init__(
        self,
        ctx: Context,
        task: TaskSource,
        worker_id: str,
        ingest: IngestLink | None,
        tickets: redis.Redis | None,
        reader: redis.Redis | None,
    ):
        self.ctx, self.spec, self.task, self.worker_id = ctx, ctx.bundle.run.spec, task, worker_id
        self.ingest, self.tickets = ingest, tickets
        # Each worker draws its own sequence, reproducible from the run's task seed and its id.
        seed = int.from_bytes(hashlib.sha256(f"{self.spec.task.seed}:{worker_id}".encode()).digest()[:8], "little")
        self.rng = np.random.default_rng(seed)
        # The online filter's retired prompts (prompt_filter.py); a worker of an ingest reads no Redis.
        online_filter = self.spec.sampling.online_filter
        self.retired = RetiredPrompts(reader, ctx.keys) if reader and online_filter else None
        self.max_redraws = online_filter.max_redraws if online_filter else 1

    def next_work(self) -> Work | None:
        """The next group's work: drawn here, or draw 0 of a ticket from the run (spec.sampling.assignment: run;
        from Redis or the ingest). None if stopped meanwhile."""
        if self.spec.sampling.assignment == "worker":
            return Work(self.task.sample_id(self.rng), int(self.rng.integers(0, 2**31)))
        ticket = self.next_ticket()
        return None if ticket is None else self.assigned(ticket, 0)

    def next_ticket(self) -> int | None:
        """A work ticket from the ingest (a worker behind one) or from Redis; None if stopped meanwhile."""
        if self.ingest:
            return request_ticket(self.ingest.session, self.ingest.tickets_url, self.ingest.token, self.ctx.stop)
        assert self.tickets is not None  # a worker without an ingest takes tickets from Redis
        return issue_ticket(self.tickets, self.ctx.keys, self.worker_id)

    def assigned(self, ticket: int, draw: int) -> Work:
        task_id, seed = assigned_work(self.task, self.spec.task.seed, self.worker_id, ticket, draw)
        return Work(task_id, seed, ticket, draw)

    def ticket_draws(self, ticket: int) -> Callable[[], Work]:
        """The draws of `ticket` one per call, from draw 0 (at most maxRedraws calls)."""
        draws = iter(range(self.max_redraws))
        return lambda: self.assigned(ticket, next(draws))

    def prompt_ids(self, tokenizer: PreTrainedTokenizerBase, task_id: str) -> list[int]:
        """The prompt tokens of `task_id`'s problem, as the group carries them (chat template included)."""
        return encode_prompt(tokenizer, self.task.problem(task_id))

    def take_work(self, room: int, tokenizer: PreTrainedTokenizerBase) -> list[Work] | None:
        """Up to `room` pieces of work, redrawing prompts the online filter retired (a prompt is its tokens under
        `tokenizer`, the loaded version's); None if stopped meanwhile (a ticket held back)."""
        if self.retired is not None:
            self.retired.refresh()

        def key_of(piece: Work | None) -> str:
            """The online filter's key of a draw: its prompt tokens as the group will carry them (chat template
            included); "" (never retired) when a user environment fails to make the problem, which the worker's
            make_groups then skips."""
            assert piece is not None  # draw_unretired asks only for the key of a draw
            try:
                return prompt_key(self.prompt_ids(tokenizer, piece.task_id))
            except EnvironmentFailure:
                return ""

        work = []
        for _ in range(room):
            if self.retired is None:
                piece = self.next_work()
            elif self.spec.sampling.assignment == "run":  # the ticket's draws, in order: the gate checks the order
                ticket = self.next_ticket()
                if ticket is None:
                    return None
                piece, skipped = draw_unretired(self.ticket_draws(ticket), key_of, self.retired, self.max_redraws)
                FILTERED.inc(skipped)
            else:
                piece, skipped = draw_unretired(self.next_work, key_of, self.retired, self.max_redraws)
                FILTERED.inc(skipped)
            if piece is None:
                return None
            work.append(piece)
        return work
