"""Prompt encoding: the one function workers and the verifier use to turn a problem into prompt ids.

A problem whose task spec sets `chatTemplate: true` is encoded through the tokenizer's chat template: messages
`[system?, user: prompt]` and the problem's tools (`Problem.tools`), rendered with `add_generation_prompt=True` to
text, then tokenized without adding special tokens (the template writes them). Any other problem is
`tokenizer(prompt)`, as before. The verifier encodes the prompt of the problem it rebuilt from the task id and
compares the ids with the worker's (rlfleet/services/toploc/checks.py), so a worker that skipped or changed the
template is refused with `prompt_mismatch`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from rlfleet.tasks.base import Problem, TaskSource, WrappedTask


class ChatTemplateMissing(ValueError):
    """chatTemplate: true with a model whose tokenizer has no chat template."""


def missing_template_message(where: str, model: str) -> str:
    return (
        f"{where}.chatTemplate: the model {model} has no chat template (its tokenizer_config.json has no "
        f"chat_template and there is no chat_template.jinja); set chatTemplate: false and write the format into "
        f"promptTemplate, or use a model that ships a template"
    )


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The prompt ids of `problem` (see the module docstring)."""
    if not problem.chat_template:
        return list(tokenizer(problem.prompt)["input_ids"])
    return list(tokenizer(prompt_text(tokenizer, problem), add_special_tokens=False)["input_ids"])


def prompt_text(tokenizer, problem: Problem) -> str:
    """The text `problem`'s prompt ids encode: the prompt itself, or with a chat template its rendering, special
    tokens written out (so another trainer given this text sees the prompt rlfleet's workers sample from)."""
    if not problem.chat_template:
        return problem.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateMissing(missing_template_message("spec.task", getattr(tokenizer, "name_or_path", "")))
    messages = [{"role": "system", "content": problem.system_prompt}] if problem.system_prompt else []
    messages.append({"role": "user", "content": problem.prompt})
    return render_chat(tokenizer, messages, list(problem.tools) or None)  # tools: rlfleet/tasks/tool_calls.py


# A template that prints today's date (Llama 3.x: transformers' `strftime_now`, the machine's local time) would
# render another prompt on another day or in another time zone, and the verifier would refuse the worker's prompt
# (`prompt_mismatch`); every render reads this date instead.
TEMPLATE_DATE = datetime(2024, 7, 26)


def render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True
) -> str:
    """`messages` (and `tools`) rendered to text by the tokenizer's chat template, the same on every machine and
    day: the template's clock reads TEMPLATE_DATE."""
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        strftime_now=TEMPLATE_DATE.strftime,
    )


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether an HF directory's tokenizer has a chat template (read from its files; no transformers import)."""
    root = Path(model_dir)
    if (root / "chat_template.jinja").exists() or (root / "chat_template.json").exists():
        return True
    config = root / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


def check_chat_templates(task_spec, has_template: bool, model: str) -> None:
    """ChatTemplateMissing naming the first source of `spec.task` that asks for a template, if the model
    (`has_template`: has_chat_template of its directory, or its loaded tokenizer's) has none."""
    from rlfleet.config import task_sources

    if has_template:
        return
    for where, _, single in task_sources(task_spec):
        if single.chat_template:
            raise ChatTemplateMissing(missing_template_message(where, model))


class ChatPromptTask(WrappedTask):
    """`inner` with its problems marked for the chat template (and the system prompt)."""

    def __init__(self, inner: TaskSource, system_prompt: str | None):
        super().__init__(inner)
        self.system_prompt = system_prompt

    def problem(self, task_id: str) -> Problem:
        return replace(self.inner.problem(task_id), chat_template=True, system_prompt=self.system_prompt)
