"""Dataset-backed task sources: rows from a JSONL or Parquet file, local or on S3.

A row's task id is its own `id` field, else `{name}-{row_index}` (the index in the file, before any
filtering), so any process that loads the same file rebuilds the same problem from the id alone; the
verifier loads the dataset itself and never trusts a worker's prompt. `sample_id` draws a kept row.
Offline difficulty filtering keeps rows whose recorded solve rate lies in [solveRateMin, solveRateMax];
rows without one are dropped when a band is set; `stats` counts what was kept and dropped.

A path is a local file, `s3://bucket/key`, or `builtin://NAME`: a sample set shipped inside the rlfleet
package (rlfleet/tasks/samples/NAME.jsonl), so it is in every image and needs no mount or bucket.

Libraries: pyarrow reads Parquet, boto3 reads `s3://` (endpoint from the spec, else AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import io
import json
import os
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
BUILTIN_PREFIX = "builtin://"
SAMPLES = "samples"  # the package folder (rlfleet/tasks/samples) of the builtin:// sets, all JSONL


def builtin_datasets() -> list[str]:
    """Names of the sample sets `builtin://NAME` reads."""
    from importlib import resources

    return sorted(p.name[: -len(".jsonl")] for p in resources.files(__package__).joinpath(SAMPLES).iterdir())


class DatasetError(ValueError):
    """A dataset that cannot be used; the message starts with the config field to fix."""


def resolve_format(path: str, fmt: str = "auto", field: str = "task.dataset") -> str:
    """`jsonl` or `parquet`: `fmt` itself, or guessed from the extension of `path` when `fmt` is auto."""
    if fmt in ("jsonl", "parquet"):
        return fmt
    if fmt != "auto":
        raise DatasetError(f"{field}.format: {fmt!r} is not one of auto, jsonl, parquet")
    if path.startswith(BUILTIN_PREFIX):
        return "jsonl"
    suffix = Path(path.split("?", 1)[0]).suffix.lower()
    if suffix not in FORMATS:
        raise DatasetError(
            f"{field}.format: cannot tell the format of {path!r} from its extension "
            f"(known: {', '.join(FORMATS)}); set format: jsonl or parquet"
        )
    return FORMATS[suffix]


def _read_bytes(path: str, endpoint_url: str | None, field: str) -> bytes:
    if path.startswith(BUILTIN_PREFIX):
        from importlib import resources

        name = path[len(BUILTIN_PREFIX) :]
        if name not in builtin_datasets():
            raise DatasetError(f"{field}.path: unknown builtin data set {name!r}; known: {builtin_datasets()}")
        return resources.files(__package__).joinpath(SAMPLES, f"{name}.jsonl").read_bytes()
    if path.startswith("s3://"):
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, _, key = path[len("s3://") :].partition("/")
        if not bucket or not key:
            raise DatasetError(f"{field}.path: {path!r} must be s3://bucket/key")
        client = boto3.client("s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None)
        try:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "?")
            raise DatasetError(f"{field}.path: cannot read {path!r} ({code}): {exc}") from None
        except BotoCoreError as exc:
            raise DatasetError(
                f"{field}.path: cannot read {path!r}: {exc} (check {field}.endpointUrl or AWS_ENDPOINT_URL)"
            ) from None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DatasetError(
            f"{field}.path: cannot read {path!r}: {exc.strerror} (relative paths are "
            f"resolved against the working directory {os.getcwd()!r})"
        ) from None


def read_rows(path: str, fmt: str = "auto", endpoint_url: str | None = None, field: str = "task.dataset") -> list[dict]:
    """Every row of a JSONL or Parquet file at a local path or s3:// URL, as dicts, in file order."""
    fmt = resolve_format(path, fmt, field)
    data = _read_bytes(path, endpoint_url, field)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(
                f"{field}.path: {path!r} is not a readable Parquet file ({exc}); check {field}.format"
            ) from None
    rows = []
    for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{field}.path: {path!r} line {lineno} is not JSON ({exc.msg}); check {field}.format"
            ) from None
        if not isinstance(row, dict):
            raise DatasetError(f"{field}.path: {path!r} line {lineno} is not a JSON object")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class DatasetStats:
    total: int
    kept: int
    dropped_out_of_band: int  # solve rate outside [min, max]
    dropped_no_solve_rate: int  # a band is set but the row records no solve rate


