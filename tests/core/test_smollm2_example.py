"""The data of examples/smollm2 (make_data.py): what the script writes, two disjoint splits, every level in
each, and every reference answer scoring 1 through the math task that the example configures."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from rlfleet.config import load_bundle
from rlfleet.tasks.math import from_spec
from tests.support import REPO

EXAMPLE = REPO / "examples" / "smollm2"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / f"{name}.jsonl").read_text().splitlines()]


def test_the_data_is_what_make_data_writes():
    proc = subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_held_out_problems_are_never_trained_on_and_every_level_is_in_both_splits():
    train, held_out = rows("train"), rows("held-out")
    assert not {r["problem"] for r in train} & {r["problem"] for r in held_out}
    assert len({r["problem"] for r in train}) == len(train)
    assert set(Counter(r["level"] for r in train)) == set(Counter(r["level"] for r in held_out)) == {1, 2, 3, 4, 5}


def test_the_reference_answers_score_one_and_a_restated_wrong_sum_scores_zero(monkeypatch):
    monkeypatch.chdir(REPO)  # the example's dataset paths are relative to the repository
    task_spec = load_bundle(EXAMPLE / "rlrun.yaml").run.spec.task
    task = from_spec(task_spec)
    for task_id in task.ids()[:200]:
        problem = task.problem(task_id)
        question = problem.prompt.removeprefix("What is ").removesuffix("?")
        assert task.reward(problem, f"{question} = {problem.answer}") == 1.0, problem
        assert task.reward(problem, f"The answer is {problem.answer}.") == 1.0, problem
        assert task.reward(problem, f"{question} = {int(problem.answer) + 10}") == 0.0, problem
