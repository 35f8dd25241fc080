"""The operator tests' cluster: one API emulator (cluster.py) and one `rlfleet operator` process logged in
to it through a kubeconfig, exactly as the CLI starts it (settings from the environment), for the
whole session; a real redis-server for the runs' streams. Each test uses its own namespace."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.wire.ports import free_port
from tests.operator.cluster import EmulatedCluster

RESYNC_INTERVAL_S = "1"  # timers every second
# What the chart sets (the operator reads it when it starts); test_operator_checks.py checks it is used.
CHART_ENV = {
    "RLFLEET_IMAGE": "registry.test/rlfleet:9",
    "RLFLEET_GPU_IMAGE": "registry.test/rlfleet-gpu:9",
    "RLFLEET_IMAGE_PULL_POLICY": "Always",
    "RLFLEET_IMAGE_PULL_SECRETS": "regcred",
}
STARTUP_TIMEOUT_S = 60


def wait_until_healthy(process, port: int, log: Path, name: str) -> None:
    """Until the operator `process` answers /healthz on `port`; fails with its log's tail if it exits first or
    takes longer than STARTUP_TIMEOUT_S."""

    def tail() -> str:  # read only for a failure's message
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert process.poll() is None, f"{name} exited: {tail()}"
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{name} did not start: {tail()}"
        time.sleep(0.2)


def stop_operator(process) -> None:
    """SIGTERM the operator `process` (kopf lets go of its handlers), SIGKILL it if it is still up after 15 s."""
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def operator_process(kubeconfig: Path, log_path: Path, resync_interval_s: str = RESYNC_INTERVAL_S, *args: str):
    """`rlfleet operator` logged in through `kubeconfig` with the chart's settings (CHART_ENV), its output in
    `log_path`, answering /healthz before this yields; stopped (SIGTERM, then SIGKILL) afterwards."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}  # not in a pod
    env.update(KUBECONFIG=str(kubeconfig), RLFLEET_RESYNC_INTERVAL=resync_interval_s, PYTHONUNBUFFERED="1", **CHART_ENV)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.cli", "operator", "--liveness", f"http://127.0.0.1:{port}/healthz", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_until_healthy(process, port, log_path, "rlfleet operator")
        yield process
    finally:
        stop_operator(process)


@pytest.fixture(scope="session")
def emulator():
    with EmulatedCluster() as emulated:
        yield emulated


@pytest.fixture(scope="session")
def operator_log(tmp_path_factory):
    return tmp_path_factory.mktemp("operator") / "operator.log"


@pytest.fixture(autouse=True)
def _operator_log_start(request):
    """Where the operator's log stood when a test using it began (the report hook below reads from there)."""
    if "api" in request.fixturenames:
        log = request.getfixturevalue("operator_log")
        request.node.operator_log_from = (log, log.stat().st_size if log.exists() else 0)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed operator test shows what the operator logged while it ran: its reconciles are in
    another process, so a timeout in the test says nothing of why without it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and hasattr(item, "operator_log_from"):
        log, start = item.operator_log_from
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        report.sections.append(("operator log during the test (last 8000 characters)", text[-8000:]))


@pytest.fixture(scope="session")
def operator_metrics(tmp_path_factory) -> str:
    """URL of the session operator's /metrics (`--metrics-port`); it serves once `api` has started it."""
    return f"http://127.0.0.1:{free_port()}/metrics"


@pytest.fixture(scope="session")
def api(emulator, operator_log, operator_metrics, tmp_path_factory):
    """Base URL of the emulator, with `rlfleet operator` running against it."""
    kubeconfig = emulator.kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    metrics_port = operator_metrics.rsplit(":", 1)[1].split("/")[0]
    with operator_process(kubeconfig, operator_log, RESYNC_INTERVAL_S, "--metrics-port", metrics_port):
        yield emulator.url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(autouse=True)
def delete_runs_afterwards(request):
    """After each test that used the operator, delete every RLRun (their pools, tiers and children follow),
    so the runs of earlier tests do not keep the operator's timers busy for the rest of the session."""
    yield
    if "api" not in request.fixturenames:
        return
    base = request.getfixturevalue("api")
    runs = requests.get(f"{base}/apis/rlfleet.io/v1alpha1/rlruns", timeout=5).json().get("items", [])
    for run in runs:
        meta = run["metadata"]
        requests.delete(
            f"{base}/apis/rlfleet.io/v1alpha1/namespaces/{meta['namespace']}/rlruns/{meta['name']}", timeout=5
        )