def filter_by_solve_rate(
    rows: list[dict], low: float | None, high: float | None, field: str = "solve_rate"
) -> tuple[list[int], DatasetStats]:
    """Indices of the rows with low <= row[field] <= high (all rows when no band is set), and the counts."""
    if low is None and high is None:
        return list(range(len(rows))), DatasetStats(len(rows), len(rows), 0, 0)
    lo, hi = (0.0 if low is None else low), (1.0 if high is None else high)
    kept, out, missing = [], 0, 0
    for i, row in enumerate(rows):
        rate = row.get(field)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate != rate:
            missing += 1
        elif lo <= rate <= hi:
            kept.append(i)
        else:
            out += 1
    return kept, DatasetStats(len(rows), len(kept), out, missing)


class DatasetTask(TaskSource):
    """Rows -> problems; subclasses give `answer(row)` and `reward`."""

    required_fields: tuple[str, ...] = ()
    reference_field: str | None = None  # a row field holding a known-good completion (Problem.reference), if any

    def __init__(
        self,
        rows: list[dict],
        name: str,
        prompt_template: str,
        solve_rate_min: float | None = None,
        solve_rate_max: float | None = None,
        solve_rate_field: str = "solve_rate",
        field: str = "task",
    ):
        self.name = name
        self.prompt_template = prompt_template
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(prompt_template) if f is not None}
        except ValueError as exc:
            raise DatasetError(f"{field}.promptTemplate: {exc} (write a literal brace as {{{{ or }}}})") from None
        if "" in names or any(not n.isidentifier() for n in names):
            raise DatasetError(f"{field}.promptTemplate: placeholders must name row fields, e.g. {{problem}}")
        needed = names | set(self.required_fields)
        for i, row in enumerate(rows):
            missing = sorted(needed - row.keys())
            if missing:
                raise DatasetError(
                    f"{field}.dataset: row {i} has no field {', '.join(missing)} "
                    f"(needed by {field}.promptTemplate or the task type); it has {', '.join(sorted(row))}"
                )
        kept, self.stats = filter_by_solve_rate(rows, solve_rate_min, solve_rate_max, solve_rate_field)
        if not kept:
            raise DatasetError(
                f"{field}.solveRateMin/solveRateMax: no row of {len(rows)} has a `{solve_rate_field}` "
                f"in [{solve_rate_min}, {solve_rate_max}] ({self.stats})"
            )
        self._rows: dict[str, dict] = {}
        self._ids: list[str] = []
        all_ids = set()
        for i, row in enumerate(rows):
            task_id = str(row["id"]) if row.get("id") not in (None, "") else f"{name}-{i}"
            if task_id in all_ids:
                raise DatasetError(f"{field}.dataset: task id {task_id!r} occurs twice (row {i}); ids must be unique")
            all_ids.add(task_id)
        for i in kept:
            row = rows[i]
            task_id = str(row["id"]) if row.get("id") not in (None, "") else f"{name}-{i}"
            self._rows[task_id] = row
            self._ids.append(task_id)

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self) -> list[str]:
        return list(self._ids)

    def answer(self, row: dict) -> str:
        raise NotImplementedError

    def problem(self, task_id: str) -> Problem:
        row = self._rows.get(task_id)
        if row is None:
            raise KeyError(f"task id {task_id!r} is not a kept row of dataset {self.name!r}")
        prompt = self.prompt_template.format(**{k: ("" if v is None else v) for k, v in row.items()})
        reference = row.get(self.reference_field) if self.reference_field else None
        return Problem(
            task_id=task_id,
            prompt=prompt,
            answer=self.answer(row),
            reference=reference if isinstance(reference, str) else None,
        )

    def sample_id(self, rng: np.random.Generator) -> str:
        return self._ids[int(rng.integers(0, len(self._ids)))]


def dataset_name(spec) -> str:
    """The task-id prefix: the spec's `name`, else the file's stem (`data/math.jsonl` -> `math`)."""
    if spec.name:
        return spec.name
    stem = Path(spec.path.split("?", 1)[0]).name.split(".", 1)[0]
    return stem or "dataset"


def load_rows(spec, field: str = "task.dataset") -> list[dict]:
    """Rows of a DatasetSpec (config.DatasetSpec)."""
    return read_rows(spec.path, spec.format, spec.endpoint_url, field)
