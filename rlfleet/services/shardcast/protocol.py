"""Shardcast HTTP protocol: the paths origin, relays and clients agree on, and the server plumbing
they share (ranged sendfile/streaming, version announcements by long-poll, serving until a stop).

Routes (the origin and every relay serve the same ones):
  GET /healthz                  200 "ok"
  GET /v1/{run}/latest          200 {"version": N}; 404 while the run has no published version
  GET /v1/{run}/latest?after=N[&wait=S]
                                long-poll: 200 {"version": M} as soon as a version M > N is available
                                (at once if one is), else 204 after S seconds (default 30, at most
                                WAIT_MAX); the caller asks again with the same N. A version is
                                "available" on a relay as soon as it is announced to it (the relay
                                then serves it cut-through), on the origin once its manifest is stored.
  GET /metrics                  Prometheus text (rlfleet_relay_* / rlfleet_origin_*)
  GET /v1/{run}/v{N}/{file}     the file: `manifest.json` or a name listed in it. 404 while vN has no
                                manifest (a partial version is never served). One `Range: bytes=a-b`
                                (or `a-`, `-n`) gives 206 + Content-Range; an unsatisfiable one 416.
                                410 once vN has been dropped by retention (older than the versions a
                                relay keeps; on the origin, no manifest while a newer one is published).
A client treats 404 and 5xx alike: not here yet, try again later or elsewhere. 410 is final for that
source: it will not have vN again, so a client that hears it from every source fetches a newer version.
Integrity is the client's job (sha256 from the manifest), not the transport's.
Bytes that lie in a local file go out with `loop.sendfile` (os.sendfile on the socket: no copy
through Python); other bodies (S3, the manifest) stream in MiB chunks read in a thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from aiohttp import web

from rlfleet.wire import tls

log = logging.getLogger("rlfleet.shardcast")

CHUNK = 1 << 20
WAIT_DEFAULT, WAIT_MAX = 30.0, 300.0  # long-poll seconds
_IO = ThreadPoolExecutor(max_workers=32, thread_name_prefix="shardcast-io")  # blocking chunk reads
ROUTE_HEALTH = "/healthz"
ROUTE_METRICS = "/metrics"
ROUTE_LATEST = "/v1/{run}/latest"
ROUTE_FILE = r"/v1/{run}/v{version:\d+}/{name:.+}"


def latest_path(run: str) -> str:
    return f"/v1/{run}/latest"


def file_path(run: str, version: int, name: str) -> str:
    return f"/v1/{run}/v{version}/{name}"


def check_run(request: web.Request, run: str) -> None:
    if request.match_info["run"] != run:
        raise web.HTTPNotFound(text=f"this server serves run {run!r}, not {request.match_info['run']!r}\n")


def request_version(request: web.Request) -> tuple[int, str]:
    return int(request.match_info["version"]), request.match_info["name"]


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class VersionBoard:
    """The newest version a server can offer, and the long-polls waiting for a newer one.
    `offer(v)` may be called from any thread; waiters live on the server's event loop."""

    def __init__(self) -> None:
        self.newest: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # bind() makes the one of the app's loop (an Event binds on first use)

        self.closed = False

    def bind(self, app: web.Application) -> None:
        """Attach to the running loop of `app`; its shutdown answers every long-poll at once
        (aiohttp waits for open requests before it stops)."""
        self.loop, self._changed, self.closed = asyncio.get_running_loop(), asyncio.Event(), False
        app.on_shutdown.append(self._close)

    async def _close(self, app: web.Application) -> None:
        self.closed = True
        self._changed.set()

    def offer(self, version: int | None) -> None:
        """Record `version` as available (ignored unless newer) and wake the long-polls."""
        if version is None or (self.newest is not None and version <= self.newest):
            return
        if self.loop is None:
            self.newest = version
        else:
            self.loop.call_soon_threadsafe(self._raise, version)

    def _raise(self, version: int) -> None:
        if self.newest is None or version > self.newest:
            self.newest = version
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def newer_than(self, after: int, wait: float) -> int | None:
        """The newest version once it is > `after`, or None after `wait` seconds."""
        deadline = asyncio.get_running_loop().time() + wait
        while self.newest is None or self.newest <= after:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or self.closed:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None
        return self.newest


def long_poll_args(request: web.Request) -> tuple[int, float] | None:
    """(after, wait) of a long-poll `latest` request, None for a plain one; 400 names a bad field."""
    if "after" not in request.query:
        return None
    try:
        after = int(request.query["after"])
        wait = float(request.query.get("wait", WAIT_DEFAULT))
    except ValueError:
        raise web.HTTPBadRequest(
            text="latest?after=N&wait=S: 'after' must be an integer version and 'wait' a number of seconds\n"
        ) from None
    if not 0 <= wait <= WAIT_MAX:
        raise web.HTTPBadRequest(text=f"latest?wait={wait:g}: 'wait' must be between 0 and {WAIT_MAX:g} seconds\n")
    return after, wait


