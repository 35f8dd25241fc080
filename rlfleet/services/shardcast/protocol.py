"""Shardcast HTTP protocol: the paths origin, relays and clients agree on, and the server plumbing
they share (ranged streaming, serving an app until a stop event).

Routes (the origin and every relay serve the same ones):
  GET /healthz                  200 "ok"
  GET /v1/{run}/latest          200 {"version": N}; 404 while the run has no published version
  GET /metrics                  Prometheus text (rlfleet_relay_* / rlfleet_origin_*)
  GET /v1/{run}/v{N}/{file}     the file: `manifest.json` or a name listed in it. 404 while vN has no
                                manifest (a partial version is never served). One `Range: bytes=a-b`
                                (or `a-`, `-n`) gives 206 + Content-Range; an unsatisfiable one 416.
A client treats 404 and 5xx alike: not here yet, try again later or elsewhere. Integrity is the
client's job (sha256 from the manifest), not the transport's.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from aiohttp import web

log = logging.getLogger("rlfleet.shardcast")

CHUNK = 1 << 20
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


def read_file_range(path: Path, start: int, end: int) -> Iterator[bytes]:
    """Chunks of bytes [start, end) of a local file; opened eagerly (FileNotFoundError here)."""
    f = open(path, "rb")
    f.seek(start)

    def chunks() -> Iterator[bytes]:
        with f:
            left = end - start
            while left > 0 and (data := f.read(min(CHUNK, left))):
                left -= len(data)
                yield data

    return chunks()


async def send_range(request: web.Request, size: int, read: Callable[[int, int], Iterator[bytes]],
                     content_type: str = "application/octet-stream",
                     on_bytes: Callable[[int], None] | None = None,
                     ready: Callable[[int, int], Awaitable[None]] | None = None) -> web.StreamResponse:
    """Stream `read(start, end)` (a blocking chunk iterator, run in the thread pool) honouring Range.
    `await ready(start, end)` runs first (a relay waits there for the shards that cover the range).
    Exceptions from `ready` and `read` themselves (e.g. KeyError) propagate before any header is sent."""
    unsatisfiable = web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    status, start, end = 200, 0, size
    if "Range" in request.headers:
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
        status = 206
    if ready is not None:
        await ready(start, end)
    chunks = await asyncio.to_thread(read, start, end)
    resp = web.StreamResponse(status=status, headers={"Accept-Ranges": "bytes"})
    if status == 206:
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    resp.content_type = content_type
    resp.content_length = end - start
    await resp.prepare(request)
    pending = None
    try:
        while request.method != "HEAD":
            pending = _IO.submit(next, chunks, None)
            if (chunk := await asyncio.wrap_future(pending)) is None:
                break
            await resp.write(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    finally:  # release the file/S3 body; if a read is still running (client gone), after it ends
        close = getattr(chunks, "close", None)
        if close is not None:
            if pending is not None and not pending.done():
                pending.add_done_callback(lambda _: close())
            else:
                close()
    await resp.write_eof()
    return resp


async def serve_until(app: web.Application, host: str, port: int, stop: threading.Event) -> None:
    """Serve `app` on host:port until `stop` is set (the runtime sets it on SIGTERM/SIGINT)."""
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("serving on http://%s:%d", host, port)
        while not stop.is_set():
            await asyncio.sleep(0.2)
    finally:
        await runner.cleanup()
