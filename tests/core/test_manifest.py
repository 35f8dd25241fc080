"""The typed manifest: stored bytes round-trip, signatures verify over what was received (old manifests
too), and a malformed manifest is refused naming the version and the field."""

from __future__ import annotations

import json

import pytest

from rlfleet.versions.checkpoint import publish_version, read_manifest
from rlfleet.versions.manifest import Manifest, ManifestError, check_manifest, parse_manifest, signing_bytes
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store


def version_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    return path


@pytest.fixture
def keys(tmp_path):
    private, public = generate_keypair(tmp_path / "keys")
    return make_signer(load_private_key(private)), parse_public_key(public)


def test_published_manifest_is_encoded_once_and_reads_back_equal(tmp_path, keys):
    signer, public = keys
    store = open_store(f"file://{tmp_path}/store")
    manifest = publish_version(store, "r", 1, version_dir(tmp_path / "v1"), signer=signer, shard_size=4096)
    raw = store.get_bytes("r/policy/v1/manifest.json")
    assert manifest.encode() == raw
    assert manifest.to_json() == json.loads(raw)
    assert manifest.signing_bytes() == signing_bytes(json.loads(raw))
    assert read_manifest(store, "r", 1) == manifest == parse_manifest(raw, "r", 1, public)
    assert [s.size for s in manifest.file("model.safetensors").shards] == [4096, 4096, 2048]


def test_an_old_manifest_without_created_and_with_unknown_fields_still_verifies(tmp_path, keys):
    """The signature covers the object as received; unknown fields are kept, so it re-encodes to the signed form."""
    signer, public = keys
    store = open_store(f"file://{tmp_path}/store")
    doc = publish_version(store, "r", 2, version_dir(tmp_path / "v2")).to_json()
    del doc["created"]
    doc["comment"] = {"from": "an older trainer"}
    doc["files"][0]["note"] = "unknown entry field"
    doc["signature"] = signer(signing_bytes(doc))
    manifest = parse_manifest(json.dumps(doc).encode(), "r", 2, public)
    assert manifest.created is None and manifest.extra == {"comment": {"from": "an older trainer"}}
    assert manifest.signature == doc["signature"]
    without_entry_note = json.loads(json.dumps(doc))
    del without_entry_note["files"][0]["note"]
    assert manifest.to_json() == without_entry_note  # entries are typed; the top level is kept whole


def test_malformed_manifests_name_the_version_and_the_field(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    good = publish_version(store, "r", 3, version_dir(tmp_path / "v3")).to_json()
    cases = {
        "manifest of 'r' v3: not a JSON object": [],
        "'shard_size' must be an int >= 1": {**good, "shard_size": 0},
        "'files' must be a non-empty list": {**good, "files": []},
        "files\\[0\\] needs name": {**good, "files": [{"name": "x"}]},
        "'signature' must be a string": {**good, "signature": 7},
        "describes run 'r' v4": {**good, "version": 4},
    }
    for message, doc in cases.items():
        with pytest.raises(ManifestError, match=message):
            check_manifest(doc, "r", 3)
    with pytest.raises(ManifestError, match="v3: not JSON"):
        parse_manifest(b"{", "r", 3)
    store.put_bytes("r/policy/v3/manifest.json", json.dumps({**good, "shard_size": "big"}).encode())
    with pytest.raises(ManifestError, match="manifest of 'r' v3: 'shard_size'"):
        read_manifest(store, "r", 3)
    assert Manifest.from_json(good).version == 3  # a version directory's own manifest: any run/version
