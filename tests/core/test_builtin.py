"""The builtin model: built in code, deterministic by seed, cached, loadable as an HF model."""

from __future__ import annotations

import hashlib
import json
import stat
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from rlfleet.config import ArithmeticTaskSpec, DatasetSpec, MathTaskSpec, ModelSpec, load_bundle
from rlfleet.models.builtin import BUILTINS, SHIPPED, build_tokenizer
from rlfleet.models.policy import load_policy
from rlfleet.models.sources import ModelSourceError, resolve_model_path
from rlfleet.tasks import make_task
from rlfleet.tasks.base import noisy_answer
from rlfleet.tasks.math import answers_match
from tests.support import REPO

TASK = ArithmeticTaskSpec(type="arithmetic", max_operand=20)
ROOT = REPO
TINY_MATH_SET = ROOT / "rlfleet" / "tasks" / "samples" / "tiny-math.jsonl"
MATH = MathTaskSpec(type="math", dataset=DatasetSpec(path="builtin://tiny-math"), prompt_template="{problem}")


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_builds_are_deterministic_by_seed_and_cached(tmp_path, monkeypatch):
    spec = ModelSpec(path="builtin://tiny-arithmetic", warm_start_steps=3)
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "a"))
    first = resolve_model_path(spec, TASK, seed=0)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(spec, TASK, seed=0) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime, "a cached build is reused"
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "b"))
    again = resolve_model_path(spec, TASK, seed=0)
    other_seed = resolve_model_path(spec, TASK, seed=1)
    assert digest(again) == digest(first)
    assert digest(other_seed) != digest(first)
    model, tokenizer = load_policy(first)
    assert model.config.model_type == "qwen2"
    assert tokenizer.decode(tokenizer("3+4=")["input_ids"], skip_special_tokens=True) == "3+4="
    assert not list((tmp_path / "b" / "builtin").glob(".build-*")), "no half-written builds are left"
    # a node's cache is read by pods running as another user than the one that built it
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [first, *first.iterdir()]}
    assert modes.pop(first.name) == 0o755 and set(modes.values()) == {0o644}, modes


def test_a_changed_architecture_gets_a_new_build_and_leaves_the_other_builtins_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    arithmetic = ModelSpec(path="builtin://tiny-arithmetic", warm_start_steps=2)
    math = ModelSpec(path="builtin://tiny-math", warm_start_steps=2)
    before, math_before = resolve_model_path(arithmetic, TASK), resolve_model_path(math, MATH)
    two_heads = replace(
        BUILTINS["tiny-arithmetic"], arch={**BUILTINS["tiny-arithmetic"].arch, "num_attention_heads": 2}
    )
    monkeypatch.setitem(BUILTINS, "tiny-arithmetic", two_heads)
    after = resolve_model_path(arithmetic, TASK)
    assert after != before, "a build of the old architecture is not reused"
    assert json.loads((after / "config.json").read_text())["num_attention_heads"] == 2
    assert resolve_model_path(math, MATH) == math_before, "the unchanged builtin keeps its cached build"


def test_unknown_builtin_and_missing_directory_are_clear_errors(tmp_path):
    with pytest.raises(ModelSourceError, match=r"spec.model.path: unknown builtin model 'builtin://nope'"):
        resolve_model_path(ModelSpec(path="builtin://nope"), TASK)
    with pytest.raises(ModelSourceError, match=r"spec.model.path: .* is not an HF model: no config.json"):
        resolve_model_path(ModelSpec(path=str(tmp_path)), TASK)


def test_tiny_math_builds_a_model_whose_tokenizer_round_trips_its_data_set(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    model, tokenizer = load_policy(resolve_model_path(ModelSpec(path="builtin://tiny-math", warm_start_steps=2), MATH))
    assert model.config.model_type == "qwen2" and model.config.vocab_size == tokenizer.vocab_size
    assert model.config.hidden_size // model.config.num_attention_heads == 32, (
        "head size 32: vLLM's CPU attention needs >= 32"
    )
    rows = [json.loads(line) for line in TINY_MATH_SET.read_text().splitlines()]
    assert len(rows) == 640
    for row in rows:
        for text in (row["problem"], f"\\boxed{{{row['answer']}}}"):
            ids = tokenizer(text)["input_ids"]
            assert tokenizer.pad_token_id not in ids, f"{text!r} has a character the tokenizer lacks"
            assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_math_refuses_a_data_set_with_characters_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    data = tmp_path / "words.jsonl"
    data.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2"}) + "\n")
    spec = MathTaskSpec(type="math", dataset=DatasetSpec(path=str(data)), prompt_template="{problem}")
    with pytest.raises(
        ValueError, match=r"spec.model.path: builtin://tiny-math knows only .*task words-0 \(spec.task\) has ' Wahist'"
    ):
        resolve_model_path(ModelSpec(path="builtin://tiny-math", warm_start_steps=2), spec)


