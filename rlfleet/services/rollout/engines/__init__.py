"""Inference engines behind one small interface (base.py), keyed by InferencePool `spec.engine`.

`torch` (torch_engine.py) runs any model on CPU or GPU; `vllm` (vllm_engine.py, pinned to one vLLM
release) is imported only when asked for, so nothing here needs vLLM installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlfleet.services.rollout.engines.base import Engine, Generation

__all__ = ["ENGINE_KINDS", "Engine", "Generation", "check_supported", "make_engine", "resolve_kind", "vllm_usable"]

ENGINE_KINDS = ("torch", "vllm", "auto")


def vllm_usable() -> bool:
    """vLLM is installed and a GPU is present (what `engine: auto` picks vLLM for)."""
    import torch

    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def resolve_kind(kind: str) -> str:
    """`auto` -> vllm when vLLM is installed and a GPU is present, else torch; others as they are."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"spec.engine: {kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    if kind == "auto":
        return "vllm" if vllm_usable() else "torch"
    return kind


def check_supported(kind: str, model_dir: Path) -> None:
    """Raise ImportError/ValueError naming the fix when engine `kind` cannot serve the model in
    `model_dir` on this machine (asked before any process starts; engines fail later otherwise)."""
    if resolve_kind(kind) == "vllm":
        from rlfleet.services.rollout.engines.vllm_pin import check_supported as vllm_check  # no vLLM import

        vllm_check(Path(model_dir))


def make_engine(kind: str, model_dir: Path, version: int, dtype: str = "float32") -> Engine:
    """Factory keyed by InferencePool `engine`: torch; vllm; auto = vllm when vLLM is installed and
    a GPU is present, else torch. vLLM on CPU works but must be asked for: its start takes tens of
    seconds on a few cores and it needs head size >= 32 (its throughput there: benchmarks/rollout.py)."""
    kind = resolve_kind(kind)
    if kind == "vllm":
        from rlfleet.services.rollout.engines.vllm_engine import VLLMEngine  # ImportError names the install extra

        return VLLMEngine(model_dir, version, dtype)
    from rlfleet.services.rollout.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, version, dtype)
