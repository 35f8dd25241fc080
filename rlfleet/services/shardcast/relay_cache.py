"""The relay's cache: pulls of policy versions from upstream, their on-disk state, and retention.

{cache_dir}/{run}/v{N}/ holds complete versions. Invariants:
  - nothing is offered before the version's manifest has verified: its ed25519 signature with the
    run's public key first, then shape, run and version (client.Fetcher.manifest);
  - a shard counts as held only once it has matched its sha256 (client.Fetcher hashes each
    piece as it arrives); its bytes are served on as they land (pull.stream), but no response
    through the relay completes before every shard in it verified, and one that carried bytes of
    a failed attempt is cut off, so a poisoned upstream never gets a complete response relayed;
  - v{N} exists only complete (`.complete` inside): shards land in `.v{N}.partial/`, renamed
    to v{N} after the last one, before the last shard is announced as ready.

  pull          one pull per version at a time (a thread running client.Fetcher against the
                upstream, `parallel` shards at once); concurrent requests share it and are
                served from its `Pull` byte by byte as the shards they need arrive (pull.py)
  resume        a partial dir keeps a journal of its verified shards (staging.ShardJournal); a
                pull that fails (its upstream down, past its deadline) keeps it, as does a relay
                killed or stopped mid-pull, and the next pull of that version re-hashes the
                journaled shards, serves them at once and fetches only the others.
                Partial dirs of versions no newer than a held one are dropped at start, and
                those older than a version whose pull starts are dropped then
  prefetch      a thread does blocking XREAD on the run's `policy` stream (the newest entry first,
                then each new one) and pulls every announced version before anyone asks; a
                restarted relay catches up the same way. Without a stream, a task long-polls the
                upstream's `latest?after=N` instead (no timer: upstream answers on a new version)
  shutdown      a hung upstream cannot hold a stopping relay: probes and `latest` use an aiohttp
                session closed at shutdown, and the pulls' Fetchers are aborted (blocked reads
                return at once)
  retention     the newest `keep_versions` complete versions and every version their delta chains
                pass through (rlfleet/versions/chain.py); with `max_disk_bytes` their bytes plus
                pulls in flight stay under it: older versions are dropped (renamed away first)
                before a pull starts, and a version larger than the bound is refused. A version
                dropped (or one that would be dropped as soon as it was pulled) is 410 Gone.

Metrics: rlfleet_relay_bytes_in_total, rlfleet_relay_bytes_out_total, rlfleet_relay_versions_held,
rlfleet_relay_disk_bytes, rlfleet_relay_clients, rlfleet_relay_shard_seconds,
rlfleet_relay_fetch_seconds.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import uuid
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import aiohttp
import redis
from prometheus_client import Counter, Gauge, Histogram

from rlfleet.services.shardcast.client import Fetcher, FetchError, FetchSettings, VersionGone
from rlfleet.services.shardcast.protocol import VersionBoard, file_path, latest_path
from rlfleet.services.shardcast.pull import Pull
from rlfleet.services.shardcast.sources import BACKOFF_MAX, BACKOFF_START, CONNECT_TIMEOUT, PARALLEL, READ_TIMEOUT
from rlfleet.services.shardcast.staging import JOURNAL, ShardJournal
from rlfleet.versions.chain import Retention, dir_retained, dir_retention
from rlfleet.versions.checkpoint import COMPLETE_MARKER, MANIFEST_NAME, parse_version_dir, version_dir_name
from rlfleet.wire import tls
from rlfleet.wire.streams import MessageError, RunKeys, decode_json, stream_entries, stream_reply

log = logging.getLogger("rlfleet.shardcast.relay")

BYTES_IN = Counter("rlfleet_relay_bytes_in", "Checkpoint bytes the relay received from upstream")
BYTES_OUT = Counter("rlfleet_relay_bytes_out", "Checkpoint bytes the relay sent to clients")
VERSIONS_HELD = Gauge("rlfleet_relay_versions_held", "Verified policy versions on the relay's disk")
DISK_BYTES = Gauge("rlfleet_relay_disk_bytes", "Bytes of complete versions and pulls in flight on the relay's disk")
CLIENTS = Gauge("rlfleet_relay_clients", "Requests for checkpoint files being served right now")
SHARD_SECONDS = Histogram(
    "rlfleet_relay_shard_seconds",
    "Seconds from a pull's start until each shard verified",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
FETCH_SECONDS = Histogram(
    "rlfleet_relay_fetch_seconds",
    "Seconds to pull and verify one version from upstream",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)

FOLLOW_WAIT = 30  # seconds one long-poll of upstream may hang
FOLLOW_TIMEOUT = aiohttp.ClientTimeout(total=FOLLOW_WAIT + 30)


class NotUpstream(LookupError):
    """Upstream has no such version (yet)."""


class DiskBoundError(RuntimeError):
    """A version that does not fit under the relay's disk bound."""


