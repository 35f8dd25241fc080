"""Shardcast client: download one policy version from origin/relay base URLs and check every byte.
(`fetch_version` downloads the files a manifest lists; workers and the verifier load versions through
assemble.fetch_policy, which uses this module to fetch whole or delta versions and rebuilds deltas.)

Every layer takes one `FetchSettings` (sources, run, timeout, public key, parallelism, the progress
callback and the stop event) plus what is its own (the version, the destination).

Algorithm (`fetch_version`):
  1. `dest_root/v{N}/.complete` exists -> return at once (idempotent; nothing is contacted).
  2. Get manifest.json from a source; with the run's public key, its ed25519 signature is checked
     before anything else in it is read, then its shape, run and version (a forged or stale manifest
     from a bad relay is rejected and another source is asked).
  3. Download the shards (byte ranges of the files, listed with sha256 in the manifest) with
     `parallel` threads into `dest_root/.v{N}.partial/`, each shard from a source picked by
     `Sources` (smooth weighted round robin over measured bandwidth x success). Each thread keeps
     one keep-alive connection per source and one RECV_CHUNK buffer: the body is read with
     `readinto` straight into the buffer, hashed (hashlib drops the GIL, so hashing overlaps the
     other threads' receives) and written in place (pwrite) piece by piece as it arrives, and
     `on_progress(i, j, bytes, attempt)` reports it (a relay serves those bytes on at once). A
     shard counts as held only once its digest matches: then the journal `.shards`
     (staging.ShardJournal) records it and `on_shard(i, j)` runs. A mismatch or an oversized body
     voids the shard's bytes (a new attempt, reported with 0 bytes) and asks another source; a
     broken connection keeps the bytes received (and the running hash) and resumes with a Range
     request from whichever source is picked next. A fetch interrupted by `stop` or a crash
     resumes after re-hashing only the journaled shards (unverified bytes on disk never count).
  4. When every shard is in, write `.complete` (last) and rename the partial dir to dest_root/v{N}:
     v{N} exists only complete. The whole-file sha256 is not recomputed: the signed manifest binds
     every shard's hash, and the shards tile the file (manifest.check_manifest).
  5. The deadline is `timeout` seconds, extended once the manifest says how many bytes are left (those not
     in the journal) by those bytes at `min_rate`; past it, raise FetchError with the last error seen. The
     partial dir stays, so the next try resumes from its journal (a consumer's prune_cache removes it once
     its version is too old to want).
404, 5xx and connection errors mean "not there yet": retry, backing off (0.1 s doubling to 5 s)
after every source failed once. 410 means "dropped by retention": that source is not asked again,
and once every source has said so the fetch raises VersionGone at once (a worker then fetches a
newer version; retrying until the deadline would hold it on a version that cannot come back).
The retry loop is our own (not urllib3's Retry): a sha256 mismatch must rotate sources, and a 404
for a brand-new version is retried until the deadline.
Manifests and shard bodies go through http.client rather than requests: `readinto` a reused buffer
is the one way in Python to take bytes off the socket without a copy per chunk (requests/urllib3
allocate a bytes object per chunk), and at GB/s that copy is most of the cost; and a fetcher that
owns its sockets can `abort` reads blocked on a hung source from another thread (a stopping relay
does; otherwise a read gives up after READ_TIMEOUT).
The relay reuses `Fetcher` (and staging.py's `ShardJournal`) for its own pulls (relay.py).
`wait_for_version` long-polls `latest?after=N` (protocol.py) for a process without the policy stream.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, TypedDict, overload
from urllib.parse import urlsplit

from rlfleet.services.shardcast.protocol import file_path
from rlfleet.services.shardcast.sources import (
    BACKOFF_MAX,
    BACKOFF_START,
    CONNECT_TIMEOUT,
    READ_TIMEOUT,
    RETRYABLE,
    FetchError,
    FetchSettings,
    GoneStatus,
    HTTPStatusError,
    VersionGone,
    wait_for_version,
)
from rlfleet.services.shardcast.staging import JOURNAL, ShardJournal, allocate, install
from rlfleet.versions.checkpoint import ChecksumError, version_dir_name
from rlfleet.versions.manifest import COMPLETE_MARKER, MANIFEST_NAME, FileEntry, Manifest, Shard, parse_manifest
from rlfleet.wire import tls

log = logging.getLogger("rlfleet.shardcast.client")

# The client's public surface: other services import these from here (pyproject's import contracts).
__all__ = ["FetchError", "FetchSettings", "Fetcher", "VersionGone", "fetch_version", "wait_for_version"]

RECV_CHUNK = 1 << 20  # bytes per readinto/hash step; a broken connection keeps all it received


class _Received(TypedDict):
    """One shard's download, kept across a broken connection."""

    have: int  # bytes received
    hash: hashlib._Hash  # their running sha256
    attempt: int


