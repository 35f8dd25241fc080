"""A rollout worker's policy versions: a background thread follows the announcements (the run's `policy`
stream, or for an ingest worker its relays' `latest?after=N` long-poll) and downloads each new version
through the relays (every file's sha256 checked, the manifest's signature verified; a delta version is
rebuilt from the one held here, shardcast/assemble.py) while generation goes on with the old weights.
A version the relays dropped before it was fetched (every relay answers 410 Gone: on a busy machine, or
when versions come faster than a relay keeps them) is skipped: the follower fetches the next one announced
rather than retrying one that cannot come back until the fetch's deadline, paused at version_lag meanwhile.
A fetch that fails otherwise (every relay down, a link slower than shardcast.minRateBytesPerSecond) is tried
again with back-off, resuming its download; the worker generates with the version it holds meanwhile, as
long as the async window allows, and the follower never dies of it.

`ready` holds the newest version on disk; the worker `take`s it between batches (main.py). Invariant:
the cache keeps the newest `keepVersions` and never the one the engine took last (it may still be
loading it while newer versions arrive).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import redis
from prometheus_client import Counter, Gauge

from rlfleet.services.rollout.timing import LAPS
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchError, FetchSettings, VersionGone, wait_for_version
from rlfleet.versions.checkpoint import prune_cache
from rlfleet.versions.signing import run_public_key
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import decode_json, stream_reply

log = logging.getLogger("rlfleet.rollout")

DOWNLOAD_SECONDS = Gauge(
    "rlfleet_rollout_weight_download_seconds", "Download (relays, hashes, signature) of the newest version"
)
FETCH_FAILURES = Counter(
    "rlfleet_rollout_version_fetch_failures_total",
    "Fetches of a policy version that failed or ran out of time; each is tried again, resuming its download",
)
FETCH_RETRY_FIRST_S, FETCH_RETRY_MAX_S = 1.0, 60.0  # back-off between tries of one version
GONE = Counter(
    "rlfleet_rollout_versions_skipped_total",
    "Announced versions the relays dropped (HTTP 410) before this worker fetched them; it fetched a newer one",
)


class VersionFollower(threading.Thread):
    """Follows the policy stream and downloads each new version; `ready` holds the newest local one."""

    def __init__(
        self, ctx: Context, relay_urls: list[str], cache_dir: Path, keep: int, reader: redis.Redis | None = None
    ):
        super().__init__(daemon=True, name="version-follower")
        self.ctx, self.relay_urls, self.cache_dir, self.keep = ctx, relay_urls, cache_dir, keep
        self.reader = reader  # reads the policy stream (a worker's read-only Redis user); None: the relays' long-poll
        self.use_redis = reader is not None
        # manifests must verify with the run's key; the relays' measurements are kept across versions
        shardcast = ctx.bundle.run.spec.shardcast
        self.fetch = FetchSettings.over(
            relay_urls,
            ctx.run_name,
            public_key=run_public_key(shardcast),
            min_rate=shardcast.min_rate_bytes_per_second,
            stop=ctx.stop,
        )
        self.announced = -1
        self.ready: tuple[int, Path, float] | None = None  # (version, directory, monotonic time it was announced)
        self.taken = -1  # the newest version handed to the engine: in use or being loaded, never pruned
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # surfaced to the main loop, which exits non-zero
            self.error = exc

    def _announcements(self):
        """The newest announced version each time there is news (None: nothing new yet)."""
        if self.reader is None:  # use_redis
            while not self.ctx.stop.is_set():
                yield wait_for_version(self.relay_urls, self.ctx.run_name, self.announced, 60, stop=self.ctx.stop)
            return
        last_id: bytes | str = "0-0"
        while not self.ctx.stop.is_set():
            resp = stream_reply(self.reader.xread({self.ctx.keys.policy: last_id}, block=500))
            newest = None
            for _, entries in resp or []:
                for msg_id, fields in entries:
                    last_id = msg_id
                    newest = max(newest or -1, int(decode_json(fields)["version"]))
            yield newest

    def _follow(self) -> None:
        """Fetch the newest announced version; one that failed is tried again after a back-off (1 s doubling to
        60 s) at the next announcement check, unless a newer one was announced meanwhile, which is fetched
        instead: the follower always chases the newest version, never an old one it failed on."""
        wanted: int | None = None  # the newest announced version not on disk yet
        announced_at, retry_at, pause = 0.0, 0.0, FETCH_RETRY_FIRST_S
        for newest in self._announcements():
            if newest is not None and newest > self.announced:
                self.announced = wanted = newest
                announced_at, retry_at, pause = time.monotonic(), 0.0, FETCH_RETRY_FIRST_S
            if wanted is None or time.monotonic() < retry_at:
                continue
            try:  # whole, or rebuilt from the version held here and a delta
                with LAPS.part("fetch"):
                    path = fetch_policy(self.fetch, wanted, self.cache_dir)
            except VersionGone as exc:  # newer versions are out: the next announcement brings one
                GONE.inc()
                log.info("v%d was dropped by the relays before it was fetched (%s); fetching a newer one", wanted, exc)
                wanted = None
                continue
            except FetchError as exc:
                if self.ctx.stop.is_set():
                    return
                FETCH_FAILURES.inc()
                log.warning(
                    "fetching v%d failed, trying again in %.0f s or for a newer version: %s", wanted, pause, exc
                )
                retry_at, pause = time.monotonic() + pause, min(2 * pause, FETCH_RETRY_MAX_S)
                continue
            DOWNLOAD_SECONDS.set(time.monotonic() - announced_at)
            with self._lock:
                self.ready = (wanted, path, announced_at)
                self._prune(wanted)
            wanted = None

    def take(self, newer_than: int) -> tuple[int, Path, float] | None:
        with self._lock:
            if self.ready and self.ready[0] > newer_than:
                self.taken = self.ready[0]
                return self.ready
        return None

    def _prune(self, newest: int) -> None:
        """Drop versions older than the newest `keep`, but never the one the engine took (it may still
        be loading it while newer versions arrive). Called with the lock held."""
        prune_cache(self.cache_dir, min(newest - self.keep + 1, self.taken))
