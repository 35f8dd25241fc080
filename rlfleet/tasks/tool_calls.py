"""Tool calls in the model's own format (docs/environments.md, "Tools").

A problem that offers tools (`Problem.tools`: function schemas, the JSON-schema form a chat template's `tools`
takes) and is prompted through a chat template that renders tools is shown them in its prompt (chat.py
`encode_prompt` passes them as the template's `tools`). Such a template also defines how the model writes a call:
`call_format` renders an assistant message that calls a sentinel function and reads off the text the template
writes before and after the call's JSON object (Qwen2.5 and Hermes-style templates: `<tool_call>` and
`</tool_call>`; Llama 3.1's: nothing, the object alone) and the key holding its arguments (`arguments`, or
`parameters`). A model turn then calls tools by writing that: each `OPEN {"name": ..., "arguments": {...}} CLOSE`
in the turn (or, with no markers, the whole turn as one object) is one call, at most MAX_CALLS a turn, and
`answer_calls` answers each, in order, with the tool's result (`TaskSource.call_tool`) or with an error the model
can read (JSON that does not parse, no tool name, arguments that are not an object, a tool that refuses them). The
results become the template's `tool` messages (turns.environment_tokens). A turn with no call is the model's
answer and ends the episode.

Everything here is a function of the turn, the template and the tools, so the verifier asks again and gets the same
tokens (turns.check_transcript). A problem whose template renders no tools, or no calls, keeps its source's plain
format (`TaskSource.respond`, answered as a user message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rlfleet.tasks.base import Problem, TaskSource, ToolError
from rlfleet.tasks.chat import render_chat

MAX_CALLS = 8  # calls answered in one model turn; later ones get an error
_SENTINEL = "rlfleet_probe_tool"
_SENTINEL_ARGUMENTS = {"rlfleet_probe": 7}
_SENTINEL_SCHEMA = {
    "type": "function",
    "function": {
        "name": _SENTINEL,
        "description": "probe",
        "parameters": {"type": "object", "properties": {"rlfleet_probe": {"type": "integer"}}},
    },
}
_TURN_MARK = "\x00rlfleet-model-turn\x00"


def function_schema(name: str, description: str, properties: dict[str, dict], required: list[str]) -> dict:
    """A tool's schema as chat templates take it: {"type": "function", "function": {name, description,
    parameters}}, the parameters an object of `properties`."""
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


@dataclass(frozen=True)
class CallFormat:
    """How a chat template writes a tool call: `open` and `close` around the call's JSON object (either may be
    empty), the object's tool name under "name" and its arguments under `arguments_key`."""

    open: str
    close: str
    arguments_key: str

    def calls(self, turn: str) -> list[tuple[str, dict] | str]:
        """The calls a model turn makes, in order: (tool name, arguments), or the error text of one that is not a
        well-formed call."""
        if not self.open:
            text = turn.strip()
            if self.close and text.endswith(self.close):
                text = text[: -len(self.close)].strip()
            return [self._parse(text)] if text.startswith("{") else []
        found, at = [], 0
        while (start := turn.find(self.open, at)) >= 0:
            body_start = start + len(self.open)
            end = turn.find(self.close, body_start) if self.close else -1
            found.append(self._parse(turn[body_start : end if end >= 0 else len(turn)].strip()))
            at = end + len(self.close) if end >= 0 else len(turn)
        return found

    def _parse(self, text: str) -> tuple[str, dict] | str:
        try:
            call = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"error: the tool call is not JSON ({exc.msg} at character {exc.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'error: a tool call is a JSON object naming its tool in "name"'
        arguments = call.get(self.arguments_key, {})
        if isinstance(arguments, str):  # some formats carry the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return f'error: the arguments of {call["name"]!r} ("{self.arguments_key}") are not a JSON object'
        return call["name"], arguments


_FORMATS: dict[str, CallFormat | None] = {}  # by chat template text


def call_format(tokenizer) -> CallFormat | None:
    """The tool-call format of `tokenizer`'s chat template (module docstring), or None when it renders no tools or
    no calls."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if template not in _FORMATS:
        _FORMATS[template] = _probe_format(tokenizer)
    return _FORMATS[template]


def _probe_format(tokenizer) -> CallFormat | None:
    """Render a call of a sentinel tool and read the template's markers around its JSON object."""
    user = [{"role": "user", "content": "q"}]
    call = {"type": "function", "function": {"name": _SENTINEL, "arguments": _SENTINEL_ARGUMENTS}}
    try:
        asked = render_chat(tokenizer, user, None)
        offered = render_chat(tokenizer, user, [_SENTINEL_SCHEMA])
        called = render_chat(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [call]}],
                             [_SENTINEL_SCHEMA], generation_prompt=False)  # fmt: skip
        answered = render_chat(tokenizer, [*user, {"role": "assistant", "content": _TURN_MARK}],
                               [_SENTINEL_SCHEMA], generation_prompt=False)  # fmt: skip
    except Exception:  # noqa: BLE001 (a template that cannot render these has no format we can use)
        return None
    if asked == offered or not called.startswith(offered) or _TURN_MARK not in answered:
        return None
    turn = called[len(offered) :]
    found = _sentinel_object(turn)
    if found is None:
        return None
    start, end, key = found
    end_of_turn = answered.split(_TURN_MARK, 1)[1]
    after = turn[end:]
    if end_of_turn and end_of_turn in after:
        after = after[: after.index(end_of_turn)]
    return CallFormat(open=turn[:start].strip(), close=after.strip(), arguments_key=key)


def _sentinel_object(text: str) -> tuple[int, int, str] | None:
    """(start, end, arguments key) of the JSON object in `text` that calls the sentinel tool."""
    decoder = json.JSONDecoder()
    name_at = text.find(f'"{_SENTINEL}"')
    for start in range(name_at, -1, -1) if name_at >= 0 else ():
        if text[start] != "{":
            continue
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("name") == _SENTINEL:
            for key, value in obj.items():
                if value == _SENTINEL_ARGUMENTS or (
                    isinstance(value, str) and _json_or_none(value) == _SENTINEL_ARGUMENTS
                ):
                    return start, end, key
            return None
    return None


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def answer_calls(task: TaskSource, problem: Problem, calls: list[tuple[str, dict] | str]) -> list[dict]:
    """The template's `tool` messages answering `calls` (module docstring), in order."""
    offered = {tool["function"]["name"] for tool in problem.tools}
    messages = []
    for k, call in enumerate(calls):
        if isinstance(call, str):
            name, content = "error", call
        elif k >= MAX_CALLS:
            name, content = call[0], f"error: at most {MAX_CALLS} tool calls are answered in one turn"
        elif call[0] not in offered:
            name, content = call[0], f"error: there is no tool named {call[0]!r} (tools: {', '.join(sorted(offered))})"
        else:
            name = call[0]
            try:
                content = task.call_tool(problem, name, call[1])
            except ToolError as exc:
                content = f"error: {exc}"
        messages.append({"role": "tool", "name": name, "content": content})
    return messages
