"""Shardcast relay: a pull-through, verifying, cut-through cache of one run's policy versions, over HTTP.

It serves the origin's routes (protocol.py) from its cache (relay_cache.py: pulls, resume,
prefetch, retention and their invariants). Serving:
  cut-through   a request for a version still being pulled is served from the partial file as
                its bytes land (pull.stream: sendfile of whatever arrived, the last byte of the
                response only once every shard in it verified), so tier k+1 receives each byte
                about when tier k does; a pull that fails before the range's first byte answers
                502, one that fails after it cuts the response short
  gone          a version older than the ones this relay keeps, or one upstream answers 410 for, is 410 Gone
                (protocol.py): its clients move on to a newer version instead of waiting for it
  latest        upstream's latest (and starts pulling it); the newest held version if upstream is down.
                `latest?after=N` answers as soon as a newer version is announced to this relay
                (it is then served cut-through) or held
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import redis
from aiohttp import web

from rlfleet.services.shardcast.client import FetchError, VersionGone
from rlfleet.services.shardcast.protocol import (
    ROUTE_FILE,
    ROUTE_HEALTH,
    ROUTE_LATEST,
    ROUTE_METRICS,
    answer_long_poll,
    check_run,
    healthz,
    latest_path,
    long_poll_args,
    metrics,
    request_version,
    send_file,
    send_range,
    serve_until,
)
from rlfleet.services.shardcast.pull import Pull, stream
from rlfleet.services.shardcast.relay_cache import BYTES_OUT, CLIENTS, DiskBoundError, NotUpstream, Relay, RelaySettings
from rlfleet.versions.manifest import MANIFEST_NAME, Manifest, ManifestError, parse_manifest
from rlfleet.wire import components, tls
from rlfleet.wire.runtime import ComponentOptions

RELAY = web.AppKey(components.RELAY, Relay)


class RelayRoutes:
    """The relay's route handlers and its start and stop (`lifecycle`), over its `relay`. With
    `redis_client`, it prefetches every version announced on the run's policy stream; without, it
    follows its upstream's long-poll."""

    def __init__(self, relay: Relay, redis_client: redis.Redis | None = None):
        self.relay, self.run, self.redis_client = relay, relay.run, redis_client

    async def latest(self, request: web.Request) -> web.Response:
        """Upstream's latest (and starts pulling it), or the newest held version if upstream is down;
        `latest?after=N` is a long poll (module docstring)."""
        relay, run = self.relay, self.run
        check_run(request, run)
        poll = long_poll_args(request)
        if poll is not None:
            return await answer_long_poll(relay.board, *poll)

        held = relay.held()
        try:
            body = await relay.ask_upstream(latest_path(run))
            version = None if body is None else int(json.loads(body)["version"])
        except (FetchError, ValueError, KeyError, TypeError) as exc:
            if not held:
                raise web.HTTPBadGateway(
                    text=f"upstream {relay.upstream} failed ({exc}) and no version is held\n"
                ) from None
            version = None
        if version is not None:
            relay.prefetch(version)
        elif not held:
            raise web.HTTPNotFound(text=f"run {run!r} has no published version yet\n")
        return web.json_response({"version": max([*held, *([version] if version is not None else [])])})

    async def serve_file(self, request: web.Request) -> web.StreamResponse:
        """A file of a version: its manifest from memory or disk, another file from this disk, or
        cut-through from a pull still under way."""
        check_run(request, self.run)
        version, name = request_version(request)
        where, raw, manifest = await self.manifest_of(version)
        if name == MANIFEST_NAME:
            return await send_range(request, len(raw), lambda s, e: iter([raw[s:e]]), "application/json", BYTES_OUT.inc)
        index = next((i for i, f in enumerate(manifest.files) if f.name == name), None)
        if index is None:
            raise web.HTTPNotFound(text=f"run {self.run!r} v{version} has no file {name!r}\n")

        size, open_file = manifest.files[index].size, lambda: self.relay.open_file(version, name)
        CLIENTS.inc()
        try:
            if isinstance(where, Pull) and not where.complete:
                try:  # what escapes `stream` happened before the response's first byte
                    return await stream(request, where, index, size, open_file, BYTES_OUT.inc)
                except FileNotFoundError:
                    raise
                except VersionGone as exc:  # upstream dropped it while it was pulled
                    raise web.HTTPGone(text=f"{exc}\n") from None
                except (FetchError, DiskBoundError, OSError) as exc:  # the pull failed
                    raise web.HTTPBadGateway(text=f"{self.bad_gateway(version)}: {exc}\n") from None
            return await send_file(request, size, open_file, BYTES_OUT.inc)
        except FileNotFoundError:  # pruned between the check and the open
            raise web.HTTPGone(text=f"v{version} was just dropped by retention\n") from None
        finally:
            CLIENTS.dec()

    async def manifest_of(self, version: int) -> tuple[Path | Pull, bytes, Manifest]:
        """Where `version` is (its directory here, or its pull), and its manifest's bytes and parsed
        form; an HTTP error when it cannot be had."""
        try:
            where = await self.relay.locate(version, probe=True)
            if isinstance(where, Pull):
                await where.wait(lambda: where.raw is not None)
                raw, manifest = where.raw, where.manifest
                assert raw is not None and manifest is not None  # a pull sets both at once, and raw was awaited
            else:  # verified when it was pulled; read back from this disk, its shape is checked again
                raw = (where / MANIFEST_NAME).read_bytes()
                manifest = parse_manifest(raw, self.run, version)
        except VersionGone as exc:  # before FetchError, which it is: waiting will not bring it back
            raise web.HTTPGone(text=f"{exc}\n") from None
        except NotUpstream as exc:
            raise web.HTTPNotFound(text=f"{exc}\n") from None
        except (FetchError, DiskBoundError) as exc:
            raise web.HTTPBadGateway(text=f"{self.bad_gateway(version)}: {exc}\n") from None
        except FileNotFoundError:  # pruned between the check and the read
            raise web.HTTPGone(text=f"v{version} was just dropped by retention\n") from None
        except ManifestError as exc:  # this relay's own disk holds a damaged manifest
            raise web.HTTPInternalServerError(text=f"held v{version}: {exc}\n") from None
        return where, raw, manifest

    def bad_gateway(self, version: int) -> str:
        return f"could not pull v{version} from {self.relay.upstream}"

    async def lifecycle(self, app: web.Application):
        """The relay's start (a clean cache, the upstream session, the announcements it follows) and,
        after the yield, its stop."""
        relay = self.relay
        relay.board.bind(app)

        async def on_shutdown(app: web.Application) -> None:
            await relay.shutdown()

        app.on_shutdown.append(on_shutdown)
        relay.open_upstream()
        await asyncio.to_thread(relay.clean_start)

        stop = threading.Event()
        listener = follower = None
        if self.redis_client is not None:
            listener = threading.Thread(
                target=relay.listen,
                args=(self.redis_client, asyncio.get_running_loop(), stop),
                name="relay-policy-listener",
                daemon=True,
            )
            listener.start()
        else:
            follower = asyncio.create_task(relay.follow_upstream())
        yield

        stop.set()
        relay.closing.set()
        if listener is not None:
            await asyncio.to_thread(listener.join, 5)
        if follower is not None:
            follower.cancel()
        for task in list(relay._tasks):
            task.cancel()


