"""The rules of a multi-turn episode (rlfleet/tasks/turns.py), the calculator tool (rlfleet/tasks/calculator.py) and
the spans on the wire: what the worker and the verifier both follow, checked without either."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.models.builtin import CHAT_TEMPLATE, build_tokenizer
from rlfleet.services.toploc.ending import ending_problem
from rlfleet.tasks import Problem, TaskSource, make_run_task
from rlfleet.tasks.calculator import calculate
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.tasks.turns import (
    TurnLimits,
    _chat_continuation,
    drawn_tokens,
    environment_tokens,
    environment_turn,
    episode_text,
    model_token_mask,
)
from rlfleet.wire.streams import MessageError, RolloutGroup, Sample, SamplingParams
from tests.runs import bundle_yaml, rlrun

CALCULATOR = {"maxOperand": 999, "operations": ["+", "-"], "tools": ["calculator"]}


def test_a_calculator_call_is_integers_joined_by_plus_and_minus():
    assert calculate("37+48") == 85
    assert calculate("-5+3-10") == -12
    assert calculate(" 7 - 12 ") == -5
    for not_a_call in ("85", "37+48=", "3*4", "", "+5", "1" * 13 + "+1", "5+"):
        assert calculate(not_a_call) is None, not_a_call


def test_the_calculator_task_answers_calls_and_rewards_the_last_model_turn():
    spec = parse_bundle(bundle_yaml(rlrun(task=CALCULATOR, sampling={"maxTurns": 2}))).run.spec
    task = make_run_task(spec)
    assert task.multi_turn
    problem = task.problem("arith-0-3")
    call = problem.prompt.rstrip("=")
    assert task.respond(problem, [call]) == f"={problem.answer}="
    assert task.respond(problem, [problem.answer]) is None, "an answer ends the episode"
    turns = [call, f"={problem.answer}=", problem.answer]
    assert task.episode_text(problem, turns) == problem.answer
    assert task.reward(problem, task.episode_text(problem, turns)) == 1.0
    assert task.reward(problem, task.episode_text(problem, turns[:2] + ["0"])) == 0.0, "the tool's output is not it"
    # warm-start demonstrations: the exact call, or a near miss whose result the tool really gives
    rng = np.random.default_rng(0)
    assert task.demonstration_turns(problem, rng, 0.0) == turns
    noisy = [task.demonstration_turns(problem, rng, 1.0) for _ in range(20)]
    assert all(t[0] != call and t[1] == f"={calculate(t[0])}=" and t[2] == str(calculate(t[0])) for t in noisy)


def test_tools_need_turns():
    with pytest.raises(ConfigError, match=r"spec.task.tools: \['calculator'\] need spec.sampling.maxTurns >= 2"):
        parse_bundle(bundle_yaml(rlrun(task=CALCULATOR)))


class Echo(TaskSource):
    multi_turn = True

    def __init__(self, answer):
        self.answer = answer

    def problem(self, task_id):
        return Problem(task_id, "1+1=", "2")

    def sample_id(self, rng):
        return "echo"

    def reward(self, problem, completion):
        return 0.0

    def respond(self, problem, turns):
        return self.answer


def test_the_episode_ends_at_max_turns_at_the_budget_or_when_the_answer_would_not_fit():
    tok = build_tokenizer()
    problem = Problem("echo", "1+1=", "2")
    limits = TurnLimits(budget=10, max_turns=3, per_turn=4)
    assert (
        environment_turn(Echo("=5="), problem, tok, ["1"], used=2, limits=limits)
        == tok("=5=", add_special_tokens=False)["input_ids"]
    )
    assert environment_turn(Echo("=5="), problem, tok, ["1", "2", "3"], used=2, limits=limits) is None
    assert environment_turn(Echo("=5="), problem, tok, ["1"], used=10, limits=limits) is None
    assert environment_turn(Echo("=5="), problem, tok, ["1"], used=7, limits=limits) is None, "no token left after it"
    assert environment_turn(Echo(None), problem, tok, ["1"], used=2, limits=limits) is None
    with pytest.raises(EnvironmentFailure, match="respond returned a int"):
        environment_turn(Echo(5), problem, tok, ["1"], used=2, limits=limits)
    assert limits.turn_budget(0) == 4 and limits.turn_budget(8) == 2


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_environment_turn_takes_the_chat_template_s_framing():
    """After the model's message (which its stop token `<|im_end|>` ended), the template's user turn and the next
    generation prompt; a builtin template's framing likewise."""
    tok = build_tokenizer()
    tok.chat_template, tok.eos_token = CHATML, "<|im_end|>"
    problem = Problem("t", "1+1=", "2", chat_template=True, system_prompt="be brief")
    user = [{"role": "user", "content": "=2="}]
    assert _chat_continuation(tok, problem, user) == "\n<|im_start|>user\n=2=<|im_end|>\n<|im_start|>assistant\n"
    builtin = build_tokenizer()
    builtin.chat_template = CHAT_TEMPLATE
    ids = environment_tokens(builtin, Problem("t", "1+1=", "2", chat_template=True), "=2=")
    assert builtin.convert_ids_to_tokens(ids) == ["<bos>", "=", "2", "=", "<bos>"]
    plain = environment_tokens(builtin, Problem("t", "1+1=", "2"), "=2=")
    assert builtin.convert_ids_to_tokens(plain) == ["=", "2", "="]


