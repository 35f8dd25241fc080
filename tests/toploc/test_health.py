"""The verifier's /healthz on its metrics port (rlfleet/services/toploc/health.py) against a real gate, Redis
and origin: alive before any model is loaded, an idle prefill probe on the model it loaded, 503 once a
prefill blocked inside the model misses the deadline (a forward hook that waits on an event: the model
runs for real, one forward never returns), 200 again when it completes."""

from __future__ import annotations

import threading

import requests
import torch

from rlfleet.models.policy import score
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.health import PROBE_SECONDS
from rlfleet.services.toploc.main import Gate
from rlfleet.wire import env
from rlfleet.wire.health import serve
from tests.support import wait_for
from tests.toploc.test_gate import as_, gate_system


def healthz(url: str) -> tuple[int, dict]:
    answer = requests.get(f"{url}/healthz", timeout=10)
    return answer.status_code, answer.json()


def test_the_verifier_is_alive_idle_and_wedged_by_its_prefills(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv(env.HEALTH_DEADLINE_S, "1")
    monkeypatch.setenv(env.HEALTH_PROBE_INTERVAL_S, "0.2")
    with gate_system(tmp_path, redis_url) as (ctx, policy, origin_url, tmp):
        ctx = as_(ctx, VERIFIER)
        gate = Gate(ctx, "verifier-health", origin_url, tmp / "cache")
        server = serve(0, "127.0.0.1", ctx.health)
        url = f"http://127.0.0.1:{server.server_port}"
        try:
            status, body = healthz(url)
            assert (status, body["status"]) == (200, "idle"), body  # ready once made; no model yet
            model, tokenizer = gate.policy(0)
            wait_for("an idle prefill probe", lambda: PROBE_SECONDS._value.get() > 0, 30)
            release = threading.Event()

            def stuck(module, args) -> None:  # returns None: the forward's inputs stay as they are
                release.wait()

            handle = model.model.register_forward_pre_hook(stuck)
            prompt = tokenizer("12+7=")["input_ids"]

            def prefill_checks():  # the gate's prefill (batch.py, checks.py)
                with torch.inference_mode():
                    score(model, [prompt], 1.0, tokenizer.pad_token_id)

            prefill = threading.Thread(target=prefill_checks, daemon=True)
            try:
                prefill.start()
                status, body = wait_for("503", lambda: (h := healthz(url))[0] == 503 and h, 30)
                assert body["status"] == "wedged" and "while busy" in body["detail"], body
            finally:
                release.set()
                handle.remove()
                prefill.join(60)
            wait_for("alive again", lambda: healthz(url)[0] == 200, 30)
        finally:
            server.shutdown()
            server.server_close()
