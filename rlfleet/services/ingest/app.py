"""`rlfleet ingest`: the authenticated HTTP front of a run's inbox for workers outside the cluster.

  POST /v1/{run}/rollouts   body: a group message (the JSON RolloutGroup.encode() puts in field `m`),
                            header `Authorization: Bearer <token>`; 202 {"id": stream id} when enqueued
  POST /v1/{run}/tickets    a work ticket for the token's worker (runs with spec.sampling.assignment: run)
  GET  /healthz             Redis reachable, inbox backlog
  GET  /metrics             Prometheus metrics of this process (rlfleet_ingest_*)

A submission passes these checks in order, and only then is XADDed to the inbox unchanged (same bytes):
  401 token unknown (compared with hmac.compare_digest against every token, no early exit)
  404 the path names another run            413 body over maxBodyBytes (Content-Length, then while reading)
  422 RolloutGroup.decode fails             403 body's worker_id is not the token's worker, or it is banned
  429 the worker is over ratePerMinute      503 the inbox holds more than maxBacklog groups
429 and 503 carry Retry-After; a worker waits and resends the same group. The ingest only guards the
door: the verifier gate still checks everything (and repeats the ban check). The rate limit is a
token bucket per worker in this process, so with N replicas a worker gets up to N times the rate.
HTTP serving is FastAPI + uvicorn, as the verifier API (rlfleet/services/toploc/api.py).
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import uvicorn
import yaml
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

from rlfleet.assignment import issue_ticket
from rlfleet.config import ConfigError, IngestSpec
from rlfleet.runtime import ComponentOptions
from rlfleet.services.ingest.client import ROLLOUTS_PATH, TICKETS_PATH
from rlfleet.services.toploc.reputation import is_banned
from rlfleet.streams import MESSAGE_FIELD, MessageError, RolloutGroup, RunKeys

log = logging.getLogger("rlfleet.ingest")

BACKLOG_RETRY_SECONDS = 1

ANSWERS = Counter("rlfleet_ingest_requests_total", "Group submissions answered, by HTTP status code", ["code"])
ACCEPTED_BYTES = Counter("rlfleet_ingest_accepted_bytes_total", "Bytes of group messages enqueued to the inbox")


def load_tokens(path: str | Path) -> dict[str, str]:
    """Read a YAML/JSON `{worker_id: token}` file; raise ConfigError naming what is wrong."""
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(source, [f"cannot read tokens file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"tokens file is not valid YAML/JSON: {exc}"]) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(source, ["tokens file must be a non-empty mapping {workerId: token}"])
    problems = [
        f"{worker!r}: token must be a non-empty string"
        for worker, token in data.items()
        if not isinstance(token, str) or not token
    ]
    if not problems and len(set(data.values())) != len(data):
        problems.append("two workers share a token; give each worker its own")
    if problems:
        raise ConfigError(source, problems)
    return {str(worker): token for worker, token in data.items()}


class TokenBook:
    """token -> worker id, looked up in constant time per entry (hmac.compare_digest, every entry)."""

    def __init__(self, tokens: dict[str, str]):
        self._entries = [(token.encode(), worker) for worker, token in tokens.items()]

    def worker_for(self, token: str) -> str | None:
        presented, found = token.encode(), None
        for known, worker in self._entries:
            if hmac.compare_digest(presented, known):
                found = worker
        return found


class RateLimiter:
    """Token bucket per worker: `rate` groups per minute, bursts up to `rate`."""

    def __init__(self, rate_per_minute: int, clock=time.monotonic):
        self.capacity, self.per_second, self.clock = float(rate_per_minute), rate_per_minute / 60.0, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # worker -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, worker: str) -> float:
        """0 when one submission is allowed now (and counted), else the seconds until it would be."""
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(worker, (self.capacity, now))
            tokens = min(self.capacity, tokens + (now - at) * self.per_second)
            if tokens >= 1.0:
                self._buckets[worker] = (tokens - 1.0, now)
                return 0.0
            self._buckets[worker] = (tokens, now)
            return (1.0 - tokens) / self.per_second


def _refuse(code: int, detail: str, retry_after: float | None = None) -> JSONResponse:
    ANSWERS.labels(str(code)).inc()
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse({"detail": detail}, status_code=code, headers=headers)


def make_app(
    run: str, spec: IngestSpec, client: redis.Redis, tokens: dict[str, str], stream_max_len: int = 10000
) -> FastAPI:
    """The ingest of run `run`: checks each submission, XADDs accepted ones to `RunKeys(run).rollouts`."""
    app = FastAPI(
        title="rlfleet ingest",
        version="1",
        description="Authenticated submission of rollout groups by workers outside the cluster.",
    )
    keys, book, limiter = RunKeys(run), TokenBook(tokens), RateLimiter(spec.rate_per_minute)

    def admit(worker: str, body: bytes) -> JSONResponse:
        """The checks after the body is read (sync Redis, run in the threadpool)."""
        try:
            group = RolloutGroup.decode({MESSAGE_FIELD: body})
        except MessageError as exc:
            return _refuse(422, f"body is not a group message: {exc}")
        if group.worker_id != worker:
            return _refuse(403, f"worker_id {group.worker_id!r} in the body is not this token's worker {worker!r}")
        if is_banned(client, keys, worker):
            return _refuse(403, f"worker {worker!r} is banned from run {run!r}")
        wait = limiter.take(worker)
        if wait > 0:
            return _refuse(429, f"worker {worker!r} is over {spec.rate_per_minute} groups per minute", retry_after=wait)
        backlog = client.xlen(keys.rollouts)
        if backlog > spec.max_backlog:
            return _refuse(
                503,
                f"inbox holds {backlog} groups (bound {spec.max_backlog}); resend later",
                retry_after=BACKLOG_RETRY_SECONDS,
            )
        stream_id = client.xadd(keys.rollouts, {MESSAGE_FIELD: body}, maxlen=stream_max_len, approximate=True)
        ANSWERS.labels("202").inc()
        ACCEPTED_BYTES.inc(len(body))
        return JSONResponse({"id": stream_id.decode(), "rollout_id": group.rollout_id}, status_code=202)

    @app.post(ROLLOUTS_PATH, status_code=202, summary="Submit one rollout group")
    async def submit(run: str, request: Request) -> Response:  # `run`: the path's run; keys.run is ours
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        worker = book.worker_for(token) if scheme.lower() == "bearer" and token else None
        if worker is None:
            return _refuse(401, "missing or unknown token: send `Authorization: Bearer <token>`")
        if run != keys.run:
            return _refuse(404, f"run {run!r} is not served here (this ingest serves {keys.run!r})")
        limit = spec.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return _refuse(413, f"Content-Length {length} is over maxBodyBytes {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return _refuse(413, f"body is over maxBodyBytes {limit}")
        return await run_in_threadpool(admit, worker, bytes(body))

    @app.post(TICKETS_PATH, summary="Take a work ticket (runs that assign work)")
    def ticket(run: str, request: Request) -> Response:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        worker = book.worker_for(token) if scheme.lower() == "bearer" and token else None
        if worker is None:
            return _refuse(401, "missing or unknown token: send `Authorization: Bearer <token>`")
        if run != keys.run:
            return _refuse(404, f"run {run!r} is not served here (this ingest serves {keys.run!r})")
        if is_banned(client, keys, worker):
            return _refuse(403, f"worker {worker!r} is banned from run {run!r}")
        return JSONResponse({"ticket": issue_ticket(client, keys, worker)}, status_code=200)

    @app.get("/healthz", summary="Liveness and backlog")
    def healthz() -> dict:
        client.ping()
        return {"status": "ok", "run": run, "inbox": client.xlen(keys.rollouts)}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


@dataclass(frozen=True, kw_only=True)
class IngestOptions(ComponentOptions):
    port: int
    host: str = "127.0.0.1"  # bind address (0.0.0.0 in a pod)
    tokens_file: Path | None = None  # overrides spec.ingest.tokensFile


def main(options: IngestOptions) -> int:
    from rlfleet.runtime import component_context

    ctx = component_context(options, "ingest")
    spec = ctx.bundle.run.spec
    tokens_file = options.tokens_file or spec.ingest.tokens_file
    if not tokens_file:
        raise ConfigError(str(options.config), ["spec.ingest.tokensFile: required (or pass --tokens-file)"])
    app = make_app(ctx.run_name, spec.ingest, ctx.redis, load_tokens(tokens_file), spec.redis.stream_max_len)
    log.info("serving the inbox of run %s on %s:%d", ctx.run_name, options.host, options.port)
    uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning")).run()
    return 0
