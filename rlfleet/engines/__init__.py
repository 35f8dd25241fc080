"""Inference engines behind one small interface (base.py), keyed by InferencePool `spec.engine`.

`torch` (torch_engine.py) runs any model on CPU or GPU; `vllm` (vllm_engine.py, pinned to one vLLM
release) is imported only when asked for, so nothing here needs vLLM installed.

Device rule: the process's device is chosen once, by rlfleet/models/device.py (a GPU when torch sees
one, unless env RLFLEET_DEVICE says otherwise); the torch engine's model lives there, and vLLM, which
places its own workers, must run where that choice says (its CUDA build on a GPU, its CPU build on
the CPU) or the engine refuses to start naming the fix.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.engines.base import Engine, Generation

if TYPE_CHECKING:
    from rlfleet.config import VLLMSpec

__all__ = ["ENGINE_KINDS", "Engine", "Generation", "check_supported", "make_engine", "resolve_kind", "vllm_usable"]

ENGINE_KINDS = ("torch", "vllm", "auto")


def vllm_usable() -> bool:
    """vLLM is installed and this process would compute on a GPU (what `engine: auto` picks vLLM for)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from rlfleet.models.device import TORCH_CUDA, decide
    from rlfleet.wire import env

    return decide(env.get(env.DEVICE), 0, TORCH_CUDA.count()).type == "cuda"


def resolve_kind(kind: str) -> str:
    """`auto` -> vllm when vLLM is installed and a GPU is present, else torch; others as they are."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"spec.engine: {kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    if kind == "auto":
        return "vllm" if vllm_usable() else "torch"
    return kind


def check_supported(kind: str, model_dir: Path, settings: VLLMSpec | None = None) -> None:
    """Raise ImportError/ValueError naming the fix when engine `kind` cannot serve the model in
    `model_dir` with the pool's `settings` on this machine (asked before any process starts; engines
    fail later otherwise)."""
    if resolve_kind(kind) == "vllm":
        from rlfleet.engines.vllm_pin import check_supported as vllm_check  # no vLLM import
        from rlfleet.engines.vllm_pin import cpu_build, engine_args

        vllm_check(Path(model_dir))
        engine_args(settings, on_cpu=cpu_build())


def make_engine(
    kind: str, model_dir: Path, version: int, dtype: str = "float32", settings: VLLMSpec | None = None
) -> Engine:
    """Factory keyed by InferencePool `engine`: torch; vllm; auto = vllm when vLLM is installed and
    a GPU is present, else torch. vLLM on CPU works but must be asked for: its start takes tens of
    seconds on a few cores and it needs head size >= 32 (its throughput there: benchmarks/rollout.py).
    `settings`: the pool's `spec.vllm` (vLLM only; None = its defaults)."""
    from rlfleet.models.device import choose_device

    kind = resolve_kind(kind)
    device = choose_device()  # module docstring
    if kind == "vllm":
        from rlfleet.engines.vllm_engine import VLLMEngine  # ImportError names the install extra

        return VLLMEngine(model_dir, version, dtype, settings, device)
    from rlfleet.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, version, dtype, device)
