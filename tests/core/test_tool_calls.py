"""Tool calls in the model's own chat-template format (rlfleet/tasks/tool_calls.py): the format read off a template
that renders tools, calls parsed from a model turn, answered as the template's tool messages, the prompt offering
the tools, and the verifier's transcript check on such episodes; templates without tools keep the plain format.

The two templates below are written here in the two common styles: calls tagged `<tool_call>` with the results in a
user turn (Qwen2.5 and Hermes-style models), and a bare JSON object with `parameters` answered in an `ipython` turn
(Llama 3.1-style)."""

from __future__ import annotations

import string
from dataclasses import dataclass

import pytest

from rlfleet.models.builtin import CHAT_TEMPLATE
from rlfleet.tasks.arithmetic import ArithmeticTask
from rlfleet.tasks.base import Problem, ToolError
from rlfleet.tasks.calculator import CalculatorTask
from rlfleet.tasks.chat import ChatPromptTask, encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure, PythonEnvironment
from rlfleet.tasks.python_tool import PythonToolTask
from rlfleet.tasks.tool_calls import MAX_CALLS, CallFormat, call_format
from rlfleet.tasks.turns import TurnLimits, check_transcript, environment_turn

TAGGED = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BARE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
    "{%- if m.role == 'user' and tools %}\n\nFunctions: {% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LIMITS = TurnLimits(budget=4000, max_turns=4, per_turn=400)


