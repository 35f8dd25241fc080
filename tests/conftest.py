"""Shared fixtures: a real redis-server and a real S3 API endpoint (moto's server over HTTP); and the order in which
`make test`'s parallel workers take the test files (below)."""

from __future__ import annotations

import os
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


@pytest.fixture
def s3_bucket(s3_env, monkeypatch):
    """(a boto3 client, the name of a new bucket) on moto's server, which AWS_ENDPOINT_URL names."""
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env)
    name = f"models-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=s3_env)
    client.create_bucket(Bucket=name)
    return client, name


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module's tiny models: one thread avoids wake-up waits on a busy machine."""
    import torch  # here, not at the top: most tests never load torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- parallel runs ---------------------------------------------------------------------------------------------
# `make test` runs pytest-xdist workers with `--dist loadfile`: a file's tests run one after another on one worker
# (its module fixtures are made once) and a worker takes the next file from a queue. xdist's queue follows the
# collection order (`--no-loadscope-reorder`; its own reordering counts tests, not seconds), so on a worker the files
# are put in order of their expected cost: a file of slow end-to-end runs first, the many short files last, so that
# no long run starts when the other worker has nothing left and the two finish close together. Nothing else is
# shared between workers: ports are free ports, files are under tmp_path, Redis and moto are the worker's own, and
# testbeds and cluster boxes name their namespaces after their owner process (testbed/bed.py).
SLOW_TEST_SECONDS, TEST_SECONDS = 60.0, 0.5  # what a test marked slow and any other one cost, roughly, on 2 cores


def expected_seconds(items: list[pytest.Item]) -> float:
    """A rough cost of a file's tests, enough to order the files."""
    return sum(SLOW_TEST_SECONDS if item.get_closest_marker("slow") else TEST_SECONDS for item in items)


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:
        # A worker computes beside another on two cores: one OpenMP thread each (torch's intra-op pool, and what the
        # processes a test starts inherit), not two each whose spinning waits take turns on the same cores. A test
        # that wants more threads sets them itself (torch.set_num_threads), as the launcher's components do.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: the collection order (short tests first, a failure shows early)
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    # Stable: equal costs keep the collection order, the same on every worker (xdist checks the collections agree).
    order = sorted(files.values(), key=expected_seconds, reverse=True)
    items[:] = [item for file_items in order for item in file_items]
