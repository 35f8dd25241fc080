"""`rlfleet ingest`: the authenticated HTTP front of a run's inbox for workers outside the cluster.

  POST /v1/{run}/rollouts   body: a group message (the JSON RolloutGroup.encode() puts in field `m`),
                            header `Authorization: Bearer <token>`; 202 {"id": stream id} when enqueued
  POST /v1/{run}/tickets    a work ticket for the token's worker (runs with spec.sampling.assignment: run)
  GET  /v1/{run}            the public run document; POST /v1/{run}/join: a worker joins (door.py)
  GET  /healthz             readiness: 200 while Redis answered in the last seconds, else 503 (from memory)
  GET  /livez               liveness: 200 while the process serves
  GET  /metrics             Prometheus metrics of this process (rlfleet_ingest_*)

A submission passes these checks in order, and only then is XADDed to the inbox unchanged (same bytes):
  401 token unknown (compared with hmac.compare_digest against every written token, no early exit; then
      the hashed tokens of joined workers in Redis, door.py)
  404 the path names another run            413 body over maxBodyBytes (Content-Length, then while reading)
  503 the bodies in flight would pass maxBufferedBytes            408 body not received within requestTimeoutSeconds
  422 RolloutGroup.decode fails             403 body's worker_id is not the token's worker, or it is banned
  429 the worker is over ratePerMinute      503 the inbox holds maxBacklog groups, or Redis is down or stalled
429 and 503 carry Retry-After; a worker waits and resends the same group. Submissions are idempotent:
one Lua script checks the backlog, looks up the (worker, content digest) record and XADDs with it
atomically, so a resend of a stored group (after a lost reply, a timeout, a 5xx) answers 202 with the
first entry's id (`duplicate: true`) and adds nothing, and concurrent submissions never push the inbox
past maxBacklog. A submission that is not stored gets its rate token back. The inbox is never trimmed
(no MAXLEN): it holds only unverified groups, bounded by maxBacklog here and maxPending for Redis workers.
The ingest only guards the door: the verifier gate still checks everything (and repeats the ban check).
The rate limit is a token bucket per worker in this process (a joined worker's rate widens with its accepted
groups, door.py), so with N replicas a worker gets up to N
times the rate. HTTP serving is FastAPI + uvicorn, as the verifier API; slow clients and buffered bytes
are bounded by limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.concurrency import run_in_threadpool

from rlfleet.config import ConfigError, IngestSpec
from rlfleet.fleet.assignment import issue_ticket
from rlfleet.fleet.reputation import is_banned
from rlfleet.services.ingest.client import JOIN_PATH, ROLLOUTS_PATH, RUN_PATH, TICKETS_PATH
from rlfleet.services.ingest.door import (
    BANNED_REFUSALS,
    JOIN_BODY_MAX_BYTES,
    JOINS,
    Door,
    Refusal,
    make_door,
    read_secret_file,
)
from rlfleet.services.ingest.limits import BodyBudget, RateLimiter, RedisWatch, guarded_protocol
from rlfleet.wire import components, tls
from rlfleet.wire.asgi import TLSServer
from rlfleet.wire.runtime import ComponentOptions
from rlfleet.wire.streams import MESSAGE_FIELD, MessageError, RolloutGroup, RunKeys, group_digest

log = logging.getLogger("rlfleet.ingest")

BACKLOG_RETRY_SECONDS = 1
REDIS_RETRY_SECONDS = 2
BUFFER_RETRY_SECONDS = 1
SUBMITTED_TTL_S = 3600  # how long a stored submission is remembered for resends (the gate's replay guard after)

ANSWERS = Counter("rlfleet_ingest_requests_total", "Group submissions answered, by HTTP status code", ["code"])
ACCEPTED_BYTES = Counter("rlfleet_ingest_accepted_bytes_total", "Bytes of group messages enqueued to the inbox")

# KEYS: inbox, the submission's idempotency record, active joined workers (door.py).
# ARGV: maxBacklog, body, record TTL seconds, now, worker (its last request time, if it joined).
# Answers {"dup", first id} | {"full", backlog} | {"ok", id}.
_ADMIT = """
local prior = redis.call('GET', KEYS[2])
if prior then return {'dup', prior} end
local backlog = redis.call('XLEN', KEYS[1])
if backlog >= tonumber(ARGV[1]) then return {'full', tostring(backlog)} end
local id = redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
redis.call('SET', KEYS[2], id, 'EX', ARGV[3])
redis.call('ZADD', KEYS[3], 'XX', ARGV[4], ARGV[5])
return {'ok', id}
"""


def load_tokens(path: str | Path) -> dict[str, str]:
    """Read a YAML/JSON `{worker_id: token}` file; raise ConfigError naming what is wrong."""
    source = str(path)
    data = read_secret_file(path, "tokens")
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


def _refuse(code: int, detail: str, retry_after: float | None = None) -> JSONResponse:
    ANSWERS.labels(str(code)).inc()
    return _refusal(code, detail, retry_after)


def _refusal(code: int, detail: str, retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse({"detail": detail}, status_code=code, headers=headers)


def _redis_trouble(exc: redis.RedisError) -> JSONResponse:
    log.warning("Redis trouble: %s: %s", type(exc).__name__, exc)
    return _refuse(503, f"Redis unavailable ({type(exc).__name__}); resend later", retry_after=REDIS_RETRY_SECONDS)


class _Refused(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


def make_app(
    run: str, spec: IngestSpec, client: redis.Redis, tokens: dict[str, str], door: Door | None = None
) -> FastAPI:
    """The ingest of run `run`: checks each submission, XADDs accepted ones to `RunKeys(run).rollouts`.
    `client` should have socket timeouts (`ingest_redis`), so a stalled Redis answers 503, not a hang.
    `door`: serves the run document and joins (door.py); without it both answer 404."""
    keys, book, limiter = RunKeys(run), TokenBook(tokens), RateLimiter(spec.rate_per_minute)
    budget, admit_script = BodyBudget(spec.max_buffered_bytes), client.register_script(_ADMIT)
    watch = RedisWatch(client, keys.rollouts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(watch.check)  # /healthz tells the truth from the first request on
        watch.start()
        yield
        watch.stop.set()

    app = FastAPI(
        title="rlfleet ingest",
        version="1",
        description="Authenticated submission of rollout groups by workers outside the cluster.",
        lifespan=lifespan,
    )

    def authenticate(run_in_path: str, request: Request) -> tuple[str, bool]:
        """(worker, joined through the door); runs in the threadpool (a joined worker's token is in Redis)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        worker = book.worker_for(token) if scheme.lower() == "bearer" and token else None
        joined = worker is None and door is not None and scheme.lower() == "bearer" and bool(token)
        if joined:
            assert door is not None  # for mypy: `joined` implies it
            try:
                worker = door.worker_for(token)
            except redis.RedisError as exc:
                raise _Refused(_redis_trouble(exc)) from None
        if worker is None:
            raise _Refused(_refuse(401, "missing or unknown token: send `Authorization: Bearer <token>`"))
        if run_in_path != keys.run:
            raise _Refused(_refuse(404, f"run {run_in_path!r} is not served here (this ingest serves {keys.run!r})"))
        return worker, joined

    def banned(worker: str) -> JSONResponse:
        BANNED_REFUSALS.inc()
        return _refuse(403, f"worker {worker!r} is banned from run {run!r}")

    def admit(worker: str, joined: bool, body: bytes) -> JSONResponse:
        """The checks after the body is read (sync Redis, run in the threadpool)."""
        try:
            group = RolloutGroup.decode({MESSAGE_FIELD: body})
        except MessageError as exc:
            return _refuse(422, f"body is not a group message: {exc}")
        if group.worker_id != worker:
            return _refuse(403, f"worker_id {group.worker_id!r} in the body is not this token's worker {worker!r}")
        try:
            if is_banned(client, keys, worker):
                return banned(worker)
            rate = door.rate_for(worker) if joined and door is not None else spec.rate_per_minute
        except redis.RedisError as exc:
            return _redis_trouble(exc)
        wait = limiter.take(worker, rate)
        if wait > 0:
            return _refuse(429, f"worker {worker!r} is over {rate} groups per minute", retry_after=wait)
        record = keys.submitted(f"{group_digest(group)}:{worker}")
        try:
            args: list[bytes | str | float] = [spec.max_backlog, body, SUBMITTED_TTL_S, time.time(), worker]
            kind, value = admit_script(keys=[keys.rollouts, record, keys.active], args=args)
        except redis.RedisError as exc:
            limiter.refund(worker)
            return _redis_trouble(exc)
        kind, value = kind.decode(), value.decode()
        if kind == "full":
            limiter.refund(worker)
            return _refuse(
                503,
                f"inbox holds {value} groups (bound {spec.max_backlog}); resend later",
                retry_after=BACKLOG_RETRY_SECONDS,
            )
        if kind == "dup":
            limiter.refund(worker)
        else:
            ACCEPTED_BYTES.inc(len(body))
        ANSWERS.labels("202").inc()
        return JSONResponse({"id": value, "rollout_id": group.rollout_id, "duplicate": kind == "dup"}, status_code=202)

    async def read_body(request: Request) -> tuple[bytes, int]:
        """The body and the bytes reserved for it in the budget (released by the caller)."""
        limit, length = spec.max_body_bytes, request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise _Refused(_refuse(413, f"Content-Length {length} is over maxBodyBytes {limit}"))
        reserved = int(length) if length is not None else 0
        if not budget.reserve(reserved):
            raise _Refused(_busy())
        body = bytearray()
        try:
            async with asyncio.timeout(spec.request_timeout_seconds):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise _Refused(_refuse(413, f"body is over maxBodyBytes {limit}"))
                    if len(body) > reserved:  # chunked (or longer than announced): reserve as it comes
                        if not budget.reserve(len(body) - reserved):
                            raise _Refused(_busy())
                        reserved = len(body)
        except TimeoutError:
            budget.release(reserved)
            raise _Refused(
                _refuse(408, f"body not received within requestTimeoutSeconds {spec.request_timeout_seconds}")
            ) from None
        except BaseException:
            budget.release(reserved)
            raise
        return bytes(body), reserved

    def _busy() -> JSONResponse:
        return _refuse(
            503,
            f"the ingest holds {budget.held} bytes of bodies in flight (maxBufferedBytes {budget.limit}); resend later",
            retry_after=BUFFER_RETRY_SECONDS,
        )

    @app.post(ROLLOUTS_PATH, status_code=202, summary="Submit one rollout group")
    async def submit(run: str, request: Request) -> Response:  # `run`: the path's run; keys.run is ours
        try:
            worker, joined = await run_in_threadpool(authenticate, run, request)
            body, reserved = await read_body(request)
        except _Refused as refused:
            return refused.response
        try:
            return await run_in_threadpool(admit, worker, joined, body)
        finally:
            budget.release(reserved)

    @app.post(TICKETS_PATH, summary="Take a work ticket (runs that assign work)")
    async def ticket(run: str, request: Request) -> Response:
        try:
            worker, _ = await run_in_threadpool(authenticate, run, request)
        except _Refused as refused:
            return refused.response

        def take() -> JSONResponse:
            try:
                if is_banned(client, keys, worker):
                    return banned(worker)
                return JSONResponse({"ticket": issue_ticket(client, keys, worker)}, status_code=200)
            except redis.RedisError as exc:
                return _redis_trouble(exc)

        return await run_in_threadpool(take)

    @app.get(RUN_PATH, summary="The public run document: what a worker needs to configure itself")
    async def document(run: str) -> JSONResponse:
        if door is None or run != keys.run:
            return JSONResponse({"detail": f"run {run!r} is not served here"}, status_code=404)
        return JSONResponse(door.document)

    @app.post(JOIN_PATH, status_code=201, summary="Join the run: a worker id and its token")
    async def join(run: str, request: Request) -> Response:
        if door is None or run != keys.run:
            JOINS.labels("404").inc()
            return JSONResponse({"detail": f"run {run!r} is not served here"}, status_code=404)
        body = b""
        async for chunk in request.stream():  # parse_join_body refuses a body this long
            body += chunk
            if len(body) > JOIN_BODY_MAX_BYTES:
                break
        address = request.client.host if request.client else "unknown"
        try:
            answer = await run_in_threadpool(door.join, address, body)
        except Refusal as no:
            JOINS.labels(str(no.code)).inc()
            return _refusal(no.code, no.detail, no.retry_after)
        except redis.RedisError as exc:
            JOINS.labels("503").inc()
            log.warning("Redis trouble: %s: %s", type(exc).__name__, exc)
            return _refusal(503, f"Redis unavailable ({type(exc).__name__}); retry later", REDIS_RETRY_SECONDS)
        JOINS.labels("201").inc()
        log.info("worker %s joined run %s from %s", answer["worker_id"], run, address)
        return JSONResponse(answer, status_code=201)

    @app.get("/healthz", summary="Readiness: Redis answered recently")
    async def healthz() -> JSONResponse:
        state = watch.state()
        body = {"status": "ok" if state["redis"] else "redis_unavailable", "run": run, **state}
        if state["redis"]:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(REDIS_RETRY_SECONDS)})

    @app.get("/livez", summary="Liveness: the process serves")
    async def livez() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def ingest_redis(url: str, spec: IngestSpec) -> redis.Redis:
    """A client that gives up after redisTimeoutSeconds, without retries: Redis trouble becomes a 503 at once."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    t = spec.redis_timeout_seconds
    return redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0))


def server_config(
    app: FastAPI, spec: IngestSpec, host: str, port: int, tls_files: tuple[Path, Path] | None = None
) -> uvicorn.Config:
    """uvicorn settings of the ingest: bounded connections and per-request deadlines (limits.py); with
    `tls_files` (certificate chain, key) it serves only HTTPS (rlfleet/wire/tls.py)."""
    if tls_files:
        tls.server_context(*tls_files)  # a missing or mismatched file: an error naming the flag, not a traceback
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=guarded_protocol(spec.request_timeout_seconds),
        limit_concurrency=spec.max_connections,
        timeout_keep_alive=5,
        ssl_certfile=str(tls_files[0]) if tls_files else None,
        ssl_keyfile=str(tls_files[1]) if tls_files else None,
    )


@dataclass(frozen=True, kw_only=True)
class IngestOptions(ComponentOptions):
    port: int
    host: str = "127.0.0.1"  # bind address (0.0.0.0 in a pod)
    tokens_file: Path | None = None  # overrides spec.ingest.tokensFile
    invites_file: Path | None = None  # overrides spec.ingest.admission.invitesFile
    relay_urls: list[str] = field(default_factory=list)  # override spec.ingest.admission.relayUrls (`rlfleet run`)
    tls_cert_file: Path | None = None  # with tls_key_file: serve HTTPS only (a cluster: spec.ingest.tls.secretName)
    tls_key_file: Path | None = None


def main(options: IngestOptions) -> int:
    from rlfleet.wire.runtime import component_context

    ctx = component_context(options, components.INGEST)
    spec = ctx.bundle.run.spec
    tokens_file = options.tokens_file or spec.ingest.tokens_file
    if not tokens_file and spec.ingest.admission.mode == "tokens":
        raise ConfigError(str(options.config), ["spec.ingest.tokensFile: required (or pass --tokens-file)"])
    client = ingest_redis(ctx.redis_url, spec.ingest)
    invites = options.invites_file or spec.ingest.admission.invites_file
    door = make_door(ctx.bundle.run, client, str(invites) if invites else None, options.relay_urls)
    tokens = load_tokens(tokens_file) if tokens_file else {}
    app = make_app(ctx.run_name, spec.ingest, client, tokens, door)
    tls_files = tls.server_files(options.tls_cert_file, options.tls_key_file)
    scheme = "https" if tls_files else "http"
    log.info("serving the inbox of run %s on %s://%s:%d", ctx.run_name, scheme, options.host, options.port)
    TLSServer(server_config(app, spec.ingest, options.host, options.port, tls_files)).run()  # certificate reloads
    return 0
