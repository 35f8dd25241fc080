"""Delta versions without the network: the codec on real safetensors, the manifest section, the
publisher's choice between whole and delta versions, and retention that keeps chains reachable."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlfleet.config import DeltaSpec
from rlfleet.versions.chain import (
    DeltaError,
    base_of,
    delta_files,
    required_base,
    result_files,
    retained,
    retention,
    whole,
)
from rlfleet.versions.checkpoint import (
    VersionExistsError,
    VersionSections,
    list_versions,
    prune_versions,
    publish_version,
    read_manifest,
)
from rlfleet.versions.codec import apply_file, encode_file, read_index
from rlfleet.versions.manifest import DeltaSection, Manifest, ManifestError, check_manifest, parse_manifest
from rlfleet.versions.publish import PolicyPublisher, local_entries
from rlfleet.versions.signing import SignatureError, generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from tests.support import trained_versions


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def roundtrip(base: Path, new: Path, tmp: Path) -> tuple[dict, float]:
    """Encode new against base, rebuild it; assert it is byte-identical; return (ops, delta/new size)."""
    ops = encode_file(base, new, tmp / "x.delta")
    size, digest = apply_file(base, tmp / "x.delta", tmp / "rebuilt")
    assert (
        (size, digest)
        == (new.stat().st_size, sha256(new))
        == ((tmp / "rebuilt").stat().st_size, sha256(tmp / "rebuilt"))
    )
    return ops, (tmp / "x.delta").stat().st_size / max(1, new.stat().st_size)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_codec_rebuilds_consecutive_trained_versions_exactly(tmp_path, dtype):
    versions = trained_versions(tmp_path / "src", 3, dtype)
    for before, after in zip(versions, versions[1:]):
        ops, ratio = roundtrip(before / "model.safetensors", after / "model.safetensors", tmp_path)
        assert ops["copy"] > 0  # the safetensors header is the same
        assert ops.get("xor", 0) + ops.get("add", 0) + ops.get("sparse", 0) > 0
        assert ratio < (0.75 if dtype == "float32" else 0.4), ratio  # measured ~0.6 and ~0.2


def test_codec_picks_copy_sparse_and_dense_forms_per_tensor(tmp_path):
    torch.manual_seed(0)
    base = {"same": torch.randn(500), "one": torch.randn(4000), "all": torch.randn(4000), "ints": torch.arange(64)}
    new = {k: v.clone() for k, v in base.items()}
    new["one"][17] += 1.0  # one element of 4000 changed: sparse
    new["all"] += 1e-3 * torch.randn(4000)  # every element: xor or add
    save_file(base, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    ops, ratio = roundtrip(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path)
    assert ops["sparse"] == 4 * 4000 and ops.get("xor", 0) + ops.get("add", 0) == 4 * 4000
    assert ops["copy"] >= 4 * 500 + 8 * 64
    assert ops["sparse_bytes"] < 100 and ratio < 0.5


def test_codec_rebuilds_other_layouts_and_opaque_files(tmp_path):
    torch.manual_seed(1)
    save_file({"w": torch.randn(100, 10), "gone": torch.randn(5)}, tmp_path / "a.safetensors")
    # another header: a tensor added, one removed, one of another shape and dtype
    save_file(
        {"w": torch.randn(100, 10), "new": torch.randn(7), "b": torch.randn(3).half()}, tmp_path / "b.safetensors"
    )
    ops, _ = roundtrip(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path)
    assert ops["raw"] > 0
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "b.bin").write_bytes(bytes(range(256)) * 39 + b"\x01" * 256)  # same size, not safetensors
    ops, _ = roundtrip(tmp_path / "a.bin", tmp_path / "b.bin", tmp_path)
    assert ops.get("sparse", 0) + ops.get("xor", 0) == 256 * 40 and "raw" not in ops  # diffed byte by byte
    (tmp_path / "c.bin").write_bytes(b"shorter")
    roundtrip(tmp_path / "a.bin", tmp_path / "c.bin", tmp_path)  # other size: raw
    (tmp_path / "empty").write_bytes(b"")
    roundtrip(tmp_path / "empty", tmp_path / "a.bin", tmp_path)
    roundtrip(tmp_path / "a.bin", tmp_path / "empty", tmp_path)


def test_codec_refuses_malformed_deltas_and_other_bases(tmp_path):
    versions = trained_versions(tmp_path / "src", 2)
    base, new = versions[0] / "model.safetensors", versions[1] / "model.safetensors"
    encode_file(base, new, tmp_path / "good.delta")
    good = (tmp_path / "good.delta").read_bytes()
    index, payload_end = read_index(tmp_path / "good.delta")
    dense = next(s for s in index["segments"] if s[2] in ("xor", "add") and s[6] > 100)

    def write(data: bytes) -> Path:
        (tmp_path / "bad.delta").write_bytes(data)
        return tmp_path / "bad.delta"

    def with_index(change) -> bytes:
        bad = json.loads(json.dumps(index))
        change(bad)
        text = json.dumps(bad).encode()
        return good[:payload_end] + text + struct.pack("<Q", len(text)) + b"RLFDELT1"

    flipped = bytearray(good)
    flipped[dense[5] + dense[6] // 2] ^= 0x10  # inside a compressed payload (zstd's frame checksum)
    cases = {
        "too short": good[:10],
        "not a delta file": good[:-1] + b"X",
        "truncated": good[: len(good) // 2],
        "index is not JSON": good[:payload_end] + b"X" + good[payload_end + 1 :],
        "segments cover": with_index(lambda i: i["segments"].pop()),
        "malformed or out of range": with_index(lambda i: i["segments"][1].__setitem__(3, 10**12)),
        "does not decompress": bytes(flipped),
    }
    for message, data in cases.items():
        with pytest.raises(DeltaError, match=message):
            apply_file(base, write(data), tmp_path / "out")
    shutil.copyfile(base, tmp_path / "longer")
    with open(tmp_path / "longer", "ab") as f:
        f.write(b"\0")
    with pytest.raises(DeltaError, match="made against a base of"):
        apply_file(tmp_path / "longer", tmp_path / "good.delta", tmp_path / "out")
    # the same delta applied to another base of the same size decodes, to other bytes: the caller's
    # sha256 check against the signed manifest is what refuses it (shardcast/assemble.py)
    other = trained_versions(tmp_path / "other", 1, seed=5)[0] / "model.safetensors"
    assert apply_file(other, tmp_path / "good.delta", tmp_path / "out")[1] != sha256(new)


@pytest.fixture
def keys(tmp_path):
    private, public = generate_keypair(tmp_path / "keys")
    return make_signer(load_private_key(private)), parse_public_key(public)


def publish_all(
    publisher: PolicyPublisher, versions: list[Path], tmp_path: Path, start: int = 0
) -> list[tuple[Manifest, str]]:
    """Publish copies of `versions` (the publisher moves files out of what it publishes); each
    manifest with the publisher's kind of it."""
    out = []
    for v, src in enumerate(versions, start):
        copy = Path(tempfile.mkdtemp(dir=tmp_path)) / f"v{v}"
        shutil.copytree(src, copy)
        out.append((publisher.publish(v, copy), publisher.last["kind"]))
    return out


