"""Applying a LoRA adapter version to the base weights a process holds (rlfleet/versions/adapter.py: the format).

For each targeted linear layer with base weight W0 (out x in) and the adapter's A (r x in), B (out x r):
    W = W0 + s * B @ A,   s = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)
computed in fp32 and cast to the weight's dtype, which is what PEFT's merge computes, so a merged model's
logits equal the trainer's unmerged PEFT model's (dropout off) up to float rounding.
Invariants:
  - merging never accumulates: `Merger` copies W0 of a layer the first time an adapter targets it and
    always merges into that copy, so version N's weights are base + adapter N whatever came before; a
    layer an adapter no longer targets gets W0 back;
  - every name and shape is checked before a weight is written, so a rejected adapter leaves the model
    as it was;
  - only plain LoRA is applied: adapters with DoRA, fan_in_fan_out (Conv1D), trained biases, extra saved
    modules or per-layer rank/alpha patterns are refused naming the setting (the trainer never makes them).
`merge_dir` writes base + adapter as a whole checkpoint directory, for an engine that reloads from files
(vLLM on CPU, rlfleet/engines/vllm_adapter.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlfleet.versions.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rlfleet.versions.manifest import MANIFEST_NAME

PEFT_PREFIX = "base_model.model."
_REFUSED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "modules_to_save": "modules_to_save"}


def read_adapter(adapter_dir: Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(s, {base weight name: (A, B)}) of the adapter in `adapter_dir`; ValueError naming what is not plain LoRA."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"{adapter_dir}: the adapter uses {what}; only plain LoRA adapters are applied")
    if config.get("bias", "none") != "none" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{adapter_dir}: the adapter trains biases or has per-layer rank/alpha patterns")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"{adapter_dir}: unexpected tensor {key!r} in {ADAPTER_WEIGHTS}")
            continue
        module = key.removesuffix(".lora_A.weight")
        b = tensors.get(module + ".lora_B.weight")
        a = tensors[key]
        if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{adapter_dir}: {module}: lora_A (r x in) and lora_B (out x r) with r = {r} are needed")
        pairs[module.removeprefix(PEFT_PREFIX) + ".weight"] = (a, b)
    if not pairs or 2 * len(pairs) != len(tensors):
        raise ValueError(f"{adapter_dir}: {ADAPTER_WEIGHTS} must hold lora_A and lora_B pairs only")
    return scale, pairs


def merged(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + s * B @ A in fp32, in W0's dtype."""
    return (w0.float() + scale * (b.float() @ a.float())).to(w0.dtype)


def _check(pairs: dict, shapes: dict[str, torch.Size], where: object) -> None:
    for name, (a, b) in pairs.items():
        shape = shapes.get(name)
        if shape is None:
            raise ValueError(f"{where}: the adapter targets {name!r}, not a weight of the base model")
        if (b.shape[0], a.shape[1]) != tuple(shape):
            raise ValueError(f"{where}: {name}: B @ A is {b.shape[0]} x {a.shape[1]}, the weight {tuple(shape)}")


class Merger:
    """Applies adapter versions to one live model in place (module docstring: never accumulates)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # W0 of every layer an adapter targeted so far

    @torch.no_grad()
    def apply(self, adapter_dir: Path) -> None:
        scale, pairs = read_adapter(adapter_dir)
        params = dict(self.model.named_parameters())
        _check(pairs, {k: p.shape for k, p in params.items()}, adapter_dir)
        for name in set(self.base) - set(pairs):
            params[name].copy_(self.base[name])
        for name, (a, b) in pairs.items():
            weight = params[name]
            if name not in self.base:
                self.base[name] = weight.detach().clone()
            weight.copy_(merged(self.base[name], a.to(weight.device), b.to(weight.device), scale))


def merge_dir(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """Write base + adapter into `out_dir` as a whole checkpoint: the base's safetensors files with the targeted
    weights merged, and its other files (config, tokenizer) copied. Returns `out_dir`."""
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    scale, pairs = read_adapter(adapter_dir)
    shards = {p.name: load_file(str(p)) for p in sorted(base_dir.glob("*.safetensors"))}
    _check(pairs, {k: t.shape for state in shards.values() for k, t in state.items()}, adapter_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file_name, state in shards.items():
        for name in state.keys() & pairs.keys():
            a, b = pairs[name]
            state[name] = merged(state[name], a, b, scale)
        save_file(state, str(out_dir / file_name), metadata={"format": "pt"})
    for path in base_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copyfile(path, out_dir / path.name)
    return out_dir


def load_adapted(version_dir: Path, base_dir: Path, dtype: str = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer) of an adapter version: the base in `base_dir` loaded and the adapter merged in, after
    checking that the version's manifest names that base (AdapterBaseError otherwise)."""
    from rlfleet.models.policy import load_policy
    from rlfleet.versions.adapter import check_base

    check_base(version_dir, base_dir)
    model, tokenizer = load_policy(base_dir, dtype, device)
    Merger(model).apply(version_dir)
    return model, tokenizer


def version_signature(version_dir: Path) -> str:
    """A digest of every file of a whole version but its weights and manifest (config, generation config,
    tokenizer): two versions with the same signature differ in their weights only. Hidden files are the fetcher's
    bookkeeping, not the version's (the `.complete` marker names the manifest's size, which differs by version)."""
    h = hashlib.sha256()
    for path in sorted(Path(version_dir).iterdir()):
        if path.name.startswith(".") or path.name == MANIFEST_NAME:
            continue
        if path.is_file() and path.suffix != ".safetensors":
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def load_version(
    version_dir: Path,
    dtype: str,
    device: str | torch.device,
    base: Callable[[], Path],
    like: tuple[Any, Any, str] | None = None,
):
    """(model, tokenizer) of a fetched policy version: whole weights as they are, or an adapter merged into the
    run's base, which `base()` resolves (only for an adapter: a whole-weights run never builds it).

    `like`: (model, tokenizer, signature) of another whole version this process loaded. When this version has the
    same signature (`version_signature`: everything but the weights), the model is a copy of that one with this
    version's weights loaded into it, and the tokenizer that one's: the same result as loading from scratch in
    a fraction of the time, and the copy leaves the other version's model untouched for whoever still uses it."""
    from rlfleet.models.policy import load_policy, load_weights_in_place
    from rlfleet.versions.adapter import is_adapter_dir

    if is_adapter_dir(version_dir):
        return load_adapted(version_dir, base(), dtype, device)
    if like is not None and like[2] == version_signature(version_dir):
        model = copy.deepcopy(like[0])
        load_weights_in_place(model, version_dir)
        return model, like[1]
    return load_policy(version_dir, dtype, device)
