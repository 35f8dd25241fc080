"""Delta versions in manifests: the signed `delta` section, which version needs which, retention.

A policy version is published whole (its manifest's `files` are the checkpoint), as a delta against
the version before it, its base, or both (rlfleet.versions.publish). A manifest with a delta has the usual
`files` (what travels: patch files, files shipped whole, each with size, sha256 and shards, so relays
store and forward them like any file) and, covered by the same signature,

    "delta": {"format": 1, "base": B, "files": [
        {"name", "size", "sha256", "from": "patch", "patch": P, "base_sha256"},  # base's file + patch P
        {"name", "size", "sha256", "from": "base", "base_sha256"},               # the base's file, unchanged
        {"name", "size", "sha256", "from": "file"}]}                             # shipped whole in `files`

The section's `files` are the *resulting* version, every file a loader sees; a client checks each
rebuilt file's size and sha256 against them before the version becomes visible (shardcast/assemble.py),
and `base_sha256` binds the delta to the exact base bytes it was made from. A version is *whole* when
every resulting file is also in `files` (identical size and sha256): then a client without the base
downloads those (`whole_files`), one holding the base only what the delta needs (`delta_files`).
Invariants: base < version, so following `required_base` (the base of a version that is not whole)
ends at a whole version; `retained(versions, keep)` is the newest `keep` versions plus every version
those cannot be rebuilt without, so pruning everything else (store, relay) never leaves a retained
version unreachable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

DELTA = "delta"  # the manifest field
FORMAT = 1
SOURCES = ("patch", "base", "file")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DeltaError(ValueError):
    """A delta that cannot be used: malformed, made against other base bytes, or rebuilding files
    that do not match the signed manifest. `base` names the held base version to blame, if any."""

    def __init__(self, message: str, base: int | None = None):
        super().__init__(message)
        self.base = base


def base_of(manifest: dict) -> int | None:
    """The base version a manifest builds on; None for a full version (or no readable base)."""
    section = manifest.get(DELTA) if isinstance(manifest, dict) else None
    base = section.get("base") if isinstance(section, dict) else None
    return base if isinstance(base, int) and not isinstance(base, bool) else None


def result_files(manifest: dict) -> list[dict]:
    """Every file of the version as a loader sees it: name, size and sha256 (a delta's rebuilt files)."""
    section = manifest.get(DELTA)
    return section["files"] if isinstance(section, dict) else manifest["files"]


def whole(manifest: dict) -> bool:
    """The version can be downloaded without any base: every resulting file is among its `files`."""
    sent = {(f["name"], f["size"], f["sha256"]) for f in manifest["files"]}
    return all((f["name"], f["size"], f["sha256"]) in sent for f in result_files(manifest))


def required_base(manifest: dict) -> int | None:
    """The base the version cannot be loaded without: its delta's base unless it is also whole."""
    section = manifest.get(DELTA) if isinstance(manifest, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("files"), list):
        return None
    try:
        return None if whole(manifest) else base_of(manifest)
    except (KeyError, TypeError):
        return base_of(manifest)


def whole_files(manifest: dict) -> list[dict]:
    """The `files` entries a client without the base downloads (only for a whole version)."""
    names = {f["name"] for f in result_files(manifest)}
    return [f for f in manifest["files"] if f["name"] in names]


def delta_files(manifest: dict) -> list[dict]:
    """The `files` entries a client holding the base downloads: patches and files shipped whole."""
    section = manifest[DELTA]["files"]
    wanted = {e["patch"] for e in section if e["from"] == "patch"} | {e["name"] for e in section if e["from"] == "file"}
    return [f for f in manifest["files"] if f["name"] in wanted]


def size_of(files: list[dict]) -> int:
    return sum(f["size"] for f in files)


def transfer_bytes(manifest: dict) -> int:
    """Bytes of everything the version's `files` list (what a relay pulls; the manifest not counted)."""
    return size_of(manifest["files"])


def read_manifest_chain(manifest: dict, read: Callable[[int], dict | None]) -> list[dict] | None:
    """`manifest` and the manifests before it that need their base, newest first, back to (not
    including) a whole version; `read(v)` gives v's manifest. None when one of them is missing."""
    chain = []
    current: dict | None = manifest
    while current is not None and (base := required_base(current)) is not None:
        chain.append(current)
        current = read(base)
    return None if current is None else chain


def check_section(manifest: dict) -> None:
    """Raise ValueError naming the problem unless the `delta` section (if any) is well formed:
    format 1, an int base below the version, resulting files with unique safe names, each from one
    source that the transferred `files` back (a patch file, or the same file shipped whole), and every
    resulting file that is also among `files` identical to it there."""
    from rlfleet.versions.store import check_key

    section = manifest.get(DELTA)
    if section is None:
        return
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise ValueError(f"'{DELTA}' must be an object with format {FORMAT}")
    base = section.get("base")
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < manifest["version"]:
        raise ValueError(f"'{DELTA}.base' must be an int version below {manifest['version']}, got {base!r}")
    files = section.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError(f"'{DELTA}.files' must be a non-empty list of the resulting files")
    sent = {f["name"]: f for f in manifest["files"]}
    names = set()
    for i, entry in enumerate(files):
        where = f"'{DELTA}.files[{i}]'"
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry.get("size"), bool)
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _SHA256.match(entry["sha256"])
            and entry.get("from") in SOURCES
        )
        if not ok:
            raise ValueError(f"{where} needs name, size (int >= 0), sha256 (64 hex) and from ({'/'.join(SOURCES)})")
        check_key(entry["name"])
        if entry["name"] in names or entry["name"] in ("manifest.json", ".complete"):
            raise ValueError(f"{where}: name {entry['name']!r} is reserved or repeated")
        names.add(entry["name"])
        if entry["from"] != "file" and not (
            isinstance(entry.get("base_sha256"), str) and _SHA256.match(entry["base_sha256"])
        ):
            raise ValueError(f"{where}: from {entry['from']!r} needs base_sha256 (64 hex)")
        if entry["from"] == "patch" and entry.get("patch") not in sent:
            raise ValueError(f"{where}: patch {entry.get('patch')!r} is not one of the manifest's files")
        same = sent.get(entry["name"])  # a resulting file also sent whole must be that file exactly
        if entry["from"] == "file" and same is None:
            raise ValueError(f"{where}: shipped whole, but the manifest's files have no {entry['name']!r}")
        if same is not None and (same["size"], same["sha256"]) != (entry["size"], entry["sha256"]):
            raise ValueError(f"{where}: the manifest's files have another {entry['name']!r} (size or sha256 differ)")


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
        return required_base(json.loads((Path(version_dir) / "manifest.json").read_bytes()))
    except (OSError, ValueError):
        return None


def dir_retained(root: Path, versions: Iterable[int], keep: int) -> set[int]:
    """`retained` over version directories `root/v{N}` (a relay's cache), bases read from their manifests."""
    return retained(versions, keep, lambda v: dir_required_base(Path(root) / f"v{v}"))
