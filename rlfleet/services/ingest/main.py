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
429 and 503 carry Retry-After; a worker waits and resends the same group.

Submissions are idempotent: one Lua script checks the backlog, looks up the (worker, content digest)
record and XADDs with it atomically, so a resend of a stored group (after a lost reply, a timeout, a
5xx) answers 202 with the first entry's id (`duplicate: true`) and adds nothing, and concurrent
submissions never push the inbox past maxBacklog. A submission that is not stored gets its rate
token back. The inbox is never trimmed (no MAXLEN): it holds only unverified groups, bounded by
maxBacklog here and maxPending for Redis workers.

The ingest only guards the door: the verifier gate still checks everything (and repeats the ban
check). The rate limit is a token bucket per worker in this process (a joined worker's rate widens
with its accepted groups, door.py), so with N replicas a worker gets up to N times the rate.

HTTP serving is FastAPI + uvicorn, as the verifier API: the handlers are the methods of `Ingest`,
registered by `make_app`; slow clients and buffered bytes are bounded by limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from rlfleet.services.ingest.door import BANNED_REFUSALS, JOIN_BODY_MAX_BYTES, JOINS, Door, Refusal, make_door
from rlfleet.services.ingest.limits import BodyBudget, RateLimiter, RedisWatch, guarded_protocol
from rlfleet.services.ingest.tokens import TokenBook, load_tokens
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


