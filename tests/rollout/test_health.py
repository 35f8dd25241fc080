"""A rollout worker's /healthz (rlfleet/wire/health.py, rlfleet/services/rollout/health.py) over real HTTP,
with a real torch engine on a tiny model: 503 while starting, 200 when an idle probe generated its token,
503 once a generation blocked inside the engine misses the deadline (and 200 again when it moves), 503
when the idle probe itself blocks or fails. Generation is blocked by a forward hook on the engine's
model that waits on an event: the engine runs for real, one of its forward steps never returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests

from rlfleet.config import parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.services.rollout.health import ALIVE, PROBE_SECONDS, engine_liveness
from rlfleet.versions.checkpoint import weight_bytes
from rlfleet.wire import env
from rlfleet.wire.health import Health, LivenessSettings, Verdict, serve
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, SamplingParams
from tests.runs import bundle_yaml, pool, rlrun
from tests.support import tiny_policy_dir, wait_for

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, seed=3)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> TorchEngine:
    return TorchEngine(tiny_policy_dir(tmp_path_factory.mktemp("policy"), seed=0), 0)


@contextmanager
def worker_health(monkeypatch, engine: TorchEngine, deadline: float = 1.0, every: float = 0.2) -> Iterator:
    """A worker's liveness over its engine (`engine_liveness`, as Worker makes it) and /healthz on a free port."""
    monkeypatch.setenv(env.HEALTH_DEADLINE_S, str(deadline))
    monkeypatch.setenv(env.HEALTH_PROBE_INTERVAL_S, str(every))
    bundle = parse_bundle(bundle_yaml(rlrun(), pool()))
    ctx = Context(bundle=bundle, redis=None, keys=RunKeys("arithmetic"), stop=threading.Event())
    server = serve(0, "127.0.0.1", ctx.health)
    made: list[TorchEngine] = []
    live = engine_liveness(ctx, lambda: made[0] if made else None)
    try:
        yield live, made, f"http://127.0.0.1:{server.server_port}"
    finally:
        ctx.stop.set()
        server.shutdown()
        server.server_close()


def healthz(url: str) -> tuple[int, dict]:
    answer = requests.get(f"{url}/healthz", timeout=10)
    return answer.status_code, answer.json()


@contextmanager
def blocking_forward(engine: TorchEngine, after: int) -> Iterator[threading.Event]:
    """The engine's forward steps block, from the `after`-th on, until the event is set."""
    release, calls = threading.Event(), [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] > after:
            release.wait()

    handle = engine.model.model.register_forward_pre_hook(hook)
    try:
        yield release
    finally:
        release.set()
        handle.remove()


def test_a_server_without_checks_answers_200_and_serves_metrics_as_before():
    health = Health()
    server = serve(0, "127.0.0.1", health)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert healthz(url) == (200, {"status": "ok", "detail": "the process serves (no health check registered)"})
        metrics = requests.get(f"{url}/metrics", timeout=10)
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        assert "python_info{" in metrics.text  # prometheus_client's default registry, as start_http_server served
        only = requests.get(f"{url}/metrics", params={"name[]": "python_info"}, timeout=10).text
        assert "python_info{" in only and "rlfleet_" not in only  # its name[] filter, as before
    finally:
        server.shutdown()
        server.server_close()


def test_a_component_that_will_register_a_check_answers_starting_until_it_does():
    health = Health(pending=True)  # component_context(..., health_check=True): the rollout worker, the verifier
    server = serve(0, "127.0.0.1", health)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        status, body = healthz(url)
        assert (status, body["status"]) == (503, "starting"), body  # a startup probe in the first second waits
        health.register(lambda: Verdict(True, "idle", "registered"))
        assert healthz(url) == (200, {"status": "idle", "detail": "registered"})
    finally:
        server.shutdown()
        server.server_close()


def test_starting_until_ready_then_an_idle_probe_keeps_it_alive(monkeypatch, engine):
    with worker_health(monkeypatch, engine) as (live, made, url):
        status, body = healthz(url)
        assert (status, body["status"]) == (503, "starting"), body
        assert ALIVE._value.get() == 0
        made.append(engine)
        live.ready()
        before = engine.heartbeat
        wait_for("an idle probe", lambda: engine.heartbeat > before, 30)  # the probe generated with the engine
        status, body = healthz(url)
        assert (status, body["status"]) == (200, "idle"), body
        assert PROBE_SECONDS._value.get() > 0
        wait_for("the alive gauge", lambda: ALIVE._value.get() == 1, 10)


def test_a_generation_blocked_in_the_engine_fails_after_the_deadline_and_recovers(monkeypatch, engine):
    with worker_health(monkeypatch, engine, every=3600) as (live, made, url):  # no idle probe in this test
        made.append(engine)
        live.ready()
        prompt = engine.tokenizer("12+7=")["input_ids"]
        with blocking_forward(engine, after=3) as release:  # the prefill and two decode steps, then stuck

            def generate():
                with live.working():
                    engine.generate(prompt, PARAMS, 4)

            worker = threading.Thread(target=generate, daemon=True)
            worker.start()
            status, body = wait_for("503", lambda: (h := healthz(url))[0] == 503 and h, 30)
            assert body["status"] == "wedged" and "while busy" in body["detail"], body
            assert ALIVE._value.get() == 0
            release.set()
            worker.join(60)
        assert not worker.is_alive()
        status, body = healthz(url)
        assert (status, body["status"]) == (200, "idle"), body


