"""The trainer's side of delta versions: publish each policy version whole, as a delta, or both.

`PolicyPublisher.publish(version, local_dir)` first makes the delta against version - 1 when deltas
are on and it holds that version's files (not for the first publish of a process), file by file: a
file identical to the base's comes from the base; a safetensors file the base also has becomes the
patch `delta/{name}.delta` (codec.encode_file) unless the patch is not smaller than the file; anything else
is shipped whole. Then it publishes
  - the delta alone, when it pays (at most maxRatio x the whole checkpoint) and the version is not due
    to be whole;
  - whole *and* the delta (both in `files`, one signed manifest) when it pays but the version is due:
    version % fullEvery == 0, or the deltas since the last whole version would add up past
    maxChainRatio x the checkpoint. Workers holding version - 1 still download only the delta; a
    client without a base downloads the whole files, never more than a whole version plus
    maxChainRatio checkpoints of deltas after it. With deltaWithWhole off, such a version is whole alone;
  - whole alone, when there is no delta or it does not pay.
The base is the publisher's own copy of the previous version's files, never read back from the store:
`base_sha256` in the manifest names exactly the bytes the delta was made against.
An adapter version (trainer.lora; `publish(..., adapter=...)`) is always published whole: an adapter
is a few MiB, its files are new at every step (the delta would be about its size), and it is applied to
the base a consumer holds, never to the previous version.
Idempotent: a version already in the store is left as it is when its resulting files (name, size,
sha256) equal `local_dir`'s, however it was published (a resumed trainer re-publishes its version),
and becomes the base of the next one; other files raise VersionExistsError.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from rlfleet.versions.chain import delta_files, read_manifest_chain, result_files, size_of, transfer_bytes
from rlfleet.versions.checkpoint import (
    COMPLETE_MARKER,
    DEFAULT_SHARD_SIZE,
    MANIFEST_NAME,
    VersionExistsError,
    VersionSections,
    publish_version,
    read_manifest,
    sha256_file,
)
from rlfleet.versions.codec import encode_file
from rlfleet.versions.manifest import AdapterSection, DeltaSection, FileRef, Manifest, ResultFile
from rlfleet.versions.store import CheckpointStore
from rlfleet.wire.timing import Laps, timed

log = logging.getLogger("rlfleet.versions")

PATCH_DIR, PATCH_SUFFIX = "delta", ".delta"  # delta/model.safetensors.delta: names sort patches first, so
# a relay pulling a version that is whole and a delta (files in name order) has the patches first


def local_entries(local_dir: Path) -> list[FileRef]:
    """name, size and sha256 of every checkpoint file under `local_dir`, by name."""
    entries = []
    for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        name = path.relative_to(local_dir).as_posix()
        if name not in (MANIFEST_NAME, COMPLETE_MARKER):
            entries.append(FileRef(name, path.stat().st_size, sha256_file(path)))
    return entries


def _link(src: Path, dest: Path) -> None:
    """`dest` gets `src`'s bytes: a hard link (no copy of a large file), or a copy across filesystems."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _key(entries: Sequence[FileRef]) -> list[tuple]:
    return sorted((e.name, e.size, e.sha256) for e in entries)


