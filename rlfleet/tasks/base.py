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


def make_run_task(run_spec) -> TaskSource:
    """The run's task source: `spec.task`, wrapped with length targets when `spec.lengthPenalty` is set."""
    task = make_task(run_spec.task)
    lp = run_spec.length_penalty
    if lp is not None:
        from rlfleet.tasks.length import LengthTargetTask

        task = LengthTargetTask(task, lp.targets, lp.coef, lp.prompt_template)
    return task


def make_task(spec) -> TaskSource:
    """Factory keyed by `spec.type`."""
    if spec.type == "arithmetic":
        from rlfleet.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(seed=spec.seed, max_operand=spec.max_operand, operations=tuple(spec.operations))
    if spec.type == "math":
        from rlfleet.tasks.math import from_spec

        return from_spec(spec)
    if spec.type == "code":
        from rlfleet.tasks.code import from_spec

        return from_spec(spec)
    raise ValueError(f"task.type: unknown task type {spec.type!r}")