def kinds(published: list[tuple[Manifest, str]]) -> list[str]:
    return [kind for _, kind in published]


def manifests_of(published: list[tuple[Manifest, str]]) -> list[Manifest]:
    return [m for m, _ in published]


def test_publisher_sends_deltas_and_whole_versions_by_the_rules(tmp_path, keys):
    signer, public = keys
    store = open_store(f"file://{tmp_path}/store")
    versions = trained_versions(tmp_path / "src", 7, "bfloat16")
    spec = DeltaSpec(full_every=4, max_chain_ratio=100.0)
    published = publish_all(PolicyPublisher(store, "r", spec, signer, 4096), versions, tmp_path)
    # v0: no base; v4: fullEvery, published whole *and* as a delta against v3
    assert kinds(published) == ["full", "delta", "delta", "delta", "full+delta", "delta", "delta"]
    for v, (m, src) in enumerate(zip(manifests_of(published), versions)):
        raw = store.get_bytes(f"r/policy/v{v}/manifest.json")
        assert parse_manifest(raw, "r", v, public) == m  # signed, delta section included
        assert m.encode() == raw  # encoded once, as stored
        expected = sorted((e.name, e.size, e.sha256) for e in local_entries(src))
        assert sorted((e.name, e.size, e.sha256) for e in result_files(m)) == expected
        assert whole(m) == (v in (0, 4)) and required_base(m) == (None if v in (0, 4) else v - 1)
        if v:
            assert base_of(m) == v - 1
            sources = {e.name: e.source for e in m.delta.files}
            assert sources["model.safetensors"] == "patch" and sources["tokenizer.json"] == "base"
            assert [f.name for f in delta_files(m)] == ["delta/model.safetensors.delta"]
            assert sum(f.size for f in delta_files(m)) < 0.4 * sum(e.size for e in result_files(m))
    # a tampered delta section breaks the signature like any other field
    forged = json.loads(store.get_bytes("r/policy/v2/manifest.json"))
    forged["delta"]["base"] = 0
    with pytest.raises(SignatureError):
        parse_manifest(json.dumps(forged).encode(), "r", 2, public)

    # the chain budget: the deltas since the last whole version stay under 0.5 x a checkpoint; the
    # version whose delta would pass it is published whole
    store2 = open_store(f"file://{tmp_path}/store2")
    short = PolicyPublisher(store2, "r", DeltaSpec(full_every=100, max_chain_ratio=0.5), signer, 4096)
    chain, seen = 0, []
    for v, src in enumerate(versions):
        manifest = publish_all(short, [src], tmp_path, start=v)[0][0]
        seen.append(short.last["kind"])
        if v and short.last["kind"] == "full+delta":
            assert chain + short.last["delta_bytes"] > 0.5 * short.last["full_bytes"]
            chain = 0
        elif v:
            chain += sum(f.size for f in manifest.files)
            assert chain <= 0.5 * short.last["full_bytes"]
    assert seen[0] == "full" and "full+delta" in seen and seen.count("delta") >= 2, seen
    # whole versions without their delta
    store4 = open_store(f"file://{tmp_path}/store4")
    spec = DeltaSpec(full_every=4, max_chain_ratio=100.0, delta_with_whole=False)
    published = publish_all(PolicyPublisher(store4, "r", spec, signer, 4096), versions, tmp_path)
    assert kinds(published) == ["full", "delta", "delta", "delta", "full", "delta", "delta"]
    assert base_of(published[4][0]) is None and base_of(published[5][0]) == 4
    # deltas that do not pay (maxRatio) and deltas turned off
    for spec in (DeltaSpec(max_ratio=0.01), DeltaSpec(enabled=False)):
        store3 = open_store(f"file://{tmp_path}/store3-{spec.enabled}")
        published = publish_all(PolicyPublisher(store3, "r", spec, signer, 4096), versions[:3], tmp_path)
        assert kinds(published) == ["full"] * 3 and all(base_of(m) is None for m in manifests_of(published))


