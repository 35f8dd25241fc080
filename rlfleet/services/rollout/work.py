"""What a worker samples next (rlfleet/services/rollout/main.py's Worker draws through this): a task id and a
group seed, drawn by the worker (`spec.sampling.assignment: worker`) or assigned by the run through a work
ticket (`assignment: run`, from Redis or the ingest; rlfleet/fleet/assignment.py), and with
`spec.sampling.onlineFilter` redrawn while its prompt is retired (rlfleet/fleet/prompt_filter.py).
"""

from __future__ import annotations

import numpy as np
import redis
import requests
from prometheus_client import Counter

from rlfleet.config import RLRunSpec
from rlfleet.engines import Engine
from rlfleet.fleet.assignment import assigned_work, issue_ticket
from rlfleet.fleet.prompt_filter import RetiredPrompts, draw_unretired, prompt_key
from rlfleet.services.ingest.client import request_ticket
from rlfleet.tasks.base import TaskSource
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.wire.runtime import Context

FILTERED = Counter("rlfleet_rollout_filtered_draws_total", "Draws skipped: the online filter retired their prompt")


class WorkSource:
    """A worker's draws (a base of main.Worker, which sets these attributes)."""

    ctx: Context
    spec: RLRunSpec
    task: TaskSource
    rng: np.random.Generator
    worker_id: str
    ingest_url: str | None
    tickets_url: str | None
    token: str
    session: requests.Session
    tickets: redis.Redis | None
    retired: RetiredPrompts | None
    max_redraws: int

    @property
    def loaded(self) -> Engine:
        raise NotImplementedError  # the worker's engine (main.Worker)

    def next_work(self) -> tuple[str, int, int | None] | None:
        """(task id, group seed, ticket) of the next group: drawn here, or assigned by the run
        (spec.sampling.assignment: run; a ticket from Redis or the ingest). None if stopped meanwhile."""
        if self.spec.sampling.assignment == "worker":
            return self.task.sample_id(self.rng), int(self.rng.integers(0, 2**31)), None
        if self.ingest_url:
            assert self.tickets_url is not None  # made with ingest_url
            ticket = request_ticket(self.session, self.tickets_url, self.token, self.ctx.stop)
            if ticket is None:
                return None
        else:
            assert self.tickets is not None  # a worker without an ingest takes tickets from Redis
            ticket = issue_ticket(self.tickets, self.ctx.keys, self.worker_id)
        task_id, seed = assigned_work(self.task, self.spec.task.seed, self.worker_id, ticket)
        return task_id, seed, ticket

    def work_prompt_key(self, piece: tuple[str, int, int | None] | None) -> str:
        """The online filter's key of a draw: its prompt tokens as the group will carry them (chat template
        included); "" (never retired) when a user environment fails to make the problem, which make_groups
        then skips."""
        assert piece is not None  # draw_unretired asks only for the key of a draw
        try:
            return prompt_key(self.prompt_ids(piece[0]))
        except EnvironmentFailure:
            return ""

    def prompt_ids(self, task_id: str) -> list[int]:
        """The prompt tokens of `task_id`'s problem, as the group carries them (chat template included)."""
        return encode_prompt(self.loaded.tokenizer, self.task.problem(task_id))

    def take_work(self, room: int) -> list[tuple[str, int, int | None]] | None:
        """Up to `room` pieces of work (next_work's), redrawing prompts the online filter retired; None if
        stopped meanwhile (a ticket held back)."""
        if self.retired is not None:
            self.retired.refresh()
        work = []
        for _ in range(room):
            if self.retired is None:
                piece = self.next_work()
            else:
                piece, skipped = draw_unretired(self.next_work, self.work_prompt_key, self.retired, self.max_redraws)
                FILTERED.inc(skipped)
            if piece is None:
                return None
            work.append(piece)
        return work