def test_the_math_example_trains_tiny_math_on_the_shipped_set(monkeypatch):
    spec = load_bundle(ROOT / "examples" / "math" / "rlrun.yaml").run.spec
    assert spec.model.path == "builtin://tiny-math" and spec.task.type == "math"
    monkeypatch.chdir(ROOT)  # the example's data set path is relative to the repository root
    task = make_task(spec.task)
    problem = task.problem(task.ids()[0])
    assert task.reward(problem, f"\\boxed{{{problem.answer}}}") == 1.0
    assert task.reward(problem, f"\\boxed{{{noisy_answer(problem.answer, np.random.default_rng(0))}}}") == 0.0


def test_near_misses_of_fractions_and_integers_are_wrong_answers():
    rng = np.random.default_rng(0)
    for answer in ("5/6", "-1/2", "7", "-3", "0"):
        for _ in range(20):
            assert not answers_match(noisy_answer(answer, rng), answer)


@pytest.mark.parametrize("script", ["make_tiny_math.py", "make_tiny_code.py"])
def test_the_sample_sets_are_what_their_scripts_write(script):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_code_rows_warm_start_on_their_solution_and_the_solution_passes():
    """builtin://tiny-code is written in tiny-math's characters; a row's `solution` is what a builtin model imitates
    (Problem.reference) and passes the row's tests."""
    from rlfleet.config import CodeTaskSpec
    from rlfleet.models.builtin import BUILTINS, check_coverage
    from rlfleet.models.warm_start import demonstrate

    task = make_task(CodeTaskSpec(type="code", dataset=DatasetSpec(path="builtin://tiny-code"),
                                  network_isolation="audit-hook"))  # fmt: skip
    check_coverage("tiny-math", BUILTINS["tiny-math"], task)
    rng = np.random.default_rng(0)
    for task_id in task.ids()[:5]:
        problem = task.problem(task_id)
        assert problem.reference and task.reward(problem, problem.reference) == 1.0
        assert demonstrate(problem, "\\boxed{{{answer}}}", rng, label_noise=0.0) == problem.reference
        assert task.reward(problem, demonstrate(problem, "", rng, label_noise=1.0)) == 0.0, "a near miss fails"


def test_every_example_finds_its_builtin_model_shipped(tmp_path, monkeypatch):
    """A first run of an example uses the shipped build (no warm start): fails when a recipe, task or
    build change needs `scripts/ship_builtins.py` rerun, or a shipped build is no longer used."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ship_builtins.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))  # empty: nothing built here before
    monkeypatch.chdir(ROOT)
    built = []
    for example in ("arithmetic/rlrun.yaml", "math/rlrun.yaml", "math/rlrun-vllm.yaml"):
        spec = load_bundle(ROOT / "examples" / example).run.spec
        path = resolve_model_path(spec.model, spec.task, spec.trainer.seed, progress=lambda *_: built.append(example))
        assert path.parent == SHIPPED, example
        name = spec.model.path.removeprefix("builtin://")
        model, tokenizer = load_policy(path)
        assert {k: getattr(model.config, k) for k in BUILTINS[name].arch} == BUILTINS[name].arch
        assert tokenizer.get_vocab() == build_tokenizer(BUILTINS[name].chars).get_vocab()
    assert not built, f"built instead of shipped: {built}"
    assert not (tmp_path / "builtin").exists() or not list((tmp_path / "builtin").iterdir())


def test_a_build_reports_its_warm_start_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    calls = []
    resolve_model_path(
        ModelSpec(path="builtin://tiny-arithmetic", warm_start_steps=3), TASK, progress=lambda *a: calls.append(a)
    )
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
    calls.clear()
    resolve_model_path(
        ModelSpec(path="builtin://tiny-arithmetic", warm_start_steps=3), TASK, progress=lambda *a: calls.append(a)
    )
    assert calls == [], "a cached build reports nothing"
