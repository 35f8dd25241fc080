"""Policy versions in the checkpoint store.

Layout (every key built here, nowhere else):
    {run}/policy/v{N}/config.json, tokenizer files, model.safetensors (or shards)
    {run}/policy/v{N}/manifest.json      written LAST
Invariants:
  - a version exists (is visible to `latest_version`, `read_manifest`, the origin) only once its
    manifest exists; the manifest is written after every file it lists;
  - a visible version is immutable: re-publishing it with identical files returns the stored
    manifest, with different files raises VersionExistsError; pruning deletes the manifest first;
  - the manifest lists each file's name, size and sha256, and splits each file into shards: byte
    ranges of `shard_size` (the last one shorter) with their own sha256. Every downloader checks
    what it uses before it uses a byte (`verify_dir` whole files; the Shardcast client per shard).
The manifest's form, its checks and its signed bytes are rlfleet.versions.manifest; `read_manifest`
validates what the store holds, `publish_version` builds, checks, signs (`signer(manifest.signing_bytes())`)
and encodes a manifest once. Pruning keeps the delta chains of kept versions (rlfleet.versions.chain).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rlfleet.versions.chain import required_base, retained
from rlfleet.versions.manifest import (
    COMPLETE_MARKER,
    MANIFEST_NAME,
    AdapterSection,
    DeltaSection,
    FileEntry,
    FileRef,
    Manifest,
    ManifestError,
    Shard,
)
from rlfleet.versions.store import CheckpointStore, check_key
from rlfleet.wire.timing import Laps, timed

_VERSION_DIR = re.compile(r"^v(0|[1-9][0-9]*)$")
DEFAULT_SHARD_SIZE = 16 * 1024 * 1024


class ChecksumError(ValueError):
    """A file whose size or sha256 differs from its manifest entry; `.name` is the file."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"{name}: {message}")


class VersionExistsError(FileExistsError):
    """Publishing different files under a version that is already visible."""


def policy_prefix(run: str) -> str:
    return f"{run}/policy/"


def version_dir_name(version: int) -> str:
    return f"v{version}"


def parse_version_dir(name: str) -> int | None:
    """`v12` -> 12; anything else -> None."""
    m = _VERSION_DIR.match(name)
    return int(m.group(1)) if m else None


def version_prefix(run: str, version: int) -> str:
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return f"{policy_prefix(run)}{version_dir_name(version)}/"


def version_key(run: str, version: int, name: str) -> str:
    return version_prefix(run, version) + name


def manifest_key(run: str, version: int) -> str:
    return version_key(run, version, MANIFEST_NAME)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_entry(path: Path, name: str, shard_size: int) -> FileEntry:
    """name, size, sha256 and the shards of one file, in one pass over it."""
    whole, shards, offset = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while data := f.read(shard_size):
            whole.update(data)
            shards.append(Shard(offset, len(data), hashlib.sha256(data).hexdigest()))
            offset += len(data)
    return FileEntry(name, offset, whole.hexdigest(), tuple(shards))


def _local_files(local_dir: Path, shard_size: int) -> tuple[FileEntry, ...]:
    if not local_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {local_dir} does not exist")
    entries = []
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        name = path.relative_to(local_dir).as_posix()
        if name in (MANIFEST_NAME, COMPLETE_MARKER):
            continue
        entries.append(_file_entry(path, check_key(name), shard_size))
    if not entries:
        raise FileNotFoundError(f"checkpoint directory {local_dir} holds no files")
    return tuple(entries)


@dataclasses.dataclass(frozen=True)
class VersionSections:
    """The optional sections of a version's manifest, signed with the rest: `delta` a delta version's,
    `adapter` an adapter version's (rlfleet/versions/manifest.py)."""

    delta: DeltaSection | None = None
    adapter: AdapterSection | None = None


