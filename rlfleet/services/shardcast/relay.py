"""Shardcast relay: a pull-through, verifying cache of one run's policy versions.

It serves the origin's routes (protocol.py) from {cache_dir}/{run}/v{N}/. Such a directory is
built only by the Shardcast client (`fetch_version`: every file's size and sha256 checked against
the manifest, then one rename with `.complete` inside), so a byte that failed its check is never
under v{N} and never served.
  pull-through  a request for a version it lacks asks upstream for the manifest (404 there -> 404
                here), then pulls the version; one pull per version at a time, concurrent requests
                await the same pull; a failed pull answers 502 (the client retries)
  prefetch      a thread does blocking XREAD on the run's `policy` stream (first the newest entry,
                then each new one) and pulls every announced version before anyone asks
  latest        upstream's latest (and starts pulling it); the newest held version if upstream is down
  retention     after each pull, all but the newest `keep_versions` are deleted (renamed away first,
                so a half-deleted version is never visible); a request for an older one is 404
Not done: cut-through per shard (serving a file before its whole version is verified).
Metrics: rlfleet_relay_bytes_in_total, rlfleet_relay_bytes_out_total, rlfleet_relay_versions_held,
rlfleet_relay_fetch_seconds.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import redis
import requests
from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram

from rlfleet.checkpoint import COMPLETE_MARKER, MANIFEST_NAME, parse_version_dir, version_dir_name
from rlfleet.services.shardcast.client import FetchError, fetch_version, latest_version_http
from rlfleet.services.shardcast.protocol import (
    ROUTE_FILE, ROUTE_HEALTH, ROUTE_LATEST, check_run, file_path, healthz, read_file_range, request_version,
    send_range, serve_until,
)
from rlfleet.streams import MessageError, RunKeys, decode_json

log = logging.getLogger("rlfleet.shardcast.relay")

BYTES_IN = Counter("rlfleet_relay_bytes_in", "Checkpoint bytes the relay received from upstream")
BYTES_OUT = Counter("rlfleet_relay_bytes_out", "Checkpoint bytes the relay sent to clients")
VERSIONS_HELD = Gauge("rlfleet_relay_versions_held", "Verified policy versions on the relay's disk")
FETCH_SECONDS = Histogram("rlfleet_relay_fetch_seconds", "Seconds to pull and verify one version from upstream",
                          buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))


class VersionGone(LookupError):
    """Older than the versions this relay keeps."""


class NotUpstream(LookupError):
    """Upstream has no such version (yet)."""


class Relay:
    """The cache, the pulls in flight and the retention rule of one relay process."""

    def __init__(self, upstream: str, cache_dir: Path, run: str, keep_versions: int, fetch_timeout: float = 120.0):
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.upstream = upstream.rstrip("/")
        self.run = run
        self.root = Path(cache_dir) / run
        self.keep = keep_versions
        self.fetch_timeout = fetch_timeout
        self.closing = threading.Event()  # aborts pulls in flight at shutdown
        self._pulls: dict[int, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()

    def version_dir(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def has(self, version: int) -> bool:
        return (self.version_dir(version) / COMPLETE_MARKER).exists()

    def held(self) -> list[int]:
        """Complete versions on disk, ascending."""
        if not self.root.is_dir():
            return []
        found = (parse_version_dir(p.name) for p in self.root.iterdir() if (p / COMPLETE_MARKER).exists())
        return sorted(v for v in found if v is not None)

    def too_old(self, version: int) -> bool:
        """True when `keep` newer versions are held: pulling it would only see it pruned."""
        return sum(v > version for v in self.held()) >= self.keep

    def clean_start(self) -> None:
        """Drop temp dirs and incomplete versions left by a previous process; apply retention."""
        self.root.mkdir(parents=True, exist_ok=True)
        for p in self.root.iterdir():
            if p.is_dir() and not (p / COMPLETE_MARKER).exists():
                shutil.rmtree(p)
        self.prune()

    def prune(self) -> None:
        for version in self.held()[:-self.keep]:
            trash = self.root / f".trash-{version_dir_name(version)}-{uuid.uuid4().hex}"
            self.version_dir(version).rename(trash)  # invisible at once, then deleted
            shutil.rmtree(trash)
            log.info("dropped v%d (keeping the newest %d)", version, self.keep)
        VERSIONS_HELD.set(len(self.held()))

    def _upstream_has(self, version: int) -> bool:
        r = requests.get(self.upstream + file_path(self.run, version, MANIFEST_NAME), timeout=(5, 60))
        if r.status_code == 404:
            return False
        r.raise_for_status()
        return True

    async def ensure(self, version: int, probe: bool) -> Path:
        """The verified directory of `version`, pulling it first if needed. With `probe`, a version
        upstream does not have raises NotUpstream at once instead of being waited for."""
        if self.has(version):
            return self.version_dir(version)
        if self.too_old(version):
            raise VersionGone(f"v{version} is older than the newest {self.keep} versions this relay keeps")
        if version not in self._pulls and probe and not await asyncio.to_thread(self._upstream_has, version):
            raise NotUpstream(f"upstream {self.upstream} has no v{version} (yet)")
        task = self._pulls.get(version)
        if task is None:
            task = asyncio.create_task(self._pull(version))
            self._pulls[version] = task
            task.add_done_callback(lambda t: self._pull_done(version, t))
        return await asyncio.shield(task)  # a client hanging up does not cancel the shared pull

    def _pull_done(self, version: int, task: asyncio.Task) -> None:
        if self._pulls.get(version) is task:
            del self._pulls[version]
        if not task.cancelled() and task.exception() is not None:
            log.warning("pull of v%d failed: %s", version, task.exception())

    async def _pull(self, version: int) -> Path:
        start = time.monotonic()
        path = await asyncio.to_thread(fetch_version, [self.upstream], self.run, version, self.root,
                                       self.fetch_timeout, on_bytes=BYTES_IN.inc, stop=self.closing)
        FETCH_SECONDS.observe(time.monotonic() - start)
        log.info("v%d pulled and verified in %.2f s", version, time.monotonic() - start)
        await asyncio.to_thread(self.prune)
        return path

    def prefetch(self, version: int) -> None:
        """Start pulling `version` in the background (event-loop thread only)."""
        if self.has(version) or version in self._pulls or self.too_old(version):
            return

        async def run() -> None:
            try:
                await self.ensure(version, probe=False)
            except (FetchError, VersionGone) as exc:  # logged by _pull_done / nothing to do
                log.debug("prefetch of v%d: %s", version, exc)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def listen(self, client: redis.Redis, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Blocking XREAD on the policy stream; each announced version is prefetched."""
        key = RunKeys(self.run).policy
        last = None
        while not stop.is_set():
            try:
                if last is None:  # start from the newest announcement
                    newest = client.xrevrange(key, count=1)
                    last = newest[0][0] if newest else "0-0"
                    entries = newest
                else:
                    entries = [e for _, batch in (client.xread({key: last}, block=500) or []) for e in batch]
                for entry_id, fields in entries:
                    last = entry_id
                    self._announce(entry_id, fields, loop)
            except redis.ConnectionError as exc:
                log.warning("policy stream %s: %s; retrying in 1 s", key, exc)
                stop.wait(1.0)

    def _announce(self, entry_id, fields: dict, loop: asyncio.AbstractEventLoop) -> None:
        try:
            version = int(decode_json(fields)["version"])
        except (MessageError, ValueError, KeyError, TypeError) as exc:
            log.warning("policy stream entry %r ignored: %s", entry_id, exc)
            return
        log.info("v%d announced; prefetching", version)
        loop.call_soon_threadsafe(self.prefetch, version)


