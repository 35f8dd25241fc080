"""Length targets: a binary task reward plus a penalty for missing a target length.

INTELLECT-2 trained with a target length written into the prompt ("think for N tokens") and drawn
per prompt from a set (TARGET-SHORT, TARGET-LONG), so one model learns to follow a thinking budget.
Here a task id carries its target (`{inner id}@len{N}`), so the verifier rebuilds the very prompt
the worker saw, and
    reward = task reward - coef * min(1, |completion tokens - N| / N).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource

SEPARATOR = "@len"


class LengthTargetTask(TaskSource):
    def __init__(self, inner: TaskSource, targets: list[int], coef: float, template: str):
        self.inner, self.targets, self.coef, self.template = inner, list(targets), coef, template
        self.multi_turn = inner.multi_turn

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        base, _ = self.split(problem.task_id)
        return self.inner.respond(self.inner.problem(base), turns)

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        base, _ = self.split(problem.task_id)
        return self.inner.call_tool(self.inner.problem(base), name, arguments)

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        base, _ = self.split(problem.task_id)
        return self.inner.episode_text(self.inner.problem(base), turns)

    def demonstration_turns(self, problem: Problem, rng: np.random.Generator, label_noise: float) -> list[str] | None:
        base, _ = self.split(problem.task_id)
        return self.inner.demonstration_turns(self.inner.problem(base), rng, label_noise)

    def split(self, task_id: str) -> tuple[str, int]:
        base, sep, target = task_id.rpartition(SEPARATOR)
        if not sep or not target.isdigit() or int(target) not in self.targets:
            raise KeyError(
                f"task id {task_id!r} carries no target length of {self.targets} (expected <id>{SEPARATOR}<N>)"
            )
        return base, int(target)

    def problem(self, task_id: str) -> Problem:
        base, target = self.split(task_id)
        inner = self.inner.problem(base)
        return replace(inner, task_id=task_id, prompt=self.template.format(prompt=inner.prompt, target=target))

    def sample_id(self, rng: np.random.Generator) -> str:
        return f"{self.inner.sample_id(rng)}{SEPARATOR}{self.targets[int(rng.integers(len(self.targets)))]}"

    def reward(self, problem: Problem, completion: str) -> float:
        return self.rewards(problem, [completion])[0]

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        base, _ = self.split(problem.task_id)
        return self.inner.rewards(self.inner.problem(base), completions)

    def scores(self, problem: Problem, completions: list[str], completion_tokens: list[int]) -> list[float]:
        base, target = self.split(problem.task_id)
        rewards = self.inner.scores(self.inner.problem(base), completions, completion_tokens)  # the inner's own terms
        return [r - self.coef * min(1.0, abs(n - target) / target) for r, n in zip(rewards, completion_tokens)]
