"""The held-out problems of `spec.eval`: the run's task with another seed (arithmetic) or another
dataset (math, code), and which of its ids an evaluation scores."""

from __future__ import annotations

import numpy as np

from rlfleet.tasks import make_task
from rlfleet.tasks.base import TaskSource
from rlfleet.tasks.datasets import DatasetError, DatasetTask


def held_out_task(run_spec) -> TaskSource:
    """The task source of `run_spec.eval`; a DatasetError names `eval.dataset` (not the training dataset)."""
    ev, task = run_spec.eval, run_spec.task
    if task.type == "arithmetic":
        return make_task(task.model_copy(update={"seed": task.seed + 1 if ev.seed is None else ev.seed}))
    held_out = task.model_copy(update={"dataset": ev.dataset, "solve_rate_min": None, "solve_rate_max": None})
    try:
        return make_task(held_out)
    except DatasetError as exc:
        raise DatasetError(str(exc).replace("task.dataset", "eval.dataset", 1)) from None


def held_out_problems(run_spec) -> list[str]:
    """What keeps `run_spec.eval`'s problems from loading (a missing or unreadable eval.dataset, a row
    without the task's fields), as `spec.eval.…: message` lines; [] when they load or there is no eval."""
    if run_spec.eval is None:
        return []
    try:
        held_out_task(run_spec)
    except DatasetError as exc:
        return [f"spec.{exc}"]
    return []


def held_out_ids(task: TaskSource, count: int) -> list[str]:
    """The ids an evaluation scores, the same at every version: a dataset's first `count` rows, else the
    first `count` distinct ids of a fixed draw (an arithmetic seed's)."""
    if isinstance(task, DatasetTask):
        return task.ids()[:count]
    rng = np.random.default_rng(0)
    ids: dict[str, None] = {}
    for _ in range(20 * count):
        ids.setdefault(task.sample_id(rng))
        if len(ids) == count:
            break
    return list(ids)
