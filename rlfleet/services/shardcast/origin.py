"""Shardcast origin: serves one run's policy versions straight from the checkpoint store over HTTP.

Routes: see protocol.py. Invariants:
  - a file is served only when its version's manifest exists in the store (read on every request,
    so a version that is still being uploaded is 404, never served half-written) and the manifest
    lists it; `latest` is the highest version with a manifest; a version without one below the newest
    published, or whose files went while it was served, was pruned: 410 (protocol.py);
  - `manifest.json` is served byte-for-byte as stored (a signature covers those bytes);
  - a file store's bytes go out with sendfile; S3 bytes stream in 1 MiB chunks (one ranged GET per
    request), never buffered whole; a Range request becomes a ranged store read;
  - `latest?after=N` (long-poll) answers once the store holds a newer manifest. A watcher thread
    re-reads the store's newest version whenever the run's `policy` stream announces one (the
    trainer announces after publishing) and at least every STORE_CHECK seconds (every
    STORE_CHECK_ALONE without a stream to follow), so a version published without an
    announcement is still offered.
The store is synchronous (boto3); its calls run in threads. The origin holds no state of its own,
so any number of replicas can serve the same store.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import redis
from aiohttp import web
from prometheus_client import Counter

from rlfleet.services.shardcast.protocol import (
    ROUTE_FILE,
    ROUTE_HEALTH,
    ROUTE_LATEST,
    ROUTE_METRICS,
    VersionBoard,
    answer_long_poll,
    check_run,
    healthz,
    long_poll_args,
    metrics,
    request_version,
    send_file,
    send_range,
    serve_until,
)
from rlfleet.versions.checkpoint import latest_version, manifest_key, version_key
from rlfleet.versions.manifest import MANIFEST_NAME, ManifestError, parse_manifest
from rlfleet.versions.store import CheckpointStore
from rlfleet.wire import components
from rlfleet.wire.runtime import ComponentOptions
from rlfleet.wire.streams import RunKeys, stream_entries, stream_reply

log = logging.getLogger("rlfleet.shardcast.origin")

BYTES_OUT = Counter("rlfleet_origin_bytes_out", "Checkpoint bytes the origin has sent")
STORE_CHECK, STORE_CHECK_ALONE = 5.0, 0.5  # seconds between store reads with / without the policy stream


def watch_store(
    store: CheckpointStore, run: str, board: VersionBoard, redis_client: redis.Redis | None, stop: threading.Event
) -> None:
    """Offer the store's newest version to `board` on each announcement and every STORE_CHECK s."""
    key, next_check = RunKeys(run).policy, 0.0
    last: bytes | str | None = None
    while not stop.is_set():
        announced = False
        if redis_client is not None:
            try:
                if last is None:
                    newest = stream_entries(redis_client.xrevrange(key, count=1))
                    last = newest[0][0] if newest else "0-0"
                for _, entries in stream_reply(redis_client.xread({key: last}, block=1000)):
                    last, announced = entries[-1][0], True
            except redis.ConnectionError as exc:
                log.warning("policy stream %s: %s; reading the store every %g s meanwhile", key, exc, STORE_CHECK_ALONE)
                stop.wait(STORE_CHECK_ALONE)
                announced = True
        else:
            stop.wait(STORE_CHECK_ALONE)
        if announced or redis_client is None or time.monotonic() >= next_check:
            next_check = time.monotonic() + STORE_CHECK
            try:
                board.offer(latest_version(store, run))
            except Exception as exc:  # a store hiccup (S3): the designed behaviour is to read again
                log.warning("reading the newest version of %r from the store failed: %s", run, exc)


def make_app(store: CheckpointStore, run: str, redis_client: redis.Redis | None = None) -> web.Application:
    """The origin's aiohttp application for `run` over `store`; with `redis_client`, long-polls are
    answered on the run's policy announcements."""
    board = VersionBoard()

    async def latest(request: web.Request) -> web.Response:
        check_run(request, run)
        poll = long_poll_args(request)
        if poll is not None:
            return await answer_long_poll(board, *poll)
        version = await asyncio.to_thread(latest_version, store, run)
        if version is None:
            raise web.HTTPNotFound(text=f"run {run!r} has no published version yet\n")
        board.offer(version)
        return web.json_response({"version": version})

    async def serve_file(request: web.Request) -> web.StreamResponse:
        check_run(request, run)
        version, name = request_version(request)
        try:
            raw = await asyncio.to_thread(store.get_bytes, manifest_key(run, version))
        except KeyError:
            if board.newest is not None and version < board.newest:  # versions are published in order
                raise web.HTTPGone(text=f"run {run!r} v{version} was pruned from the store\n") from None
            raise web.HTTPNotFound(text=f"run {run!r} v{version} is not published (no manifest yet)\n") from None
        if name == MANIFEST_NAME:
            return await send_range(request, len(raw), lambda s, e: iter([raw[s:e]]), "application/json", BYTES_OUT.inc)
        try:
            entry = parse_manifest(raw, run, version).file(name)  # the trainer's own store: no signature check
        except ManifestError as exc:
            raise web.HTTPInternalServerError(text=f"the store's manifest is malformed: {exc}\n") from None
        if entry is None:
            raise web.HTTPNotFound(text=f"run {run!r} v{version} has no file {name!r}\n")
        key = version_key(run, version, name)
        try:
            local = store.local_path(key)
            if local is not None:
                return await send_file(request, entry.size, lambda: open(local, "rb"), BYTES_OUT.inc)
            return await send_range(
                request, entry.size, lambda s, e: store.open_read(key, s, e), on_bytes=BYTES_OUT.inc
            )
        except (KeyError, FileNotFoundError):  # listed but gone: the version was pruned while we looked
            raise web.HTTPGone(text=f"run {run!r} v{version}: {name!r} is no longer in the store\n") from None

    async def lifecycle(app: web.Application):
        board.bind(app)
        stop = threading.Event()
        watcher = threading.Thread(
            target=watch_store, args=(store, run, board, redis_client, stop), name="origin-store-watcher", daemon=True
        )
        watcher.start()
        yield
        stop.set()
        await asyncio.to_thread(watcher.join, 5)

    app = web.Application()
    app.cleanup_ctx.append(lifecycle)
    app.router.add_get(ROUTE_HEALTH, healthz)
    app.router.add_get(ROUTE_METRICS, metrics)
    app.router.add_get(ROUTE_LATEST, latest)
    app.router.add_get(ROUTE_FILE, serve_file)
    return app


@dataclass(frozen=True, kw_only=True)
class OriginOptions(ComponentOptions):
    port: int
    host: str = "127.0.0.1"  # bind address (0.0.0.0 in a pod)


def main(options: OriginOptions) -> int:
    """`rlfleet origin`: serve the store of the config's run on host:port until SIGTERM."""
    from rlfleet.versions.store import open_run_store
    from rlfleet.wire.runtime import component_context

    ctx = component_context(options, components.ORIGIN)
    store = open_run_store(ctx, str(options.config))
    asyncio.run(serve_until(make_app(store, ctx.run_name, ctx.redis), options.host, options.port, ctx.stop))
    return 0
