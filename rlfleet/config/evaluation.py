"""Held-out evaluation of the policy (`spec.eval`), run by the trainer (rlfleet/services/trainer/evaluation.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlfleet.config.base import Spec
from rlfleet.config.tasks import DatasetSpec


class EvalSpec(Spec):
    every: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Evaluate every this many policy versions; the base model (version 0) and the last version are "
        "always evaluated.",
    )
    seed: int | None = Field(
        default=None,
        description="Arithmetic tasks: the held-out problems are those of this seed (task ids `arith-{seed}-{i}`). "
        "Default: task.seed + 1.",
    )
    dataset: DatasetSpec | None = Field(
        default=None,
        description="Dataset tasks (math, code): the held-out rows, read with the run's task settings (prompt "
        "template, fields; no solve-rate band). Required for them.",
    )
    max_problems: int = Field(
        default=100,
        ge=1,
        le=1_000_000,
        description="Problems per evaluation: the first rows of the held-out dataset, or the first ids of the "
        "held-out seed.",
    )
    mode: Literal["greedy", "sampled"] = Field(
        default="greedy",
        description="`greedy`: one most-likely completion per problem (pass@1). `sampled`: k completions at "
        "`temperature` (pass@k: a problem counts as solved when any of them passes).",
    )
    k: int = Field(default=1, ge=1, le=1024, description="Completions per problem (mode: sampled; greedy takes 1).")
    temperature: float | None = Field(
        default=None,
        gt=0.0,
        le=10.0,
        description="Sampling temperature of mode: sampled. Default: sampling.temperature.",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=32768, description="Completion tokens per problem. Default: sampling.maxTokens."
    )
    pass_reward: float = Field(
        default=1.0,
        description="A completion passes when its reward is at least this (1.0: right, for the binary "
        "rewards).",  # fmt: skip
    )

    @model_validator(mode="after")
    def _greedy_is_one(self) -> EvalSpec:
        if self.mode == "greedy" and self.k != 1:
            raise ValueError(
                f"k: greedy decoding gives one completion per problem, not {self.k}; set mode: sampled for pass@k"
            )
        if self.mode == "greedy" and self.temperature is not None:
            raise ValueError("temperature: greedy decoding takes no temperature; set mode: sampled or remove it")
        return self


def eval_problems(spec) -> list[str]:
    """What `spec.eval` (an RLRunSpec's) asks of its task, as `eval.field: message` lines."""
    ev, task = spec.eval, spec.task
    if ev is None:
        return []
    kind = getattr(task, "type", None)
    if kind == "arithmetic":
        problems = []
        if ev.dataset is not None:
            problems.append("eval.dataset: an arithmetic task is held out by seed; use eval.seed instead")
        if ev.seed is not None and ev.seed == task.seed:
            problems.append(
                f"eval.seed: {ev.seed} is the training seed (task.seed), so the held-out problems would be the "
                "training ones; choose another seed"
            )
        return problems
    if ev.seed is not None:
        return [f"eval.seed: a {kind} task is held out by rows; give eval.dataset instead"]
    if ev.dataset is None:
        return [f"eval.dataset: required for task type {kind}: the held-out rows (a file other than task.dataset)"]
    if ev.dataset.path == task.dataset.path:
        return [
            f"eval.dataset.path: {ev.dataset.path!r} is the training dataset (task.dataset.path); held-out rows "
            "must be other rows"
        ]
    return []
