"""Shardcast origin: serves one run's policy versions straight from the checkpoint store over HTTP.

Routes: see protocol.py. Invariants:
  - a file is served only when its version's manifest exists in the store (read on every request,
    so a version that is still being uploaded is 404, never served half-written) and the manifest
    lists it; `latest` is the highest version with a manifest;
  - `manifest.json` is served byte-for-byte as stored (a signature covers those bytes);
  - bytes stream from the store in 1 MiB chunks (S3: one ranged GET per request), never buffered
    whole; a Range request becomes a ranged store read.
The store is synchronous (boto3); its calls run in threads. The origin holds no state of its own,
so any number of replicas can serve the same store.
"""
from __future__ import annotations

import asyncio
import json

from aiohttp import web
from prometheus_client import Counter

from rlfleet.checkpoint import MANIFEST_NAME, latest_version, manifest_key, version_key
from rlfleet.services.shardcast.protocol import (
    ROUTE_FILE, ROUTE_HEALTH, ROUTE_LATEST, ROUTE_METRICS, check_run, healthz, metrics, request_version, send_range,
    serve_until,
)
from rlfleet.store import CheckpointStore

BYTES_OUT = Counter("rlfleet_origin_bytes_out", "Checkpoint bytes the origin has sent")


def make_app(store: CheckpointStore, run: str) -> web.Application:
    """The origin's aiohttp application for `run` over `store`."""

    async def latest(request: web.Request) -> web.Response:
        check_run(request, run)
        version = await asyncio.to_thread(latest_version, store, run)
        if version is None:
            raise web.HTTPNotFound(text=f"run {run!r} has no published version yet\n")
        return web.json_response({"version": version})

    async def serve_file(request: web.Request) -> web.StreamResponse:
        check_run(request, run)
        version, name = request_version(request)
        try:
            raw = await asyncio.to_thread(store.get_bytes, manifest_key(run, version))
        except KeyError:
            raise web.HTTPNotFound(text=f"run {run!r} v{version} is not published (no manifest yet)\n") from None
        if name == MANIFEST_NAME:
            return await send_range(request, len(raw), lambda s, e: iter([raw[s:e]]),
                                    "application/json", BYTES_OUT.inc)
        entry = next((f for f in json.loads(raw)["files"] if f["name"] == name), None)
        if entry is None:
            raise web.HTTPNotFound(text=f"run {run!r} v{version} has no file {name!r}\n")
        key = version_key(run, version, name)
        try:
            return await send_range(request, entry["size"], lambda s, e: store.open_read(key, s, e),
                                    on_bytes=BYTES_OUT.inc)
        except KeyError:  # listed but gone: the version was pruned while we looked
            raise web.HTTPNotFound(text=f"run {run!r} v{version}: {name!r} is no longer in the store\n") from None

    app = web.Application()
    app.router.add_get(ROUTE_HEALTH, healthz)
    app.router.add_get(ROUTE_METRICS, metrics)
    app.router.add_get(ROUTE_LATEST, latest)
    app.router.add_get(ROUTE_FILE, serve_file)
    return app


def main(args) -> int:
    """`rlfleet origin`: serve the store of the config's run on args.host:args.port until SIGTERM."""
    from rlfleet.runtime import component_context, open_run_store

    ctx = component_context(args, "origin")
    store = open_run_store(ctx, args.config)
    asyncio.run(serve_until(make_app(store, ctx.run_name), args.host, args.port, ctx.stop))
    return 0
