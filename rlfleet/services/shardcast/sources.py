"""Where a client gets a version from: the sources it can ask (origin and relay base URLs) with the
bandwidth and success it measured of each, and what they offer (`latest`, the `latest?after=N`
long-poll of protocol.py), and the settings one client's fetches share (`FetchSettings`). Errors shared
by every fetch live here too."""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass

import requests

from rlfleet.services.shardcast.protocol import latest_path
from rlfleet.versions.checkpoint import ChecksumError, ManifestError
from rlfleet.versions.signing import SignatureError
from rlfleet.wire import tls

log = logging.getLogger("rlfleet.shardcast.client")

BACKOFF_START, BACKOFF_MAX = 0.1, 5.0
# READ_TIMEOUT bounds each wait for the next bytes (not a whole body): a source that sends nothing
# for that long is hung and another is tried; it also bounds how long a stopping process waits on
# a blocked read.
CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 10.0
EXPLORE = 0.1  # probability of picking a source uniformly instead of by weight
PARALLEL = 4  # shards a fetch downloads at once


class FetchError(TimeoutError):
    """A version could not be fetched and verified before the deadline (or the fetch was stopped)."""


class VersionGone(FetchError):
    """No source keeps the version any more: every one answered 410 Gone (retention dropped it, protocol.py).
    Unlike a 404 ("not there yet"), waiting cannot bring it back; the caller fetches a newer version instead."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


class HTTPStatusError(RuntimeError):
    """A server answered something other than the expected status or length."""


class GoneStatus(HTTPStatusError):
    """One source answered 410 Gone: it dropped the version (the fetch asks the others; all of them: VersionGone)."""


# What a fetch retries (from another source, after a backoff) until its deadline.
RETRYABLE = (
    requests.RequestException,
    http.client.HTTPException,
    HTTPStatusError,
    ChecksumError,
    ManifestError,
    SignatureError,
    ValueError,
    OSError,
)


class Sources:
    """Base URLs with measured bandwidth (EWMA, bytes/s) and success counts; thread-safe.
    Weight = bandwidth x ((ok + 1) / (ok + fail + 2))^2; untried sources get the best bandwidth seen
    (optimism). Keep one across fetches to learn.
    Pick: smooth weighted round robin. Each pick adds every candidate's share of the candidates'
    total weight to its credit and takes the candidate with the most credit, which pays 1: over any
    run of picks each source gets its share within one pick, interleaved, so clients spread their
    shards over equal relays evenly at every moment (a weighted random choice let one relay carry
    more clients than its uplink serves at full rate while another idled, and in a tree where each
    relay's uplink just covers its clients, the clients it slowed never caught up). Credits start
    at random so that clients do not move in step; with probability EXPLORE a pick is uniform,
    which keeps measuring sources whose weight fell."""

    def __init__(self, urls: list[str], explore: float = EXPLORE, rng: random.Random | None = None):
        if not urls:
            raise ValueError("Shardcast needs at least one base URL (origin or relay)")
        self.urls = [u.rstrip("/") for u in urls]
        self.explore = explore
        self.rng = rng or random.Random()
        self.bandwidth: dict[str, float] = {}
        self.ok = dict.fromkeys(self.urls, 0)
        self.fail = dict.fromkeys(self.urls, 0)
        self.credit = {u: self.rng.random() for u in self.urls}
        self._lock = threading.Lock()

    def weight(self, url: str) -> float:
        best = max(self.bandwidth.values(), default=1.0)
        success = (self.ok[url] + 1) / (self.ok[url] + self.fail[url] + 2)
        return self.bandwidth.get(url, best) * success * success

    def pick(self, avoid: set[str] | frozenset[str] = frozenset()) -> str:
        with self._lock:
            candidates = [u for u in self.urls if u not in avoid] or self.urls
            if len(candidates) == 1:
                return candidates[0]
            if self.rng.random() < self.explore:
                return self.rng.choice(candidates)
            weights = [self.weight(u) + 1e-9 for u in candidates]
            total = sum(weights)
            for u, w in zip(candidates, weights):
                self.credit[u] += w / total
            chosen = max(candidates, key=self.credit.__getitem__)
            self.credit[chosen] -= 1.0
            return chosen

    def success(self, url: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.ok[url] += 1
            if nbytes >= 1 << 16:  # tiny bodies measure latency, not bandwidth
                rate = nbytes / max(seconds, 1e-6)
                old = self.bandwidth.get(url)
                self.bandwidth[url] = rate if old is None else 0.7 * old + 0.3 * rate

    def failure(self, url: str) -> None:
        with self._lock:
            self.fail[url] += 1


@dataclass(frozen=True)
class FetchSettings:
    """What one client's fetches share, from fetch_policy down to each Fetcher."""

    sources: Sources  # the base URLs and their measurements (kept across fetches)
    run: str
    _: KW_ONLY
    timeout: float = 300  # seconds one fetch_version / fetch_policy call may take, before its bytes are known
    # bytes per second: once a manifest says what is left to download, the fetch may also take those bytes at
    # this rate (a 65 GB version at 4 MiB/s: 4.4 hours), so a slow link is slow, not failed; None: timeout only
    min_rate: float | None = None
    public_key: object = None  # ed25519 public key: manifests must carry a valid signature; None: not required
    parallel: int = PARALLEL  # shards downloaded at once
    on_bytes: Callable[[int], None] | None = None  # per received chunk (metrics)
    stop: threading.Event | None = None  # set: abort with FetchError, keeping the partial download to resume

    @classmethod
    def over(cls, urls: Sequence[str], run: str, **options) -> FetchSettings:
        """Settings with fresh `Sources` over `urls`."""
        return cls(Sources(list(urls)), run, **options)


def wait_for_version(
    base_urls: list[str],
    run: str,
    after: int,
    timeout: float,
    *,
    stop: threading.Event | None = None,
    wait: float = 30.0,
) -> int | None:
    """Block until one of `base_urls` offers a version newer than `after`; return it (None at
    `timeout` or on `stop`). Long-polls `latest?after=N` (no timer of our own: the server answers
    when the version is announced); a source that fails is left for the next, with a short pause
    after all failed."""
    deadline = time.monotonic() + timeout
    pause, i = BACKOFF_START, 0
    with requests.Session() as session:
        while not (stop is not None and stop.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            base = base_urls[i % len(base_urls)].rstrip("/")
            hold = min(wait, left)
            try:
                r = session.get(
                    base + latest_path(run),
                    params={"after": str(after), "wait": f"{hold:.3f}"},
                    timeout=(CONNECT_TIMEOUT, hold + READ_TIMEOUT),
                    verify=tls.requests_verify(),  # per request: a session's `verify` loses to REQUESTS_CA_BUNDLE
                )
                if r.status_code == 200 and int(r.json()["version"]) > after:
                    return int(r.json()["version"])
                if r.status_code == 204:
                    pause = BACKOFF_START
                    continue
                raise HTTPStatusError(f"HTTP {r.status_code}: {r.text[:200].strip()}")
            except (requests.RequestException, HTTPStatusError, ValueError, KeyError) as exc:
                log.log(tls.level(exc), "long-poll of %s: %s", base,
                        tls.describe(exc))  # fmt: skip
                i += 1
                if i % len(base_urls) == 0:
                    (stop or threading.Event()).wait(min(pause, max(0.0, deadline - time.monotonic())))
                    pause = min(pause * 2, BACKOFF_MAX)
    return None
