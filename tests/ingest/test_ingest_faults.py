"""`rlfleet ingest` under faults and load (issue 16 items 14-18), as a process on 127.0.0.1 against a real
redis-server: Redis trouble is a 503 with Retry-After and /healthz stays cheap and honest; a resend is
idempotent; validation keeps the inbox below the streams' MAXLEN; slow clients, buffered bytes and
connections are bounded; a 503 spends no rate budget and the backlog bound holds under concurrency.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import requests
import yaml

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.services.ingest.client import rollouts_url
from rlfleet.wire.ports import free_port
from tests.ingest.test_ingest import KEYS, RUN, TOKENS, group_bytes, post
from tests.runs import bundle_yaml, pool, rlrun, write_rlrun
from tests.support import redis_from_url, wait_for


@contextmanager
def ingest_process(tmp_path, redis_url: str, ingest: str = "{}"):
    """`rlfleet ingest` as its own process, as a pod or `rlfleet` would start it; yields its base URL."""
    config, tokens, port = tmp_path / "run.yaml", tmp_path / "tokens.json", free_port()
    write_rlrun(config, rlrun(RUN, ingest=yaml.safe_load(ingest)))  # `ingest`: a YAML flow mapping
    tokens.write_text(json.dumps(TOKENS))
    log = open(tmp_path / "ingest.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "ingest", "--config", str(config), "--redis-url", redis_url]
        + ["--port", str(port), "--tokens-file", str(tokens)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(base + "/healthz", timeout=1)
                break
            except requests.ConnectionError:
                assert proc.poll() is None, (tmp_path / "ingest.log").read_text()
                assert time.monotonic() < deadline, "the ingest did not start"
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


# ---- item 14: Redis trouble ---------------------------------------------------------------------


def test_redis_down_or_stalled_gives_503_with_retry_after_and_an_honest_cheap_healthz(tmp_path):
    port = free_port()
    server = EmbeddedRedis(tmp_path / "redis", port=port)
    url = server.start()
    try:
        with ingest_process(tmp_path, url) as base:
            assert post(base, group_bytes()).status_code == 202
            wait_for("healthz 200", lambda: requests.get(base + "/healthz", timeout=2).status_code == 200)

            server.stop()  # Redis down
            resp = post(base, group_bytes())
            assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, resp.text
            assert "Redis" in resp.json()["detail"]
            wait_for("healthz 503", lambda: requests.get(base + "/healthz", timeout=2).status_code == 503)
            assert requests.get(base + "/healthz", timeout=2).json()["status"] == "redis_unavailable"

            server = EmbeddedRedis(tmp_path / "redis", port=port)  # back: accepted again
            server.start()
            wait_for("a post accepted (202)", lambda: post(base, group_bytes()).status_code == 202)

            os.kill(server.proc.pid, signal.SIGSTOP)  # Redis stalled: no answer at all
            try:
                stuck = [threading.Thread(target=post, args=(base, group_bytes())) for _ in range(8)]
                for t in stuck:
                    t.start()
                t0 = time.monotonic()
                health = requests.get(base + "/healthz", timeout=5)
                assert time.monotonic() - t0 < 1.0, "healthz queued behind submissions"
                t0 = time.monotonic()
                resp = post(base, group_bytes())
                assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text
                assert time.monotonic() - t0 < 8.0
                wait_for("healthz 503", lambda: requests.get(base + "/healthz", timeout=2).status_code == 503)
                for t in stuck:
                    t.join(15)
                assert health.status_code in (200, 503)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            wait_for("healthz 200", lambda: requests.get(base + "/healthz", timeout=2).status_code == 200)
    finally:
        server.stop()


# ---- item 15: idempotent submissions ----------------------------------------------------------


def test_a_resend_of_a_stored_group_is_answered_with_the_first_entry_and_adds_nothing(tmp_path, redis_url):
    body = group_bytes()
    client = redis_from_url(redis_url)
    with ingest_process(tmp_path, redis_url) as base:
        first, again = post(base, body), post(base, body)
        assert first.status_code == again.status_code == 202
        assert again.json()["id"] == first.json()["id"] and again.json()["duplicate"] is True
        assert client.xlen(KEYS.rollouts) == 1
        # The same work from another worker is its own submission (the gate judges it a replay).
        other = post(base, body.replace(b'"worker_id":"w1"', b'"worker_id":"w2"'), token="token-of-w2")
        assert other.status_code == 202 and other.json()["id"] != first.json()["id"]
        assert client.xlen(KEYS.rollouts) == 2


# ---- item 16: the inbox stays below the streams' MAXLEN ---------------------------------------


def test_validation_refuses_a_backlog_or_pending_bound_at_or_over_the_streams_max_len():
    def problems(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_bundle(text)
        return info.value.report()

    run = bundle_yaml(rlrun(RUN, ingest={"maxBacklog": 500}, redis={"streamMaxLen": 500}))
    assert "ingest.maxBacklog" in problems(run) and "streamMaxLen" in problems(run)
    pooled = bundle_yaml(rlrun(RUN, ingest={}, redis={"streamMaxLen": 2000}), pool("p", RUN, maxPending=2000))
    assert "spec.maxPending" in problems(pooled)
    parse_bundle(bundle_yaml(rlrun(RUN, ingest={"maxBacklog": 499}, redis={"streamMaxLen": 500})))  # below: fine


# ---- item 17: slow clients, buffered bytes, connections ---------------------------------------


def _open(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (a 408 it may send first is read and ignored)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_slow_headers_and_slow_bodies_are_cut_off(tmp_path, redis_url):
    with ingest_process(tmp_path, redis_url, "{requestTimeoutSeconds: 1.0}") as base:
        path = rollouts_url("", RUN)
        slow_headers = _open(base)
        slow_headers.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())  # never finishes its headers
        slow_body = _open(base)
        slow_body.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer token-of-w1\r\n"
            "Content-Length: 2000\r\n\r\n{".encode()
        )
        t0 = time.monotonic()
        for _ in range(6):  # trickling does not keep them alive
            time.sleep(0.25)
            for s in (slow_headers, slow_body):
                try:
                    s.sendall(b"x")
                except OSError:
                    pass
        assert _closed_within(slow_headers, 3.0) and _closed_within(slow_body, 3.0)
        assert time.monotonic() - t0 < 6.0
        assert post(base, group_bytes()).status_code == 202  # and the ingest still serves


def test_bodies_in_flight_and_connections_are_bounded(tmp_path, redis_url):
    ingest = "{maxBodyBytes: 4096, maxBufferedBytes: 8192, maxConnections: 4, requestTimeoutSeconds: 20}"
    with ingest_process(tmp_path, redis_url, ingest) as base:
        path = rollouts_url("", RUN)

        def hold(length: int) -> socket.socket:  # a request whose body is still on its way
            s = _open(base)
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer token-of-w1\r\n"
                f"Content-Length: {length}\r\n\r\n{{".encode()
            )
            return s

        held = [hold(4096), hold(4096)]  # 8192 bytes reserved: the budget is full
        time.sleep(0.5)
        resp = post(base, group_bytes())
        assert resp.status_code == 503 and "maxBufferedBytes" in resp.json()["detail"], resp.text
        assert resp.headers["Retry-After"]
        for s in held:
            s.close()
        wait_for("a post accepted (202)", lambda: post(base, group_bytes()).status_code == 202)
        held = [hold(10) for _ in range(4)]  # four small requests in flight: the connection bound
        time.sleep(0.5)
        resp = post(base, group_bytes())
        assert resp.status_code == 503 and "maxBufferedBytes" not in resp.text, resp.text
        for s in held:
            s.close()
        wait_for("a post accepted (202)", lambda: post(base, group_bytes()).status_code == 202)


# ---- item 18: rate budget and the backlog bound -----------------------------------------------


def test_503s_do_not_spend_the_rate_budget(tmp_path, redis_url):
    client = redis_from_url(redis_url)
    with ingest_process(tmp_path, redis_url, "{ratePerMinute: 2, maxBacklog: 1}") as base:
        client.xadd(KEYS.rollouts, {b"m": b"queued"})  # the inbox is full
        assert [post(base, group_bytes()).status_code for _ in range(5)] == [503] * 5
        client.delete(KEYS.rollouts)  # the verifier caught up
        assert post(base, group_bytes()).status_code == 202
        client.delete(KEYS.rollouts)
        assert post(base, group_bytes()).status_code == 202  # the whole budget of 2 was still there
        client.delete(KEYS.rollouts)
        assert post(base, group_bytes()).status_code == 429


def test_the_backlog_bound_holds_under_concurrent_submissions(tmp_path, redis_url):
    client = redis_from_url(redis_url)
    bound = 20
    with ingest_process(tmp_path, redis_url, f"{{ratePerMinute: 100000, maxBacklog: {bound}}}") as base:
        codes: list[int] = []
        bodies = [group_bytes(w) for w in ("w1", "w2") for _ in range(40)]
        barrier = threading.Barrier(len(bodies))

        def send(body: bytes) -> None:
            token = TOKENS["w1"] if b'"worker_id":"w1"' in body else TOKENS["w2"]
            barrier.wait()
            codes.append(post(base, body, token=token).status_code)

        threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert client.xlen(KEYS.rollouts) == bound
        assert codes.count(202) == bound and codes.count(503) == len(bodies) - bound