class PolicyPublisher:
    """Publishes one run's versions in order, keeping the last one's files as the next one's base.
    `spec` is a DeltaSpec (spec.shardcast.deltas). `last` describes the latest publish for logs and
    benchmarks: kind ("full", "delta", "full+delta" or "existing"), full_bytes, sent_bytes (what a
    worker holding the previous version downloads), relay_bytes (what a relay pulls), delta_bytes,
    encode_seconds, ops (codec bytes per op)."""

    def __init__(
        self,
        store: CheckpointStore,
        run: str,
        spec,
        signer: Callable[[bytes], str] | None = None,
        shard_size: int = DEFAULT_SHARD_SIZE,
        laps: Laps | None = None,
    ):
        self.store, self.run, self.spec, self.signer, self.shard_size = store, run, spec, signer, shard_size
        # The trainer's step parts (services/trainer/split.py), when given: each publish counts its seconds as
        # publish_delta, publish_hash and publish_sign, and the rest of it (store I/O, moving the files) as
        # publish_store.
        self.laps = laps
        self._dir = tempfile.TemporaryDirectory(prefix="rlfleet-publish-base-")
        self.base: tuple[int, Path, list[FileRef]] | None = None  # (version, its files, their entries)
        self.chain_bytes = 0.0  # bytes of the deltas since the last whole version
        self.last: dict = {}

    def close(self) -> None:
        self._dir.cleanup()

    def publish(self, version: int, local_dir: Path, adapter: AdapterSection | None = None) -> Manifest:
        """Publish `local_dir`'s files as `version` (an adapter over a base when `adapter` is given: whole,
        never a delta); return its manifest. Afterwards the files are moved out of `local_dir` into the
        publisher's base directory."""
        with timed(self.laps, "publish_store"):
            return self._write(version, Path(local_dir), adapter)

    def _write(self, version: int, local_dir: Path, adapter: AdapterSection | None) -> Manifest:
        full_bytes = sum(p.stat().st_size for p in local_dir.rglob("*") if p.is_file())
        self.last = {"version": version, "full_bytes": full_bytes, "ops": {}}
        existing = read_manifest(self.store, self.run, version)
        if existing is not None:
            manifest = self._existing(existing, local_dir, version)
        else:
            with tempfile.TemporaryDirectory(prefix="rlfleet-delta-") as tmp:
                with timed(self.laps, "publish_delta"):
                    section = self._delta(local_dir, Path(tmp)) if self._has_base(version) and not adapter else None
                manifest = self._publish(version, local_dir, Path(tmp), section, full_bytes, adapter)
        self._keep(version, local_dir, result_files(manifest))
        return manifest

    def _has_base(self, version: int) -> bool:
        return self.spec.enabled and self.base is not None and self.base[0] == version - 1

    def _publish(
        self,
        version: int,
        local_dir: Path,
        out: Path,
        section: list[ResultFile] | None,
        full_bytes: int,
        adapter: AdapterSection | None = None,
    ) -> Manifest:
        """Publish the delta in `out` (described by `section`), or it and the whole files, or these alone."""
        sent = self.last.get("delta_bytes", 0)
        base = self.base[0] if self.base is not None else None  # a section is made only against a base
        offer = DeltaSection(base, tuple(section)) if section is not None and base is not None else None
        pays = offer is not None and 0 < sent <= self.spec.max_ratio * full_bytes
        due = version % self.spec.full_every == 0 or self.chain_bytes + sent > self.spec.max_chain_ratio * full_bytes
        if pays and not due:
            kind, src = "delta", out
        elif offer is not None and pays and self.spec.delta_with_whole:
            kind, src = "full+delta", out  # whole and the delta: the whole files beside the patches
            for entry in offer.files:
                if not (out / entry.name).exists():
                    _link(local_dir / entry.name, out / entry.name)
        else:
            kind, src, pays = "full", local_dir, False
        delta = offer if pays else None
        manifest = publish_version(
            self.store,
            self.run,
            version,
            src,
            signer=self.signer,
            shard_size=self.shard_size,
            sections=VersionSections(delta, adapter),
            laps=self.laps,
        )
        self.chain_bytes = self.chain_bytes + sent if kind == "delta" else 0.0
        worker = size_of(delta_files(manifest)) if pays else full_bytes  # what a worker holding version - 1 gets
        self.last.update(kind=kind, sent_bytes=worker, relay_bytes=transfer_bytes(manifest))
        log.info(
            "v%d published %s: the delta %s %d of %d bytes (%.3f)%s",
            version,
            kind,
            "has" if section is not None else "would have",
            sent,
            full_bytes,
            sent / max(full_bytes, 1),
            "" if pays else " (published whole only)",
        )
        return manifest

    def _existing(self, existing: Manifest, local_dir: Path, version: int) -> Manifest:
        if _key(result_files(existing)) != _key(local_entries(local_dir)):
            raise VersionExistsError(
                f"run {self.run!r} version {version} is already published with different files; "
                "published versions are immutable, publish a new version number"
            )
        chain = read_manifest_chain(existing, lambda v: read_manifest(self.store, self.run, v))
        self.chain_bytes = sum(size_of(delta_files(m)) for m in chain) if chain is not None else math.inf
        self.last.update(kind="existing", sent_bytes=0)
        return existing

    def _delta(self, local_dir: Path, out: Path) -> list[ResultFile]:
        """Write the delta of `local_dir` against the base into `out`; return the section's files."""
        assert self.base is not None  # _has_base() said so
        _, base_dir, base_entries = self.base
        started, ops = time.monotonic(), Counter[str]()
        entries = local_entries(local_dir)
        by_name = {e.name: e for e in base_entries}
        names = {e.name for e in entries}
        section, sent = [], 0
        for entry in entries:
            name, base = entry.name, by_name.get(entry.name)
            ref = (entry.name, entry.size, entry.sha256)
            if base is not None and (base.size, base.sha256) == (entry.size, entry.sha256):
                section.append(ResultFile(*ref, source="base", base_sha256=base.sha256))
                continue
            patch = f"{PATCH_DIR}/{name}{PATCH_SUFFIX}"
            if base is not None and name.endswith(".safetensors") and patch not in names:
                (out / patch).parent.mkdir(parents=True, exist_ok=True)
                ops.update(encode_file(base_dir / name, local_dir / name, out / patch))
                size = (out / patch).stat().st_size
                if size < entry.size:
                    section.append(ResultFile(*ref, source="patch", patch=patch, base_sha256=base.sha256))
                    sent += size
                    continue
                (out / patch).unlink()
            _link(local_dir / name, out / name)
            section.append(ResultFile(*ref, source="file"))
            sent += entry.size
        self.last.update(encode_seconds=time.monotonic() - started, ops=dict(ops), delta_bytes=sent)
        return section

    def _keep(self, version: int, local_dir: Path, entries: Sequence[FileRef]) -> None:
        """Make `local_dir`'s files the base of the next version (moved, not copied)."""
        keep = Path(self._dir.name) / "base"
        if keep.exists():
            shutil.rmtree(keep)
        keep.mkdir()
        for entry in entries:
            (keep / entry.name).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(local_dir / entry.name, keep / entry.name)
        self.base = (version, keep, [FileRef(e.name, e.size, e.sha256) for e in entries])
