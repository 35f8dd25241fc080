"""Signed manifests: ed25519 keys, the signature over the canonical manifest, and key configuration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlfleet.config import ShardcastSpec
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.manifest import ManifestError, parse_manifest, signing_bytes
from rlfleet.versions.signing import (
    KeyConfigError,
    SignatureError,
    generate_keypair,
    load_private_key,
    make_signer,
    parse_public_key,
    public_key_text,
    run_public_key,
    run_signer,
)
from rlfleet.versions.store import open_store
from rlfleet.wire import env


def version_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(os.urandom(10_000))
    return path


@pytest.fixture
def keys(tmp_path):
    private, public = generate_keypair(tmp_path / "keys")
    return load_private_key(private), parse_public_key(public), private


def test_signed_manifest_verifies_and_any_change_is_caught(tmp_path, keys):
    key, public, private = keys
    assert oct(private.stat().st_mode & 0o777) == "0o600"
    store = open_store(f"file://{tmp_path}/store")
    manifest = publish_version(store, "r", 1, version_dir(tmp_path / "v1"), signer=make_signer(key), shard_size=4096)
    raw = store.get_bytes("r/policy/v1/manifest.json")
    assert manifest.signature.startswith("ed25519:")
    assert parse_manifest(raw, "r", 1, public) == manifest

    forged = json.loads(raw)
    forged["files"][1]["shards"][0]["sha256"] = "0" * 64  # poisoned weights need a changed hash
    with pytest.raises(SignatureError, match="does not verify"):
        parse_manifest(json.dumps(forged).encode(), "r", 1, public)
    attacker = make_signer(load_private_key(generate_keypair(tmp_path / "attacker")[0]))
    forged["signature"] = attacker(signing_bytes(forged))  # re-signed with another key
    with pytest.raises(SignatureError, match="does not verify"):
        parse_manifest(json.dumps(forged).encode(), "r", 1, public)
    unsigned = {k: v for k, v in json.loads(raw).items() if k != "signature"}
    with pytest.raises(SignatureError, match="not signed"):
        parse_manifest(json.dumps(unsigned).encode(), "r", 1, public)
    with pytest.raises(SignatureError, match="base64"):
        parse_manifest(json.dumps({**unsigned, "signature": "ed25519:!!"}).encode(), "r", 1, public)
    # the signature is checked first, so a stale (other version) but validly signed manifest fails on shape
    with pytest.raises(ManifestError, match="describes run 'r' v1"):
        parse_manifest(raw, "r", 2, public)
    assert parse_manifest(json.dumps(unsigned).encode(), "r", 1, None).version == 1  # no key: not required


def test_public_key_text_round_trip_and_bad_text(keys):
    key, public, _ = keys
    text = public_key_text(key)
    assert text == public_key_text(public) and ShardcastSpec(publicKey=text).public_key == text
    for bad, match in [
        ("rsa:AAAA", "ed25519:<base64>"),
        ("ed25519:not base64!", "base64"),
        ("ed25519:AAAA", "32 bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_public_key(bad)


def test_key_configuration(tmp_path, keys, monkeypatch):
    _, public, private = keys
    monkeypatch.delenv(env.SIGNING_KEY_FILE, raising=False)
    monkeypatch.delenv(env.PUBLIC_KEY, raising=False)
    required = ShardcastSpec()
    with pytest.raises(KeyConfigError, match="requireSignatures.*RLFLEET_SIGNING_KEY_FILE"):
        run_signer(required)
    with pytest.raises(KeyConfigError, match="spec.shardcast.publicKey"):
        run_public_key(required)
    optional = ShardcastSpec(requireSignatures=False)
    assert run_signer(optional) is None and run_public_key(optional) is None

    monkeypatch.setenv(env.SIGNING_KEY_FILE, str(private))
    signer = run_signer(required)
    assert public_key_text(run_public_key(required)) == public_key_text(public)  # derived from the key file
    public.verify(__import__("base64").b64decode(signer(b"x").split(":", 1)[1]), b"x")
    monkeypatch.delenv(env.SIGNING_KEY_FILE)
    monkeypatch.setenv(env.PUBLIC_KEY, "ed25519:AAAA")
    with pytest.raises(KeyConfigError, match="RLFLEET_PUBLIC_KEY: public key must be 32 bytes"):
        run_public_key(required)
    (tmp_path / "bad.pem").write_text("not a key")
    monkeypatch.setenv(env.SIGNING_KEY_FILE, str(tmp_path / "bad.pem"))
    with pytest.raises(KeyConfigError, match="bad.pem: cannot read"):
        run_signer(required)
