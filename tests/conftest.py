"""Shared fixtures: a real redis-server and a real S3 API endpoint (moto's server over HTTP)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests

from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.wire.ports import free_port
from tests.support import redis_from_url


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as url:
        yield url


@pytest.fixture
def redis_client(redis_url):
    client = redis_from_url(redis_url)  # the test's own server: a dead one fails the test at once
    yield client
    client.close()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """An S3 API on 127.0.0.1 (moto's server, a process of its own); yields its endpoint URL.

    Not moto's threaded server inside the test process: that imports flask, whose module-level
    proxies raise on any attribute access outside a request, and vLLM's in-process engine start walks
    every loaded module's attributes (its kernel overrides), so a later vLLM test would fail."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, log.read_text()
        try:
            requests.get(url, timeout=5)
            break
        except requests.RequestException:  # not listening yet, or busy starting
            assert time.monotonic() < deadline, "moto's S3 server did not start: " + log.read_text()
            time.sleep(0.1)
    yield url
    server.terminate()
    server.wait(10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Dummy credentials for the local S3 endpoint; returns the endpoint URL."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module's tiny models: one thread avoids wake-up waits on a busy machine."""
    import torch  # here, not at the top: most tests never load torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