def publish_version(
    store: CheckpointStore,
    run: str,
    version: int,
    local_dir: Path,
    signer: Callable[[bytes], str] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    sections: VersionSections = VersionSections(),
    laps: Laps | None = None,
) -> Manifest:
    """Upload every file of `local_dir` to `{run}/policy/v{N}/`, then manifest.json; return the manifest.
    `sections`: its delta or adapter section, if any. `laps` (the trainer's step parts) gets the hashing of the
    files (publish_hash) and the signing (publish_sign)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    local_dir = Path(local_dir)
    with timed(laps, "publish_hash"):
        files = _local_files(local_dir, shard_size)
    existing = read_manifest(store, run, version)
    if existing is not None:
        if existing.files == files:
            return existing
        raise VersionExistsError(
            f"run {run!r} version {version} is already published with different files; "
            "published versions are immutable, publish a new version number"
        )
    created = datetime.now(UTC).isoformat()
    manifest = Manifest(run, version, shard_size, files, created, sections.delta, adapter=sections.adapter)
    manifest = Manifest.from_json(manifest.to_json(), run, version)  # an ill-formed delta never reaches the store
    for entry in files:
        store.put_file(version_key(run, version, entry.name), local_dir / entry.name)
    if signer is not None:
        with timed(laps, "publish_sign"):
            manifest = dataclasses.replace(manifest, signature=signer(manifest.signing_bytes()))
    store.put_bytes(manifest_key(run, version), manifest.encode())  # last: makes it visible
    return manifest


def read_manifest(store: CheckpointStore, run: str, version: int) -> Manifest | None:
    """The manifest of a visible version, or None if the version is not (yet) published; ManifestError
    (naming the version and the field) if what the store holds is malformed."""
    try:
        raw = store.get_bytes(manifest_key(run, version))
    except KeyError:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest of {run!r} v{version} in the store: not JSON ({exc})") from None
    return Manifest.from_json(doc, run, version)


def list_versions(store: CheckpointStore, run: str) -> list[int]:
    """Visible versions (those with a manifest), ascending."""
    prefix = policy_prefix(run)
    versions = []
    for key in store.list(prefix):
        head, _, tail = key[len(prefix) :].partition("/")
        number = parse_version_dir(head)
        if number is not None and tail == MANIFEST_NAME:
            versions.append(number)
    return sorted(versions)


def latest_version(store: CheckpointStore, run: str) -> int | None:
    versions = list_versions(store, run)
    return versions[-1] if versions else None


def prune_versions(store: CheckpointStore, run: str, keep: int) -> None:
    """Delete the visible versions other than the newest `keep` and the versions their delta chains
    pass through (chain.retained: a kept version stays reachable), manifest first, so none is
    half-visible. Unpublished directories are left alone (maybe in progress)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = list_versions(store, run)

    def base(version: int) -> int | None:
        manifest = read_manifest(store, run, version)
        return None if manifest is None else required_base(manifest)

    kept = retained(versions, keep, base)
    for version in (v for v in versions if v not in kept):
        store.delete_prefix(manifest_key(run, version))
        store.delete_prefix(version_prefix(run, version))


def prune_cache(cache_dir: Path, oldest: int) -> list[int]:
    """Delete the local copies of versions older than `oldest` in a consumer's cache (`v{N}` and an
    unfinished `.v{N}.partial`); the callers choose `oldest` so that no version in use goes. The versions
    deleted."""
    gone = set()
    for child in Path(cache_dir).iterdir() if Path(cache_dir).is_dir() else ():
        name = child.name
        version = parse_version_dir(name.removeprefix(".").removesuffix(".partial"))
        if version is not None and version < oldest and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            gone.add(version)
    return sorted(gone)


def weight_bytes(model_dir: Path) -> int:
    """Bytes of a model directory's safetensors weights (what a load reads)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def save_model_dir(model, tokenizer, dest: Path, state_dict: dict | None = None) -> None:
    """Save an HF model (safetensors) and, if given, its tokenizer into `dest`; `state_dict`, if
    given, holds the weights to write (e.g. gathered from a sharded model) instead of `model`'s."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def verify_file(path: Path, entry: FileRef) -> None:
    """Raise ChecksumError unless `path` has the entry's size and sha256."""
    name = entry.name
    if not path.is_file():
        raise ChecksumError(name, "missing")
    size = path.stat().st_size
    if size != entry.size:
        raise ChecksumError(name, f"size {size} != manifest size {entry.size}")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise ChecksumError(name, f"sha256 {digest} != manifest sha256 {entry.sha256}")


def verify_dir(local_dir: Path, manifest: Manifest) -> None:
    """Check every file of the manifest in `local_dir`; raise ChecksumError naming the first bad one."""
    for entry in manifest.files:
        verify_file(Path(local_dir) / entry.name, entry)