def test_publisher_resumes_idempotently(tmp_path, keys):
    signer, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    versions = trained_versions(tmp_path / "src", 4, "bfloat16")
    first = publish_all(PolicyPublisher(store, "r", DeltaSpec(), signer, 4096), versions[:3], tmp_path)
    assert base_of(first[2][0]) == 1
    # a restarted trainer re-publishes its last version: the stored delta version is kept as it is ...
    again = PolicyPublisher(store, "r", DeltaSpec(), signer, 4096)
    assert manifests_of(publish_all(again, versions[2:3], tmp_path, start=2)) == manifests_of(first[2:])
    assert again.last["kind"] == "existing"
    # ... and is the base of the next one
    nxt = publish_all(again, versions[3:], tmp_path, start=3)[0][0]
    assert base_of(nxt) == 2
    with pytest.raises(VersionExistsError, match="version 2"):
        publish_all(PolicyPublisher(store, "r", DeltaSpec(), signer, 4096), versions[1:2], tmp_path, start=2)


def test_manifest_delta_sections_are_checked(tmp_path, keys):
    store = open_store(f"file://{tmp_path}/store")
    versions = trained_versions(tmp_path / "src", 2, "bfloat16")
    manifest = publish_all(PolicyPublisher(store, "r", DeltaSpec(), keys[0], 4096), versions, tmp_path)[1][0]
    manifest = manifest.to_json()
    assert check_manifest(manifest, "r", 1).to_json() == manifest
    cases = {
        "format 1": lambda d: d.update(format=2),
        "base' must be an int version below 1": lambda d: d.update(base=1),
        "non-empty list": lambda d: d.update(files=[]),
        "needs name, size": lambda d: d["files"][0].pop("sha256"),
        "reserved or repeated": lambda d: d["files"].append(dict(d["files"][0])),
        "needs base_sha256": lambda d: next(f for f in d["files"] if f["from"] == "base").pop("base_sha256"),
        "is not one of the manifest's files": lambda d: next(f for f in d["files"] if f["from"] == "patch").update(
            patch="nope"
        ),
        "have no 'config.json'": lambda d: d["files"][0].update({"from": "file"}),
        "another 'delta/model": lambda d: d["files"][0].update(name="delta/model.safetensors.delta"),
        "must be a relative path": lambda d: d["files"][0].update(name="../escape"),
    }
    for message, change in cases.items():
        bad = json.loads(json.dumps(manifest))
        change(bad["delta"])
        with pytest.raises(ManifestError, match=message):
            check_manifest(bad, "r", 1)
    with pytest.raises(ManifestError, match="format 1"):
        publish_version(store, "r", 5, versions[0], sections=VersionSections(delta=DeltaSection(0, (), format=9)))
    assert read_manifest(store, "r", 5) is None


