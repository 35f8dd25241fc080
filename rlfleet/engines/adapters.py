"""Adapter (LoRA) versions for the engines: how a worker applies a version that is an adapter over its base.

A LoRA run's versions are adapters (rlfleet/versions/adapter.py), applied to the base model the engine
started from, after checking that the version's signed manifest names that base:
- the torch engine merges in place (`InPlace`, rlfleet/models/adapter.py `Merger`): its targeted layers'
  base weights are copied once and every version is base + adapter, never accumulated;
- an engine that reloads weights from a directory (vLLM, whose CPU build has no LoRA support) gets
  `MergedDirs.resolve`: base + adapter written as a whole checkpoint directory (merge_dir), one kept at a
  time, which the engine reloads as it would a whole version. It reads the base's weights from disk for
  each version, so it costs one base's size of memory and disk while a version is merged.
A whole version (a directory without adapter_config.json) passes through unchanged.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlfleet.models.adapter import Merger, merge_dir
from rlfleet.versions.adapter import check_base, is_adapter_dir


class InPlace:
    """Applies adapter versions to a live model whose base weights came from `base_dir`."""

    def __init__(self, model, base_dir: Path):
        self.base_dir = Path(base_dir)
        self.merger = Merger(model)

    def apply(self, version_dir: Path) -> None:
        check_base(version_dir, self.base_dir)
        self.merger.apply(version_dir)


class MergedDirs:
    """Version directories as an engine that reloads from files loads them: an adapter's as base + adapter."""

    def __init__(self, base_dir: Path):
        self.base_dir = Path(base_dir)
        self._tmp = tempfile.TemporaryDirectory(prefix="rlfleet-merged-")

    def resolve(self, version_dir: Path) -> Path:
        if not is_adapter_dir(version_dir):
            return Path(version_dir)
        check_base(version_dir, self.base_dir)
        out = Path(self._tmp.name) / "merged"
        if out.exists():  # the previous version's, already loaded by the engine
            shutil.rmtree(out)
        return merge_dir(self.base_dir, version_dir, out)
