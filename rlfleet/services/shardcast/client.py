"""Shardcast client: download one policy version from origin/relay base URLs and check every byte.

Algorithm (`fetch_version`):
  1. `dest_root/v{N}/.complete` exists -> return at once (idempotent; nothing is contacted).
  2. Get manifest.json from the first URL that has it and check its shape, run and version.
  3. Download each listed file into a fresh temp dir under dest_root; check size and sha256. A bad
     file is deleted and fetched again from the next URL; a broken connection keeps the partial
     file and resumes it with a Range request. After every full round over the URLs, back off
     (0.1 s doubling to 5 s). 404, 5xx and connection errors are "not there yet": retry.
  4. When every file passes, write manifest.json (the bytes received) and `.complete` (last) into
     the temp dir and rename it to dest_root/v{N} in one step: v{N} exists only complete.
  5. At `timeout` seconds, delete the temp dir and raise FetchError with the last error seen.
The retry loop is our own (not urllib3's Retry): a sha256 mismatch must rotate URLs, and a 404
for a brand-new version must be retried until a deadline. The manifest signature check goes in
`_Fetcher.manifest` once manifests are signed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests

from rlfleet.checkpoint import (
    COMPLETE_MARKER, MANIFEST_NAME, ChecksumError, ManifestError, check_manifest, version_dir_name, verify_file,
)
from rlfleet.services.shardcast.protocol import file_path, latest_path

log = logging.getLogger("rlfleet.shardcast.client")

BACKOFF_START, BACKOFF_MAX = 0.1, 5.0
CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 60.0
RECV_CHUNK = 1 << 16


class FetchError(TimeoutError):
    """A version could not be fetched and verified before the deadline (or the fetch was stopped)."""


class HTTPStatusError(RuntimeError):
    """A server answered something other than the expected status."""


_RETRYABLE = (requests.RequestException, HTTPStatusError, ChecksumError, ManifestError, ValueError, OSError)


def fetch_version(base_urls: list[str], run: str, version: int, dest_root: Path, timeout: float = 300, *,
                  on_bytes: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> Path:
    """Download and verify `run` v`version` into dest_root/v{N}; return that directory.
    `on_bytes(n)` is called per received chunk (metrics); setting `stop` aborts with FetchError."""
    if not base_urls:
        raise ValueError("fetch_version needs at least one base URL (origin or relay)")
    dest_root = Path(dest_root)
    final = dest_root / version_dir_name(version)
    if (final / COMPLETE_MARKER).exists():
        return final
    dest_root.mkdir(parents=True, exist_ok=True)
    fetcher = _Fetcher(base_urls, run, version, timeout, on_bytes, stop)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=dest_root))
    try:
        raw = fetcher.manifest()
        for entry in json.loads(raw)["files"]:
            fetcher.file(entry, tmp / entry["name"])
        (tmp / MANIFEST_NAME).write_bytes(raw)
        (tmp / COMPLETE_MARKER).write_text(f"{len(raw)} bytes of manifest, all files verified\n")
        return _install(tmp, final)
    finally:
        fetcher.session.close()
        if tmp.exists():
            shutil.rmtree(tmp)


def _install(tmp: Path, final: Path) -> Path:
    """Rename the verified temp dir to `final`; another fetcher that got there first wins."""
    if final.exists() and not (final / COMPLETE_MARKER).exists():  # leftover of something interrupted
        trash = final.with_name(f".{final.name}.trash-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(final, trash)
        shutil.rmtree(trash)
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / COMPLETE_MARKER).exists():
            return final
        raise
    return final


class _Fetcher:
    def __init__(self, base_urls, run, version, timeout, on_bytes, stop):
        self.urls = [u.rstrip("/") for u in base_urls]
        self.run, self.version, self.timeout = run, version, timeout
        self.deadline = time.monotonic() + timeout
        self.on_bytes, self.stop = on_bytes, stop
        self.session = requests.Session()
        self.cursor = 0  # index of the URL to try next; stays on a URL while it works
        self.last_error = "none"

    def _request_timeout(self) -> tuple[float, float]:
        left = max(1.0, self.deadline - time.monotonic())
        return min(CONNECT_TIMEOUT, left), min(READ_TIMEOUT, left)

    def _retry(self, what: str, attempt: Callable[[str], object]):
        delay, failures = BACKOFF_START, 0
        while True:
            if self.stop is not None and self.stop.is_set():
                raise FetchError(f"run {self.run!r} v{self.version}: fetch stopped")
            base = self.urls[self.cursor % len(self.urls)]
            try:
                return attempt(base)
            except _RETRYABLE as exc:
                self.last_error = f"{what} from {base}: {exc}"
                log.debug("retrying: %s", self.last_error)
            self.cursor += 1
            failures += 1
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise FetchError(f"run {self.run!r} v{self.version}: not fetched and verified within "
                                 f"{self.timeout:g} s from {self.urls}; last error: {self.last_error}")
            if failures % len(self.urls) == 0:
                pause = min(delay, left)
                if self.stop is not None:
                    self.stop.wait(pause)
                else:
                    time.sleep(pause)
                delay = min(delay * 2, BACKOFF_MAX)

    def manifest(self) -> bytes:
        def attempt(base: str) -> bytes:
            r = self.session.get(base + file_path(self.run, self.version, MANIFEST_NAME),
                                 timeout=self._request_timeout())
            if r.status_code != 200:
                raise HTTPStatusError(f"HTTP {r.status_code}: {r.text[:200].strip()}")
            check_manifest(json.loads(r.content), self.run, self.version)
            return r.content

        return self._retry(MANIFEST_NAME, attempt)

    def file(self, entry: dict, path: Path) -> None:
        name, size = entry["name"], entry["size"]
        path.parent.mkdir(parents=True, exist_ok=True)

        def attempt(base: str) -> None:
            have = path.stat().st_size if path.exists() else 0
            if have > size:
                path.unlink()
                have = 0
            if not path.exists() or have < size:
                self._download(base + file_path(self.run, self.version, name), path, have, size)
            try:
                verify_file(path, entry)
            except ChecksumError:
                path.unlink(missing_ok=True)  # never resume from bytes that failed the check
                raise

        self._retry(name, attempt)

    def _download(self, url: str, path: Path, have: int, size: int) -> None:
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self.session.get(url, headers=headers, stream=True, timeout=self._request_timeout()) as r:
            if r.status_code == 206 and have and r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                mode = "ab"
            elif r.status_code == 200:
                mode = "wb"
            else:
                raise HTTPStatusError(f"HTTP {r.status_code}: {r.text[:200].strip() if not r.ok else 'bad range'}")
            with open(path, mode) as f:
                for chunk in r.iter_content(RECV_CHUNK):  # small: a broken read loses at most this much
                    f.write(chunk)
                    if self.on_bytes is not None:
                        self.on_bytes(len(chunk))
                    if f.tell() > size:
                        raise ChecksumError(path.name, f"server sent more than the manifest size {size}")
                    if self.stop is not None and self.stop.is_set():
                        raise FetchError(f"run {self.run!r} v{self.version}: fetch stopped")


def latest_version_http(base_url: str, run: str, timeout: float = 10.0) -> int | None:
    """The newest version `base_url` offers for `run`, or None when it has none (HTTP 404).
    Other failures raise (requests.RequestException)."""
    r = requests.get(base_url.rstrip("/") + latest_path(run), timeout=timeout)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return int(r.json()["version"])