def test_a_model_turn_stops_by_its_own_budget_and_the_text_and_mask_follow_the_spans():
    tok = build_tokenizer()
    eos = tok.eos_token_id
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    env = tok("=9=", add_special_tokens=False)["input_ids"]
    params = SamplingParams(1.0, 1.0, 0, 16, seed=0)

    def group(ids, spans, reason):
        return RolloutGroup("t", "w", 0, [1, 2], params, [Sample(ids, [0.0] * len(ids), [], 0.0, reason, spans)])

    stop_ids = frozenset([eos])
    honest = [*digits[:2], eos, *env, *digits[:4]]  # a turn that stopped, the tool, a turn cut at its budget of 4
    assert ending_problem(group(honest, [3, 3, 4], "length"), stop_ids, 64, 3, 4) is None
    assert "model turn 2 ends after 3 tokens without a stop token" in ending_problem(
        group(honest[:-1], [3, 3, 3], "length"), stop_ids, 64, 3, 4
    )
    assert "model turn 1 has 1 token(s) after its stop token" in ending_problem(
        group([digits[0], eos, digits[1], *env, *digits[:4]], [3, 3, 4], "length"), stop_ids, 64, 3, 4
    )
    assert "claims finish reason 'stop'" in ending_problem(group(honest, [3, 3, 4], "stop"), stop_ids, 64, 3, 4)
    assert model_token_mask([3, 3, 4]) == [1.0] * 3 + [0.0] * 3 + [1.0] * 4
    assert drawn_tokens([3, 3, 4], 10) == 7 and drawn_tokens(None, 10) == 10
    assert episode_text(Echo(None), None, tok, honest, [3, 3, 4], stop_ids) == "12=9=1234"


def test_spans_travel_on_the_wire_and_bad_spans_are_malformed():
    params = SamplingParams(1.0, 1.0, 0, 16, seed=0)
    sample = Sample([5, 6, 7, 8], [-1.0, 0.0, 0.0, -1.0], [], 1.0, "stop", [1, 2, 1])
    group = RolloutGroup("t", "w", 0, [1, 2], params, [sample])
    assert RolloutGroup.decode(group.encode()).samples[0].spans == [1, 2, 1]
    single = RolloutGroup("t", "w", 0, [1], params, [Sample([5], [-1.0], [], 0.0, "stop")])
    assert "s" not in single.samples[0].to_wire(), "a single-turn sample's wire is as before"
    for spans, message in (([1, 3], "an odd count"), ([1, 2, 2], "add up to 5"), ([0, 3, 1], "model span is empty")):
        sample.spans = spans
        with pytest.raises(MessageError, match=message):
            RolloutGroup.decode(group.encode())


def test_a_held_out_evaluation_of_a_tool_task_scores_whole_episodes():
    """The trainer's evaluation and `rlfleet filter` (engines/solve.py) sample a task that takes turns as the workers
    do: the calculator example's model calls the tool, then answers; scored on its first turn alone it would
    score nothing (the call is not the answer)."""
    from rlfleet.config import load_bundle
    from rlfleet.engines.solve import greedy, score_problems
    from rlfleet.engines.torch_engine import TorchEngine
    from rlfleet.models.sources import resolve_model_path
    from tests.support import REPO

    spec = load_bundle(str(REPO / "examples" / "calculator" / "rlrun.yaml")).run.spec
    engine = TorchEngine(resolve_model_path(spec.model, spec.task, seed=spec.trainer.seed), 0)
    task = make_run_task(spec)
    ids = [f"arith-0-{i}" for i in range(16)]
    episodes = score_problems(engine, task, ids, 1, greedy(spec.sampling.max_tokens), sampling=spec.sampling)
    first_turns = score_problems(engine, task, ids, 1, greedy(spec.sampling.max_tokens))
    assert episodes.pass_at_k() >= 0.5, episodes.rewards
    assert first_turns.pass_at_k() == 0.0, first_turns.rewards
