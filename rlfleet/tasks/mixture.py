"""Task mixtures: several sources in one run, each group drawn from one of them by weight.

A mixture's task id is `{source name}/{the source's own id}` (source names are DNS labels, so the
first `/` splits it), so the verifier rebuilds the problem and recomputes the reward with that source,
and the trainer reports reward and counts per source (`source_of`). A worker draws the source with
probability weight / sum of weights, then the source draws its id from the same generator.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource

SEPARATOR = "/"


def source_of(task_id: str) -> str | None:
    """The mixture source named by a task id, or None for a task id of a single-source run."""
    name, sep, _ = task_id.partition(SEPARATOR)
    return name if sep else None


class MixtureTask(TaskSource):
    def __init__(self, sources: list[tuple[str, float, TaskSource]]):
        if not sources:
            raise ValueError("spec.task.mixture: at least one source")
        self.names = [name for name, _, _ in sources]
        self.sources = {name: source for name, _, source in sources}
        weights = np.array([weight for _, weight, _ in sources], dtype=np.float64)
        self.probabilities = weights / weights.sum()
        self.multi_turn = any(source.multi_turn for source in self.sources.values())

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        _, source, inner_id = self.split(problem.task_id)
        return source.respond(replace(problem, task_id=inner_id), turns)

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        _, source, inner_id = self.split(problem.task_id)
        return source.call_tool(replace(problem, task_id=inner_id), name, arguments)

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        _, source, inner_id = self.split(problem.task_id)
        return source.episode_text(replace(problem, task_id=inner_id), turns)

    def demonstration_turns(self, problem: Problem, rng: np.random.Generator, label_noise: float) -> list[str] | None:
        _, source, inner_id = self.split(problem.task_id)
        return source.demonstration_turns(replace(problem, task_id=inner_id), rng, label_noise)

    def split(self, task_id: str) -> tuple[str, TaskSource, str]:
        """(source name, source, the source's own id) of a mixture task id; KeyError if no source has it."""
        name, sep, inner_id = task_id.partition(SEPARATOR)
        if not sep or name not in self.sources:
            raise KeyError(f"task id {task_id!r} names no source of the mixture (expected <source>/<id>, one of "
                           f"{self.names})")  # fmt: skip
        return name, self.sources[name], inner_id

    def problem(self, task_id: str) -> Problem:
        _, source, inner_id = self.split(task_id)
        return replace(source.problem(inner_id), task_id=task_id)

    def sample_id(self, rng: np.random.Generator) -> str:
        name = self.names[int(rng.choice(len(self.names), p=self.probabilities))]
        return f"{name}{SEPARATOR}{self.sources[name].sample_id(rng)}"

    def reward(self, problem: Problem, completion: str) -> float:
        return self.rewards(problem, [completion])[0]

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        _, source, inner_id = self.split(problem.task_id)
        return source.rewards(replace(problem, task_id=inner_id), completions)

    def scores(self, problem: Problem, completions: list[str], completion_tokens: list[int]) -> list[float]:
        _, source, inner_id = self.split(problem.task_id)
        return source.scores(replace(problem, task_id=inner_id), completions, completion_tokens)

    def ids(self) -> list[str]:
        """Every listed id of the sources that list theirs (data sets; generated sources list none)."""
        out = []
        for name in self.names:
            ids = getattr(self.sources[name], "ids", None)
            out += [f"{name}{SEPARATOR}{i}" for i in (ids() if ids else [])]
        return out
