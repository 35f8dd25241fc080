"""Delta versions: which version builds on which, what a client downloads for each route, retention.

A policy version is published whole (its manifest's `files` are the checkpoint), as a delta against
the version before it, its base, or both (rlfleet.versions.publish). A delta version's manifest has the
usual `files` (what travels: patch files, files shipped whole, each with size, sha256 and shards, so relays
store and forward them like any file) and, covered by the same signature, a `delta` section
(manifest.DeltaSection): the base and the *resulting* files, every file a loader sees, each built from
the base's file and a patch ("patch"), the base's file unchanged ("base") or shipped whole ("file").
A client checks each rebuilt file's size and sha256 against them before the version becomes visible
(shardcast/assemble.py), and `base_sha256` binds the delta to the exact base bytes it was made from.
A version is *whole* when every resulting file is also in `files` (identical size and sha256): then a
client without the base downloads those (`whole_files`), one holding the base only what the delta needs
(`delta_files`).
Invariants: base < version (manifest.check_manifest), so following `required_base` (the base of a version
that is not whole) ends at a whole version; `retained(versions, keep)` is the newest `keep` versions plus
every version those cannot be rebuilt without, so pruning everything else (store, relay) never leaves a
retained version unreachable.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Literal

from rlfleet.versions.manifest import MANIFEST_NAME, DeltaSection, FileEntry, FileRef, Manifest, ManifestError

Retention = Literal["kept", "dropped", "unsure"]  # what retention does with a version (`retention`)


class DeltaError(ValueError):
    """A delta that cannot be used: malformed, made against other base bytes, or rebuilding files
    that do not match the signed manifest. `base` names the held base version to blame, if any."""

    def __init__(self, message: str, base: int | None = None):
        super().__init__(message)
        self.base = base


def base_of(manifest: Manifest) -> int | None:
    """The base version a manifest builds on; None for a full version."""
    return manifest.delta.base if manifest.delta is not None else None


def section_of(manifest: Manifest) -> DeltaSection:
    """The delta section of a delta version; DeltaError for a version that has none (a full version)."""
    if manifest.delta is None:
        raise DeltaError(f"run {manifest.run!r} v{manifest.version} is not a delta version")
    return manifest.delta


def result_files(manifest: Manifest) -> Sequence[FileRef]:
    """Every file of the version as a loader sees it: name, size and sha256 (a delta's rebuilt files)."""
    return manifest.delta.files if manifest.delta is not None else manifest.files


def _ref(f: FileRef) -> tuple[str, int, str]:
    return f.name, f.size, f.sha256


def whole(manifest: Manifest) -> bool:
    """The version can be downloaded without any base: every resulting file is among its `files`."""
    sent = {_ref(f) for f in manifest.files}
    return all(_ref(f) in sent for f in result_files(manifest))


def required_base(manifest: Manifest) -> int | None:
    """The base the version cannot be loaded without: its delta's base unless it is also whole."""
    return None if whole(manifest) else base_of(manifest)


def whole_files(manifest: Manifest) -> list[FileEntry]:
    """The `files` entries a client without the base downloads (only for a whole version)."""
    names = {f.name for f in result_files(manifest)}
    return [f for f in manifest.files if f.name in names]


def delta_files(manifest: Manifest) -> list[FileEntry]:
    """The `files` entries a client holding the base downloads: patches and files shipped whole."""
    section = section_of(manifest).files
    wanted = {e.patch for e in section if e.source == "patch"} | {e.name for e in section if e.source == "file"}
    return [f for f in manifest.files if f.name in wanted]


def size_of(files: Iterable[FileRef]) -> int:
    return sum(f.size for f in files)


def transfer_bytes(manifest: Manifest) -> int:
    """Bytes of everything the version's `files` list (what a relay pulls; the manifest not counted)."""
    return size_of(manifest.files)


def read_manifest_chain(manifest: Manifest, read: Callable[[int], Manifest | None]) -> list[Manifest] | None:
    """`manifest` and the manifests before it that need their base, newest first, back to (not
    including) a whole version; `read(v)` gives v's manifest. None when one of them is missing."""
    chain = []
    current: Manifest | None = manifest
    while current is not None and (base := required_base(current)) is not None:
        chain.append(current)
        current = read(base)
    return None if current is None else chain


def retained(versions: Iterable[int], keep: int, base: Callable[[int], int | None]) -> set[int]:
    """The newest `keep` of `versions` and every version their chains pass through (`base(v)` is the base
    v cannot be loaded without: None for a whole version, or one whose manifest is gone). A base that
    is not among `versions` is included (it is needed, e.g. to be pulled again) but not followed further."""
    held = set(versions)
    kept = set(sorted(held)[-keep:]) if keep > 0 else set()
    todo = list(kept)
    while todo:
        b = base(todo.pop())
        if b is not None and b not in kept:
            kept.add(b)
            if b in held:
                todo.append(b)
    return kept


def dir_required_base(version_dir: Path) -> int | None:
    """`required_base` of the manifest.json in a version directory (None: whole, or unreadable)."""
    try:
        return required_base(Manifest.from_json(json.loads((Path(version_dir) / MANIFEST_NAME).read_bytes())))
    except (OSError, ValueError, ManifestError):
        return None


def dir_retained(root: Path, versions: Iterable[int], keep: int) -> set[int]:
    """`retained` over version directories `root/v{N}` (a relay's cache), bases read from their manifests."""
    return retained(versions, keep, lambda v: dir_required_base(Path(root) / f"v{v}"))


def retention(held: Iterable[int], keep: int, base: Callable[[int], int | None], version: int) -> Retention:
    """Whether `retained` over `held` and `version` keeps `version`: "kept"; "dropped" when it is outside every
    kept chain for good; "unsure" when a kept chain reaches a base newer than `version` that is not held (its
    own base unknown here, e.g. still being pulled), so `version` may yet be on that chain."""
    versions = {*held, version}
    kept = retained(versions, keep, base)
    if version in kept:
        return "kept"
    return "unsure" if any(b > version for b in kept - versions) else "dropped"


def dir_retention(root: Path, held: Iterable[int], keep: int, version: int) -> Retention:
    """`retention` over version directories `root/v{N}` (a relay's cache), bases read from their manifests."""
    return retention(held, keep, lambda v: dir_required_base(Path(root) / f"v{v}"), version)
