"""Online prompt filter (`spec.sampling.onlineFilter`): stop sampling prompts that teach nothing.

A group whose completions were all right (or all wrong) has zero advantage: the trainer learns nothing
from it, and once a prompt is solved its groups repeat (the same prompt tokens, the same completions),
so the trainer drops them as repeats of trained work (same content digest). Late in the arithmetic
example most generation went there.

Identity: a prompt is its prompt tokens (`prompt_key`), the part of the content digest the worker
cannot vary, not its task id: arithmetic names the same `a+b=` under countless ids, and two rows of a
dataset with the same text are the same prompt.

Who knows what:
- the trainer (trusted) observes every verified group it reads, the ones it drops too, with the
  rewards the gate recomputed (`OutcomeRecorder`). It keeps each prompt's last `window` outcomes
  (solved: mean reward >= solvedAt; failed: <= failedAt; else mixed) and, when they are all solved or
  all failed, retires the prompt: RPUSH of its key onto the run's `retired_prompts` list (append-only,
  so a retired prompt stays retired for the run, and a restarted trainer reloads the list);
- a worker reads the list incrementally (LRANGE from where it stopped, `RetiredPrompts`) before each
  batch and redraws a retired prompt (`draw_unretired`), at most maxRedraws times per group.
Nothing here touches what is verified or trained: the filter only changes which prompts honest
workers draw. A worker that ignores it is checked as before, and its repeats are dropped as before.
Under `assignment: run` a worker redraws along its ticket's own draws, so a redraw costs no ticket, and the
gate checks that every draw it skipped was retired (rlfleet/fleet/assignment.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import numpy as np
import redis

from rlfleet.wire.streams import RunKeys

T = TypeVar("T")
OUTCOMES = ("solved", "failed")


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's identity: sha256 of its token ids (as the content digest writes them), 32 hex digits."""
    return hashlib.sha256(np.asarray(prompt_ids, dtype="<i4").tobytes()).hexdigest()[:32]


class OutcomeRecorder:
    """The trainer's side: recent outcomes per prompt; retires prompts (see the module docstring).

    Invariant: a key is pushed to `retired_prompts` at most once per recorder (retired ones are never
    observed again), and `retired` counts the prompts this run retired, by outcome."""

    def __init__(self, spec, client: redis.Redis, keys: RunKeys):
        self.window, self.solved_at, self.failed_at = spec.window, spec.solved_at, spec.failed_at
        self.client, self.key = client, keys.retired_prompts
        self.recent: dict[str, deque[str]] = {}
        stored = cast(list[bytes], client.lrange(self.key, 0, -1))
        self.retired_keys = {k.decode() for k in stored}
        self.retired = {"solved": 0, "failed": 0}

    def outcome(self, rewards: Sequence[float]) -> str:
        mean = float(np.mean(rewards))
        if self.solved_at is not None and mean >= self.solved_at:
            return "solved"
        if self.failed_at is not None and mean <= self.failed_at:
            return "failed"
        return "mixed"

    def observe(self, prompt_ids: Sequence[int], rewards: Sequence[float]) -> str | None:
        """Record one verified group; the outcome that retired its prompt now, else None."""
        key = prompt_key(prompt_ids)
        if key in self.retired_keys:
            return None
        outcome = self.outcome(rewards)
        recent = self.recent.setdefault(key, deque(maxlen=self.window))
        recent.append(outcome)
        if outcome == "mixed" or len(recent) < self.window or any(o != outcome for o in recent):
            return None
        del self.recent[key]
        self.retired_keys.add(key)
        self.retired[outcome] += 1
        self.client.rpush(self.key, key)
        return outcome


class RetiredPrompts:
    """A copy of the run's retired prompt keys, refreshed incrementally from Redis: a worker's, and the gate's
    (it checks a ticket's redraws, rlfleet/fleet/assignment.py, from two threads)."""

    def __init__(self, reader: redis.Redis, keys: RunKeys):
        self.reader, self.key = reader, keys.retired_prompts
        self.keys: set[str] = set()
        self.read = 0  # list entries read so far (the list only grows)
        self.lock = threading.Lock()  # two refreshes at once would each count the same new entries

    def refresh(self) -> None:
        with self.lock:
            new = cast(list[bytes], self.reader.lrange(self.key, self.read, -1))
            self.read += len(new)
            self.keys.update(k.decode() for k in new)

    def __contains__(self, key: str) -> bool:
        return key in self.keys


def draw_unretired(
    draw: Callable[[], T | None], key_of: Callable[[T], str], retired: RetiredPrompts, max_draws: int
) -> tuple[T | None, int]:
    """(the first of up to `max_draws` draws whose prompt is not retired, else the last draw; how many draws
    were skipped as retired). A draw of None (stopped) ends it at once."""
    piece: T | None = None
    for skipped in range(max_draws):
        piece = draw()
        if piece is None or key_of(piece) not in retired:
            return piece, skipped
    return piece, max_draws - 1
