"""Adapter versions (trainer.lora): what a LoRA policy version is on disk and on the wire.

A LoRA run's version N is the adapter alone, PEFT's two files in `{run}/policy/v{N}/`:
    adapter_config.json          r, lora_alpha, target_modules, ...
    adapter_model.safetensors    per targeted linear layer `<module>.lora_A.weight` (r x in) and
                                 `<module>.lora_B.weight` (out x r), names prefixed `base_model.model.`
published like any version (rlfleet/versions/publish.py: listed, hashed, signed, served by the relay
tree; always whole, never a delta) with a signed `adapter` section in its manifest that names the base
it was trained over. A consumer applies it to the base it holds, W' = W + (alpha / r) B @ A
(rlfleet/models/adapter.py), after `check_base`: the base is identified by `base_identity`, the sha256
of the sorted lines "name size sha256" of the base directory's config.json and *.safetensors files, so
two copies of the same weights agree wherever they were built or stored, and any other base differs.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from rlfleet.versions.manifest import MANIFEST_NAME, AdapterSection, Manifest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)

_identities: dict[tuple[str, tuple], str] = {}  # (resolved dir, its files' (name, size, mtime)) -> identity
_lock = threading.Lock()


class AdapterBaseError(ValueError):
    """An adapter version that does not apply to the base this process holds (or no adapter section)."""


def is_adapter_dir(version_dir: Path) -> bool:
    """Whether a version's directory holds an adapter (LoRA) rather than whole weights."""
    return (Path(version_dir) / ADAPTER_CONFIG).is_file()


def _identity_files(model_dir: Path) -> list[Path]:
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to identify a base model by")
    return [model_dir / "config.json", *files] if (model_dir / "config.json").is_file() else files


def base_identity(model_dir: Path) -> str:
    """The identity of the base model in `model_dir` (module docstring); computed once per process and directory
    (recomputed if a file's size or mtime changes)."""
    from rlfleet.versions.checkpoint import sha256_file  # checkpoint imports nothing of this module

    model_dir = Path(model_dir).resolve()
    files = _identity_files(model_dir)
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(model_dir), stamp)
    with _lock:
        if key not in _identities:
            lines = "".join(f"{p.name} {p.stat().st_size} {sha256_file(p)}\n" for p in files)
            _identities[key] = hashlib.sha256(lines.encode()).hexdigest()
        return _identities[key]


def adapter_section(base_dir: Path, model: str) -> AdapterSection:
    """The manifest section of an adapter trained over the base in `base_dir` (`model`: spec.model.path)."""
    return AdapterSection(base_identity(base_dir), model)


def check_base(version_dir: Path, base_dir: Path) -> AdapterSection:
    """The adapter section of the version in `version_dir` (its manifest.json, as fetched and verified) if it was
    trained over the base in `base_dir`; else AdapterBaseError naming both."""
    version_dir = Path(version_dir)
    try:
        manifest = Manifest.from_json(json.loads((version_dir / MANIFEST_NAME).read_bytes()))
    except (OSError, ValueError) as exc:
        raise AdapterBaseError(f"{version_dir}: an adapter version without a readable manifest ({exc})") from None
    if manifest.adapter is None:
        raise AdapterBaseError(
            f"{version_dir}: holds an adapter but its manifest has no 'adapter' section naming the base"
        )
    mine = base_identity(base_dir)
    if manifest.adapter.base != mine:
        raise AdapterBaseError(
            f"v{manifest.version} is an adapter over base {manifest.adapter.base[:12]}... ({manifest.adapter.model}); "
            f"this process holds base {mine[:12]}... ({base_dir}): give it the run's spec.model"
        )
    return manifest.adapter
