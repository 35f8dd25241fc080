"""Task sources, keyed by `spec.task.type` (base.py holds the seam every source implements).

A task source names problems by id, rebuilds any problem from its id, and scores a completion
with a trusted verifier. Each source module is imported only when a run asks for it.
"""

from __future__ import annotations

from rlfleet.tasks.base import Problem, TaskSource

__all__ = ["Problem", "TaskSource", "make_run_task", "make_task"]


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
        from rlfleet.tasks.math import from_spec as math_task

        return math_task(spec)
    if spec.type == "code":
        from rlfleet.tasks.code import from_spec as code_task

        return code_task(spec)
    raise ValueError(f"task.type: unknown task type {spec.type!r}")
