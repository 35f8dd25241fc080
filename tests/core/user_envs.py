"""User environments for the tests (spec.task type python): a well-behaved one whose task ids say how its
reward misbehaves, and factories that break the contract. Loaded by entry point `tests.core.user_envs:NAME`."""

from __future__ import annotations

import time

from rlfleet.tasks import Problem, TaskSource

KINDS = ("ok", "raise", "hang", "nan", "str", "short")


class Moody(TaskSource):
    """Task ids `mood-{kind}-{n}`: prompt `{n}+1=`, answer n+1. The reward of kind ok is exact match; the others
    raise, hang, return NaN, return a string, or return too few rewards, as their kind says."""

    def __init__(self, kinds: str = "ok"):
        self.kinds = kinds.split(",")

    def problem(self, task_id: str) -> Problem:
        parts = task_id.split("-")
        if len(parts) != 3 or parts[0] != "mood" or parts[1] not in KINDS or not parts[2].isdigit():
            raise KeyError(f"task id {task_id!r} is not mood-<kind>-<n>")
        n = int(parts[2])
        return Problem(task_id=task_id, prompt=f"{n}+1=", answer=str(n + 1))

    def sample_id(self, rng) -> str:
        return f"mood-{self.kinds[int(rng.integers(len(self.kinds)))]}-{int(rng.integers(0, 50))}"

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0

    def rewards(self, problem: Problem, completions: list[str]):
        kind = problem.task_id.split("-")[1]
        if kind == "raise":
            raise RuntimeError("the reward model is down")
        if kind == "hang":
            time.sleep(3600)
        if kind == "nan":
            return [float("nan")] * len(completions)
        if kind == "str":
            return ["high"] * len(completions)
        if kind == "short":
            return [0.0]
        return [self.reward(problem, c) for c in completions]


def not_a_source(**config):
    return {"problem": "not a TaskSource"}


def failing_factory(**config):
    raise RuntimeError("cannot reach the problem bank")


NOT_CALLABLE = 42
