"""The ingest over HTTPS (rlfleet/wire/tls.py), against a real redis-server and a real uvicorn on 127.0.0.1 with a
certificate signed by a CA made in the test: a worker that trusts the CA gets its groups in, a plain-HTTP client
gets no answer, a worker that trusts another CA (or the system's store), or reaches the server by a name its
certificate does not carry, fails at once with an error naming the CA bundle and the fix; `rlfleet join` joins
over HTTPS with --ca-file; a renewed certificate is served without a restart."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from rlfleet.config import ConfigError, IngestSpec
from rlfleet.services.ingest.client import post_group, rollouts_url
from rlfleet.services.ingest.door import make_door
from rlfleet.services.ingest.main import make_app, server_config
from rlfleet.services.rollout.join import JoinOptions, prepare
from rlfleet.wire import env, tls
from rlfleet.wire.asgi import BackgroundServer, TLSServer
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys
from tests.certs import TestCA
from tests.ingest.test_ingest import TOKENS, group_bytes
from tests.ingest.test_join import RELAY, run_bundle
from tests.shardcast.test_shardcast_tls import trusted_by
from tests.support import redis_from_url, wait_for

RUN = "demo"
KEYS = RunKeys(RUN)
SPEC = IngestSpec.model_validate({"maxBodyBytes": 4096, "ratePerMinute": 1000, "maxBacklog": 5})


@pytest.fixture
def ca(tmp_path) -> TestCA:
    return TestCA()


@contextmanager
def https_ingest(redis_url: str, files: tuple[Path, Path], spec: IngestSpec = SPEC, door=None):
    """An ingest serving HTTPS with the certificate and key `files`; yields (base URL, Redis client)."""
    client = redis_from_url(redis_url)
    app = make_app(RUN, spec, client, TOKENS, door)
    port = free_port()
    server = BackgroundServer(
        app, "127.0.0.1", port, "ingest", config=server_config(app, spec, "127.0.0.1", port, files)
    ).start()
    try:
        yield f"https://127.0.0.1:{port}", client
    finally:
        server.stop()
        client.close()


def test_a_worker_that_trusts_the_ca_posts_over_https(tmp_path, redis_url, ca, monkeypatch):
    monkeypatch.setenv(env.TLS_CA_FILE, str(ca.write(tmp_path / "ca.crt")))
    with https_ingest(redis_url, ca.issue_files(["127.0.0.1"], tmp_path)) as (base, client):
        session = requests.Session()
        body = group_bytes()
        entry = post_group(session, rollouts_url(base, RUN), TOKENS["w1"], body, threading.Event())
        [(stored_id, fields)] = client.xrange(KEYS.rollouts)
        assert stored_id.decode() == entry and fields[b"m"] == body


def test_plain_http_to_an_https_ingest_gets_no_answer(tmp_path, redis_url, ca):
    with https_ingest(redis_url, ca.issue_files(["127.0.0.1"], tmp_path)) as (base, client):
        plain = base.replace("https://", "http://")
        with pytest.raises(requests.ConnectionError):
            requests.post(
                rollouts_url(plain, RUN),
                data=group_bytes(),
                headers={"Authorization": f"Bearer {TOKENS['w1']}"},
                timeout=10,
            )
        assert client.xlen(KEYS.rollouts) == 0


@pytest.mark.parametrize("trust", ["another CA", "system store", "wrong host name"])
def test_a_certificate_the_worker_cannot_verify_fails_at_once_naming_the_ca_bundle(
    tmp_path, redis_url, ca, monkeypatch, trust
):
    hosts = ["ingest.example.org"] if trust == "wrong host name" else ["127.0.0.1"]
    bundle = (TestCA("another CA") if trust == "another CA" else ca).write(tmp_path / "ca.crt")
    if trust == "system store":
        monkeypatch.delenv(env.TLS_CA_FILE, raising=False)
    else:
        monkeypatch.setenv(env.TLS_CA_FILE, str(bundle))
    with https_ingest(redis_url, ca.issue_files(hosts, tmp_path)) as (base, client):
        session = requests.Session()
        stop = threading.Event()
        threading.Timer(20, stop.set).start()  # a retry loop would end here instead of raising
        with pytest.raises(RuntimeError) as failure:
            post_group(session, rollouts_url(base, RUN), TOKENS["w1"], group_bytes(), stop)
        assert not stop.is_set(), "an untrusted certificate was retried like a transient failure"
        stop.set()
        message = str(failure.value)
        assert "TLS certificate was not accepted" in message and env.TLS_CA_FILE in message, message
        where = "system's trust store" if trust == "system store" else str(bundle)
        assert where in message, message
        if trust == "wrong host name":
            assert "IP address mismatch" in message or "match" in message, message
        assert client.xlen(KEYS.rollouts) == 0


def test_rlfleet_join_over_https_with_the_ca_file(tmp_path, redis_url, ca, monkeypatch):
    monkeypatch.setenv(env.TLS_CA_FILE, "")  # unset for this test; restored after (join sets it in-process)
    run, _ = run_bundle(tmp_path, {"mode": "open", "relayUrls": [RELAY]})
    client = redis_from_url(redis_url)
    door = make_door(run, client, None)
    with https_ingest(redis_url, ca.issue_files(["127.0.0.1"], tmp_path / "server"), run.spec.ingest, door) as (
        base,
        _,
    ):
        url = f"{base}/v1/{RUN}"
        with pytest.raises(ConfigError) as refused:  # the system's store does not know the test's CA
            prepare(JoinOptions(url, work_dir=tmp_path / "untrusted"))
        assert "TLS certificate was not accepted" in refused.value.report(), refused.value.report()
        config, document, credentials = prepare(
            JoinOptions(url, work_dir=tmp_path / "work", ca_file=ca.write(tmp_path / "ca.crt"))
        )
        assert document["run"] == RUN and credentials["token"]
        assert f"ingestUrl: {base}" in config.read_text()
    client.close()


def test_a_server_certificate_that_does_not_load_is_an_error_naming_the_flag(tmp_path, ca):
    cert, key = ca.issue_files(["127.0.0.1"], tmp_path)
    with pytest.raises(ConfigError, match="--tls-key-file .*: no such file"):
        tls.server_context(cert, tmp_path / "missing.key")
    _, other_key = TestCA().issue_files(["127.0.0.1"], tmp_path / "other")
    with pytest.raises(ConfigError, match="not a PEM certificate and its key"):
        tls.server_context(cert, other_key)
    with pytest.raises(ConfigError, match="give both"):
        tls.server_files(cert, None)
    assert tls.server_files(None, None) is None


def test_the_ingest_serves_a_renewed_certificate_without_a_restart(tmp_path, redis_url, monkeypatch):
    """`rlfleet ingest` runs uvicorn as TLSServer: a renewed pair on disk (cert-manager's) is served to new
    handshakes, checked from uvicorn's own tick."""
    old_ca, new_ca = TestCA("old CA"), TestCA("new CA")
    cert, key = old_ca.issue_files(["127.0.0.1"], tmp_path / "tls")
    monkeypatch.setattr(tls, "RELOAD_INTERVAL_S", 0.3)
    client = redis_from_url(redis_url)
    app, port = make_app(RUN, SPEC, client, TOKENS), free_port()
    server = TLSServer(server_config(app, SPEC, "127.0.0.1", port, (cert, key)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for("the ingest serving", lambda: server.started, 10)
        assert trusted_by(port, old_ca.write(tmp_path / "old-ca.crt"))
        renewed_cert, renewed_key = new_ca.issue(["127.0.0.1"])
        cert.write_bytes(renewed_cert)
        key.write_bytes(renewed_key)
        wait_for("the renewed certificate served", lambda: trusted_by(port, new_ca.write(tmp_path / "new.crt")), 10)
        assert not trusted_by(port, tmp_path / "old-ca.crt")
    finally:
        server.should_exit = True
        thread.join(10)
        client.close()