async def answer_long_poll(board: VersionBoard, after: int, wait: float) -> web.Response:
    version = await board.newer_than(after, wait)
    if version is None:
        return web.Response(status=204)
    return web.json_response({"version": version})


def parse_range(request: web.Request, size: int) -> tuple[int, int, int]:
    """(status, start, end) for a body of `size` bytes: 200 over all of it, or 206 over one Range."""
    if "Range" not in request.headers:
        return 200, 0, size
    unsatisfiable = web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    try:
        rng = request.http_range
    except ValueError:
        raise unsatisfiable from None
    start = rng.start or 0
    if start < 0:  # suffix range: the last -start bytes
        start = max(0, size + start)
    end = size if rng.stop is None else min(rng.stop, size)
    if start >= size:
        raise unsatisfiable
    return 206, start, end


async def start_response(
    request: web.Request, status: int, start: int, end: int, size: int, content_type: str
) -> web.StreamResponse:
    """Send the headers of a (206: ranged) response of `end - start` bytes of a `size`-byte body."""
    resp = web.StreamResponse(status=status, headers={"Accept-Ranges": "bytes"})
    if status == 206:
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    resp.content_type = content_type
    resp.content_length = end - start
    await resp.prepare(request)  # a StreamResponse sends its headers here, before the body
    return resp


async def send_file(
    request: web.Request, size: int, open_file: Callable[[], BinaryIO], on_bytes: Callable[[int], None] | None = None
) -> web.StreamResponse:
    """Send bytes of the local file `open_file()` (which holds `size` bytes) honouring Range, with
    os.sendfile; exceptions from `open_file` propagate before any header is sent. (A relay serves
    a version it is still pulling with pull.stream instead.)"""
    status, start, end = parse_range(request, size)
    with open_file() as f:
        resp = await start_response(request, status, start, end, size, "application/octet-stream")
        if request.method != "HEAD":
            if request.transport is None:
                raise ConnectionResetError("client went away")
            sent = await asyncio.get_running_loop().sendfile(request.transport, f, start, end - start)
            if on_bytes is not None:
                on_bytes(sent)
    await resp.write_eof()
    return resp


async def send_range(
    request: web.Request,
    size: int,
    read: Callable[[int, int], Iterator[bytes]],
    content_type: str = "application/octet-stream",
    on_bytes: Callable[[int], None] | None = None,
) -> web.StreamResponse:
    """Stream `read(start, end)` (a blocking chunk iterator, run in the thread pool) honouring Range.
    Exceptions from `read` itself (e.g. KeyError) propagate before any header is sent."""
    status, start, end = parse_range(request, size)
    chunks = await asyncio.to_thread(read, start, end)
    pending = None
    try:
        resp = await start_response(request, status, start, end, size, content_type)
        while request.method != "HEAD":
            pending = _IO.submit(next, chunks, None)
            if (chunk := await asyncio.wrap_future(pending)) is None:
                break
            await resp.write(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    finally:  # release the S3 body; if a read is still running (client gone), after it ends
        close = getattr(chunks, "close", None)
        if close is not None:
            if pending is not None and not pending.done():
                pending.add_done_callback(lambda _: close())
            else:
                close()
    await resp.write_eof()
    return resp


SHUTDOWN_TIMEOUT_S = 5.0  # how long a stopping server lets requests in flight finish (aiohttp's default: 60)


async def serve_until(
    app: web.Application, host: str, port: int, stop: threading.Event, tls_files: tuple[Path, Path] | None = None
) -> None:
    """Serve `app` on host:port until `stop` is set (the runtime sets it on SIGTERM/SIGINT); requests
    still in flight then get SHUTDOWN_TIMEOUT_S to finish. With `tls_files` (certificate chain, key): HTTPS
    only, a renewed pair loaded while serving (wire/tls.py)."""
    context = tls.server_context(*tls_files) if tls_files else None
    reloader = tls.CertificateReloader(context, *tls_files) if context and tls_files else None
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=context).start()
        log.info("serving on %s://%s:%d", "https" if context else "http", host, port)
        checked = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.2)
            if reloader and time.monotonic() - checked > tls.RELOAD_INTERVAL_S:  # on this loop: no handshake beside it
                reloader.check()
                checked = time.monotonic()
    finally:
        await runner.cleanup()
