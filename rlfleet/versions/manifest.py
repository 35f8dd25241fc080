"""The manifest of a policy version: typed, validated once where its bytes come in, encoded once where it goes out.

JSON form (what is stored, served, signed):
    {"run", "version", "created", "shard_size",
     "files": [{"name", "size", "sha256", "shards": [{"offset", "size", "sha256"}]}],
     ["delta": {"format": 1, "base": B, "files": [{"name", "size", "sha256", "from", ["patch"], ["base_sha256"]}]}],
     ["adapter": {"format": 1, "base": "<sha256 of the base model>", "model": "<the run's spec.model.path>"}],
     ["signature": "ed25519:..."]}
`files` are what travels (for a delta version: patch files and files shipped whole); the signed `delta`
section names the base version and the *resulting* files (rlfleet.versions.chain says how they are built).
Invariants of a `Manifest` (checked by `Manifest.from_json`, the one way in from bytes):
  - file names are safe relative store keys, unique, never manifest.json or .complete, so a downloader
    may join them under its own directory;
  - each file's shards tile it in order, each 1..shard_size bytes with its own sha256;
  - a delta's base is below the version; each resulting file comes from one source the transferred
    `files` back (a patch file, or the same file shipped whole), and a resulting file also among
    `files` is identical to it there;
  - an adapter version (LoRA: its files are the adapter, rlfleet/versions/adapter.py) names the base it
    was trained over by that base's identity (adapter.base_identity), so a consumer holding another base
    refuses it; it is never a delta (an adapter is small and ships whole).
Signatures: `signing_bytes` is the canonical JSON (sorted keys, compact) of the JSON object without
"signature". `parse_manifest` verifies the signature over the object exactly as received, before the
shape is checked or anything typed is built; unknown top-level fields are kept in `extra`, so
`to_json` gives back what was signed. `encode` is the stored form (indented, sorted keys).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

from rlfleet.versions.store import check_key

MANIFEST_NAME = "manifest.json"
COMPLETE_MARKER = ".complete"  # written last into a downloaded version directory
SIGNATURE_FIELD = "signature"
DELTA = "delta"  # the manifest field of the delta section
ADAPTER = "adapter"  # the manifest field of an adapter version's section
FORMAT = 1
SOURCES = ("patch", "base", "file")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_KNOWN = {"run", "version", "created", "shard_size", "files", DELTA, ADAPTER, SIGNATURE_FIELD}


class ManifestError(ValueError):
    """A manifest that is malformed or does not describe the expected run/version."""


@dataclass(frozen=True)
class FileRef:
    """A file by name, size and sha256."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Shard:
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class FileEntry(FileRef):
    """A file that travels: split into shards, each checked on its own by a downloader."""

    shards: tuple[Shard, ...] = ()

    def to_json(self) -> dict:
        shards = [{"offset": s.offset, "size": s.size, "sha256": s.sha256} for s in self.shards]
        return {**super().to_json(), "shards": shards}


@dataclass(frozen=True)
class ResultFile(FileRef):
    """A file of a delta version as a loader sees it, and where it comes from (`source`, "from" in JSON):
    "patch" (the base's file + patch file `patch`), "base" (the base's file unchanged) or "file" (shipped whole)."""

    source: str = "file"
    patch: str | None = None
    base_sha256: str | None = None

    def to_json(self) -> dict:
        out = {**super().to_json(), "from": self.source}
        if self.patch is not None:
            out["patch"] = self.patch
        if self.base_sha256 is not None:
            out["base_sha256"] = self.base_sha256
        return out


@dataclass(frozen=True)
class DeltaSection:
    base: int
    files: tuple[ResultFile, ...]
    format: int = FORMAT

    def to_json(self) -> dict:
        return {"format": self.format, "base": self.base, "files": [f.to_json() for f in self.files]}


@dataclass(frozen=True)
class AdapterSection:
    """A LoRA version: its files are an adapter over the base model whose identity is `base`; `model` is the
    run's spec.model.path, for messages."""

    base: str
    model: str
    format: int = FORMAT

    def to_json(self) -> dict:
        return {"format": self.format, "base": self.base, "model": self.model}


