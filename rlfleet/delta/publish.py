"""The trainer's side of delta versions: publish each policy version whole or as a delta against the one before.

`PolicyPublisher.publish(version, local_dir)` publishes
  - whole when deltas are off, when it has no base (the first publish of a process, or the previous
    publish was not version - 1), when version % fullEvery == 0, when the delta would be larger than
    maxRatio x the whole checkpoint (it does not pay), or when the deltas since the last whole
    version would add up past maxChainRatio x the whole checkpoint (a client without a base fetches
    the last whole version and every delta after it: never more than 1 + maxChainRatio checkpoints);
  - else as a delta against version - 1, file by file: a file identical to the base's comes from the
    base; a safetensors file the base also has becomes the patch `{name}.delta` (codec.encode_file)
    unless the patch is not smaller than the file; anything else is shipped whole.
The base is the publisher's own copy of the previous version's files, never read back from the store:
`base_sha256` in the manifest names exactly the bytes the delta was made against.
Idempotent: a version already in the store is left as it is when its resulting files (name, size,
sha256) equal `local_dir`'s, however it was published (a resumed trainer re-publishes its version),
and becomes the base of the next one; other files raise VersionExistsError.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rlfleet.checkpoint import (
    COMPLETE_MARKER,
    DEFAULT_SHARD_SIZE,
    MANIFEST_NAME,
    VersionExistsError,
    publish_version,
    read_manifest,
    sha256_file,
)
from rlfleet.delta.chain import DELTA, FORMAT, base_of, result_files, transfer_bytes
from rlfleet.delta.codec import encode_file
from rlfleet.store import CheckpointStore

log = logging.getLogger("rlfleet.delta")

PATCH_SUFFIX = ".delta"


def local_entries(local_dir: Path) -> list[dict]:
    """name, size and sha256 of every checkpoint file under `local_dir`, by name."""
    entries = []
    for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        name = path.relative_to(local_dir).as_posix()
        if name not in (MANIFEST_NAME, COMPLETE_MARKER):
            entries.append({"name": name, "size": path.stat().st_size, "sha256": sha256_file(path)})
    return entries


def _key(entries: list[dict]) -> list[tuple]:
    return sorted((e["name"], e["size"], e["sha256"]) for e in entries)


class PolicyPublisher:
    """Publishes one run's versions in order, keeping the last one's files as the next one's base.
    `spec` is a DeltaSpec (spec.shardcast.deltas). `last` describes the latest publish for logs and
    benchmarks: kind ("full", "delta" or "existing"), full_bytes, sent_bytes, encode_seconds, ops."""

    def __init__(
        self,
        store: CheckpointStore,
        run: str,
        spec,
        signer: Callable[[bytes], str] | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
    ):
        self.store, self.run, self.spec, self.signer, self.shard_size = store, run, spec, signer, shard_size
        self._dir = tempfile.TemporaryDirectory(prefix="rlfleet-publish-base-")
        self.base: tuple[int, Path, list[dict]] | None = None  # (version, its files, their entries)
        self.chain_bytes = 0.0  # bytes of the deltas since the last whole version
        self.last: dict = {}

    def close(self) -> None:
        self._dir.cleanup()

    def publish(self, version: int, local_dir: Path) -> dict:
        """Publish `local_dir`'s files as `version`; return its manifest. Afterwards the files are
        moved out of `local_dir` into the publisher's base directory."""
        local_dir = Path(local_dir)
        full_bytes = sum(p.stat().st_size for p in local_dir.rglob("*") if p.is_file())
        self.last = {"version": version, "full_bytes": full_bytes, "ops": {}}
        existing = read_manifest(self.store, self.run, version)
        if existing is not None:
            manifest = self._existing(existing, local_dir, version)
        else:
            manifest = self._delta(version, local_dir, full_bytes) if self._wants_delta(version) else None
            if manifest is None:
                manifest = publish_version(
                    self.store, self.run, version, local_dir, signer=self.signer, shard_size=self.shard_size
                )
                self.chain_bytes = 0.0
                self.last.update(kind="full", sent_bytes=transfer_bytes(manifest))
        self._keep(version, local_dir, result_files(manifest))
        return manifest

    def _wants_delta(self, version: int) -> bool:
        return (
            self.spec.enabled
            and self.base is not None
            and self.base[0] == version - 1
            and version % self.spec.full_every != 0
        )

    def _existing(self, existing: dict, local_dir: Path, version: int) -> dict:
        if _key(result_files(existing)) != _key(local_entries(local_dir)):
            raise VersionExistsError(
                f"run {self.run!r} version {version} is already published with different files; "
                "published versions are immutable, publish a new version number"
            )
        self.chain_bytes = self._chain_in_store(existing)
        self.last.update(kind="existing", sent_bytes=0)
        return existing

    def _chain_in_store(self, manifest: dict) -> float:
        """Bytes of the deltas from `manifest` back to its whole version (inf if the chain is broken)."""
        total = 0.0
        while (base := base_of(manifest)) is not None:
            total += transfer_bytes(manifest)
            manifest = read_manifest(self.store, self.run, base)
            if manifest is None:
                return math.inf
        return total

    def _delta(self, version: int, local_dir: Path, full_bytes: int) -> dict | None:
        """Publish `version` as a delta against the base, or return None when it would not pay."""
        base_version, base_dir, base_entries = self.base
        started, ops = time.monotonic(), Counter()
        entries = local_entries(local_dir)
        by_name = {e["name"]: e for e in base_entries}
        names = {e["name"] for e in entries}
        section, sent = [], 0
        with tempfile.TemporaryDirectory(prefix="rlfleet-delta-") as tmp:
            out = Path(tmp)
            for entry in entries:
                name, base = entry["name"], by_name.get(entry["name"])
                if base is not None and (base["size"], base["sha256"]) == (entry["size"], entry["sha256"]):
                    section.append({**entry, "from": "base", "base_sha256": base["sha256"]})
                    continue
                patch = name + PATCH_SUFFIX
                if base is not None and name.endswith(".safetensors") and patch not in names:
                    (out / patch).parent.mkdir(parents=True, exist_ok=True)
                    ops.update(encode_file(base_dir / name, local_dir / name, out / patch))
                    size = (out / patch).stat().st_size
                    if size < entry["size"]:
                        section.append({**entry, "from": "patch", "patch": patch, "base_sha256": base["sha256"]})
                        sent += size
                        continue
                    (out / patch).unlink()
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local_dir / name, out / name)
                section.append({**entry, "from": "file"})
                sent += entry["size"]
            self.last.update(encode_seconds=time.monotonic() - started, ops=dict(ops), delta_bytes=sent)
            too_big = sent > self.spec.max_ratio * full_bytes
            too_long = self.chain_bytes + sent > self.spec.max_chain_ratio * full_bytes
            if sent == 0 or too_big or too_long:
                why = "nothing changed" if sent == 0 else "it does not pay" if too_big else "the chain is long enough"
                log.info("v%d published whole: its delta has %d of %d bytes and %s", version, sent, full_bytes, why)
                return None
            extra = {DELTA: {"format": FORMAT, "base": base_version, "files": section}}
            manifest = publish_version(
                self.store, self.run, version, out, signer=self.signer, shard_size=self.shard_size, extra=extra
            )
        self.chain_bytes += sent
        self.last.update(kind="delta", sent_bytes=transfer_bytes(manifest))
        log.info(
            "v%d published as a delta against v%d: %d of %d bytes (%.3f) in %.2f s",
            version,
            base_version,
            sent,
            full_bytes,
            sent / max(full_bytes, 1),
            self.last["encode_seconds"],
        )
        return manifest

    def _keep(self, version: int, local_dir: Path, entries: list[dict]) -> None:
        """Make `local_dir`'s files the base of the next version (moved, not copied)."""
        keep = Path(self._dir.name) / "base"
        if keep.exists():
            shutil.rmtree(keep)
        keep.mkdir()
        for entry in entries:
            (keep / entry["name"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(local_dir / entry["name"], keep / entry["name"])
        self.base = (version, keep, [{k: e[k] for k in ("name", "size", "sha256")} for e in entries])
