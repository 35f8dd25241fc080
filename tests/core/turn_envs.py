"""Multi-turn user environments for the tests (spec.task type python, `tests.core.turn_envs:NAME`), written in the
builtin tokenizer's characters (rlfleet/models/builtin.py CHARS)."""

from __future__ import annotations

import time

from rlfleet.tasks import Problem, TaskSource
from rlfleet.tasks.base import ToolError
from rlfleet.tasks.tool_calls import function_schema

KINDS = ("ok", "raise", "hang", "int")


class Counter(TaskSource):
    """Task ids `turns-{kind}-{n}`: prompt `{n}+1=`, answer n+1. The environment answers each model turn with
    `={the sum of its digits}=` (a stand-in for a tool's result: a function of what the model wrote) until the
    model's turn holds the answer; the reward is 1 when the transcript holds it. Kinds other than ok make `respond`
    raise, hang or answer an int."""

    multi_turn = True

    def __init__(self, kinds: str = "ok"):
        self.kinds = kinds.split(",")

    def problem(self, task_id: str) -> Problem:
        parts = task_id.split("-")
        if len(parts) != 3 or parts[0] != "turns" or parts[1] not in KINDS or not parts[2].isdigit():
            raise KeyError(f"task id {task_id!r} is not turns-<kind>-<n>")
        n = int(parts[2])
        return Problem(task_id=task_id, prompt=f"{n}+1=", answer=str(n + 1))

    def sample_id(self, rng) -> str:
        return f"turns-{self.kinds[int(rng.integers(len(self.kinds)))]}-{int(rng.integers(0, 50))}"

    def respond(self, problem: Problem, turns: list[str]):
        kind = problem.task_id.split("-")[1]
        if kind == "raise":
            raise RuntimeError("the tool is down")
        if kind == "hang":
            time.sleep(3600)
        if kind == "int":
            return len(turns)
        if problem.answer in turns[-1]:
            return None
        return f"={sum(int(c) for c in turns[-1] if c.isdigit())}="

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if problem.answer in completion.replace(" ", "") else 0.0


class Reverser(TaskSource):
    """Task ids `reverse-{text}`: the model may call the tool `reverse` (a user environment's own tool, in its chat
    template's format: rlfleet/tasks/tool_calls.py), which answers the reversed text, and is rewarded for writing
    the reversed text. Called on `down` the tool raises; on `int` it answers an int."""

    multi_turn = True
    SCHEMA = function_schema("reverse", "Reverses a text.", {"text": {"type": "string"}}, ["text"])

    def problem(self, task_id: str) -> Problem:
        text = task_id.removeprefix("reverse-")
        return Problem(task_id=task_id, prompt=f"Reverse {text}", answer=text[::-1], tools=(self.SCHEMA,))

    def sample_id(self, rng) -> str:
        return f"reverse-{''.join('abc'[int(k)] for k in rng.integers(0, 3, size=4))}"

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        if not isinstance(arguments.get("text"), str):
            raise ToolError('reverse takes a string in "text"')
        if arguments["text"] == "down":  # the tool itself fails: the environment's failure, not the model's error
            raise RuntimeError("the reverse service is down")
        if arguments["text"] == "int":
            return 3  # type: ignore[return-value]  (a tool that breaks the contract)
        return arguments["text"][::-1]

    def reward(self, problem: Problem, completion: str) -> float:
        return float(problem.answer in completion)
