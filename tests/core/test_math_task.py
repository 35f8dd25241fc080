"""Math task: answer extraction, equivalence, the sample dataset and the config factory."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rlfleet.config import MathTaskSpec
from rlfleet.tasks import make_task
from rlfleet.tasks.math import MathTask, answers_match, extract_answer, math_reward

SAMPLE = "data/samples/math.jsonl"


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("so the result is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # last box, nested braces
        ("\\boxed{{{1}}}", "{{1}}"),
        ("The answer is 3/4.", "3/4."),
        ("**Final answer:** 12", "12"),
        ("we get 3 apples, then 5, so 8 in total", "8"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "given,reference",
    [
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{1}{2}", "1/2"),
        ("\\frac12", "0.5"),
        ("$\\frac{3}{4}$.", "3/4"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("12 cm", "12"),
        ("5\\text{ cm}", "5"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("\\$4.50", "4.5"),
        ("x = 3", "3"),
        ("\\left(1, 1\\right)", "(1,1)"),
        ("-\\frac{3}{4}", "-0.75"),
        ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"),
        ("9\\pi", "9 \\pi"),
        ("2x+2", "2(x+1)"),
        ("x^2+2x+1", "(x+1)^2"),
        ("2^{10}", "1024"),
        ("\\text{yes}", "yes"),
    ],
)
def test_equivalent_answers_match(given, reference):
    assert answers_match(given, reference)


@pytest.mark.parametrize(
    "given,reference",
    [
        ("4", "3/4"),
        ("0.333", "1/3"),
        ("x+1", "x+2"),
        ("(2,3)", "(3,2)"),
        ("1,2", "12"),
        ("1/0", "1"),
        ("\\sqrt{3}", "\\sqrt{2}"),
        ("", "1"),
        ("no", "yes"),
    ],
)
def test_different_answers_do_not_match(given, reference):
    assert not answers_match(given, reference)


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "e.n",
        "9^9^9^9^9",
        "2^{2^{100}}",
        "x" * 5000,
        "lambda: 1",
        "().__class__",
        "1/(2",
        "{}1",  # an unclosed bracket; an empty tuple times 1 (both crashed a rollout worker's reward)
    ],
)
def test_hostile_answers_score_zero_quickly_and_run_nothing(hostile):
    start = time.monotonic()
    assert math_reward(f"\\boxed{{{hostile}}}", "1") == 0.0
    assert time.monotonic() - start < 2.0


def _task(**kw) -> MathTask:
    spec = MathTaskSpec.model_validate({"type": "math", "dataset": {"path": SAMPLE}, **kw})
    task = make_task(spec)
    assert isinstance(task, MathTask)
    return task


def test_sample_dataset_reference_answers_score_one_and_wrong_ones_zero():
    task = _task()
    assert len(task) == 30 and task.stats.kept == 30
    for task_id in task.ids():
        p = task.problem(task_id)
        assert p.task_id == task_id and p.prompt.endswith("\\boxed{}.")
        assert task.reward(p, f"Reasoning... so the answer is \\boxed{{{p.answer}}}") == 1.0, p
        assert task.reward(p, "\\boxed{7777}") == 0.0, p


def test_problem_is_rebuilt_from_its_id_by_a_fresh_task():
    task, fresh = _task(promptTemplate="Q: {problem}\nA:"), _task(promptTemplate="Q: {problem}\nA:")
    rng = np.random.default_rng(0)
    ids = [task.sample_id(rng) for _ in range(50)]
    assert all(i.startswith("math-") for i in ids) and len(set(ids)) > 10
    for task_id in ids:
        assert fresh.problem(task_id) == task.problem(task_id)
    assert task.problem("math-0").prompt == "Q: What is 17 + 25?\nA:" and task.problem("math-0").answer == "42"
    with pytest.raises(KeyError):
        task.problem("math-30")
    with pytest.raises(KeyError):
        task.problem("other-0")
