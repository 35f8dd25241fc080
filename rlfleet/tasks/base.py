"""The task seam: a task source names problems by id, rebuilds any problem from its id, and scores
a completion with a trusted verifier. Workers sample ids; the verifier rebuilds the prompt from
the id (never trusting the worker's) and recomputes the reward.

This is also the contract of a user environment (`spec.task.type: python`, docs/environments.md):
`problem` and `reward` must be deterministic functions of their arguments (the verifier, another
process on another machine, recomputes them and rejects a group whose rewards differ), and
`sample_id` may draw only from the generator it is given.

A source that takes turns (`multi_turn = True`) also answers each model turn with the environment's turn
(`respond`), a deterministic function of the problem and the model's turns so far; the verifier asks it
again and requires the worker's transcript to hold exactly its answers (rlfleet/tasks/turns.py).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    answer: str
    # Set by the run's task spec (chat.py), never by a source: encode the prompt through the tokenizer's
    # chat template, with this system turn.
    chat_template: bool = False
    system_prompt: str | None = None
    # A known-good completion, when the source has one (a row's `solution`); builtin models warm-start on it.
    reference: str | None = None
    # The tools the problem offers, as function schemas (the JSON-schema form a chat template's `tools` takes):
    # a chat template that renders tools shows them in the prompt and the model calls them in the template's own
    # format (rlfleet/tasks/tool_calls.py), answered by `TaskSource.call_tool`.
    tools: tuple[dict, ...] = field(default=(), hash=False)


class TaskSource(ABC):
    """A deterministic family of problems with a reward (binary for the shipped types)."""

    # Whether `respond` may answer a model turn: the worker then samples episodes of up to
    # spec.sampling.maxTurns model turns (rlfleet/tasks/turns.py); otherwise one completion per sample.
    multi_turn: bool = False

    @abstractmethod
    def problem(self, task_id: str) -> Problem:
        """Rebuild the problem named by `task_id`; KeyError if the id does not belong to this source."""

    @abstractmethod
    def sample_id(self, rng: np.random.Generator) -> str:
        """Draw a task id."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Trusted reward of a completion (decoded text, without the end-of-sequence token)."""

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        """Rewards of a group's completions; a source that scores a group faster at once overrides this."""
        return [self.reward(problem, c) for c in completions]

    def scores(self, problem: Problem, completions: list[str], completion_tokens: list[int]) -> list[float]:
        """The rewards trained on: the task rewards, plus whatever depends on the token counts (length.py)."""
        return self.rewards(problem, completions)

    def score(self, problem: Problem, completion: str, completion_tokens: int) -> float:
        """`scores` of one completion."""
        return self.scores(problem, [completion], [completion_tokens])[0]

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        """The text the reward of a multi-turn episode of `problem` reads, from its turns (the model's first,
        alternating with the environment's and ending with the model's; a model turn without its stop token): by
        default the whole transcript. A source whose environment writes what must not count as the model's answer
        (a tool's output) returns the model's part it grades instead."""
        return "".join(turns)

    def demonstration_turns(self, problem: Problem, rng: np.random.Generator, label_noise: float) -> list[str] | None:
        """A builtin model's warm start on a source that takes turns: the turns of an episode to imitate (the
        model's and the environment's, alternating as in `episode_text`), a near miss with probability
        `label_noise` (drawn from `rng`). None: the single-turn demonstration (rlfleet/models/warm_start.py)."""
        return None

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        """The environment's turn after the model's turns so far (`turns`, oldest first, each decoded without its
        stop token), inserted into the transcript before the model's next turn; None ends the episode. Must be a
        deterministic function of its arguments: the verifier calls it again on the claimed turns. A source that
        takes no turns ends every episode after the first."""
        return None

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        """The result of the model's call of tool `name` (one of `problem.tools`) with `arguments`, when it calls it
        in its chat template's format (rlfleet/tasks/tool_calls.py); ToolError, whose message the model is shown,
        for a call the tool refuses. Deterministic, as `respond`."""
        raise ToolError(f"there is no tool named {name!r}")


class ToolError(ValueError):
    """A tool call the tool refuses (unknown tool, arguments it cannot take): the model is answered with the
    message."""


class WrappedTask(TaskSource):
    """A source that is `inner` but for what a subclass overrides (a chat template, a tool): every method, and
    whether it takes turns, is the inner source's."""

    def __init__(self, inner: TaskSource):
        self.inner = inner
        self.multi_turn = inner.multi_turn

    def problem(self, task_id: str) -> Problem:
        return self.inner.problem(task_id)

    def sample_id(self, rng: np.random.Generator) -> str:
        return self.inner.sample_id(rng)

    def reward(self, problem: Problem, completion: str) -> float:
        return self.inner.reward(problem, completion)

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        return self.inner.rewards(problem, completions)

    def scores(self, problem: Problem, completions: list[str], completion_tokens: list[int]) -> list[float]:
        return self.inner.scores(problem, completions, completion_tokens)

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        return self.inner.respond(problem, turns)

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        return self.inner.call_tool(problem, name, arguments)

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        return self.inner.episode_text(problem, turns)

    def demonstration_turns(self, problem: Problem, rng: np.random.Generator, label_noise: float) -> list[str] | None:
        return self.inner.demonstration_turns(problem, rng, label_noise)

    def ids(self) -> list[str]:
        """The inner source's listed ids (a data set's), or none."""
        ids = getattr(self.inner, "ids", None)
        return ids() if ids else []


_INTEGER = re.compile(r"-?\d+")


def noisy_answer(answer: str, rng: np.random.Generator) -> str:
    """`answer` with its first integer (the numerator of a fraction) off by 1..9: a wrong answer, since a fraction's
    value changes with its numerator. The near miss of a warm start's demonstrations (rlfleet/models/warm_start.py)
    and of a source's `demonstration_turns`."""
    offset = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
    first = _INTEGER.search(answer)
    if first is None:
        raise ValueError(f"warm start: answer {answer!r} has no integer to make a near miss of")
    return answer[: first.start()] + str(int(first.group(0)) + offset) + answer[first.end() :]