RELAY = web.AppKey("relay", Relay)


def make_app(upstream: str, cache_dir: Path, run: str, keep_versions: int,
             redis_client: redis.Redis | None = None, fetch_timeout: float = 120.0) -> web.Application:
    """The relay's aiohttp application; `app[RELAY]` is its Relay. With `redis_client`, it
    prefetches every version announced on the run's policy stream."""
    relay = Relay(upstream, cache_dir, run, keep_versions, fetch_timeout)

    async def latest(request: web.Request) -> web.Response:
        check_run(request, run)
        held = relay.held()
        try:
            version = await asyncio.to_thread(latest_version_http, relay.upstream, run, 10.0)
        except (requests.RequestException, ValueError, KeyError) as exc:
            if not held:
                raise web.HTTPBadGateway(text=f"upstream {relay.upstream} failed ({exc}) and no version is held\n")
            version = None
        if version is not None:
            relay.prefetch(version)
        elif not held:
            raise web.HTTPNotFound(text=f"run {run!r} has no published version yet\n")
        return web.json_response({"version": max([*held, *([version] if version is not None else [])])})

    async def serve_file(request: web.Request) -> web.StreamResponse:
        check_run(request, run)
        version, name = request_version(request)
        try:
            path = await relay.ensure(version, probe=True)
        except (VersionGone, NotUpstream) as exc:
            raise web.HTTPNotFound(text=f"{exc}\n") from None
        except (FetchError, requests.RequestException) as exc:
            raise web.HTTPBadGateway(text=f"could not pull v{version} from {relay.upstream}: {exc}\n") from None
        try:
            if name == MANIFEST_NAME:
                target = path / MANIFEST_NAME
            else:
                files = json.loads((path / MANIFEST_NAME).read_bytes())["files"]
                if name not in {f["name"] for f in files}:
                    raise web.HTTPNotFound(text=f"run {run!r} v{version} has no file {name!r}\n")
                target = path / name
            size = target.stat().st_size
            return await send_range(request, size, lambda s, e: read_file_range(target, s, e),
                                    "application/json" if name == MANIFEST_NAME else "application/octet-stream",
                                    BYTES_OUT.inc)
        except FileNotFoundError:  # pruned between the check and the open
            raise web.HTTPNotFound(text=f"v{version} was just dropped by retention\n") from None

    async def lifecycle(app: web.Application):
        await asyncio.to_thread(relay.clean_start)
        stop = threading.Event()
        listener = None
        if redis_client is not None:
            listener = threading.Thread(target=relay.listen, args=(redis_client, asyncio.get_running_loop(), stop),
                                        name="relay-policy-listener", daemon=True)
            listener.start()
        yield
        stop.set()
        relay.closing.set()
        if listener is not None:
            await asyncio.to_thread(listener.join, 5)
        for task in list(relay._background):
            task.cancel()

    app = web.Application()
    app[RELAY] = relay
    app.cleanup_ctx.append(lifecycle)
    app.router.add_get(ROUTE_HEALTH, healthz)
    app.router.add_get(ROUTE_LATEST, latest)
    app.router.add_get(ROUTE_FILE, serve_file)
    return app


def main(args) -> int:
    """`rlfleet relay`: pull from args.upstream into args.cache_dir, serve on args.host:args.port."""
    from rlfleet.runtime import component_context

    ctx = component_context(args, "relay")
    keep = args.keep_versions or ctx.bundle.run.spec.shardcast.keep_versions
    app = make_app(args.upstream, Path(args.cache_dir), ctx.run_name, keep, redis_client=ctx.redis)
    asyncio.run(serve_until(app, args.host, args.port, ctx.stop))
    return 0
