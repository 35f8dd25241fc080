"""Shardcast over HTTPS (rlfleet/wire/tls.py) on real servers on 127.0.0.1: store -> origin (HTTP, inside the
cluster) -> an exposed relay serving HTTPS with a certificate signed by a CA made in the test -> a downstream
relay (another cluster's tier, following its upstream's long-poll) and clients that verify it with the CA
bundle in RLFLEET_TLS_CA_FILE. A plain-HTTP client gets no answer from the HTTPS relay; a client or relay that
trusts another CA fails with an error naming the CA bundle and the fix. A renewed certificate (cert-manager
rewriting the Secret's files) is served without a restart."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import pytest
import requests
from cryptography import x509

from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.client import FetchError, FetchSettings, fetch_version, wait_for_version
from rlfleet.services.shardcast.protocol import file_path, latest_path
from rlfleet.versions.checkpoint import COMPLETE_MARKER, publish_version
from rlfleet.versions.store import open_store
from rlfleet.wire import env, tls
from tests.certs import TestCA
from tests.shardcast.test_shardcast import latest_version, sha256, small_version
from tests.support import serving, wait_for

RUN = "demo"


@pytest.fixture
def published(tmp_path):
    """A file store holding v1 of RUN; yields (store, the version's source directory)."""
    store = open_store(f"file://{tmp_path}/store")
    v1 = small_version(tmp_path / "v1", 1)
    publish_version(store, RUN, 1, v1)
    return store, v1


def test_an_https_relay_serves_clients_and_a_downstream_relay_that_trust_its_ca(tmp_path, published, monkeypatch):
    store, v1 = published
    ca = TestCA()
    monkeypatch.setenv(env.TLS_CA_FILE, str(ca.write(tmp_path / "ca.crt")))
    exposed = ca.issue_files(["127.0.0.1"], tmp_path / "tls")
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "exposed", RUN, 3)),
            tls_files=exposed,
            ca_file=tmp_path / "ca.crt",
        ) as exposed_url,
        # another cluster's tier: no Redis, it long-polls its https:// upstream (aiohttp) and pulls (Fetcher)
        serving(relay.make_app(relay.RelaySettings(exposed_url, tmp_path / "edge", RUN, 3))) as edge_url,
    ):
        assert exposed_url.startswith("https://")
        assert wait_for_version([exposed_url], RUN, 0, timeout=10) == 1
        path = fetch_version(FetchSettings.over([exposed_url], RUN, timeout=30), 1, tmp_path / "worker")
        assert sha256(path / "model.safetensors") == sha256(v1 / "model.safetensors")
        wait_for("the edge relay's pull of v1", lambda: (tmp_path / "edge" / RUN / "v1" / COMPLETE_MARKER).exists(), 20)
        assert latest_version(edge_url, RUN) == 1
        edge = fetch_version(FetchSettings.over([edge_url], RUN, timeout=30), 1, tmp_path / "edge-worker")
        assert sha256(edge / "model.safetensors") == sha256(v1 / "model.safetensors")

        plain = exposed_url.replace("https://", "http://")
        with pytest.raises(requests.ConnectionError):  # the TLS port never answers plain HTTP
            requests.get(plain + latest_path(RUN), timeout=10)
        with pytest.raises(FetchError):
            fetch_version(FetchSettings.over([plain], RUN, timeout=2), 1, tmp_path / "plain-worker")
        assert not (tmp_path / "plain-worker" / "v1").exists()


def test_a_relay_certificate_from_another_ca_fails_with_an_error_naming_the_bundle(tmp_path, published, monkeypatch):
    store, _ = published
    ca, other = TestCA(), TestCA("another CA")
    exposed = ca.issue_files(["127.0.0.1"], tmp_path / "tls")
    monkeypatch.setenv(env.TLS_CA_FILE, str(other.write(tmp_path / "other-ca.crt")))
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "exposed", RUN, 3)),
            tls_files=exposed,
            ca_file=ca.write(tmp_path / "ca.crt"),
        ) as exposed_url,
        serving(relay.make_app(relay.RelaySettings(exposed_url, tmp_path / "edge", RUN, 3))) as edge_url,
    ):
        with pytest.raises(FetchError) as failed:
            fetch_version(FetchSettings.over([exposed_url], RUN, timeout=2), 1, tmp_path / "worker")
        message = str(failed.value)
        assert "TLS certificate was not accepted" in message and str(tmp_path / "other-ca.crt") in message, message
        # the edge relay cannot pull either: its clients get 502 with the reason, nothing is served
        answer = requests.get(edge_url + latest_path(RUN), timeout=30)
        assert answer.status_code == 502 and "TLS certificate was not accepted" in answer.text, answer.text
        assert requests.get(edge_url + file_path(RUN, 1, "model.safetensors"), timeout=30).status_code == 502


def served_certificate(port: int, ca_file: Path) -> x509.Certificate:
    """The certificate a server on 127.0.0.1:`port` presents in a new handshake (verified with `ca_file`)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def trusted_by(port: int, ca_file: Path) -> bool:
    try:
        served_certificate(port, ca_file)
    except ssl.SSLCertVerificationError:
        return False
    return True


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path, published, monkeypatch):
    """cert-manager renews the Secret and the kubelet swaps the mounted files: new handshakes get the new
    certificate (this one from another CA, to tell them apart), a half-written pair is skipped until whole."""
    store, _ = published
    old_ca, new_ca = TestCA("old CA"), TestCA("new CA")
    cert, key = old_ca.issue_files(["127.0.0.1"], tmp_path / "tls")
    monkeypatch.setattr(tls, "RELOAD_INTERVAL_S", 0.5)
    with serving(
        origin.make_app(store, RUN), tls_files=(cert, key), ca_file=old_ca.write(tmp_path / "old-ca.crt")
    ) as url:
        port = int(url.rsplit(":", 1)[1])
        first = served_certificate(port, tmp_path / "old-ca.crt")
        renewed_cert, renewed_key = new_ca.issue(["127.0.0.1"])
        cert.write_bytes(renewed_cert)  # the key not yet: a pair that does not load keeps the old one serving
        time.sleep(1.5)
        assert served_certificate(port, tmp_path / "old-ca.crt") == first
        key.write_bytes(renewed_key)
        new_ca_file = new_ca.write(tmp_path / "new-ca.crt")
        wait_for("the renewed certificate served", lambda: trusted_by(port, new_ca_file), 10)
        assert served_certificate(port, new_ca_file) != first
        with pytest.raises(ssl.SSLCertVerificationError):  # the old certificate is gone from new handshakes
            served_certificate(port, tmp_path / "old-ca.crt")