def test_retained_follows_chains_to_a_full_version():
    bases = {1: 0, 2: 1, 3: 2, 4: None, 5: 4, 6: 5, 7: None, 8: 7}
    assert retained(range(9), 2, bases.get) == {8, 7}
    assert retained(range(9), 3, bases.get) == {8, 7, 6, 5, 4}
    assert retained([3, 6], 1, bases.get) == {6, 5}  # a base not held is kept (to pull again), not followed
    assert retained([], 3, bases.get) == set()


def test_retention_says_dropped_only_when_no_kept_chain_can_reach_the_version():
    """A relay answers 410 only for "dropped"; "unsure" (404, ask again) while a kept chain runs into a version it
    does not hold yet: the version asked for may be further down that chain."""
    bases = {1: 0, 2: 1, 3: 2, 4: None, 5: 4, 6: 5, 7: None, 8: 7}
    assert retention([6, 7, 8], 2, bases.get, 5) == "dropped"  # 8 and 7 kept; 7 is whole
    assert retention([4, 5, 6], 1, bases.get, 5) == "kept"  # on the chain of 6
    assert retention([4, 5, 6], 1, bases.get, 3) == "dropped"  # the chain of 6 ends at the whole 4
    assert retention([3], 1, bases.get, 1) == "unsure"  # 3's base 2 is not held: its chain goes on unseen
    assert retention([2, 3], 1, bases.get, 1) == "kept"  # ...and, once 2 is held, passes through 1
    assert retention([6], 1, bases.get, 1) == "unsure"  # where 5's chain ends is not known without 5
    assert retention([8], 1, bases.get, 1) == "unsure"  # nor 7's (whole, but not held here)
    assert retention([7, 8], 1, bases.get, 1) == "dropped"
    assert retention([], 1, bases.get, 1) == "kept"  # nothing newer held: it is the newest


def test_prune_never_leaves_a_kept_version_unreachable(tmp_path, keys):
    store = open_store(f"file://{tmp_path}/store")
    versions = trained_versions(tmp_path / "src", 9, "bfloat16")
    publisher = PolicyPublisher(store, "r", DeltaSpec(full_every=4, max_chain_ratio=100.0), keys[0], 4096)
    for v, src in enumerate(versions):
        publish_all(publisher, [src], tmp_path, start=v)
        for keep in (1, 2, 3):
            before = list_versions(store, "r")
            prune_versions(store, "r", keep)
            kept = list_versions(store, "r")
            assert kept[-keep:] == before[-keep:]
            for version in kept:  # every kept version's chain ends at a whole version in the store
                while (base := required_base(read_manifest(store, "r", version))) is not None:
                    assert base in kept, (v, keep, version, base)
                    version = base
    assert list_versions(store, "r") == [8]  # v8 is whole and a delta (fullEvery 4): nothing older is needed
