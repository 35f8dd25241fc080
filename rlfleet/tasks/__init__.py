"""Task sources, keyed by `spec.task.type` (base.py holds the seam every source implements).

A task source names problems by id, rebuilds any problem from its id, and scores a completion
with a trusted verifier. Each source module is imported only when a run asks for it. A mixture
(mixture.py) holds several sources; each source, and a single task, is wrapped for its chat template
(chat.py) and its length targets (length.py) as its spec asks.
"""

from __future__ import annotations

from rlfleet.tasks.base import Problem, TaskSource

__all__ = ["Problem", "TaskSource", "make_run_task", "make_task"]


def make_run_task(run_spec) -> TaskSource:
    """The run's task source: `spec.task`, wrapped with length targets when `spec.lengthPenalty` is set."""
    return _with_length(make_task(run_spec.task), run_spec.length_penalty)


def _with_length(task: TaskSource, lp) -> TaskSource:
    if lp is None:
        return task
    from rlfleet.tasks.length import LengthTargetTask

    return LengthTargetTask(task, lp.targets, lp.coef, lp.prompt_template)


def make_task(spec, field: str = "spec.task", isolate: bool = True) -> TaskSource:
    """Factory keyed by `spec.type`; `field` is where the spec sits (named in errors). `isolate=False` runs a user
    environment in this process (a builtin model's warm start: thousands of problems, no untrusted input)."""
    if spec.type == "mixture":
        from rlfleet.tasks.mixture import MixtureTask

        sources = []
        for i, source in enumerate(spec.mixture):
            task = make_task(source.task, f"{field}.mixture[{i}].task", isolate)
            sources.append((source.source_name, source.weight, _with_length(task, source.length_penalty)))
        return MixtureTask(sources)
    task = _make_single(spec, field, isolate)
    if spec.chat_template:
        from rlfleet.tasks.chat import ChatPromptTask

        task = ChatPromptTask(task, spec.system_prompt)
    return task


def _make_single(spec, field: str, isolate: bool) -> TaskSource:
    if spec.type == "arithmetic":
        from rlfleet.tasks.arithmetic import ArithmeticTask

        task = ArithmeticTask(seed=spec.seed, max_operand=spec.max_operand, operations=tuple(spec.operations))
        if "calculator" in spec.tools:
            from rlfleet.tasks.calculator import CalculatorTask

            return CalculatorTask(task)
        return task
    if spec.type == "math":
        from rlfleet.tasks.math import from_spec as math_task

        if "python" in spec.tools:
            from rlfleet.tasks.python_tool import PythonToolTask

            return PythonToolTask(math_task(spec))
        return math_task(spec)
    if spec.type == "code":
        from rlfleet.tasks.code import from_spec as code_task

        return code_task(spec)
    if spec.type == "python":
        from rlfleet.tasks.python_env import from_spec as python_task

        return python_task(spec, field, isolate)
    raise ValueError(f"{field}.type: unknown task type {spec.type!r}")