def test_a_blocked_or_failing_idle_probe_fails(monkeypatch, engine):
    with worker_health(monkeypatch, engine, every=0.2) as (live, made, url):
        made.append(engine)
        with blocking_forward(engine, after=0) as release:
            live.ready()
            status, body = wait_for("503", lambda: (h := healthz(url))[0] == 503 and h, 30)
            # "the idle probe has run N s" once the prober started it; on a loaded machine the prober thread may
            # start it late, and the idle deadline passes first ("no ... probe completed ... while idle"): both
            # are the idle verdicts of a probe that never returns (a CI run on four busy workers saw the second)
            idle_verdict = "idle probe" in body["detail"] or "while idle" in body["detail"]
            assert body["status"] == "wedged" and idle_verdict, body
            release.set()
        wait_for("alive again", lambda: healthz(url)[0] == 200, 30)

    def broken(module, args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with worker_health(monkeypatch, engine, every=0.2) as (live, made, url):
        made.append(engine)
        handle = engine.model.model.register_forward_pre_hook(broken)
        try:
            live.ready()
            status, body = wait_for("503", lambda: (h := healthz(url))[0] == 503 and h, 30)
            assert body["status"] == "probe_failed" and "illegal memory access" in body["detail"], body
        finally:
            handle.remove()
        wait_for("alive again", lambda: healthz(url)[0] == 200, 30)


@contextmanager
def slow_weight_load(monkeypatch) -> Iterator[threading.Event]:
    """The torch engine's weight loads wait for the event first (a slow disk), then load for real."""
    import rlfleet.engines.torch_engine as torch_engine

    release, real = threading.Event(), torch_engine.load_weights_in_place

    def slow(model, model_dir):
        release.wait()
        real(model, model_dir)

    monkeypatch.setattr(torch_engine, "load_weights_in_place", slow)
    try:
        yield release
    finally:
        release.set()


@pytest.mark.parametrize("budget_s", [30.0, 2.0])
def test_a_swap_has_its_own_budget_from_its_bytes(monkeypatch, tmp_path, engine, budget_s):
    """Bug: a weight swap beats no forward step, so one slower than the deadline (a 32B reload takes 35-65 s
    against 60 s) answered 503 and the kubelet restarted the worker mid-swap. Now a swap has the deadline plus
    its bytes at RLFLEET_HEALTH_SWAP_MIN_RATE: here the deadline is 1 s and the rate makes the budget
    `budget_s`. The 30 s swap is alive at 2.5 deadlines; the 2 s one is wedged once past its budget."""
    version = tiny_policy_dir(tmp_path / "v1", seed=1)
    nbytes = weight_bytes(version)
    monkeypatch.setenv(env.HEALTH_SWAP_MIN_RATE, str(nbytes / (budget_s - 1.0)))
    with worker_health(monkeypatch, engine, every=3600) as (live, made, url), slow_weight_load(monkeypatch) as release:
        made.append(engine)
        live.ready()
        started = threading.Event()

        def swap():
            with live.swapping(nbytes):
                started.set()
                engine.load_weights(version, 1)

        worker = threading.Thread(target=swap, daemon=True)
        worker.start()
        assert started.wait(30)
        if budget_s > 10:
            time.sleep(2.5)  # 2.5 deadlines into the swap, well inside its budget
            status, body = healthz(url)
            assert (status, body["status"]) == (200, "swapping"), body
            assert "GiB of weights" in body["detail"], body
        else:
            status, body = wait_for("503", lambda: (h := healthz(url))[0] == 503 and h, 30)
            assert body["status"] == "wedged" and "weight swap" in body["detail"], body
        release.set()
        worker.join(60)
        assert engine.version == 1
        status, body = healthz(url)
        assert (status, body["status"]) == (200, "idle"), body


def test_the_settings_come_from_the_environment_and_refuse_what_is_not_a_duration(monkeypatch):
    monkeypatch.setenv(env.HEALTH_DEADLINE_S, "5")
    assert LivenessSettings.from_env() == LivenessSettings(deadline_s=5.0, probe_every_s=30.0)
    assert LivenessSettings.from_env().swap_budget_s(2**30) == 5.0 + 8.0  # 1 GiB at 128 MiB/s
    monkeypatch.setenv(env.HEALTH_PROBE_INTERVAL_S, "0")
    with pytest.raises(SystemExit, match="RLFLEET_HEALTH_PROBE_INTERVAL_S=0: seconds, above 0"):
        LivenessSettings.from_env()
    monkeypatch.setenv(env.HEALTH_PROBE_INTERVAL_S, "30")
    monkeypatch.setenv(env.HEALTH_SWAP_MIN_RATE, "-1")
    with pytest.raises(SystemExit, match="RLFLEET_HEALTH_SWAP_MIN_RATE=-1: bytes per second, above 0"):
        LivenessSettings.from_env()
