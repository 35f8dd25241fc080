"""The verifier's HTTP API (FastAPI; OpenAPI at /openapi.json, docs at /docs).

  POST /verify             verify one rollout group out of band: the inbox message body (the JSON of
                           field `m`); every check but the replay guard, nothing forwarded or counted.
                           200 with the verdict; 413 over maxMessageBytes (Content-Length, then while
                           reading: never more held); 422 not a group message (not JSON, nested too
                           deep, wrong types, another schema), with the gate's reason and what is wrong
  GET  /workers            reputation of every worker seen: counters and ban record
  GET  /workers/{id}       one worker's counters and ban record
  GET  /healthz            Redis reachable, inbox backlog, versions loaded, the prefill model's liveness
                           (rlfleet/services/toploc/health.py; 503 when it is not alive, as on the metrics port)
  GET  /metrics            Prometheus metrics of this process (rlfleet_verifier_*)
It shares the gate's loaded models; it runs in a thread of the verifier process (`--api-port`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from rlfleet.fleet.reputation import one_worker_stats, worker_stats
from rlfleet.services.toploc.checks import Rejection
from rlfleet.wire.asgi import BackgroundServer
from rlfleet.wire.streams import MESSAGE_FIELD


class Verdict(BaseModel):
    accepted: bool = Field(description="Whether the group passed every check.")
    reason: str | None = Field(default=None, description="Rejection reason (one per check), when rejected.")
    detail: str | None = Field(default=None, description="What the failing check found.")
    rollout_id: str | None = Field(default=None, description="The group's rollout id, when it could be decoded.")
    worker_id: str | None = Field(default=None, description="The worker that claims the group, when known.")
    rewards: list[float] | None = Field(default=None, description="Trusted rewards, when accepted.")
    reward_mismatches: int | None = Field(
        default=None, description="Samples whose claimed reward differed from the trusted one."
    )


class WorkerStats(BaseModel):
    counters: dict[str, int] = Field(description="accepted, rejected, rejected:{reason}, reward_mismatch, unchecked.")
    banned: dict[str, Any] | None = Field(description="Ban record (reason, detail, rollout_id, rule, at) or null.")


class Health(BaseModel):
    status: str = Field(description="`ok` when Redis answers and the prefill model is alive.")
    engine: str = Field(description="The prefill model's liveness: idle, busy, or why it is not alive.")
    consumer: str = Field(description="This replica's consumer name.")
    inbox: int = Field(description="Unhandled groups in the inbox stream.")
    loaded_versions: list[int] = Field(description="Policy versions held in memory.")


_BODY = {"type": "object", "description": "An inbox message body: the JSON object of field `m`."}


def _refuse(status: int, detail: str, reason: str | None = None) -> JSONResponse:
    """A 4xx answer; `reason` is the gate's rejection reason when it has one (malformed, schema_version, size)."""
    return JSONResponse({"accepted": False, "detail": detail, "reason": reason}, status_code=status)


def make_api(gate) -> FastAPI:
    """The API of one gate replica (`gate`: rlfleet.services.toploc.main.Gate)."""
    app = FastAPI(
        title="rlfleet verifier",
        version="1",
        description="TOPLOC verification gate: out-of-band verification, worker reputation, health, metrics.",
    )
    r, keys = gate.ctx.redis, gate.ctx.keys

    limit = gate.spec.verifier.max_message_bytes - len(MESSAGE_FIELD)  # what decode_group admits

    @app.post(
        "/verify",
        response_model=Verdict,
        summary="Verify one rollout group out of band",
        responses={413: {"description": "Body over maxMessageBytes"}, 422: {"description": "Not a group message"}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BODY}}}},
    )
    async def verify(request: Request) -> Response | Verdict:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return _refuse(413, f"Content-Length {length[:30]} is over maxMessageBytes ({limit} for the body)")
        body = bytearray()
        async for chunk in request.stream():  # bounded: never more than `limit` bytes held
            body += chunk
            if len(body) > limit:
                return _refuse(413, f"body is over maxMessageBytes ({limit} for the body)")
        group, result = await run_in_threadpool(gate.verify, {MESSAGE_FIELD: bytes(body)})
        if group is None:  # the gate could not read it as a group message: the caller's mistake
            return _refuse(413 if result.reason == "size" else 422, result.detail, reason=result.reason)
        ids = {"rollout_id": group.rollout_id, "worker_id": group.worker_id}
        if isinstance(result, Rejection):
            return Verdict(accepted=False, reason=result.reason, detail=result.detail, **ids)
        return Verdict(accepted=True, rewards=result.rewards, reward_mismatches=result.reward_mismatches, **ids)

    @app.get("/workers", response_model=dict[str, WorkerStats], summary="Reputation of every worker")
    def workers() -> dict:
        return worker_stats(r, keys)

    @app.get("/workers/{worker_id}", response_model=WorkerStats, summary="Reputation of one worker")
    def worker(worker_id: str) -> dict:
        return one_worker_stats(r, keys, worker_id)

    @app.get("/healthz", response_model=Health, summary="Liveness and backlog", responses={503: {"model": Health}})
    def healthz() -> Response | Health:
        r.ping()
        engine = gate.liveness.check()
        health = Health(
            status="ok" if engine.ok else engine.status,
            engine=f"{engine.status}: {engine.detail}",
            consumer=gate.consumer,
            inbox=r.xlen(keys.rollouts),
            loaded_versions=gate.resident.versions(),
        )
        return health if engine.ok else JSONResponse(health.model_dump(), status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_in_thread(gate, host: str, port: int) -> BackgroundServer:
    return BackgroundServer(make_api(gate), host, port, "verifier API").start()
