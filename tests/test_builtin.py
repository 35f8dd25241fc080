"""The builtin model: built in code, deterministic by seed, cached, loadable as an HF model."""
from __future__ import annotations

import hashlib

import pytest

from rlfleet.config import ArithmeticTaskSpec, ModelSpec
from rlfleet.models.builtin import resolve_model_path
from rlfleet.policy import load_policy

TASK = ArithmeticTaskSpec(type="arithmetic", max_operand=20)


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


def test_unknown_builtin_and_missing_directory_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown builtin model 'nope'"):
        resolve_model_path(ModelSpec(path="builtin://nope"), TASK)
    with pytest.raises(FileNotFoundError, match="spec.model.path"):
        resolve_model_path(ModelSpec(path=str(tmp_path)), TASK)
