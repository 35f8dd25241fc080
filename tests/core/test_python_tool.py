"""The Python tool (rlfleet/tasks/python_tool.py): a model turn's ```python block runs in the code task's sandbox and
the environment answers with its output, the same on the worker and the verifier, so the gate's transcript check
accepts an honest episode and rejects a forged output."""

from __future__ import annotations

import string

import pytest

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.models.builtin import build_tokenizer
from rlfleet.tasks import make_run_task
from rlfleet.tasks.code import Limits
from rlfleet.tasks.python_tool import PythonToolTask
from rlfleet.tasks.turns import TurnLimits, check_transcript, environment_turn
from rlfleet.wire.streams import Sample
from tests.runs import bundle_yaml, rlrun

MATH = {"type": "math", "dataset": {"path": "builtin://tiny-math"}, "tools": ["python"]}


def call(program: str) -> str:
    return f"Let me compute.\n```python\n{program}\n```"


@pytest.fixture(scope="module")
def task():
    spec = parse_bundle(bundle_yaml(rlrun(task=MATH, sampling={"maxTurns": 3, "maxTokens": 512}))).run.spec
    return make_run_task(spec)


def test_a_turn_s_program_runs_and_its_output_is_the_environment_s_turn(task):
    problem = task.problem(task.sample_id(__import__("numpy").random.default_rng(0)))
    assert task.multi_turn
    assert task.respond(problem, [call("print(6 * 7)")]) == "```output\n42\n```\n"
    assert task.respond(problem, ["```python\nprint(1)\n```\nthen " + call("print(2)")]) == "```output\n2\n```\n"
    assert task.respond(problem, ["The answer is \\boxed{42}."]) is None, "no block: the model's answer"
    failed = task.respond(problem, [call("print('before')\nraise SystemExit(3)")])
    assert failed == "```output\nbefore\n(exit code 3)\n```\n"
    drawn = call("import random\nprint(random.random())")
    assert task.respond(problem, [drawn]) == task.respond(problem, [drawn]), "random is seeded: verifiable"
    huge = task.respond(problem, [call("print('x' * 5000)")])
    assert "... (3977 more characters)" in huge and len(huge) < 1100
    # the reward reads the model's last turn, never a program's output
    right = f"\\boxed{{{problem.answer}}}"
    turns = [call(f"print({right!r})"), task.respond(problem, [call(f"print({right!r})")]), "I do not know."]
    assert task.reward(problem, task.episode_text(problem, turns)) == 0.0
    assert task.reward(problem, task.episode_text(problem, [*turns[:2], right])) == 1.0


def test_a_program_is_sandboxed_and_time_limited():
    inner = make_run_task(parse_bundle(bundle_yaml(rlrun(task={**MATH, "tools": []}))).run.spec)
    tool = PythonToolTask(inner, Limits(timeout_seconds=1.0))
    problem = inner.problem(inner.sample_id(__import__("numpy").random.default_rng(0)))
    assert tool.respond(problem, [call("while True:\n    pass")]) == "```output\n(timed out after 1 s)\n```\n"
    network = tool.respond(problem, [call("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)")])
    assert "(exit code 1)" in network, network


def test_the_gate_s_transcript_check_reruns_the_program(task):
    """An episode as a worker would send it, in a character tokenizer that writes code: honest, it passes; with the
    program's output forged, it is a transcript problem."""
    tok = build_tokenizer(string.printable.replace("\x0b", "").replace("\x0c", ""))
    problem = task.problem(task.sample_id(__import__("numpy").random.default_rng(1)))
    limits = TurnLimits(budget=400, max_turns=3, per_turn=120)
    first = call("print(2 ** 10)")
    ids = tok(first, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = environment_turn(task, problem, tok, [first], len(ids), limits)
    assert tok.decode(answer) == "```output\n1024\n```\n"
    last = tok("\\boxed{1024}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    spans = [len(ids), len(answer), len(last)]
    honest = Sample(ids + answer + last, [0.0] * sum(spans), [], 0.0, "stop", spans)
    stop_ids = frozenset([tok.eos_token_id])
    assert check_transcript(task, problem, tok, honest, stop_ids, limits) is None
    forged_answer = tok("```output\n1000\n```\n", add_special_tokens=False)["input_ids"]
    forged = Sample(ids + forged_answer + last, [0.0] * sum(spans), [], 0.0, "stop", spans)
    assert "is not the environment's answer" in check_transcript(task, problem, tok, forged, stop_ids, limits)


def test_the_python_tool_is_offered_on_math_only_and_needs_turns():
    with pytest.raises(ConfigError, match="need spec.sampling.maxTurns >= 2"):
        parse_bundle(bundle_yaml(rlrun(task=MATH)))
    with pytest.raises(ConfigError, match="tools.0: Input should be 'calculator'"):
        parse_bundle(bundle_yaml(rlrun(task={"tools": ["python"]}, sampling={"maxTurns": 2})))
