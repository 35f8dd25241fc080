"""Task mixtures, chat templates and their config errors (rlfleet/tasks/mixture.py, chat.py, config/tasks.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rlfleet.config import ConfigError, MixtureTaskSpec, parse_bundle
from rlfleet.models.builtin import CHAT_TEMPLATE, MATH_CHARS, build_tokenizer
from rlfleet.tasks import make_run_task, make_task
from rlfleet.tasks.base import Problem
from rlfleet.tasks.chat import ChatTemplateMissing, check_chat_templates, encode_prompt, has_chat_template
from rlfleet.tasks.mixture import source_of
from tests.runs import bundle_yaml, rlrun

MATH = {"type": "math", "dataset": {"path": "builtin://tiny-math"}, "promptTemplate": "{problem}"}
CODE = {"type": "code", "dataset": {"path": "builtin://tiny-code"}, "networkIsolation": "audit-hook"}
ARITH = {"type": "arithmetic", "maxOperand": 9}


def mixture_run(*sources: dict, **spec) -> str:
    return bundle_yaml(rlrun("mix", model="builtin://tiny-math", task={"type": "mixture", "mixture": list(sources)},
                             **spec))  # fmt: skip


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_bundle(text, "f.yaml")
    return info.value.problems


def test_a_mixture_draws_sources_by_weight_and_its_ids_name_the_source():
    spec = parse_bundle(mixture_run({"weight": 3, "task": MATH}, {"name": "code", "weight": 1, "task": CODE})).run.spec
    task = make_run_task(spec)
    rng = np.random.default_rng(0)
    ids = [task.sample_id(rng) for _ in range(2000)]
    counts = Counter(source_of(i) for i in ids)
    assert set(counts) == {"math", "code"}, "a source without a name is named by its type"
    assert 0.70 < counts["math"] / len(ids) < 0.80, counts  # weight 3 of 4
    fresh = make_run_task(spec)  # the verifier's: the problem and the reward come back from the id alone
    for task_id in ids[:50]:
        problem = fresh.problem(task_id)
        assert problem == task.problem(task_id) and problem.task_id == task_id
    code_id = next(i for i in ids if i.startswith("code/"))
    problem = fresh.problem(code_id)
    assert problem.reference is not None and problem.answer.startswith("assert x==")
    assert fresh.rewards(problem, [problem.reference, "x=0"]) == [1.0, 0.0], "the code source's own reward"
    math_id = next(i for i in ids if i.startswith("math/"))
    problem = fresh.problem(math_id)
    assert fresh.rewards(problem, [f"\\boxed{{{problem.answer}}}", "\\boxed{1234}"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="names no source"):
        fresh.problem("nope/tiny-math-1")
    with pytest.raises(KeyError):
        fresh.problem("tiny-math-1")  # a single-task id is not a mixture's


def test_each_source_keeps_its_own_length_penalty_and_the_run_s_applies_to_all():
    spec = parse_bundle(
        mixture_run(
            {"name": "short", "weight": 1, "task": ARITH, "lengthPenalty": {"targets": [2], "coef": 0.5}},
            {"name": "free", "weight": 1, "task": ARITH},
        )
    ).run.spec
    task = make_run_task(spec)
    short, free = task.problem("short/arith-0-7@len2"), task.problem("free/arith-0-7")
    assert "Think for 2 tokens" in short.prompt and "Think" not in free.prompt
    assert task.scores(short, [short.answer], [4]) == [1.0 - 0.5 * 1.0]  # |4 - 2| / 2 = 1
    assert task.scores(free, [free.answer], [4]) == [1.0]
    with pytest.raises(KeyError):
        task.problem("short/arith-0-7")  # the source's ids carry its target
    both = parse_bundle(mixture_run({"weight": 1, "task": ARITH}, lengthPenalty={"targets": [4], "coef": 0.5})).run.spec
    wrapped = make_run_task(both)
    problem = wrapped.problem("arithmetic/arith-0-7@len4")
    assert wrapped.scores(problem, [problem.answer], [2]) == [0.75]


@pytest.mark.parametrize(
    "name,sources,field,fix",
    [
        ("zero-weight", [{"weight": 0, "task": ARITH}], "spec.task.mixture.0.weight", "greater than 0"),
        ("negative-weight", [{"weight": -1, "task": ARITH}], "spec.task.mixture.0.weight", "greater than 0"),
        ("duplicate-default-names", [{"weight": 1, "task": ARITH}, {"weight": 1, "task": {**ARITH, "seed": 1}}],
         "mixture[1].name", "give each source a distinct name"),
        ("duplicate-names", [{"name": "a", "weight": 1, "task": ARITH}, {"name": "a", "weight": 2, "task": MATH}],
         "mixture[1].name: 'a' is also the name of mixture[0]", "distinct name"),
        ("bad-name", [{"name": "A/b", "weight": 1, "task": ARITH}], "spec.task.mixture.0.name", "pattern"),
        ("empty", [], "spec.task.mixture", "at least 1"),
        ("entrypoint-form", [{"weight": 1, "task": {"type": "python", "entrypoint": "a b:c"}}],
         "spec.task.mixture.0.task.entrypoint", "pattern"),
        ("system-without-template", [{"weight": 1, "task": {**ARITH, "systemPrompt": "x="}}],
         "spec.task.mixture.0.task", "set chatTemplate: true"),
    ],
)  # fmt: skip
def test_bad_mixtures_are_field_errors(name, sources, field, fix):
    problems = problems_of(mixture_run(*sources))
    assert any(field in p and fix in p for p in problems), problems


def test_the_builtin_key_of_a_task_without_chat_fields_is_unchanged():
    """chatTemplate and systemPrompt at their defaults leave the hashed task as it was before they existed, so the
    shipped builds keep their keys; asking for a template makes another build (the tokenizer gets the template)."""
    from rlfleet.config import MathTaskSpec
    from rlfleet.models.builtin import _task_key

    plain = MathTaskSpec.model_validate(MATH)
    assert "chat_template" not in _task_key(plain) and "system_prompt" not in _task_key(plain)
    templated = MathTaskSpec.model_validate({**MATH, "chatTemplate": True})
    assert _task_key(templated)["chat_template"] is True


def test_prompts_go_through_the_chat_template_with_the_system_prompt(tmp_path):
    tokenizer = build_tokenizer(MATH_CHARS)
    plain = Problem("t", "1+2=?", "3")
    templated = Problem("t", "1+2=?", "3", chat_template=True, system_prompt="x=")
    with pytest.raises(ChatTemplateMissing, match="spec.task.chatTemplate"):
        encode_prompt(tokenizer, templated)
    tokenizer.save_pretrained(tmp_path / "plain")
    assert not has_chat_template(tmp_path / "plain")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat")
    assert has_chat_template(tmp_path / "chat")
    ids = encode_prompt(tokenizer, templated)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "x", "=", "<bos>", *"1+2=?", "<bos>"]
    assert encode_prompt(tokenizer, plain) == tokenizer("1+2=?")["input_ids"], "no template: as before"
    assert encode_prompt(tokenizer, Problem("t", "1+2=?", "3", chat_template=True)) == ids[3:]


def test_a_model_without_a_template_is_an_error_naming_the_source_that_asks_for_one():
    spec = parse_bundle(
        mixture_run({"weight": 1, "task": ARITH}, {"name": "m", "weight": 1, "task": {**MATH, "chatTemplate": True}})
    ).run.spec
    assert isinstance(spec.task, MixtureTaskSpec)
    with pytest.raises(ChatTemplateMissing, match=r"spec\.task\.mixture\[1\]\.task\.chatTemplate: the model m1 has no"):
        check_chat_templates(spec.task, False, "m1")
    check_chat_templates(spec.task, True, "m1")  # a model with one is fine
    single = parse_bundle(bundle_yaml(rlrun(task={"chatTemplate": True}))).run.spec
    with pytest.raises(ChatTemplateMissing, match=r"^spec\.task\.chatTemplate"):
        check_chat_templates(single.task, False, "m1")


def test_a_single_task_with_a_template_marks_its_problems():
    spec = parse_bundle(bundle_yaml(rlrun(task={"chatTemplate": True, "systemPrompt": "+"}))).run.spec
    problem = make_task(spec.task).problem("arith-0-3")
    assert problem.chat_template and problem.system_prompt == "+"
    assert not make_task(parse_bundle(bundle_yaml(rlrun())).run.spec.task).problem("arith-0-3").chat_template


def test_a_cluster_run_names_each_mixture_source_whose_data_set_a_pod_cannot_have():
    from rlfleet.operator.resources import pod_file_problems

    run = parse_bundle(
        mixture_run({"weight": 1, "task": MATH},
                    {"name": "mine", "weight": 1, "task": {**CODE, "dataset": {"path": "data/mine.jsonl"}}})
    ).run  # fmt: skip
    problems = pod_file_problems(run)
    assert len(problems) == 1 and problems[0].startswith("spec.task.mixture[1].task.dataset.path: 'data/mine.jsonl'")
