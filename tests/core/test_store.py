"""The checkpoint store (file and S3 behave the same) and policy versions on top of it."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import boto3
import pytest

from rlfleet.versions.checkpoint import (
    ChecksumError,
    VersionExistsError,
    latest_version,
    list_versions,
    manifest_key,
    prune_versions,
    publish_version,
    read_manifest,
    verify_dir,
    version_key,
    version_prefix,
)
from rlfleet.versions.manifest import ManifestError, check_manifest
from rlfleet.versions.store import CheckpointStore, FileStore, S3Store, open_store


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> CheckpointStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_env")
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/some/prefix", endpoint_url=endpoint)


class RecordingStore(CheckpointStore):
    """A real store that also records the order of writes."""

    def __init__(self, inner: CheckpointStore):
        self.inner, self.writes = inner, []

    def put_bytes(self, key, data):
        self.writes.append(key)
        self.inner.put_bytes(key, data)

    def put_file(self, key, path):
        self.writes.append(key)
        self.inner.put_file(key, path)

    def get_bytes(self, key):
        return self.inner.get_bytes(key)

    def download(self, key, dest):
        self.inner.download(key, dest)

    def open_read(self, key, start=0, end=None):
        return self.inner.open_read(key, start, end)

    def size(self, key):
        return self.inner.size(key)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix):
        return self.inner.list(prefix)

    def delete_prefix(self, prefix):
        self.inner.delete_prefix(prefix)


def make_version_dir(path: Path, seed: int, big: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    (path / "model.safetensors").write_bytes(os.urandom(1000 + seed) + b"x" * big)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_put_get_list_exists_delete(store, tmp_path):
    store.put_bytes("run/a/one", b"1")
    store.put_bytes("run/a/two", b"22")
    store.put_bytes("run/ab/three", b"333")
    store.put_bytes("other/x", b"")
    assert store.get_bytes("run/a/two") == b"22"
    assert store.get_bytes("other/x") == b""
    assert store.exists("run/a/one") and not store.exists("run/a/nope") and not store.exists("run/a")
    assert store.size("run/ab/three") == 3
    assert store.list("run/a/") == ["run/a/one", "run/a/two"]
    assert store.list("run/a") == ["run/a/one", "run/a/two", "run/ab/three"]  # string prefix, like S3
    assert store.list("") == ["other/x", "run/a/one", "run/a/two", "run/ab/three"]
    assert store.list("missing/") == []
    store.put_bytes("run/a/one", b"replaced")
    assert store.get_bytes("run/a/one") == b"replaced"
    store.delete_prefix("run/a/")
    assert store.list("run/") == ["run/ab/three"]
    store.delete_prefix("nothing/here/")
    src = tmp_path / "src.bin"
    src.write_bytes(b"file body")
    store.put_file("run/f.bin", src)
    store.download("run/f.bin", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == b"file body"


def test_ranged_read(store):
    data = bytes(range(256)) * 9000  # 2.3 MB: several chunks
    store.put_bytes("r/blob", data)
    assert b"".join(store.open_read("r/blob")) == data
    assert b"".join(store.open_read("r/blob", 10, 20)) == data[10:20]
    assert b"".join(store.open_read("r/blob", 1_500_000)) == data[1_500_000:]
    assert b"".join(store.open_read("r/blob", 5, 5)) == b""
    assert b"".join(store.open_read("r/blob", len(data) - 3, len(data) + 100)) == data[-3:]
    assert b"".join(store.open_read("r/blob", len(data) + 10)) == b""


def test_missing_key_raises_keyerror(store, tmp_path):
    for call in (
        lambda: store.get_bytes("no/such"),
        lambda: store.size("no/such"),
        lambda: store.open_read("no/such"),
        lambda: store.download("no/such", tmp_path / "d"),
    ):
        with pytest.raises(KeyError, match="no/such"):
            call()
    assert not (tmp_path / "d").exists()


def test_large_file_upload(store, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 * 1024 * 1024))  # above boto3's 8 MiB multipart threshold
    store.put_file("run/big.bin", big)
    assert store.size("run/big.bin") == big.stat().st_size
    store.download("run/big.bin", tmp_path / "back.bin")
    assert hashlib.sha256((tmp_path / "back.bin").read_bytes()).digest() == hashlib.sha256(big.read_bytes()).digest()


def test_bad_keys_refused(store):
    for key in ("", "/abs", "a/../b", "a//b", "a/./b"):
        with pytest.raises(ValueError, match="store key"):
            store.put_bytes(key, b"x")


@pytest.mark.parametrize("uri", ["/plain/path", "file://relative/no/dot", "file://", "s3://", "gs://bucket/x", "s3:/b"])
def test_bad_uri_is_a_clear_error(uri):
    with pytest.raises(ValueError) as info:
        open_store(uri)
    assert repr(uri) in str(info.value) and "file:///" in str(info.value) and "s3://bucket/prefix" in str(info.value)


def test_file_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_store("file://./here/store")
    assert isinstance(rel, FileStore) and rel.root == tmp_path / "here" / "store"
    rel.put_bytes("k", b"v")
    assert (tmp_path / "here" / "store" / "k").read_bytes() == b"v"
    assert open_store(f"file://{tmp_path}/abs").root == tmp_path / "abs"
    assert not (tmp_path / "abs").exists()  # nothing created before the first write


def test_s3_missing_bucket_is_named(s3_env):
    with pytest.raises(FileNotFoundError, match="'no-such-bucket-xyz'"):
        open_store("s3://no-such-bucket-xyz/p", endpoint_url=s3_env)


def test_s3_endpoint_from_environment(s3_env, monkeypatch):
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket="env-endpoint")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env)
    store = open_store("s3://env-endpoint")
    assert isinstance(store, S3Store) and store.prefix == ""
    store.put_bytes("k", b"v")
    assert store.list("") == ["k"]


def test_publish_writes_manifest_last(store, tmp_path):
    rec = RecordingStore(store)
    src = make_version_dir(tmp_path / "v1", seed=1)
    manifest = publish_version(rec, "run1", 1, src)
    assert rec.writes[-1] == manifest_key("run1", 1) == "run1/policy/v1/manifest.json"
    assert sorted(rec.writes[:-1]) == [
        version_key("run1", 1, n) for n in ("config.json", "model.safetensors", "tokenizer.json")
    ]
    assert manifest.run == "run1" and manifest.version == 1 and manifest.created
    blob = (src / "model.safetensors").read_bytes()
    assert manifest.file("model.safetensors").to_json() == {
        "name": "model.safetensors",
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "shards": [{"offset": 0, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}],
    }
    assert read_manifest(store, "run1", 1) == manifest


def test_files_are_split_into_hashed_shards(store, tmp_path):
    src = make_version_dir(tmp_path / "v1", seed=1, big=10_000)  # model.safetensors: 11_001 bytes
    manifest = publish_version(store, "run1", 1, src, shard_size=4096)
    assert manifest.shard_size == 4096
    entry = manifest.file("model.safetensors")
    blob = (src / "model.safetensors").read_bytes()
    assert [(s.offset, s.size) for s in entry.shards] == [(0, 4096), (4096, 4096), (8192, 2809)]
    for s in entry.shards:
        assert s.sha256 == hashlib.sha256(blob[s.offset : s.offset + s.size]).hexdigest()
    assert check_manifest(manifest.to_json(), "run1", 1) == manifest
    broken = manifest.to_json()
    broken["files"][1]["shards"][1]["offset"] = 4000  # a gap/overlap in the tiling
    with pytest.raises(ManifestError, match="shards\\[1\\] needs offset 4096"):
        check_manifest(broken, "run1", 1)
    broken = manifest.to_json()
    broken["files"][1]["shards"].pop()
    with pytest.raises(ManifestError, match="cover 8192 bytes"):
        check_manifest(broken, "run1", 1)


def test_latest_version_sees_only_complete_versions(store, tmp_path):
    assert latest_version(store, "run1") is None
    publish_version(store, "run1", 1, make_version_dir(tmp_path / "a", 1))
    publish_version(store, "run1", 10, make_version_dir(tmp_path / "b", 2))
    # v11 half-uploaded: its files are there, its manifest is not
    store.put_file(version_key("run1", 11, "model.safetensors"), tmp_path / "b" / "model.safetensors")
    publish_version(store, "other", 12, make_version_dir(tmp_path / "c", 3))
    assert list_versions(store, "run1") == [1, 10]
    assert latest_version(store, "run1") == 10
    assert read_manifest(store, "run1", 11) is None
    assert version_prefix("run1", 11) == "run1/policy/v11/"


def test_republish_is_idempotent_and_versions_are_immutable(store, tmp_path):
    src = make_version_dir(tmp_path / "v1", seed=1)
    first = publish_version(store, "r", 1, src)
    assert publish_version(store, "r", 1, src) == first
    (src / "model.safetensors").write_bytes(b"different")
    with pytest.raises(VersionExistsError, match="version 1"):
        publish_version(store, "r", 1, src)
    assert read_manifest(store, "r", 1) == first


def test_verify_dir_names_the_bad_file(store, tmp_path):
    manifest = publish_version(store, "r", 3, make_version_dir(tmp_path / "src", 3))
    dest = tmp_path / "dest"
    dest.mkdir()
    for entry in manifest.files:
        store.download(version_key("r", 3, entry.name), dest / entry.name)
    verify_dir(dest, manifest)
    blob = bytearray((dest / "model.safetensors").read_bytes())
    blob[100] ^= 0xFF
    (dest / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ChecksumError, match="model.safetensors: sha256"):
        verify_dir(dest, manifest)
    (dest / "config.json").write_text("{}")
    with pytest.raises(ChecksumError, match="config.json: size"):
        verify_dir(dest, manifest)


def test_prune_keeps_newest(store, tmp_path):
    src = make_version_dir(tmp_path / "src", 0)
    for v in (1, 2, 3, 4):
        publish_version(store, "r", v, src)
    prune_versions(store, "r", keep=2)
    assert list_versions(store, "r") == [3, 4]
    assert store.list(version_prefix("r", 1)) == [] and store.list(version_prefix("r", 2)) == []
    assert len(store.list(version_prefix("r", 4))) == 4
