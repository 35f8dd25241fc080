"""`rlfleet filter` (rlfleet/services/rollout/difficulty.py): the rows of builtin://tiny-math rated by the
builtin tiny-math model with the torch engine, the output usable by the offline band, and bad input
refused with the field named and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfleet.config import ConfigError, DatasetSpec, MathTaskSpec
from rlfleet.services.rollout.difficulty import FilterOptions, rate_rows
from rlfleet.tasks import make_task
from rlfleet.tasks.datasets import read_rows
from tests.support import REPO

MATH_EXAMPLE = REPO / "examples" / "math" / "rlrun.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_filter_writes_each_rows_solve_rate_and_the_band_then_selects_by_it(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "rated.jsonl"
    summary = rate_rows(FilterOptions(file=str(MATH_EXAMPLE), out=out, k=4, max_rows=24))
    source = read_rows("builtin://tiny-math")[:24]
    rated = read_rows(str(out))
    assert [{k: v for k, v in r.items() if k != "solve_rate"} for r in rated] == source, "rows unchanged, in order"
    rates = [r["solve_rate"] for r in rated]
    assert set(rates) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert 0.0 < summary["solve_rate_mean"] < 1.0 and len(set(rates)) > 1, "the warm-started model solves some"
    assert summary["solve_rate_mean"] == pytest.approx(sum(rates) / 24)
    assert rate_rows(FilterOptions(file=str(MATH_EXAMPLE), out=tmp_path / "again.jsonl", k=4, max_rows=24))
    assert read_rows(str(tmp_path / "again.jsonl")) == rated, "seeded: the same rates again"
    band = {"solve_rate_min": 0.25, "solve_rate_max": 0.75}
    task = make_task(MathTaskSpec(type="math", dataset=DatasetSpec(path=str(out)), prompt_template="{problem}", **band))
    assert len(task) == sum(0.25 <= r <= 0.75 for r in rates), "the offline band keeps the rows within it"


def run_filter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "filter", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "RLFLEET_TORCH_THREADS": "1"},
    )


def test_the_command_line_refuses_bad_input_naming_it_and_writes_nothing(tmp_path):
    out = tmp_path / "rated.jsonl"
    proc = run_filter(str(MATH_EXAMPLE), "--out", str(out), "-k", "0")
    assert proc.returncode == 2 and "-k: 0 completions per row; sample at least 1" in proc.stderr
    proc = run_filter(str(REPO / "examples" / "arithmetic" / "rlrun.yaml"), "--out", str(out))
    assert proc.returncode == 2 and "spec.task: type arithmetic has no dataset rows to rate" in proc.stderr
    missing = tmp_path / "rlrun.yaml"
    missing.write_text(MATH_EXAMPLE.read_text().replace("builtin://tiny-math     #", f"{tmp_path / 'no.jsonl'} #"))
    proc = run_filter(str(missing), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert f"spec.task.dataset.path: cannot read '{tmp_path / 'no.jsonl'}'" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_rows": 0}, "--max-rows: 0; give at least 1, or leave it out for every row"),
        ({"temperature": 0.0}, "--temperature: 0.0 is outside (0, 10]"),
        ({"max_tokens": 0}, "--max-tokens: 0; give at least 1"),
    ],
)
def test_bad_options_are_errors_naming_the_option(tmp_path, options, message):
    with pytest.raises(ConfigError) as err:
        rate_rows(FilterOptions(file=str(MATH_EXAMPLE), out=tmp_path / "x.jsonl", **options))
    assert err.value.problems == [message]
    assert not (tmp_path / "x.jsonl").exists()


def test_the_output_is_json_lines(tmp_path):
    out = tmp_path / "sub" / "rated.jsonl"
    proc = run_filter(str(MATH_EXAMPLE), "--out", str(out), "-k", "2", "--max-rows", "3")
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and all("solve_rate" in json.loads(line) for line in lines)
    assert "3 rows, 2 completions each" in proc.stdout