class Fetcher:
    """The retrying HTTP side of one version's download: its manifest, then its shards."""

    def __init__(self, settings: FetchSettings, version: int, timeout: float | None = None):
        """`timeout`: seconds from now (default settings.timeout; a chain of versions passes what is left)."""
        self.settings, self.version = settings, version
        self.sources, self.run, self.stop = settings.sources, settings.run, settings.stop
        self.timeout = settings.timeout if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout
        self.parallel = max(1, settings.parallel)
        self.last_error = "none"
        self._abort = threading.Event()  # one shard worker failed for good, or `abort`: every thread stops
        self._local = threading.local()  # per thread: its connections, a buffer
        self._conns: list[http.client.HTTPConnection] = []  # every thread's, for `close` and `abort`
        self._lock = threading.Lock()

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def connection(self, base: str, fresh: bool = False) -> tuple[http.client.HTTPConnection, str]:
        """This thread's keep-alive connection to `base` (a new one with `fresh`), and its path prefix."""
        conns = self._local.__dict__.setdefault("conns", {})
        parts = urlsplit(base)
        if fresh and base in conns:
            conns.pop(base).close()
        conn = conns.get(base)
        if conn is None:
            if not parts.hostname:
                raise ValueError(f"shardcast source {base!r}: no host in the URL (http://HOST:PORT)")
            conn = conns[base] = tls.http_connection(parts, READ_TIMEOUT)  # https: verified (wire/tls.py)
            with self._lock:
                self._conns.append(conn)
        return conn, parts.path.rstrip("/")

    def drop_connection(self, base: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(base, None)
        if conn is not None:
            conn.close()

    def buffer(self) -> memoryview:
        """This thread's RECV_CHUNK receive buffer (reused across shards)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(RECV_CHUNK))
        return buf

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def abort(self) -> None:
        """Stop this fetch now, from any thread: no new request starts, and every read blocked on a
        socket returns at once (shutdown wakes a blocked recv; close from another thread does not).
        The fetch then raises FetchError as if stopped; a connection opened between a thread's check
        and this call still gives up after READ_TIMEOUT."""
        self._abort.set()
        with self._lock:
            socks = [conn.sock for conn in self._conns if conn.sock is not None]
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by its thread
                pass

    def allow_bytes(self, nbytes: int) -> None:
        """`nbytes` are left to download: the deadline is at least that many bytes at settings.min_rate away."""
        rate = self.settings.min_rate
        if rate and nbytes > 0:
            needed = time.monotonic() + nbytes / rate
            if needed > self.deadline:
                self.timeout += needed - self.deadline
                self.deadline = needed

    def _check(self) -> None:
        if self.stopped or self._abort.is_set():
            raise FetchError(f"run {self.run!r} v{self.version}: fetch stopped")
        if time.monotonic() > self.deadline:
            raise FetchError(
                f"run {self.run!r} v{self.version}: not fetched and verified within "
                f"{self.timeout:g} s from {self.sources.urls}; last error: {self.last_error}"
            )

    def _request_timeout(self) -> tuple[float, float]:
        left = max(1.0, self.deadline - time.monotonic())
        return min(CONNECT_TIMEOUT, left), min(READ_TIMEOUT, left)

    def _retry(self, what: str, attempt: Callable[[str], object]):
        """attempt(url) until it returns, rotating sources; back off after each full round of failures.
        A source that answered 410 Gone is not asked again (it dropped the version: not a failure of the
        source); once every source has, VersionGone, at once rather than at the deadline."""
        tried: set[str] = set()
        gone: set[str] = set()
        delay = BACKOFF_START
        while True:
            self._check()
            url = self.sources.pick(tried | gone)
            try:
                return attempt(url)
            except FetchError:  # stopped or out of time (a TimeoutError, so an OSError too)
                raise
            except GoneStatus as exc:
                self.last_error = f"{what} from {url}: {exc}"
                gone.add(url)
                if gone >= set(self.sources.urls):
                    raise VersionGone(
                        f"run {self.run!r} v{self.version}: no source keeps it any more "
                        f"({', '.join(self.sources.urls)}); last answer: {exc}",
                        self.version,
                    ) from None
            except RETRYABLE as exc:
                self.last_error = f"{what} from {url}: {tls.describe(exc)}"
                log.log(tls.level(exc), "retrying: %s", self.last_error)
                self.sources.failure(url)
                tried.add(url)
            if len(tried | gone) >= len(self.sources.urls):
                tried.clear()
                pause = max(0.0, min(delay, self.deadline - time.monotonic()))
                (self.stop or self._abort).wait(pause)
                delay = min(delay * 2, BACKOFF_MAX)

    @overload
    def manifest(self, missing_ok: Literal[False] = False) -> tuple[bytes, Manifest]: ...
    @overload
    def manifest(self, missing_ok: bool) -> tuple[bytes, Manifest] | None: ...
    def manifest(self, missing_ok: bool = False) -> tuple[bytes, Manifest] | None:
        """(raw bytes, parsed manifest) from the first source whose manifest verifies. With `missing_ok`,
        None once every source has answered 404 or 410 (a version older than the ones kept), instead of
        waiting; without it, VersionGone once every source has answered 410."""
        missing: set[str] = set()

        def attempt(base: str) -> tuple[bytes, Manifest] | None:
            started = time.monotonic()
            try:
                r = self._request(base, file_path(self.run, self.version, MANIFEST_NAME), {})
                body = r.read()
            except BaseException:
                self.drop_connection(base)  # its response may be half read
                raise
            if r.status in (404, 410) and missing_ok:
                missing.add(base)
                if missing >= set(self.sources.urls):
                    return None
            if r.status != 200:
                error = GoneStatus if r.status == 410 else HTTPStatusError
                raise error(f"HTTP {r.status}: {body[:200].decode(errors='replace').strip()}")
            manifest = parse_manifest(body, self.run, self.version, self.settings.public_key)
            self.sources.success(base, len(body), time.monotonic() - started)
            return body, manifest

        return self._retry(MANIFEST_NAME, attempt)

    def shards(
        self,
        files: Sequence[FileEntry],
        dest: Path,
        skip: set[tuple[int, int]],
        on_shard: Callable[[int, int], None] | None = None,
        on_progress: Callable[[int, int, int, int], None] | None = None,
    ) -> None:
        """Download every shard not in `skip` of `files` (a verified manifest's, or the part of them a route
        needs) into the files under `dest` (created at full size).
        `on_progress(i, j, n, attempt)`: bytes [0, n) of shard j of files[i] are on disk, unverified
        (a new `attempt` voids the bytes of the previous ones); `on_shard(i, j)`: it verified."""
        fds = []
        try:
            for entry in files:
                path = dest / entry.name
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                fds.append(fd)
                allocate(fd, entry.size)
            todo = [(i, j) for i, entry in enumerate(files) for j in range(len(entry.shards)) if (i, j) not in skip]
            self.allow_bytes(sum(files[i].shards[j].size for i, j in todo))
            todo.reverse()  # pop() from the end: shards go in file order

            def worker() -> None:
                while True:
                    with self._lock:
                        if not todo:
                            return
                        i, j = todo.pop()
                    entry = files[i]
                    progress = None if on_progress is None else lambda n, a, i=i, j=j: on_progress(i, j, n, a)
                    self._shard(entry, entry.shards[j], fds[i], progress)
                    if on_shard is not None:
                        on_shard(i, j)

            with ThreadPoolExecutor(self.parallel, thread_name_prefix="shardcast-fetch") as pool:
                futures = [pool.submit(worker) for _ in range(min(self.parallel, len(todo)))]
                errors = []
                for f in futures:
                    try:
                        f.result()
                    except BaseException as exc:
                        self._abort.set()
                        errors.append(exc)
                if errors:  # the first real cause, not the "stopped" of the workers it aborted
                    raise next((e for e in errors if "fetch stopped" not in str(e)), errors[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _shard(self, entry: FileEntry, shard: Shard, fd: int, progress: Callable[[int, int], None] | None) -> None:
        """Receive one shard, hashing and writing each piece as it arrives, until its digest matches."""
        size, where = shard.size, f"{entry.name}[{shard.offset}:+{shard.size}]"
        state: _Received = {"have": 0, "hash": hashlib.sha256(), "attempt": 0}

        def attempt(base: str) -> None:
            started, had = time.monotonic(), state["have"]
            try:
                self._get_range(base, entry, shard, fd, state, progress)
            except BaseException:
                self.drop_connection(base)  # its response may be half read
                raise
            digest = state["hash"].hexdigest()
            if digest != shard.sha256:  # never resume from bytes that failed the check
                state.update({"have": 0, "hash": hashlib.sha256(), "attempt": state["attempt"] + 1})
                if progress is not None:
                    progress(0, state["attempt"])
                raise ChecksumError(where, f"sha256 {digest} != manifest sha256 {shard.sha256}")
            self.sources.success(base, size - had, time.monotonic() - started)

        self._retry(where, attempt)

    def _request(self, base: str, path: str, headers: dict) -> http.client.HTTPResponse:
        """GET on this thread's connection to `base`; a kept-alive connection the server closed
        meanwhile is replaced once, at once (that is not a failure of the source)."""
        for fresh in (False, True):
            self._check()  # an aborted fetch opens nothing new
            conn, prefix = self.connection(base, fresh)
            conn.timeout = self._request_timeout()[1]
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            reused = conn.sock is not None
            try:
                conn.request("GET", prefix + path, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused or fresh:
                    raise
        raise AssertionError("unreachable")

    def _get_range(
        self,
        base: str,
        entry: FileEntry,
        shard: Shard,
        fd: int,
        state: _Received,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        """Receive the missing bytes of `shard` (from state["have"] on), hashing and writing them."""
        have, size = state["have"], shard.size
        start, end = shard.offset + have, shard.offset + size
        if start == 0 and end == entry.size:
            headers = {}
        else:  # open-ended when the shard runs to the end of the file
            headers = {"Range": f"bytes={start}-" if end == entry.size else f"bytes={start}-{end - 1}"}
        r = self._request(base, file_path(self.run, self.version, entry.name), headers)
        if r.status == 200 and not headers:
            pass
        elif not (r.status == 206 and (r.getheader("Content-Range") or "").startswith(f"bytes {start}-{end - 1}/")):
            detail = r.read(200).decode(errors="replace").strip() if r.status >= 300 else "bad range"
            self.drop_connection(base)
            raise (GoneStatus if r.status == 410 else HTTPStatusError)(f"HTTP {r.status}: {detail}")
        if r.length is None or r.length > size - have:
            self.drop_connection(base)
            raise ChecksumError(
                entry.name,
                f"server sent more than the shard size {size} (Content-Length {r.getheader('Content-Length')})",
            )
        buf = self.buffer()
        while have < size:
            n = r.readinto(buf[: min(size - have, RECV_CHUNK)])
            if not n:
                break
            state["hash"].update(buf[:n])
            written = 0
            while written < n:
                written += os.pwrite(fd, buf[written:n], shard.offset + have + written)
            have = state["have"] = have + n
            if self.settings.on_bytes is not None:
                self.settings.on_bytes(n)
            if progress is not None:
                progress(have, state["attempt"])
            self._check()
        if have < size:
            raise HTTPStatusError(f"truncated body: {have} of {size} shard bytes")


def fetch_version(settings: FetchSettings, version: int, dest_root: Path) -> Path:
    """Download and verify `settings.run` v`version` into dest_root/v{N} within settings.timeout; return
    that directory (FetchSettings says what the public key, the sources, `on_bytes` and `stop` do)."""
    dest_root = Path(dest_root)
    final = dest_root / version_dir_name(version)
    if (final / COMPLETE_MARKER).exists():
        return final
    dest_root.mkdir(parents=True, exist_ok=True)
    fetcher = Fetcher(settings, version)
    partial = dest_root / f".{final.name}.partial"
    try:
        raw, manifest = fetcher.manifest()
        with ShardJournal(partial) as journal:
            done = journal.resume(raw, manifest.files)
            fetcher.shards(manifest.files, partial, done, journal.record)
        (partial / JOURNAL).unlink()
        (partial / COMPLETE_MARKER).write_text(f"{len(raw)} bytes of manifest, all shards verified\n")
        return install(partial, final)
    finally:  # a timeout or a stop keeps the partial dir: the next try resumes from its journal
        fetcher.close()