def make_app(settings: RelaySettings, redis_client: redis.Redis | None = None) -> web.Application:
    """The relay's aiohttp application; `app[RELAY]` is its Relay. With `redis_client`, it
    prefetches every version announced on the run's policy stream. With `settings.public_key`,
    manifests must carry a valid signature."""
    routes = RelayRoutes(Relay(settings), redis_client)
    app = web.Application()
    app[RELAY] = routes.relay
    app.cleanup_ctx.append(routes.lifecycle)
    app.router.add_get(ROUTE_HEALTH, healthz)
    app.router.add_get(ROUTE_METRICS, metrics)
    app.router.add_get(ROUTE_LATEST, routes.latest)
    app.router.add_get(ROUTE_FILE, routes.serve_file)
    return app


@dataclass(frozen=True, kw_only=True)
class RelayOptions(ComponentOptions):
    port: int
    upstream: str  # upstream base URL (origin or a lower-tier relay)
    cache_dir: Path
    host: str = "127.0.0.1"  # bind address (0.0.0.0 in a pod)
    keep_versions: int | None = None  # overrides spec.shardcast.keepVersions (a RelayTier's keepVersions)
    max_disk_bytes: int | None = None  # overrides spec.shardcast.relayMaxDiskBytes
    tls_cert_file: Path | None = None  # with tls_key_file: serve HTTPS only (a cluster: the RelayTier's tls.secretName)
    tls_key_file: Path | None = None


def main(options: RelayOptions) -> int:
    """`rlfleet relay`: pull from the upstream into the cache dir, serve on host:port until SIGTERM."""
    from rlfleet.versions.signing import run_public_key
    from rlfleet.wire.runtime import component_context

    # Without Redis (a relay tier of a run trained in another cluster) it follows its upstream's long-poll.
    ctx = component_context(options, components.RELAY, redis_optional=True)
    tls_files = tls.server_files(options.tls_cert_file, options.tls_key_file)
    shardcast = ctx.bundle.run.spec.shardcast
    settings = RelaySettings(
        options.upstream,
        options.cache_dir,
        ctx.run_name,
        options.keep_versions or shardcast.keep_versions,
        public_key=run_public_key(shardcast),
        max_disk_bytes=options.max_disk_bytes or shardcast.relay_max_disk_bytes,
        min_rate=shardcast.min_rate_bytes_per_second,
    )
    app = make_app(settings, redis_client=ctx.redis)
    asyncio.run(serve_until(app, options.host, options.port, ctx.stop, tls_files))
    return 0
