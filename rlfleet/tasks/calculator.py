"""The calculator tool (`spec.task.tools: [calculator]` on the arithmetic task): the smallest agent task there is,
in the builtin tokenizer's characters, so a builtin model learns to use a tool on one CPU machine.

An episode (rlfleet/tasks/turns.py): the prompt is the problem (`37+48=`). A model turn that is an expression of
integers joined by + and - (`37+48`, no `=`) calls the calculator, which answers `={value}=` (`=85=`); any other
turn is the model's answer and ends the episode. Prompted through a chat template that renders tools, the problem
offers the calculator as a function (`SCHEMA`) and the model calls it in the template's format with `{"expression":
"37+48"}`, answered `85` as a tool message (rlfleet/tasks/tool_calls.py). The reward is the arithmetic task's exact
match on the model's last turn only (`episode_text`): the calculator's output is never the model's answer, so an
episode that calls the tool and stops there scores 0. Everything is a function of the turns, so the verifier asks
again and gets the same answers.

A builtin model warm-starts on episodes that call the tool with the problem's expression and then copy its
result (`demonstration_turns`); a near miss calls it with an operand off by 1..9 and copies that result, so the
warm-started policy sometimes calls the tool wrongly and RL teaches it to copy the problem exactly.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource, ToolError, WrappedTask, noisy_answer
from rlfleet.tasks.tool_calls import function_schema

TOOLS = ("calculator",)
# a call: integers joined by + or -; a leading minus allowed; at most 12 digits a number (no huge integers)
CALL = re.compile(r"-?\d{1,12}(?:[+-]\d{1,12})+")
SCHEMA = function_schema(
    "calculator",
    "Adds and subtracts integers and returns the value.",
    {"expression": {"type": "string", "description": "integers joined by + and -, such as 37+48"}},
    ["expression"],
)


def calculate(call: str) -> int | None:
    """The value of a calculator call, or None when `call` is not one (module docstring)."""
    call = call.replace(" ", "")
    if not CALL.fullmatch(call):
        return None
    return sum(int(term) for term in re.findall(r"[+-]?\d+", call))


class CalculatorTask(WrappedTask):
    """`inner` (the arithmetic task) with the calculator: see the module docstring."""

    def __init__(self, inner: TaskSource):
        super().__init__(inner)
        self.multi_turn = True

    def problem(self, task_id: str) -> Problem:
        return replace(self.inner.problem(task_id), tools=(SCHEMA,))

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        value = calculate(turns[-1])
        return None if value is None else f"={value}="

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        expression = arguments.get("expression")
        value = calculate(expression) if name == "calculator" and isinstance(expression, str) else None
        if value is None:
            raise ToolError(f"calculator takes an expression of integers joined by + and -, not {arguments}")
        return str(value)

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        return turns[-1]  # the model's answer; the calculator's outputs before it are not

    def demonstration_turns(self, problem: Problem, rng: np.random.Generator, label_noise: float) -> list[str]:
        call = problem.prompt.rstrip("=")
        if rng.random() < label_noise:
            call = noisy_answer(call, rng)
        result = self.respond(problem, [call])
        assert result is not None, f"{problem.prompt!r} is not a calculator call"
        return [call, result, str(calculate(call))]