class Ingest:
    """The ingest of run `run`: its route handlers (registered by `make_app`) and what they share (the
    token book, the per-worker rate limiter, the budget of body bytes in flight, the watch on Redis).
    `client` should have socket timeouts (`ingest_redis`), so a stalled Redis answers 503, not a hang.
    `door`: serves the run document and joins (door.py); without it both answer 404."""

    def __init__(
        self, run: str, spec: IngestSpec, client: redis.Redis, tokens: dict[str, str], door: Door | None = None
    ):
        self.run, self.spec, self.client, self.door = run, spec, client, door
        self.keys = RunKeys(run)
        self.book = TokenBook(tokens)
        self.limiter = RateLimiter(spec.rate_per_minute)
        self.budget = BodyBudget(spec.max_buffered_bytes)
        self.watch = RedisWatch(client, self.keys.rollouts)
        self._admit = client.register_script(_ADMIT)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await asyncio.to_thread(self.watch.check)  # /healthz tells the truth from the first request on
        self.watch.start()
        yield
        self.watch.stop.set()

    # Submissions: POST /v1/{run}/rollouts.

    async def submit(self, run: str, request: Request) -> Response:
        """Submit one rollout group (`run`: the path's run; self.keys.run is ours)."""
        try:
            worker, joined = await run_in_threadpool(self.authenticate, run, request)
            body, reserved = await self.read_body(request)
        except _Refused as refused:
            return refused.response
        try:
            return await run_in_threadpool(self.admit, worker, joined, body)
        finally:
            self.budget.release(reserved)

    def authenticate(self, run_in_path: str, request: Request) -> tuple[str, bool]:
        """(worker, joined through the door); runs in the threadpool (a joined worker's token is in Redis)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and bool(token)
        worker = self.book.worker_for(token) if bearer else None
        joined = worker is None and self.door is not None and bearer
        if joined:
            assert self.door is not None  # for mypy: `joined` implies it
            try:
                worker = self.door.worker_for(token)
            except redis.RedisError as exc:
                raise _Refused(_redis_trouble(exc)) from None

        if worker is None:
            raise _Refused(_refuse(401, "missing or unknown token: send `Authorization: Bearer <token>`"))
        if run_in_path != self.keys.run:
            served = self.keys.run
            raise _Refused(_refuse(404, f"run {run_in_path!r} is not served here (this ingest serves {served!r})"))
        return worker, joined

    async def read_body(self, request: Request) -> tuple[bytes, int]:
        """The body and the bytes reserved for it in the budget (released by the caller)."""
        limit, length = self.spec.max_body_bytes, request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise _Refused(_refuse(413, f"Content-Length {length} is over maxBodyBytes {limit}"))
        reserved = int(length) if length is not None else 0
        if not self.budget.reserve(reserved):
            raise _Refused(self.busy())

        body = bytearray()
        try:
            async with asyncio.timeout(self.spec.request_timeout_seconds):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise _Refused(_refuse(413, f"body is over maxBodyBytes {limit}"))
                    if len(body) > reserved:  # chunked (or longer than announced): reserve as it comes
                        if not self.budget.reserve(len(body) - reserved):
                            raise _Refused(self.busy())
                        reserved = len(body)
        except TimeoutError:
            self.budget.release(reserved)
            timeout = self.spec.request_timeout_seconds
            raise _Refused(_refuse(408, f"body not received within requestTimeoutSeconds {timeout}")) from None
        except BaseException:
            self.budget.release(reserved)
            raise
        return bytes(body), reserved

    def busy(self) -> JSONResponse:
        """503: the bodies in flight would pass maxBufferedBytes."""
        held, limit = self.budget.held, self.budget.limit
        return _refuse(
            503,
            f"the ingest holds {held} bytes of bodies in flight (maxBufferedBytes {limit}); resend later",
            retry_after=BUFFER_RETRY_SECONDS,
        )

    def admit(self, worker: str, joined: bool, body: bytes) -> JSONResponse:
        """The checks after the body is read (sync Redis, run in the threadpool), then the admission script."""
        try:
            group = RolloutGroup.decode({MESSAGE_FIELD: body})
        except MessageError as exc:
            return _refuse(422, f"body is not a group message: {exc}")
        if group.worker_id != worker:
            return _refuse(403, f"worker_id {group.worker_id!r} in the body is not this token's worker {worker!r}")
        try:
            if is_banned(self.client, self.keys, worker):
                return self.banned(worker)
            rate = self.door.rate_for(worker) if joined and self.door is not None else self.spec.rate_per_minute
        except redis.RedisError as exc:
            return _redis_trouble(exc)
        wait = self.limiter.take(worker, rate)
        if wait > 0:
            return _refuse(429, f"worker {worker!r} is over {rate} groups per minute", retry_after=wait)

        record = self.keys.submitted(f"{group_digest(group)}:{worker}")
        try:
            args: list[bytes | str | float] = [self.spec.max_backlog, body, SUBMITTED_TTL_S, time.time(), worker]
            kind, value = self._admit(keys=[self.keys.rollouts, record, self.keys.active], args=args)
        except redis.RedisError as exc:
            self.limiter.refund(worker)
            return _redis_trouble(exc)
        kind, value = kind.decode(), value.decode()
        if kind == "full":
            self.limiter.refund(worker)
            return _refuse(
                503,
                f"inbox holds {value} groups (bound {self.spec.max_backlog}); resend later",
                retry_after=BACKLOG_RETRY_SECONDS,
            )
        if kind == "dup":
            self.limiter.refund(worker)
        else:
            ACCEPTED_BYTES.inc(len(body))
        ANSWERS.labels("202").inc()
        return JSONResponse({"id": value, "rollout_id": group.rollout_id, "duplicate": kind == "dup"}, status_code=202)

    def banned(self, worker: str) -> JSONResponse:
        BANNED_REFUSALS.inc()
        return _refuse(403, f"worker {worker!r} is banned from run {self.run!r}")

    # Work tickets: POST /v1/{run}/tickets.

    async def ticket(self, run: str, request: Request) -> Response:
        """A work ticket for the token's worker (runs that assign work)."""
        try:
            worker, _ = await run_in_threadpool(self.authenticate, run, request)
        except _Refused as refused:
            return refused.response
        return await run_in_threadpool(self.take_ticket, worker)

    def take_ticket(self, worker: str) -> JSONResponse:
        try:
            if is_banned(self.client, self.keys, worker):
                return self.banned(worker)
            return JSONResponse({"ticket": issue_ticket(self.client, self.keys, worker)}, status_code=200)
        except redis.RedisError as exc:
            return _redis_trouble(exc)

    # The door: GET /v1/{run}, POST /v1/{run}/join (door.py).

    async def document(self, run: str) -> JSONResponse:
        if self.door is None or run != self.keys.run:
            return JSONResponse({"detail": f"run {run!r} is not served here"}, status_code=404)
        return JSONResponse(self.door.document)

    async def join(self, run: str, request: Request) -> Response:
        if self.door is None or run != self.keys.run:
            JOINS.labels("404").inc()
            return JSONResponse({"detail": f"run {run!r} is not served here"}, status_code=404)
        body = b""
        async for chunk in request.stream():  # parse_join_body refuses a body this long
            body += chunk
            if len(body) > JOIN_BODY_MAX_BYTES:
                break

        address = request.client.host if request.client else "unknown"
        try:
            answer = await run_in_threadpool(self.door.join, address, body)
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

    # The process: /healthz, /livez, /metrics.

    async def healthz(self) -> JSONResponse:
        state = self.watch.state()
        body = {"status": "ok" if state["redis"] else "redis_unavailable", "run": self.run, **state}
        if state["redis"]:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(REDIS_RETRY_SECONDS)})

    async def livez(self) -> dict:
        return {"status": "ok"}

    def metrics(self) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def make_app(
    run: str, spec: IngestSpec, client: redis.Redis, tokens: dict[str, str], door: Door | None = None
) -> FastAPI:
    """The ingest of run `run` (`Ingest`): checks each submission, XADDs accepted ones to
    `RunKeys(run).rollouts`."""
    ingest = Ingest(run, spec, client, tokens, door)
    app = FastAPI(
        title="rlfleet ingest",
        version="1",
        description="Authenticated submission of rollout groups by workers outside the cluster.",
        lifespan=ingest.lifespan,
    )
    app.post(ROLLOUTS_PATH, status_code=202, summary="Submit one rollout group")(ingest.submit)
    app.post(TICKETS_PATH, summary="Take a work ticket (runs that assign work)")(ingest.ticket)
    app.get(RUN_PATH, summary="The public run document: what a worker needs to configure itself")(ingest.document)
    app.post(JOIN_PATH, status_code=201, summary="Join the run: a worker id and its token")(ingest.join)
    app.get("/healthz", summary="Readiness: Redis answered recently")(ingest.healthz)
    app.get("/livez", summary="Liveness: the process serves")(ingest.livez)
    app.get("/metrics", summary="Prometheus metrics", response_class=Response)(ingest.metrics)
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
    """`rlfleet ingest`: serve the run's inbox on host:port until SIGTERM."""
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