@dataclass(frozen=True)
class RelaySettings:
    """What one relay is: its upstream, cache and run, what it keeps, and how it pulls."""

    upstream: str  # base URL of the origin or a lower-tier relay
    cache_dir: Path  # versions live in cache_dir/run
    run: str
    keep_versions: int  # complete versions kept (and the versions their delta chains need)
    _: KW_ONLY
    fetch_timeout: float = 120.0  # seconds one pull may take, before its bytes are known
    min_rate: float | None = None  # then also its bytes at this rate (shardcast.minRateBytesPerSecond)
    public_key: object = None  # ed25519 public key: manifests must carry a valid signature; None: not required
    max_disk_bytes: int | None = None  # bound on held versions plus pulls in flight
    parallel: int = PARALLEL  # shards one pull downloads at once


class Relay:
    """The cache, the pulls in flight and the retention rules of one relay process."""

    def __init__(self, settings: RelaySettings):
        if settings.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {settings.keep_versions}")
        self.upstream = settings.upstream.rstrip("/")
        self.run = settings.run
        self.root = Path(settings.cache_dir) / settings.run
        self.keep = settings.keep_versions
        self.max_disk = settings.max_disk_bytes

        self.closing = threading.Event()  # aborts pulls in flight at shutdown
        self.fetch = FetchSettings.over(  # every pull's: one upstream, its bytes counted, aborted at shutdown
            [self.upstream],
            self.run,
            timeout=settings.fetch_timeout,
            min_rate=settings.min_rate,
            public_key=settings.public_key,
            parallel=settings.parallel,
            on_bytes=BYTES_IN.inc,
            stop=self.closing,
        )

        self.http: aiohttp.ClientSession | None = None  # upstream probes and `latest`; open while serving
        self._fetchers: set[Fetcher] = set()  # the pulls' downloads in flight, aborted at shutdown
        self.board = VersionBoard()  # what long-polls of `latest` are told
        self._pulls: dict[int, Pull] = {}
        self._tasks: set[asyncio.Task] = set()
        self._disk_lock = threading.RLock()  # retention and disk accounting run in pull threads

    def version_dir(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def partial_dir(self, version: int) -> Path:
        return self.root / f".{version_dir_name(version)}.partial"

    def has(self, version: int) -> bool:
        return (self.version_dir(version) / COMPLETE_MARKER).exists()

    def held(self) -> list[int]:
        """Complete versions on disk, ascending."""
        if not self.root.is_dir():
            return []
        found = (parse_version_dir(p.name) for p in self.root.iterdir() if (p / COMPLETE_MARKER).exists())
        return sorted(v for v in found if v is not None)

    def retention(self, version: int) -> Retention:
        """Whether `version` is kept beside the versions held here, would be dropped, or cannot be told
        yet (rlfleet/versions/chain.py `dir_retention`)."""
        return dir_retention(self.root, self.held(), self.keep, version)

    def partials(self) -> dict[int, Path]:
        """Partial dirs on disk by version."""
        found = {}
        for p in self.root.iterdir() if self.root.is_dir() else []:
            if p.name.startswith(".v") and p.name.endswith(".partial"):
                version = parse_version_dir(p.name[1 : -len(".partial")])
                if version is not None:
                    found[version] = p
        return found

    def clean_start(self) -> None:
        """Drop temp dirs left by a previous process, and its partial pulls except those of
        versions newer than every held one (kept to resume); apply retention."""
        self.root.mkdir(parents=True, exist_ok=True)
        newest = max(self.held(), default=-1)
        keep = {p for v, p in self.partials().items() if v > newest}

        for p in self.root.iterdir():
            if p.is_dir() and not (p / COMPLETE_MARKER).exists() and p not in keep:
                shutil.rmtree(p)
        self.prune()
        self.board.offer(max(self.held(), default=None))

    def _drop(self, version: int) -> None:
        trash = self.root / f".trash-{version_dir_name(version)}-{uuid.uuid4().hex}"
        self.version_dir(version).rename(trash)  # invisible at once, then deleted
        shutil.rmtree(trash)
        log.info("dropped v%d", version)

    def _disk_used(self) -> int:
        held = sum(f.stat().st_size for v in self.held() for f in self.version_dir(v).rglob("*") if f.is_file())
        return held + sum(p.size for p in list(self._pulls.values()) if not p.complete)

    def prune(self, room_for: int = 0) -> None:
        """Keep at most `keep` complete versions (`keep - 1` when `room_for` bytes are about to
        arrive) and, with a disk bound, room for those bytes."""
        with self._disk_lock:
            keep = max(self.keep - 1, 1) if room_for else self.keep
            for version in sorted(set(self.held()) - dir_retained(self.root, self.held(), keep)):
                self._drop(version)
            if self.max_disk is not None:
                while self.held() and self._disk_used() + room_for > self.max_disk:
                    self._drop(self.held()[0])
            VERSIONS_HELD.set(len(self.held()))
            DISK_BYTES.set(self._disk_used() + room_for)

    def open_upstream(self) -> None:
        """Open the session for probes and `latest` (event-loop thread, at start)."""
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
        self.http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=tls.client_context()))

    async def ask_upstream(self, path: str, version: int | None = None) -> bytes | None:
        """The body of a GET of `path` upstream, None on HTTP 404; VersionGone on 410 when `path` is a
        file of `version`; FetchError for anything else."""
        if self.http is None or self.http.closed:
            raise FetchError("the relay is shutting down")

        try:
            async with self.http.get(self.upstream + path) as r:
                body = await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise FetchError(f"upstream {self.upstream} did not answer {path}: {tls.describe(exc)}") from None

        if r.status == 410 and version is not None:
            raise VersionGone(f"upstream {self.upstream} no longer keeps v{version}", version)
        if r.status not in (200, 404):
            raise FetchError(f"upstream {self.upstream} answered {path} with HTTP {r.status}: {body[:200]!r}")
        return body if r.status == 200 else None

    async def locate(self, version: int, probe: bool) -> Path | Pull:
        """The complete directory of `version`, or the pull that is bringing it. With `probe`, a
        version upstream does not have raises NotUpstream at once instead of being waited for."""
        if self.has(version):
            return self.version_dir(version)
        if (verdict := self.retention(version)) == "dropped":  # pulled, it would be pruned at once
            raise VersionGone(f"v{version} is older than the newest {self.keep} versions this relay keeps", version)
        if verdict == "unsure":
            raise NotUpstream(f"v{version} may be on a chain this relay is still pulling; ask again")

        if (
            version not in self._pulls
            and probe
            and await self.ask_upstream(file_path(self.run, version, MANIFEST_NAME), version) is None
        ):
            raise NotUpstream(f"upstream {self.upstream} has no v{version} (yet)")
        if self.has(version):  # finished while we probed
            return self.version_dir(version)

        pull = self._pulls.get(version)
        if pull is None:
            pull = self._pulls[version] = Pull(version, asyncio.get_running_loop())
            task = asyncio.create_task(asyncio.to_thread(self._pull, pull))
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._pull_done(pull, t))
        return pull

    def _pull_done(self, pull: Pull, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._pulls.get(pull.version) is pull:
            del self._pulls[pull.version]
        error = None if task.cancelled() else task.exception()
        if error is not None:
            pull.error = error
            pull._wake()
            log.warning("pull of v%d failed: %s", pull.version, error)

    def _pull(self, pull: Pull) -> None:
        """Blocking: verified manifest, then shards into the partial dir (resuming what a journal
        there holds), then rename (pull thread)."""
        started = time.monotonic()
        version, partial = pull.version, self.partial_dir(pull.version)
        fetcher = Fetcher(self.fetch, version)
        self._fetchers.add(fetcher)
        journal = ShardJournal(partial)
        try:
            raw, manifest = fetcher.manifest()
            size = sum(f.size for f in manifest.files)
            if self.max_disk is not None and size > self.max_disk:
                raise DiskBoundError(f"v{version} has {size} bytes, more than the relay's disk bound {self.max_disk}")
            for other, path in self.partials().items():  # leftovers of pulls that will not resume
                if other < version and other not in self._pulls:
                    shutil.rmtree(path, ignore_errors=True)
            self.prune(room_for=size)

            done = journal.resume(raw, manifest.files)
            pull.size = size
            pull.ready |= done
            pull.raw, pull.manifest = raw, manifest
            total = sum(len(f.shards) for f in manifest.files)
            if len(done) == total:  # everything was already here (or only empty files)
                self._finish(pull)
            pull.notify()

            lock = threading.Lock()

            def on_shard(i: int, j: int) -> None:
                journal.record(i, j)
                SHARD_SECONDS.observe(time.monotonic() - started)
                with lock:
                    pull.ready.add((i, j))
                    last = len(pull.ready) == total
                if last:
                    self._finish(pull)
                pull.notify()

            fetcher.shards(manifest.files, partial, done, on_shard, pull.progress)
        except BaseException:
            # A failed pull (upstream down, past its deadline) keeps its partial dir like a stopped one: the journal
            # lists only shards that matched their sha256, so the next pull of the version resumes from them
            # instead of starting over (a 65 GB version over a slow link would never finish otherwise).
            journal.close()
            raise
        finally:
            self._fetchers.discard(fetcher)
            journal.close()
            fetcher.close()

        FETCH_SECONDS.observe(time.monotonic() - started)
        log.info(
            "v%d pulled and verified in %.2f s (%d shards were already here)",
            version,
            time.monotonic() - started,
            len(done),
        )

    def _finish(self, pull: Pull) -> None:
        """Mark complete (marker last), make v{N} visible, apply retention."""
        partial = self.partial_dir(pull.version)
        (partial / JOURNAL).unlink(missing_ok=True)
        (partial / COMPLETE_MARKER).write_text("all shards verified\n")
        # Under the disk lock, so a concurrent retention pass counts v{N} as held or as a pull in
        # flight, never both (which would drop an older version the bound has room for) or neither.
        with self._disk_lock:
            partial.rename(self.version_dir(pull.version))
            pull.complete = True
            self.prune()

    def open_file(self, version: int, name: str):
        """`name` of v{N} opened for reading, wherever it lies now (the partial dir is renamed to
        v{N} when the pull ends; an open file survives that)."""
        for _ in range(2):
            for base in (self.version_dir(version), self.partial_dir(version)):
                try:
                    return open(base / name, "rb")
                except FileNotFoundError:
                    continue
        raise FileNotFoundError(name)

    async def shutdown(self) -> None:
        """Stop the pulls and everything asked of upstream, and answer every request waiting on
        them at once (event-loop thread): aiohttp waits for open requests before it stops, and the
        process waits for the pull threads; a hung upstream would hold both for READ_TIMEOUT."""
        self.closing.set()

        for fetcher in list(self._fetchers):
            fetcher.abort()
        for pull in list(self._pulls.values()):
            if pull.error is None:
                pull.error = FetchError("the relay is shutting down")
            pull._wake()
        if self.http is not None:
            await self.http.close()  # requests in flight fail at once

    def prefetch(self, version: int) -> None:
        """Start pulling `version` in the background and offer it to long-polls (event-loop thread only)."""
        if self.has(version) or version in self._pulls or self.retention(version) != "kept":
            return
        self.board.offer(version)
        task = asyncio.create_task(self.locate(version, probe=False))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def listen(self, client: redis.Redis, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Blocking XREAD on the policy stream; each announced version is prefetched."""
        key = RunKeys(self.run).policy
        last: bytes | str | None = None
        while not stop.is_set():
            try:
                if last is None:  # start from the newest announcement
                    newest = stream_entries(client.xrevrange(key, count=1))
                    last = newest[0][0] if newest else "0-0"
                    entries = newest
                else:
                    entries = [e for _, batch in stream_reply(client.xread({key: last}, block=500)) for e in batch]
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

    async def follow_upstream(self) -> None:
        """Long-poll upstream's `latest?after=N` and prefetch each newer version, until cancelled
        (the relay's announcements when it has no policy stream to read)."""
        pause = BACKOFF_START
        https = aiohttp.TCPConnector(ssl=tls.client_context())  # an https:// upstream is verified (wire/tls.py)
        async with aiohttp.ClientSession(timeout=FOLLOW_TIMEOUT, connector=https) as session:
            while True:
                after = max([*self.held(), *self._pulls, -1 if self.board.newest is None else self.board.newest])
                try:
                    async with session.get(
                        self.upstream + latest_path(self.run), params={"after": str(after), "wait": str(FOLLOW_WAIT)}
                    ) as r:
                        if r.status == 204:
                            pause = BACKOFF_START
                            continue
                        version = int((await r.json())["version"]) if r.status == 200 else None
                    if version is None or version <= after:  # an error, or an upstream without long-poll
                        raise ValueError(f"HTTP {r.status}, version {version}")
                    pause = BACKOFF_START
                    log.info("upstream offers v%d; prefetching", version)
                    self.prefetch(version)
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                    level, cause = tls.level(exc), tls.describe(exc)
                    log.log(level, "long-poll of %s: %s; again in %.1f s", self.upstream, cause, pause)
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, BACKOFF_MAX)
