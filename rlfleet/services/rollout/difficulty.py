"""`rlfleet filter FILE --out ROWS.jsonl`: record each dataset row's solve rate under the base model, so the
offline band (`spec.task.solveRateMin/Max`) works on any dataset, as INTELLECT-2 filtered its tasks.

For the dataset task of the RLRun in FILE (math or code), every row is sampled `k` times with the
run's base model (`spec.model`) and a rollout engine (torch, or vLLM with `--engine vllm`), at the
run's sampling settings unless overridden; each completion is scored with the task's own reward
(rlfleet/engines/solve.py). The rows are written to `--out` as JSONL, unchanged but for
the field `spec.task.solveRateField` (default `solve_rate`): the share of the k completions whose
reward is at least `--pass-reward`. Rows keep their order, so task ids (`{name}-{rowIndex}`) stay
the same; point `spec.task.dataset.path` at the output and set the band. The run's own band is
ignored here: every row is rated. The output is written to a temporary file and renamed into place,
so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlfleet.config import ConfigError, DatasetTaskFields, load_bundle
from rlfleet.tasks import make_task
from rlfleet.tasks.base import WrappedTask
from rlfleet.tasks.datasets import DatasetError, DatasetTask, load_rows
from rlfleet.wire.streams import SamplingParams


@dataclass(frozen=True)
class FilterOptions:
    file: str
    out: Path
    k: int = 8
    max_rows: int | None = None
    engine: str = "torch"
    temperature: float | None = None
    max_tokens: int | None = None
    pass_reward: float = 1.0
    seed: int = 0


def option_problems(o: FilterOptions) -> list[str]:
    problems = []
    if o.k < 1:
        problems.append(f"-k: {o.k} completions per row; sample at least 1 (8 or more for a useful rate)")
    if o.max_rows is not None and o.max_rows < 1:
        problems.append(f"--max-rows: {o.max_rows}; give at least 1, or leave it out for every row")
    if o.temperature is not None and not 0 < o.temperature <= 10:
        problems.append(f"--temperature: {o.temperature} is outside (0, 10]")
    if o.max_tokens is not None and o.max_tokens < 1:
        problems.append(f"--max-tokens: {o.max_tokens}; give at least 1")
    return problems


def write_jsonl(rows: list[dict], dest: Path) -> None:
    """`rows` as JSONL at `dest`, atomically (a temporary file in the same directory, renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rate_rows(o: FilterOptions, progress=None) -> dict:
    """Rate the rows (module docstring) and write them; returns a summary. Raises ConfigError on bad input."""
    problems = option_problems(o)
    if problems:
        raise ConfigError("rlfleet filter", problems)
    bundle = load_bundle(o.file)
    spec, task_spec = bundle.run.spec, bundle.run.spec.task
    if not isinstance(task_spec, DatasetTaskFields):
        raise ConfigError(o.file, [f"spec.task: type {task_spec.type} has no dataset rows to rate; `rlfleet filter` "
                                   "rates the rows of a math or code task's spec.task.dataset"])  # fmt: skip
    try:
        rows = load_rows(task_spec.dataset)
        task = make_task(task_spec.model_copy(update={"solve_rate_min": None, "solve_rate_max": None}))
    except DatasetError as exc:
        raise ConfigError(o.file, [f"spec.{exc}"]) from None
    # A dataset task, or one wrapped for its chat template or tools: either lists the rows' ids, every row (the band
    # is off here), in file order.
    assert isinstance(task, DatasetTask | WrappedTask)
    rows = rows[: o.max_rows] if o.max_rows else rows
    from rlfleet.engines import make_engine
    from rlfleet.engines.solve import score_problems
    from rlfleet.models.policy import configure_torch_threads
    from rlfleet.models.sources import resolve_model_path  # torch: imported once the input is known good

    configure_torch_threads()  # env RLFLEET_TORCH_THREADS, as the components
    model_dir = resolve_model_path(spec.model, spec.task, seed=spec.trainer.seed)
    pool = bundle.pools[0].spec.vllm if bundle.pools else None
    engine = make_engine(o.engine, model_dir, 0, spec.model.dtype, pool)
    s = spec.sampling
    params = SamplingParams(o.temperature or s.temperature, s.top_p, s.top_k, o.max_tokens or s.max_tokens, seed=o.seed)
    try:
        scores = score_problems(engine, task, task.ids()[: len(rows)], o.k, params, on_batch=progress)
    finally:
        engine.close()
    rates = scores.solve_rates(o.pass_reward)
    field = task_spec.solve_rate_field
    write_jsonl([{**row, field: rate} for row, rate in zip(rows, rates)], o.out)
    return {
        "rows": len(rows),
        "k": o.k,
        "field": field,
        "solve_rate_mean": sum(rates) / max(1, len(rates)),
        "never_solved": sum(r == 0 for r in rates),
        "always_solved": sum(r == 1 for r in rates),
        "out": str(o.out),
    }


def main(o: FilterOptions) -> int:
    def progress(done: int, total: int) -> None:
        print(f"rlfleet filter: {done}/{total} rows rated", file=sys.stderr)

    summary = rate_rows(o, progress)
    print(
        f"rlfleet filter: {summary['rows']} rows, {summary['k']} completions each: mean {summary['field']} "
        f"{summary['solve_rate_mean']:.3f}, {summary['never_solved']} never solved, {summary['always_solved']} always "
        f"solved; written to {summary['out']}"
    )
    return 0
