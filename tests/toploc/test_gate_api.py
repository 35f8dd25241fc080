"""The verifier's HTTP API served by uvicorn on 127.0.0.1, against a real gate, Redis and origin."""

from __future__ import annotations

import json
import re

import httpx

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.api import serve_in_thread
from rlfleet.services.toploc.main import Gate
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import SCHEMA_VERSION
from tests.support import tiny_policy_dir
from tests.toploc.test_gate import as_, gate_system, honest_group, run_gate, verified_ids


def body(group) -> dict:
    return json.loads(group.encode()[b"m"])


def test_api_verifies_out_of_band_and_reports_workers_health_metrics(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url) as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        gate = Gate(as_(ctx, VERIFIER), "verifier-api", origin_url, tmp / "cache-api")
        port = free_port()
        server = serve_in_thread(gate, "127.0.0.1", port)
        try:
            api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            health = api.get("/healthz").json()
            assert health["status"] == "ok" and health["consumer"] == "verifier-api" and health["inbox"] == 0
            assert health["engine"].startswith("idle: "), health  # no model loaded yet: nothing to wedge

            honest = honest_group(engine, ctx, 1)
            verdict = api.post("/verify", json=body(honest)).json()
            assert verdict["accepted"] and verdict["rollout_id"] == honest.rollout_id and len(verdict["rewards"]) == 4
            other = honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2, worker="w-other")
            verdict = api.post("/verify", json=body(other)).json()
            assert (verdict["accepted"], verdict["reason"], verdict["worker_id"]) == (False, "toploc", "w-other")
            assert (
                api.post("/verify", json={"schema": SCHEMA_VERSION + 1, "worker_id": "w-new"}).json()["reason"]
                == "schema_version"
            )
            assert api.post("/verify", json={"schema": SCHEMA_VERSION}).json()["reason"] == "malformed"
            assert (
                api.post("/verify", content=b"[1, 2]", headers={"content-type": "application/json"}).status_code == 422
            )
            # Out of band writes nothing: no stream entry, no counter, no ban, no replay guard.
            assert (r.xlen(keys.verified), r.xlen(keys.rejected), r.hlen(keys.workers), r.hlen(keys.banned)) == (
                0,
                0,
                0,
                0,
            )

            for g in (honest, other):  # the same groups through the inbox: counted, forwarded, banned
                r.xadd(keys.rollouts, g.encode())
            run_gate(ctx, origin_url, tmp / "cache", expected=2)
            assert verified_ids(ctx) == [honest.rollout_id]
            workers = api.get("/workers").json()
            honest_counters = workers["w-honest"]["counters"]  # the seed replay's score rides with the verdict
            assert workers["w-honest"]["banned"] is None and honest_counters["accepted"] == 1
            assert honest_counters["replay_mismatches"] == 0 and honest_counters["replay_positions"] > 0
            assert workers["w-other"]["banned"]["reason"] == "toploc"
            one = api.get("/workers/w-other").json()
            assert one["counters"] == {"rejected": 1, "rejected:toploc": 1} and one["banned"]["rule"] == "banOn"
            assert api.get("/workers/nobody").json() == {"counters": {}, "banned": None}
            assert (
                api.post("/verify", json=body(honest_group(engine, ctx, 3, worker="w-other"))).json()["reason"]
                == "banned"
            )

            metrics = api.get("/metrics")
            assert metrics.headers["content-type"].startswith("text/plain")
            rejected = re.search(
                r'rlfleet_verifier_groups_total\{reason="toploc",verdict="rejected"\} (\S+)', metrics.text
            )
            assert rejected and float(rejected.group(1)) >= 1  # every reason is on /metrics from the start, at 0
            paths = api.get("/openapi.json").json()["paths"]
            assert {"/verify", "/workers", "/workers/{worker_id}", "/healthz", "/metrics"} <= set(paths)
            assert api.get("/docs").status_code == 200
        finally:
            server.stop()
        assert not server.thread.is_alive()
