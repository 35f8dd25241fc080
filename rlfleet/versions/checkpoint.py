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
Manifest: {"run", "version", "created", "shard_size", "files": [{"name", "size", "sha256",
  "shards": [{"offset", "size", "sha256"}]}][, "delta"][, "signature"]}. A delta version's `files` are
  what travels (patch files); its signed "delta" section names the base version and the resulting
  files with their sha256 (rlfleet.versions.chain). Pruning keeps the chains of kept versions.
Signing: `publish_version(..., signer=f)` stores f(manifest_signing_bytes(manifest)) under
"signature"; the bytes are canonical JSON of the manifest without that field (rlfleet.versions.signing).
`parse_manifest` checks the signature first, then the shape; nothing of an unchecked manifest is used.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rlfleet.versions.chain import check_section, required_base, retained
from rlfleet.versions.store import CheckpointStore, check_key

MANIFEST_NAME = "manifest.json"
COMPLETE_MARKER = ".complete"  # written last into a downloaded version directory
SIGNATURE_FIELD = "signature"
_VERSION_DIR = re.compile(r"^v(0|[1-9][0-9]*)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_SHARD_SIZE = 16 * 1024 * 1024


class ChecksumError(ValueError):
    """A file whose size or sha256 differs from its manifest entry; `.name` is the file."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(f"{name}: {message}")


class ManifestError(ValueError):
    """A manifest that is malformed or does not describe the expected run/version."""


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


def manifest_signing_bytes(manifest: dict) -> bytes:
    """Canonical bytes a signature covers: sorted-key compact JSON without the signature field."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def _file_entry(path: Path, name: str, shard_size: int) -> dict:
    """name, size, sha256 and the shards of one file, in one pass over it."""
    whole, shards, offset = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while data := f.read(shard_size):
            whole.update(data)
            shards.append({"offset": offset, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            offset += len(data)
    return {"name": name, "size": offset, "sha256": whole.hexdigest(), "shards": shards}


def _local_files(local_dir: Path, shard_size: int) -> list[dict]:
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
    return entries


def publish_version(
    store: CheckpointStore,
    run: str,
    version: int,
    local_dir: Path,
    signer: Callable[[bytes], str] | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    extra: dict | None = None,
) -> dict:
    """Upload every file of `local_dir` to `{run}/policy/v{N}/`, then manifest.json; return the manifest.
    `extra` adds signed fields to the manifest (a delta version's "delta" section)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    local_dir = Path(local_dir)
    files = _local_files(local_dir, shard_size)
    existing = read_manifest(store, run, version)
    if existing is not None:
        if existing["files"] == files:
            return existing
        raise VersionExistsError(
            f"run {run!r} version {version} is already published with different files; "
            "published versions are immutable, publish a new version number"
        )
    for entry in files:
        store.put_file(version_key(run, version, entry["name"]), local_dir / entry["name"])
    manifest = {
        "run": run,
        "version": version,
        "files": files,
        "shard_size": shard_size,
        "created": datetime.now(UTC).isoformat(),
        **(extra or {}),
    }
    check_manifest(manifest, run, version)  # an ill-formed extra never reaches the store
    if signer is not None:
        manifest[SIGNATURE_FIELD] = signer(manifest_signing_bytes(manifest))
    store.put_bytes(manifest_key(run, version), encode_manifest(manifest))  # last: makes it visible
    return manifest


def check_manifest(manifest: object, run: str, version: int) -> dict:
    """Return `manifest` if it is well formed and describes run/version, else raise ManifestError.
    File names are safe relative paths, so a downloader may join them under its own directory."""
    where = f"manifest of {run!r} v{version}"
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if manifest.get("run") != run or manifest.get("version") != version:
        raise ManifestError(f"{where}: describes run {manifest.get('run')!r} v{manifest.get('version')!r}")
    shard_size = manifest.get("shard_size")
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise ManifestError(f"{where}: 'shard_size' must be an int >= 1")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise ManifestError(f"{where}: 'files' must be a non-empty list")
    names = set()
    for i, entry in enumerate(files):
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("size"), int)
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _SHA256.match(entry["sha256"])
        )
        if not ok:
            raise ManifestError(f"{where}: files[{i}] needs name (str), size (int >= 0) and sha256 (64 hex)")
        try:
            check_key(entry["name"])
        except ValueError as exc:
            raise ManifestError(f"{where}: files[{i}]: {exc}") from None
        if entry["name"] in (MANIFEST_NAME, COMPLETE_MARKER) or entry["name"] in names:
            raise ManifestError(f"{where}: files[{i}]: name {entry['name']!r} is reserved or repeated")
        names.add(entry["name"])
        _check_shards(f"{where}: files[{i}] ({entry['name']})", entry, shard_size)
    try:
        check_section(manifest)
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    return manifest


def _check_shards(where: str, entry: dict, shard_size: int) -> None:
    """Shards must tile the file in order, each 1..shard_size bytes with a sha256."""
    shards = entry.get("shards")
    if not isinstance(shards, list):
        raise ManifestError(f"{where}: 'shards' must be a list")
    offset = 0
    for j, shard in enumerate(shards):
        ok = (
            isinstance(shard, dict)
            and shard.get("offset") == offset
            and isinstance(shard.get("size"), int)
            and 1 <= shard["size"] <= shard_size
            and isinstance(shard.get("sha256"), str)
            and _SHA256.match(shard["sha256"])
        )
        if not ok:
            raise ManifestError(f"{where}: shards[{j}] needs offset {offset}, size 1..{shard_size} and sha256 (64 hex)")
        offset += shard["size"]
    if offset != entry["size"]:
        raise ManifestError(f"{where}: shards cover {offset} bytes, the file has {entry['size']}")


def parse_manifest(raw: bytes, run: str, version: int, public_key=None) -> dict:
    """The manifest in `raw` if its signature verifies with `public_key` (an ed25519 public key;
    None = signatures not required) and it is well formed for run/version. Raises
    rlfleet.versions.signing.SignatureError or ManifestError; the signature is checked before anything else."""
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest of {run!r} v{version}: not JSON ({exc})") from None
    if public_key is not None:
        from rlfleet.versions.signing import SignatureError, verify_signature

        if not isinstance(manifest, dict):
            raise SignatureError(f"manifest of {run!r} v{version}: not a JSON object, so not signed")
        verify_signature(public_key, manifest_signing_bytes(manifest), manifest.get(SIGNATURE_FIELD))
    return check_manifest(manifest, run, version)


def read_manifest(store: CheckpointStore, run: str, version: int) -> dict | None:
    """The manifest of a visible version, or None if the version is not (yet) published."""
    try:
        return json.loads(store.get_bytes(manifest_key(run, version)))
    except KeyError:
        return None


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
    kept = retained(versions, keep, lambda v: required_base(read_manifest(store, run, v) or {}))
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


def save_model_dir(model, tokenizer, dest: Path, state_dict: dict | None = None) -> None:
    """Save an HF model (safetensors) and, if given, its tokenizer into `dest`; `state_dict`, if
    given, holds the weights to write (e.g. gathered from a sharded model) instead of `model`'s."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def verify_file(path: Path, entry: dict) -> None:
    """Raise ChecksumError unless `path` has the entry's size and sha256."""
    name = entry["name"]
    if not path.is_file():
        raise ChecksumError(name, "missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise ChecksumError(name, f"size {size} != manifest size {entry['size']}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ChecksumError(name, f"sha256 {digest} != manifest sha256 {entry['sha256']}")


def verify_dir(local_dir: Path, manifest: dict) -> None:
    """Check every file of the manifest in `local_dir`; raise ChecksumError naming the first bad one."""
    for entry in manifest["files"]:
        verify_file(Path(local_dir) / entry["name"], entry)
