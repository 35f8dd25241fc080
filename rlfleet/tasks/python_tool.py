"""The Python tool (`spec.task.tools: [python]` on the math task): the model runs code in its turns.

An episode (rlfleet/tasks/turns.py): a model turn holding a fenced ```python block calls the tool with its last
such block; the program runs in the code task's sandbox (rlfleet/tasks/code.py `run_program`: its own temporary
directory, no network, limits on memory, output, processes and time, a minimal environment) and the environment
answers with what it printed, as a fenced block:

    ```output
    42
    ```

(the first OUTPUT_CHARS characters of its stdout, then `... (N more characters)`; `(exit code N)` after a
program that failed, `(timed out after S s)` for one the limit stopped; stderr is not shown: tracebacks name
temporary paths, which differ from run to run). A turn without a block is the model's answer and ends the
episode, and the reward is the math task's on the model's last turn only (`episode_text`), never on a program's
output. Prompted through a chat template that renders tools, the problem offers `python` as a function (`SCHEMA`):
the model calls it in the template's format with `{"code": "..."}` and is answered with the same output, unfenced,
as a tool message (rlfleet/tasks/tool_calls.py).

The verifier runs every program again (turns.check_transcript) and requires the same answer, so a program's
output must be a function of its text: the tool seeds `random` (and the sandbox fixes PYTHONHASHSEED) before the
program runs. What it cannot fix is a program that reads the clock or finishes near the time limit on one
machine and past it on another: its group fails the transcript check as a forged result would
(docs/environments.md, "Tools").
"""

from __future__ import annotations

import re
from dataclasses import replace

from rlfleet.tasks.base import Problem, TaskSource, ToolError, WrappedTask
from rlfleet.tasks.code import Limits, resolve_isolation, run_program
from rlfleet.tasks.tool_calls import function_schema

CALL = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
SCHEMA = function_schema(
    "python",
    "Runs a Python program in a sandbox (no network, limited time and memory) and returns what it printed.",
    {"code": {"type": "string", "description": "the program; print what you want to see"}},
    ["code"],
)
OUTPUT_CHARS = 1024  # of a program's stdout shown to the model
# Run before the program: a seeded `random`, so a program that draws answers the verifier as it did the worker.
PRELUDE = "import random as _rlfleet_random\n_rlfleet_random.seed(0)\ndel _rlfleet_random\n"


def tool_output(program: str, limits: Limits, isolation: str) -> str:
    """The environment's answer to a call of `program` in the plain format (module docstring)."""
    return f"```output\n{program_output(program, limits, isolation)}\n```\n"


def program_output(program: str, limits: Limits, isolation: str) -> str:
    """What `program` printed, cut and annotated (module docstring), without the fence."""
    result, _ = run_program(PRELUDE + program, limits=limits, isolation=isolation)
    out = result.stdout
    if len(out) > OUTPUT_CHARS:
        out = f"{out[:OUTPUT_CHARS]}... ({len(out) - OUTPUT_CHARS} more characters)"
    lines = [out.rstrip("\n")] if out.strip("\n") else []
    if result.timed_out:
        lines.append(f"(timed out after {limits.timeout_seconds:g} s)")
    elif result.returncode:
        lines.append(f"(exit code {result.returncode})")
    return "\n".join(lines)


class PythonToolTask(WrappedTask):
    """`inner` (the math task) with a Python interpreter: see the module docstring."""

    def __init__(self, inner: TaskSource, limits: Limits = Limits(), isolation: str = "auto"):
        super().__init__(inner)
        self.multi_turn = True
        self.limits, self.isolation = limits, resolve_isolation(isolation)

    def problem(self, task_id: str) -> Problem:
        return replace(self.inner.problem(task_id), tools=(SCHEMA,))

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        blocks = CALL.findall(turns[-1])
        return tool_output(blocks[-1], self.limits, self.isolation) if blocks else None

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        code = arguments.get("code")
        if name != "python" or not isinstance(code, str):
            raise ToolError(f'python takes the program as a string in "code", not {sorted(arguments)}')
        return program_output(code, self.limits, self.isolation)

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        return turns[-1]  # the model's answer; a program's output before it is not