@dataclass(frozen=True)
class Manifest:
    run: str
    version: int
    shard_size: int
    files: tuple[FileEntry, ...]
    created: str | None = None
    delta: DeltaSection | None = None
    signature: str | None = None
    adapter: AdapterSection | None = None
    extra: Mapping = field(default_factory=dict)  # unknown top-level fields, kept so re-encoding is lossless

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def to_json(self) -> dict:
        out = {**self.extra, "run": self.run, "version": self.version, "shard_size": self.shard_size}
        out["files"] = [f.to_json() for f in self.files]
        if self.created is not None:
            out["created"] = self.created
        if self.delta is not None:
            out[DELTA] = self.delta.to_json()
        if self.adapter is not None:
            out[ADAPTER] = self.adapter.to_json()
        if self.signature is not None:
            out[SIGNATURE_FIELD] = self.signature
        return out

    def signing_bytes(self) -> bytes:
        return signing_bytes(self.to_json())

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, doc: object, run: str | None = None, version: int | None = None) -> Manifest:
        """The manifest `doc` (a decoded JSON object) if it is well formed (and, when given, describes
        run/version); else ManifestError naming the version and the field."""
        return check_manifest(doc, run, version)


def signing_bytes(doc: Mapping) -> bytes:
    """Canonical bytes a signature covers: sorted-key compact JSON of the object without the signature field."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(raw: bytes, run: str, version: int, public_key=None) -> Manifest:
    """The manifest in `raw` if its signature verifies with `public_key` (an ed25519 public key;
    None = signatures not required) and it is well formed for run/version. Raises
    rlfleet.versions.signing.SignatureError or ManifestError; the signature is checked before anything else."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"manifest of {run!r} v{version}: not JSON ({exc})") from None
    if public_key is not None:
        from rlfleet.versions.signing import SignatureError, verify_signature

        if not isinstance(doc, dict):
            raise SignatureError(f"manifest of {run!r} v{version}: not a JSON object, so not signed")
        verify_signature(public_key, signing_bytes(doc), doc.get(SIGNATURE_FIELD))
    return check_manifest(doc, run, version)


