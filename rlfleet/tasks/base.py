"""The task seam: a task source names problems by id, rebuilds any problem from its id, and scores
a completion with a trusted verifier. Workers sample ids; the verifier rebuilds the prompt from
the id (never trusting the worker's) and recomputes the reward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    answer: str


class TaskSource(ABC):
    """A deterministic family of problems with a binary reward."""

    @abstractmethod
    def problem(self, task_id: str) -> Problem:
        """Rebuild the problem named by `task_id`; KeyError if the id does not belong to this source."""

    @abstractmethod
    def sample_id(self, rng: np.random.Generator) -> str:
        """Draw a task id."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Trusted reward of a completion (decoded text, without the end-of-sequence token)."""

    def score(self, problem: Problem, completion: str, completion_tokens: int) -> float:
        """The reward trained on: the task reward, plus whatever depends on the token count (length.py)."""
        return self.reward(problem, completion)
