"""TLS for the servers that traffic from outside the cluster reaches (the ingest, relay tiers) and for their
clients (rollout workers, relays, the verifier, `rlfleet join`).

Servers take a certificate chain and its private key as PEM files (`--tls-cert-file`, `--tls-key-file`; on a
cluster the operator mounts the `kubernetes.io/tls` Secret named by `tls.secretName`, keys tls.crt and tls.key,
which is what cert-manager writes). Such a server speaks only TLS on its port: a plain-HTTP request never gets
an answer (its connection is closed during the handshake); a renewed certificate is loaded while it serves
(CertificateReloader).

Clients check every https:// server they reach against the CA bundle named by env RLFLEET_TLS_CA_FILE (on a
cluster the operator mounts the run's spec.tls CA there; `rlfleet join --ca-file` sets it), or the system's
trust store when it is unset. The bundle replaces the system store for rlfleet's own connections only: the
store (S3) and the model hub keep their usual trust. A certificate that does not verify (unknown CA, wrong
host name, expired) is told apart from a transient failure by `untrusted`, and `describe` turns it into a
message that names the bundle in use and how to give the right one.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import ssl
import tempfile
from functools import lru_cache
from pathlib import Path
from urllib.parse import SplitResult

from rlfleet.config import ConfigError
from rlfleet.wire import env

log = logging.getLogger("rlfleet.tls")
TLS_CERT_KEY = "tls.crt"  # keys of a kubernetes.io/tls Secret
TLS_KEY_KEY = "tls.key"
CA_KEY = "ca.crt"  # key of the CA bundle in its Secret or ConfigMap (cert-manager's and trust-manager's name)


def ca_file() -> str | None:
    """The CA bundle clients verify servers with (env RLFLEET_TLS_CA_FILE), None for the system's trust store."""
    path = env.get(env.TLS_CA_FILE)
    if path is not None and not Path(path).is_file():
        raise ConfigError(env.TLS_CA_FILE, [f"{env.TLS_CA_FILE}={path}: no such file; name the PEM CA bundle"])
    return path


@lru_cache(maxsize=4)
def _client_context(cafile: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(env.TLS_CA_FILE, [f"{env.TLS_CA_FILE}={cafile}: not a PEM CA bundle ({exc})"]) from None


def client_context() -> ssl.SSLContext:
    """The context of every https:// connection rlfleet opens: certificate and host name checked."""
    return _client_context(ca_file())


def requests_verify() -> str | bool:
    """`verify=` for a requests call: the CA bundle's path, or True (the system's trust store)."""
    return ca_file() or True


def http_connection(url: SplitResult, timeout: float) -> http.client.HTTPConnection:
    """An http.client connection to `url`'s host: HTTPS (verified with client_context) for https://."""
    if url.scheme == "https":
        return http.client.HTTPSConnection(url.hostname or "", url.port, timeout=timeout, context=client_context())
    return http.client.HTTPConnection(url.hostname or "", url.port, timeout=timeout)


def server_context(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """A server's context from its PEM chain and key; ConfigError naming the flag when either does not load."""
    for flag, path in (("--tls-cert-file", cert_file), ("--tls-key-file", key_file)):
        if not Path(path).is_file():
            raise ConfigError(str(path), [f"{flag} {path}: no such file"])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert_file), str(key_file))
    except ssl.SSLError as exc:
        raise ConfigError(
            str(cert_file),
            [f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: not a PEM certificate and its key ({exc})"],
        ) from None
    return context


class CertificateReloader:
    """Loads a renewed certificate into a serving context. cert-manager renews a Secret in place and the kubelet
    updates the mounted files (both at once, by a symlink swap); `check` sees that their bytes changed and loads
    the pair into the same context, so every handshake after it presents the new certificate while open
    connections keep theirs. The servers call `check` from their own event loop (never beside a handshake in
    progress), every RELOAD_INTERVAL_S. The bytes read are copied to a private directory and loaded into a
    scratch context first: OpenSSL replaces a context's certificate before it checks the key, so a pair that
    does not match (a half-written renewal) must never reach the serving context. Such a pair is logged and
    tried again at the next check; the previous pair keeps serving."""

    def __init__(self, context: ssl.SSLContext, cert_file: str | Path, key_file: str | Path):
        self.context, self.cert_file, self.key_file = context, Path(cert_file), Path(key_file)
        self.loaded = self._digest(self.cert_file.read_bytes(), self.key_file.read_bytes())

    @staticmethod
    def _digest(cert: bytes, key: bytes) -> bytes:
        return hashlib.sha256(cert + b"\0" + key).digest()

    def check(self) -> bool:
        """Load the pair if its files changed since the last load; whether a new pair now serves."""
        try:
            cert, key = self.cert_file.read_bytes(), self.key_file.read_bytes()
            if self._digest(cert, key) == self.loaded:
                return False
            with tempfile.TemporaryDirectory(prefix="rlfleet-tls-") as scratch:
                copies = Path(scratch, "tls.crt"), Path(scratch, "tls.key")
                copies[0].write_bytes(cert)
                copies[1].write_bytes(key)
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(*copies)  # a matching pair?
                self.context.load_cert_chain(*copies)
        except OSError as exc:  # ssl.SSLError is one
            log.warning(
                "certificate %s changed but does not load (%s); still serving the previous one", self.cert_file, exc
            )
            return False
        self.loaded = self._digest(cert, key)
        log.info("serving the renewed certificate %s", self.cert_file)
        return True


RELOAD_INTERVAL_S = 60.0  # how often a server looks for a renewed certificate (cert-manager renews days early)


def server_files(cert_file: Path | None, key_file: Path | None) -> tuple[Path, Path] | None:
    """The (cert, key) pair a server was given, None for plain HTTP; both or neither (ConfigError otherwise)."""
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise ConfigError("--tls-cert-file", ["--tls-cert-file and --tls-key-file: give both (HTTPS) or neither"])
    return cert_file, key_file


def untrusted(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure inside `exc` (requests, urllib3 and aiohttp wrap it), else None."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    found = None
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            if getattr(e, "verify_message", None):  # ssl's own (aiohttp's wrapper is an instance too, without it)
                return e
            found = found or e
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None), getattr(e, "certificate_error", None)]
        todo += list(e.args)
    return found


def level(exc: BaseException) -> int:
    """The log level of a retried connection failure: WARNING for a certificate that did not verify (retrying
    will not fix it), else DEBUG (transient)."""
    return logging.WARNING if untrusted(exc) else logging.DEBUG


def describe(exc: BaseException) -> str:
    """`exc` as a log or error line; a certificate that did not verify says which CA bundle was used and the fix."""
    failure = untrusted(exc)
    if failure is None:
        return str(exc)
    bundle = env.get(env.TLS_CA_FILE)
    trusted = f"the CA bundle {bundle} ({env.TLS_CA_FILE})" if bundle else "the system's trust store"
    reason = getattr(failure, "verify_message", None) or failure
    return (
        f"the server's TLS certificate was not accepted ({reason}), checked against "
        f"{trusted}: give the CA that signed it in {env.TLS_CA_FILE} (on a cluster the run's spec.tls.caSecret or "
        f"spec.tls.caConfigMap; `rlfleet join --ca-file`), and a certificate whose names include the URL's host"
    )
