"""Datasets: JSONL and Parquet, local and on a real S3 endpoint; ids, templates, solve-rate filter, errors."""

from __future__ import annotations

import json

import boto3
import numpy as np
import pytest

from rlfleet.config import ConfigError, MathTaskSpec, parse_bundle
from rlfleet.tasks import make_task
from rlfleet.tasks.datasets import DatasetError, filter_by_solve_rate, read_rows
from rlfleet.tasks.math import MathTask
from tests.runs import bundle_yaml, rlrun

JSONL, PARQUET = "data/samples/math.jsonl", "data/samples/math.parquet"


def test_jsonl_and_parquet_samples_hold_the_same_rows():
    rows = read_rows(JSONL)
    assert len(rows) == 30 and set(rows[0]) == {"problem", "answer", "solve_rate"}
    assert read_rows(PARQUET) == rows
    assert read_rows(PARQUET, "parquet") == rows


def test_rows_from_s3(s3_env, monkeypatch):
    s3 = boto3.client("s3", endpoint_url=s3_env)
    s3.create_bucket(Bucket="tasks")
    with open(PARQUET, "rb") as f:
        s3.put_object(Bucket="tasks", Key="math/train.parquet", Body=f.read())
    assert read_rows("s3://tasks/math/train.parquet", endpoint_url=s3_env) == read_rows(JSONL)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env)  # endpoint from the environment
    spec = MathTaskSpec.model_validate({"type": "math", "dataset": {"path": "s3://tasks/math/train.parquet"}})
    task = make_task(spec)
    assert task.problem("train-0").answer == "42"  # the name is the file stem
    with pytest.raises(DatasetError, match=r"task.dataset.path: .*NoSuchKey"):
        read_rows("s3://tasks/missing.jsonl", endpoint_url=s3_env)


def test_builtin_sets_ship_in_the_package_and_need_no_working_directory(tmp_path, monkeypatch):
    """`builtin://tiny-math` reads the set shipped inside rlfleet, so a pod (any working directory) has it."""
    from tests.support import REPO

    monkeypatch.chdir(tmp_path)
    rows = read_rows("builtin://tiny-math")
    shipped = REPO / "rlfleet" / "tasks" / "samples" / "tiny-math.jsonl"
    assert rows == [json.loads(line) for line in shipped.read_text().splitlines() if line.strip()]
    spec = MathTaskSpec(type="math", dataset={"path": "builtin://tiny-math"})
    assert spec.dataset.format == "auto" and make_task(spec).problem("tiny-math-0").prompt
    with pytest.raises(
        DatasetError, match=r"task.dataset.path: unknown builtin data set 'nope'; known: \['tiny-code', 'tiny-math'\]"
    ):
        read_rows("builtin://nope")


def test_solve_rate_band_keeps_and_counts(tmp_path):
    rows = [{"problem": "p", "answer": "1", "solve_rate": r} for r in (0.0, 0.1, 0.5, 0.8, 0.81, 1.0)]
    rows.append({"problem": "p", "answer": "1"})
    kept, stats = filter_by_solve_rate(rows, 0.1, 0.8)
    assert kept == [1, 2, 3]
    assert (stats.total, stats.kept, stats.dropped_out_of_band, stats.dropped_no_solve_rate) == (7, 3, 3, 1)
    assert filter_by_solve_rate(rows, None, None)[0] == list(range(7))
    task = MathTask(rows, "t", "{problem}", solve_rate_min=0.1, solve_rate_max=0.8)
    assert task.ids() == ["t-1", "t-2", "t-3"]  # ids keep the file's row index
    assert {task.sample_id(np.random.default_rng(s)) for s in range(40)} == {"t-1", "t-2", "t-3"}
    with pytest.raises(KeyError):
        task.problem("t-0")  # dropped rows are not this source's problems
    with pytest.raises(DatasetError, match="solveRateMin"):
        MathTask(rows, "t", "{problem}", solve_rate_min=0.9, solve_rate_max=0.95)


def test_row_ids_and_templates(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "alpha", "question": "1+1", "answer": "2", "level": 1},
                {"question": "2+2", "answer": "4", "level": 2},
            ]
        )
        + "\n"
    )
    task = MathTask(read_rows(str(path)), "d", "[{level}] {question} = {{?}}")
    assert task.ids() == ["alpha", "d-1"]
    assert task.problem("alpha").prompt == "[1] 1+1 = {?}"
    with pytest.raises(DatasetError, match=r"promptTemplate|no field problem"):
        MathTask(read_rows(str(path)), "d", "{problem}")
    with pytest.raises(DatasetError, match="promptTemplate"):
        MathTask(read_rows(str(path)), "d", "{question")


def test_bad_path_and_format_errors_name_the_field(tmp_path):
    with pytest.raises(DatasetError, match=r"^task.dataset.path: .*nope.jsonl"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match=r"^task.dataset.format: .*data.csv"):
        read_rows(str(tmp_path / "data.csv"))
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DatasetError, match=r"task.dataset.path: .*line 2"):
        read_rows(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DatasetError, match=r"task.dataset.path: .*not a readable Parquet"):
        read_rows(JSONL, "parquet")


def task_run(**task) -> str:
    """A run of the builtin model on the task `task` (its fields by their YAML names)."""
    return bundle_yaml(rlrun("m", task=task))


def test_config_shapes_and_errors():
    bundle = parse_bundle(
        task_run(
            type="math",
            dataset={"path": "data/samples/math.jsonl", "format": "auto"},
            promptTemplate="Q: {problem}",
            solveRateMin=0.1,
            solveRateMax=0.8,
        )
    )
    task = make_task(bundle.run.spec.task)
    assert 0 < task.stats.kept < 30 and task.stats.kept + task.stats.dropped_out_of_band == 30
    code = parse_bundle(
        task_run(type="code", dataset={"path": "data/samples/code.jsonl"}, timeoutSeconds=5, memoryMb=512)
    )
    assert code.run.spec.task.timeout_seconds == 5 and code.run.spec.task.network_isolation == "auto"
    for task, field in [
        ({"type": "math", "dataset": {"path": "data/x.csv"}}, "spec.task.dataset"),
        ({"type": "math", "dataset": {"path": "a.jsonl", "format": "csv"}}, "spec.task.dataset.format"),
        ({"type": "math", "dataset": {"path": "a.jsonl"}, "solveRateMin": 1.5}, "spec.task.solveRateMin"),
        ({"type": "math", "dataset": {"path": "a.jsonl"}, "solveRateMin": 0.9, "solveRateMax": 0.1}, "spec.task"),
        ({"type": "code", "dataset": {"path": "a.jsonl"}, "timeoutSeconds": 0}, "spec.task.timeoutSeconds"),
        ({"type": "math"}, "spec.task.dataset"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_bundle(task_run(**task))
        assert any(p.startswith(f"document 0 (RLRun m): {field}") for p in err.value.problems), err.value.problems


def test_every_new_field_is_described():
    from rlfleet.config import CodeTaskSpec, DatasetSpec

    for model in (MathTaskSpec, CodeTaskSpec, DatasetSpec):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