def tokenizer(template: str, eos: str):
    """A character tokenizer over printable ASCII, newlines included (the builtin one splits on `.`, which skips
    them), with `template` and the stop token `eos`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", *dict.fromkeys(string.printable)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template, tok.eos_token = template, eos
    return tok


def tagged_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def calculator() -> tuple[ChatPromptTask, Problem]:
    task = ChatPromptTask(CalculatorTask(ArithmeticTask(seed=0, max_operand=99)), system_prompt=None)
    return task, task.problem("arith-0-3")


def test_the_call_format_is_read_off_a_template_that_renders_tools():
    assert call_format(tokenizer(TAGGED, "<|im_end|>")) == CallFormat("<tool_call>", "</tool_call>", "arguments")
    assert call_format(tokenizer(BARE, "<|eot_id|>")) == CallFormat("", "", "parameters")
    assert call_format(tokenizer(CHATML, "<|im_end|>")) is None, "renders no tools: the plain format"
    assert call_format(tokenizer(CHAT_TEMPLATE, "<eos>")) is None, "the builtin models' template"


def test_a_turn_s_calls_are_parsed_in_order_and_malformed_ones_are_named():
    form = CallFormat("<tool_call>", "</tool_call>", "arguments")
    turn = (
        "Let me add. "
        + tagged_call("calculator", '{"expression": "1+2"}')
        + " and "
        + tagged_call("python", '"{\\"code\\": \\"print(1)\\"}"')  # the arguments as a JSON string
        + "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        + '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
    )
    calls = form.calls(turn)
    assert calls[:2] == [("calculator", {"expression": "1+2"}), ("python", {"code": "print(1)"})], "string arguments"
    assert calls[2].startswith("error: the tool call is not JSON")
    assert calls[3] == 'error: a tool call is a JSON object naming its tool in "name"'
    assert calls[4] == "error: the arguments of 'calculator' (\"arguments\") are not a JSON object"
    assert form.calls("The answer is 85.") == []
    bare = CallFormat("", "", "parameters")
    assert bare.calls(' {"name": "calculator", "parameters": {"expression": "2+2"}} ') == [
        ("calculator", {"expression": "2+2"})
    ]
    assert bare.calls("85") == []


def test_the_prompt_offers_the_tools_and_calls_are_answered_as_the_template_s_tool_messages():
    tok = tokenizer(TAGGED, "<|im_end|>")
    task, problem = calculator()
    prompt = tok.decode(encode_prompt(tok, problem))
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")

    def answer(turn: str) -> str | None:
        tokens = environment_turn(task, problem, tok, [turn], used=10, limits=LIMITS)
        return None if tokens is None else tok.decode(tokens)

    response = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
    assert answer(tagged_call("calculator", '{"expression": "37+48"}')) == (
        response.format("85") + "<|im_start|>assistant\n"
    )
    two = tagged_call("calculator", '{"expression": "1+1"}') + tagged_call("weather", '{"city": "Oslo"}')
    assert answer(two) == (
        response.format("2")
        + response.format("error: there is no tool named 'weather' (tools: calculator)")[1:]
        + "<|im_start|>assistant\n"
    ), "one tool message a call, in order; consecutive ones in one user turn as the template writes them"
    refused = answer(tagged_call("calculator", '{"expression": "6*7"}'))
    assert "error: calculator takes an expression of integers joined by + and -" in refused
    assert answer("85") is None, "a turn with no call is the answer"
    assert answer("37+48") is None, "the plain format is not a call where the template has its own"
    many = answer(tagged_call("calculator", '{"expression": "1+1"}') * (MAX_CALLS + 1))
    assert many.count("<tool_response>") == MAX_CALLS + 1 and f"at most {MAX_CALLS} tool calls" in many


def test_a_bare_json_template_s_calls_are_answered_in_its_tool_turn():
    tok = tokenizer(BARE, "<|eot_id|>")
    task, problem = calculator()
    assert '"name": "calculator"' in tok.decode(encode_prompt(tok, problem))
    tokens = environment_turn(
        task, problem, tok, ['{"name": "calculator", "parameters": {"expression": "40+2"}}'], 10, LIMITS
    )
    assert tok.decode(tokens) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


DATED = (
    "{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "<|system|>Today Date: {{ date_string }}\n{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_prints_today_s_date_renders_the_same_prompt_on_every_machine_and_day():
    """Llama 3.x templates print transformers' `strftime_now` (local time): a worker in another time zone, or a group
    verified after midnight, would otherwise fail `prompt_mismatch`."""
    tok = tokenizer(DATED, "<eos>")
    problem = Problem("t", "1+1=", "2", chat_template=True)
    assert tok.decode(encode_prompt(tok, problem)) == "<|system|>Today Date: 26 Jul 2024\n<|user|>1+1=\n<|assistant|>"


def test_a_template_without_tools_keeps_the_plain_format():
    tok = tokenizer(CHATML, "<|im_end|>")
    task, problem = calculator()
    assert tok.decode(environment_turn(task, problem, tok, ["37+48"], 10, LIMITS)) == (
        "\n<|im_start|>user\n=85=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        environment_turn(task, problem, tok, [tagged_call("calculator", '{"expression": "1+1"}')], 10, LIMITS) is None
    )


@dataclass
class Episode:
    completion_ids: list[int]
    spans: list[int]


def test_the_verifier_accepts_the_tool_s_answer_and_refuses_a_forged_one():
    tok = tokenizer(TAGGED, "<|im_end|>")
    stop = frozenset({tok.eos_token_id})
    task, problem = calculator()
    call = tok(tagged_call("calculator", '{"expression": "37+48"}'), add_special_tokens=False)["input_ids"]
    call += [tok.eos_token_id]
    result = environment_turn(task, problem, tok, [tok.decode(call[:-1])], len(call), LIMITS)
    answer = tok("85", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    honest = Episode(call + result + answer, [len(call), len(result), len(answer)])
    assert check_transcript(task, problem, tok, honest, stop, LIMITS) is None
    forged_result = tok.encode(tok.decode(result).replace("85", "86"), add_special_tokens=False)
    forged = Episode(call + forged_result + answer, [len(call), len(forged_result), len(answer)])
    assert "is not the environment's answer" in check_transcript(task, problem, tok, forged, stop, LIMITS)


def test_the_python_tool_runs_the_code_argument():
    task = PythonToolTask(ArithmeticTask(seed=0))
    problem = task.problem("arith-0-1")
    assert [t["function"]["name"] for t in problem.tools] == ["python"]
    assert task.call_tool(problem, "python", {"code": "print(6 * 7)"}) == "42"
    assert task.call_tool(problem, "python", {"code": "raise SystemExit(3)"}) == "(exit code 3)"
    with pytest.raises(ToolError, match='"code"'):
        task.call_tool(problem, "python", {"program": "print(1)"})


def test_a_user_environment_s_tools_are_called_across_its_process_boundary():
    env = PythonEnvironment("tests.core.turn_envs:Reverser", {}, timeout_seconds=5.0)
    try:
        tok = tokenizer(TAGGED, "<|im_end|>")
        problem = ChatPromptTask(env, system_prompt=None).problem("reverse-abc")
        assert [t["function"]["name"] for t in problem.tools] == ["reverse"]
        tokens = environment_turn(env, problem, tok, [tagged_call("reverse", '{"text": "abc"}')], 10, LIMITS)
        assert "<tool_response>\ncba\n</tool_response>" in tok.decode(tokens)
        refused = environment_turn(env, problem, tok, [tagged_call("reverse", '{"text": 3}')], 10, LIMITS)
        assert '<tool_response>\nerror: reverse takes a string in "text"\n</tool_response>' in tok.decode(refused)
        # a tool that fails or breaks the contract is the environment's failure: the gate rejects the group with
        # reason `environment` (forgiven) and goes on, as for a failing `respond`
        with pytest.raises(EnvironmentFailure, match="call_tool raised RuntimeError: the reverse service is down"):
            environment_turn(env, problem, tok, [tagged_call("reverse", '{"text": "down"}')], 10, LIMITS)
        with pytest.raises(EnvironmentFailure, match="call_tool returned a int, not a str"):
            environment_turn(env, problem, tok, [tagged_call("reverse", '{"text": "int"}')], 10, LIMITS)
    finally:
        env.close()
