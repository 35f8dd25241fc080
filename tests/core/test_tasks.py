"""Tasks (rlfleet/tasks) and the builtin character tokenizer."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

from rlfleet.config import ArithmeticTaskSpec
from rlfleet.models.builtin import build_tokenizer
from rlfleet.tasks import make_task
from rlfleet.tasks.arithmetic import ArithmeticTask

PROMPT = re.compile(r"^(\d+)([+-])(\d+)=$")


def _parts(prompt: str) -> tuple[int, str, int]:
    m = PROMPT.match(prompt)
    assert m, prompt
    return int(m.group(1)), m.group(2), int(m.group(3))


def test_problem_is_rebuilt_from_its_id_by_a_fresh_instance():
    task = ArithmeticTask(seed=3, max_operand=50, operations=("+", "-"))
    rng = np.random.default_rng(0)
    ids = [task.sample_id(rng) for _ in range(20)]
    assert len(set(ids)) == 20
    fresh = ArithmeticTask(seed=3, max_operand=50, operations=("+", "-"))
    for task_id in ids:
        assert fresh.problem(task_id) == task.problem(task_id)
        assert fresh.problem(task_id).task_id == task_id
    # Different ids give different problems (not one fixed prompt).
    assert len({task.problem(i).prompt for i in ids}) > 10


def test_sample_id_is_deterministic_in_the_rng():
    task = ArithmeticTask(seed=1)
    a = [task.sample_id(np.random.default_rng(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    assert task.sample_id(np.random.default_rng(8)) != a[0]


@pytest.mark.parametrize(
    "task_id", ["arith-4-12", "arith-33-12", "arith-3-", "arith-3-x1", "arith-3--5", "other-3-1", ""]
)
def test_ids_of_other_seeds_or_malformed_are_rejected(task_id):
    with pytest.raises(KeyError):
        ArithmeticTask(seed=3).problem(task_id)


def test_id_of_one_seed_is_rejected_by_another():
    task_id = ArithmeticTask(seed=1).sample_id(np.random.default_rng(0))
    ArithmeticTask(seed=1).problem(task_id)
    with pytest.raises(KeyError):
        ArithmeticTask(seed=11).problem(task_id)
    with pytest.raises(KeyError):
        ArithmeticTask(seed=2).problem(task_id)


def test_answer_is_the_arithmetic_result():
    task = ArithmeticTask(seed=0, max_operand=30, operations=("+", "-"))
    rng = np.random.default_rng(1)
    ops = set()
    for _ in range(100):
        p = task.problem(task.sample_id(rng))
        a, op, b = _parts(p.prompt)
        ops.add(op)
        assert int(p.answer) == (a + b if op == "+" else a - b)
    assert ops == {"+", "-"}


def test_reward_is_exact_match():
    task = ArithmeticTask(seed=0, max_operand=99)
    p = task.problem("arith-0-5")
    a, _, b = _parts(p.prompt)
    answer = str(a + b)
    assert p.answer == answer
    assert task.reward(p, answer) == 1.0
    assert task.reward(p, f"  {answer}\n") == 1.0
    assert task.reward(p, str(a + b + 1)) == 0.0
    assert task.reward(p, "") == 0.0
    assert task.reward(p, answer + "0") == 0.0
    assert task.reward(p, f"{answer} {answer}") == 0.0
    assert task.reward(p, f"{answer}=") == 0.0


def test_negative_answer_reward():
    task = ArithmeticTask(seed=0, max_operand=20, operations=("-",))
    rng = np.random.default_rng(2)
    for _ in range(50):
        p = task.problem(task.sample_id(rng))
        a, op, b = _parts(p.prompt)
        if a < b:
            assert p.answer.startswith("-")
            assert task.reward(p, str(a - b)) == 1.0
            assert task.reward(p, str(b - a)) == 0.0
            return
    pytest.fail("no problem with a negative answer in 50 draws")


@pytest.mark.parametrize("max_operand", [1, 5, 20])
def test_operands_stay_within_max_operand(max_operand):
    task = ArithmeticTask(seed=2, max_operand=max_operand)
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(300):
        a, _, b = _parts(task.problem(task.sample_id(rng)).prompt)
        assert 0 <= a <= max_operand and 0 <= b <= max_operand
        seen.update((a, b))
    assert seen == set(range(max_operand + 1))  # both ends of [0, maxOperand] are drawn


def test_make_task_from_config_spec():
    spec = ArithmeticTaskSpec.model_validate({"type": "arithmetic", "seed": 5, "maxOperand": 7, "operations": ["-"]})
    task = make_task(spec)
    assert isinstance(task, ArithmeticTask)
    assert (task.seed, task.max_operand, task.operations) == (5, 7, ("-",))
    task_id = task.sample_id(np.random.default_rng(0))
    assert task_id.startswith("arith-5-")
    a, op, b = _parts(task.problem(task_id).prompt)
    assert op == "-" and a <= 7 and b <= 7
    # The same spec gives the same problems in another process-like fresh task.
    assert make_task(spec).problem(task_id) == task.problem(task_id)


def test_make_task_rejects_unknown_type():
    with pytest.raises(ValueError, match="task.type"):
        make_task(SimpleNamespace(type="chess"))


def test_tokenizer_round_trips_a_prompt():
    tok = build_tokenizer()
    ids = tok.encode("12+7=")
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len("12+7=")  # one token per character
    assert len(set(ids[1:3])) == 2  # "1" and "2" are different tokens
    assert tok.decode(ids, skip_special_tokens=True) == "12+7="
    assert tok.decode(tok.encode("-30") + [tok.eos_token_id], skip_special_tokens=True) == "-30"


def test_tokenizer_special_ids():
    tok = build_tokenizer()
    special = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert None not in special and len(special) == 3
    chars = set(tok.encode("0123456789+-=", add_special_tokens=False))
    assert len(chars) == 13 and not chars & special
    assert len(tok) == 3 + len("0123456789+-= ")
