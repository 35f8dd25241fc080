"""Manifest signatures: ed25519 through `cryptography`.

The trainer signs each policy manifest with the run's private key; relays, workers and the verifier
check the signature with the run's public key before they trust any other byte of the manifest
(and through its per-shard sha256, every byte of the checkpoint). Formats:
  private key   PEM (PKCS#8), as written by `generate_keypair` or `openssl genpkey -algorithm ed25519`
  public key    "ed25519:<base64 of the 32 raw bytes>"   (safe to put in the RLRun spec)
  signature     "ed25519:<base64 of the 64-byte signature>"  over manifest.signing_bytes
Where a process finds its keys (`run_signer`, `run_public_key`): env RLFLEET_SIGNING_KEY_FILE (the
trainer only), env RLFLEET_PUBLIC_KEY, else spec.shardcast.publicKey, else the public half of the
signing key file. With spec.shardcast.requireSignatures (the default) a missing key is an error
that names the setting; with it off, manifests are published and accepted unsigned.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from rlfleet.config import ConfigError
from rlfleet.wire import env

ALG = "ed25519"
PRIVATE_KEY_FILE, PUBLIC_KEY_FILE = "signing-key", "public-key"


class SignatureError(ValueError):
    """A signature that is missing, malformed or does not verify with the run's public key."""


class KeyConfigError(ConfigError):
    """A key that is required but not configured, or that cannot be read (the CLI prints it, exit 2)."""

    def __init__(self, message: str):
        super().__init__("manifest signing", [message])


def _b64(prefix_text: str, what: str, size: int) -> bytes:
    alg, sep, body = prefix_text.partition(":")
    if not sep or alg != ALG:
        raise ValueError(f"{what} must look like '{ALG}:<base64>', got {prefix_text[:40]!r}")
    try:
        raw = base64.b64decode(body, validate=True)
    except binascii.Error:
        raise ValueError(f"{what} is not valid base64") from None
    if len(raw) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(raw)}")
    return raw


def public_key_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALG}:{base64.b64encode(raw).decode()}"


def parse_public_key(text: str) -> Ed25519PublicKey:
    """`ed25519:<base64>` -> the key; ValueError naming the problem otherwise."""
    return Ed25519PublicKey.from_public_bytes(_b64(text.strip(), "public key", 32))


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyConfigError(f"signing key {path}: cannot read an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyConfigError(
            f"signing key {path}: not an ed25519 key (make one with `openssl genpkey -algorithm ed25519`)"
        )
    return key


def generate_keypair(directory: Path) -> tuple[Path, str]:
    """Write a fresh private key (PEM, mode 0600) and its public key text into `directory`;
    return (private key path, public key text)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    private = directory / PRIVATE_KEY_FILE
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = public_key_text(key)
    (directory / PUBLIC_KEY_FILE).write_text(public + "\n")
    return private, public


def make_signer(key: Ed25519PrivateKey) -> Callable[[bytes], str]:
    """The `signer` that checkpoint.publish_version takes."""
    return lambda data: f"{ALG}:{base64.b64encode(key.sign(data)).decode()}"


def verify_signature(key: Ed25519PublicKey, data: bytes, signature: object) -> None:
    """Raise SignatureError unless `signature` (the manifest field) signs `data` with `key`."""
    if not isinstance(signature, str):
        raise SignatureError("manifest is not signed (no 'signature' string) but the run requires signatures")
    try:
        raw = _b64(signature, "signature", 64)
    except ValueError as exc:
        raise SignatureError(str(exc)) from None
    try:
        key.verify(raw, data)
    except InvalidSignature:
        raise SignatureError(
            "manifest signature does not verify with the run's public key (forged or altered)"
        ) from None


def run_signer(shardcast_spec) -> Callable[[bytes], str] | None:
    """The trainer's signer: from env RLFLEET_SIGNING_KEY_FILE; None when unset and signatures are optional."""
    path = env.get(env.SIGNING_KEY_FILE)
    if path:
        return make_signer(load_private_key(Path(path)))
    if shardcast_spec.require_signatures:
        raise KeyConfigError(
            f"spec.shardcast.requireSignatures is true but no signing key is configured: set {env.SIGNING_KEY_FILE} "
            "to a PEM ed25519 key (on a cluster: spec.shardcast.signingKeySecret; `rlfleet run` makes one), "
            "or set spec.shardcast.requireSignatures: false"
        )
    return None


def run_public_key(shardcast_spec) -> Ed25519PublicKey | None:
    """The key every downloader checks manifests with; None when none is set and signatures are optional."""
    text = env.get(env.PUBLIC_KEY) or shardcast_spec.public_key
    if text:
        try:
            return parse_public_key(text)
        except ValueError as exc:
            where = env.PUBLIC_KEY if env.get(env.PUBLIC_KEY) else "spec.shardcast.publicKey"
            raise KeyConfigError(f"{where}: {exc}") from None
    path = env.get(env.SIGNING_KEY_FILE)
    if path:
        return load_private_key(Path(path)).public_key()
    if shardcast_spec.require_signatures:
        raise KeyConfigError(
            "spec.shardcast.requireSignatures is true but no public key is configured: set spec.shardcast.publicKey "
            f"('{ALG}:<base64>', the trainer key's public half) or env {env.PUBLIC_KEY}, "
            "or set spec.shardcast.requireSignatures: false"
        )
    return None