def _int(value: object, low: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _sha(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _SHA256.match(value) is not None


def check_manifest(doc: object, run: str | None = None, version: int | None = None) -> Manifest:
    """`doc` as a Manifest if it is well formed and describes run/version (either None: any), else
    ManifestError. File names are safe relative paths, so a downloader may join them under its own directory."""
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest of {run!r} v{version}: not a JSON object")
    run = doc.get("run") if run is None else run
    version = doc.get("version") if version is None else version
    where = f"manifest of {run!r} v{version}"
    if doc.get("run") != run or doc.get("version") != version or not isinstance(run, str) or not _int(version):
        raise ManifestError(f"{where}: describes run {doc.get('run')!r} v{doc.get('version')!r}")
    shard_size = doc.get("shard_size")
    if not _int(shard_size, 1):
        raise ManifestError(f"{where}: 'shard_size' must be an int >= 1")
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        raise ManifestError(f"{where}: 'files' must be a non-empty list")
    entries: list[FileEntry] = []
    names: set[str] = set()
    for i, entry in enumerate(files):
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str) and _int(entry.get("size"))
        if not ok or not _sha(entry.get("sha256")):
            raise ManifestError(f"{where}: files[{i}] needs name (str), size (int >= 0) and sha256 (64 hex)")
        try:
            _claim_name(entry["name"], names)
        except ValueError as exc:
            raise ManifestError(f"{where}: files[{i}]: {exc}") from None
        shards = _shards(f"{where}: files[{i}] ({entry['name']})", entry, shard_size)
        entries.append(FileEntry(entry["name"], entry["size"], entry["sha256"], shards))
    try:
        delta = _section(doc.get(DELTA), version, {e.name: e for e in entries})
        adapter = _adapter(doc.get(ADAPTER), delta)
    except ValueError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    signature = doc.get(SIGNATURE_FIELD)
    if signature is not None and not isinstance(signature, str):
        raise ManifestError(f"{where}: '{SIGNATURE_FIELD}' must be a string")
    created = doc.get("created")
    extra = {k: v for k, v in doc.items() if k not in _KNOWN}
    return Manifest(run, version, shard_size, tuple(entries), created, delta, signature, adapter, extra)


def _adapter(section: object, delta: DeltaSection | None) -> AdapterSection | None:
    """The `adapter` section (None if absent), or ValueError: format 1, base a sha256, model a string, no delta."""
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("format") != FORMAT or not _sha(section.get("base")):
        raise ValueError(f"'{ADAPTER}' must be an object with format {FORMAT}, base (64 hex) and model (str)")
    if not isinstance(section.get("model"), str):
        raise ValueError(f"'{ADAPTER}' must be an object with format {FORMAT}, base (64 hex) and model (str)")
    if delta is not None:
        raise ValueError(f"an adapter version ships whole: '{ADAPTER}' and '{DELTA}' together")
    return AdapterSection(section["base"], section["model"])


def _claim_name(name: str, names: set[str]) -> None:
    """Add a file name to a version's `names`: a safe relative key (store.check_key), neither the manifest's
    own files nor one already named; ValueError otherwise."""
    check_key(name)
    if name in (MANIFEST_NAME, COMPLETE_MARKER) or name in names:
        raise ValueError(f"name {name!r} is reserved or repeated")
    names.add(name)


def _shards(where: str, entry: dict, shard_size: int) -> tuple[Shard, ...]:
    """Shards must tile the file in order, each 1..shard_size bytes with a sha256."""
    shards = entry.get("shards")
    if not isinstance(shards, list):
        raise ManifestError(f"{where}: 'shards' must be a list")
    out, offset = [], 0
    for j, shard in enumerate(shards):
        ok = (
            isinstance(shard, dict)
            and shard.get("offset") == offset
            and _int(shard.get("size"), 1)
            and shard["size"] <= shard_size
            and _sha(shard.get("sha256"))
        )
        if not ok:
            raise ManifestError(f"{where}: shards[{j}] needs offset {offset}, size 1..{shard_size} and sha256 (64 hex)")
        out.append(Shard(offset, shard["size"], shard["sha256"]))
        offset += shard["size"]
    if offset != entry["size"]:
        raise ManifestError(f"{where}: shards cover {offset} bytes, the file has {entry['size']}")
    return tuple(out)


def _section(section: object, version: int, sent: dict[str, FileEntry]) -> DeltaSection | None:
    """The `delta` section (None if absent), or ValueError naming the problem: format 1, an int base
    below the version, resulting files with unique safe names, each from one source that the transferred
    `files` back, and every resulting file that is also among `files` identical to it there."""
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("format") != FORMAT:
        raise ValueError(f"'{DELTA}' must be an object with format {FORMAT}")
    base = section.get("base")
    if not _int(base) or not base < version:
        raise ValueError(f"'{DELTA}.base' must be an int version below {version}, got {base!r}")
    files = section.get("files")
    if not isinstance(files, list) or not files:
        raise ValueError(f"'{DELTA}.files' must be a non-empty list of the resulting files")
    out: list[ResultFile] = []
    names: set[str] = set()
    for i, entry in enumerate(files):
        where = f"'{DELTA}.files[{i}]'"
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and _int(entry.get("size"))
            and _sha(entry.get("sha256"))
            and entry.get("from") in SOURCES
        )
        if not ok:
            raise ValueError(f"{where} needs name, size (int >= 0), sha256 (64 hex) and from ({'/'.join(SOURCES)})")
        try:
            _claim_name(entry["name"], names)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if entry["from"] != "file" and not _sha(entry.get("base_sha256")):
            raise ValueError(f"{where}: from {entry['from']!r} needs base_sha256 (64 hex)")
        if entry["from"] == "patch" and entry.get("patch") not in sent:
            raise ValueError(f"{where}: patch {entry.get('patch')!r} is not one of the manifest's files")
        same = sent.get(entry["name"])  # a resulting file also sent whole must be that file exactly
        if entry["from"] == "file" and same is None:
            raise ValueError(f"{where}: shipped whole, but the manifest's files have no {entry['name']!r}")
        if same is not None and (same.size, same.sha256) != (entry["size"], entry["sha256"]):
            raise ValueError(f"{where}: the manifest's files have another {entry['name']!r} (size or sha256 differ)")
        patch, base_sha = entry.get("patch"), entry.get("base_sha256")
        patch = patch if isinstance(patch, str) else None
        base_sha = base_sha if isinstance(base_sha, str) else None
        out.append(ResultFile(entry["name"], entry["size"], entry["sha256"], entry["from"], patch, base_sha))
    return DeltaSection(base, tuple(out))
