"""What keeps one ingest process bounded and honest under load and faults.

- `RateLimiter`: a token bucket per worker (and per joining address); a submission that is not stored
  (503, Redis trouble, an idempotent resend) gets its token back (`refund`), so backpressure never
  spends a worker's rate.
- `BodyBudget`: request bytes all submissions in flight hold together (`maxBufferedBytes`); a
  request is refused before its body is read when its share does not fit.
- `guarded_protocol`: uvicorn's HTTP protocol with a per-request deadline (`requestTimeoutSeconds`):
  a connection that has not delivered a whole request that long after it opened (or after its
  previous response) is closed, whatever it is trickling (slow headers, slow chunked bodies).
  uvicorn has a keep-alive timeout but none for a request in progress, so this one subclass is ours.
- `RedisWatch`: a thread that pings Redis about once a second, so `/healthz` answers from memory at
  once (never queued behind submissions) and says when it last heard from Redis.
"""

from __future__ import annotations

import asyncio
import threading
import time

import redis


class RateLimiter:
    """Token bucket per key (a worker, a client address): `rate` per minute, bursts up to `rate`. A call
    may give a key its own rate (a joined worker on probation); the bucket keeps the last one given.

    Memory: a bucket that has refilled is the same as no bucket (a missing key starts full), so when the
    table reaches `prune_at` keys the full ones are dropped and the mark moves to twice what is left. The
    table then holds about the keys seen in the last minute (a bucket refills within 60 s), not every
    address or worker ever seen, at an amortized O(1) cost per call."""

    def __init__(self, rate_per_minute: int, clock=time.monotonic, prune_at: int = 4096):
        self.rate, self.clock = rate_per_minute, clock
        self._buckets: dict[str, tuple[float, float, int]] = {}  # key -> (tokens, at, rate per minute)
        self._lock = threading.Lock()
        self._min_prune_at = self._prune_at = prune_at

    def __len__(self) -> int:
        return len(self._buckets)

    def _prune(self, now: float) -> None:
        full = [k for k, (tokens, at, rate) in self._buckets.items() if tokens + (now - at) * rate / 60.0 >= rate]
        for key in full:
            del self._buckets[key]
        self._prune_at = max(self._min_prune_at, 2 * len(self._buckets))

    def _level(self, key: str, now: float, rate: int | None) -> tuple[float, int]:
        tokens, at, known = self._buckets.get(key, (float(rate or self.rate), now, rate or self.rate))
        rate = rate or known
        return min(float(rate), tokens + (now - at) * rate / 60.0), rate

    def take(self, key: str, rate_per_minute: int | None = None) -> float:
        """0 when one request is allowed now (and counted), else the seconds until it would be."""
        with self._lock:
            now = self.clock()
            if len(self._buckets) >= self._prune_at:
                self._prune(now)
            tokens, rate = self._level(key, now, rate_per_minute)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now, rate)
                return 0.0
            self._buckets[key] = (tokens, now, rate)
            return (1.0 - tokens) * 60.0 / rate

    def refund(self, key: str) -> None:
        """Give back the token of a request that was not served (a submission that was not stored)."""
        with self._lock:
            now = self.clock()
            tokens, rate = self._level(key, now, None)
            self._buckets[key] = (min(float(rate), tokens + 1.0), now, rate)


class BodyBudget:
    """Bytes of request bodies held at once, over all requests; used from the event loop thread only."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def reserve(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        self.held -= n


def guarded_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) closing a connection whose request
    is not whole `timeout` seconds after the connection opened or its previous response completed."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    # uvicorn annotates AutoHTTPProtocol as a variable (`type[asyncio.Protocol]`, the class it picked at import).
    class Guarded(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self, delay: float) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(delay, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle.response_started and not cycle.response_complete:
                self._arm(1.0)  # a response on its way: let it finish
            elif not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(timeout)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    return Guarded


class RedisWatch(threading.Thread):
    """Pings Redis every `interval` seconds (with the client's timeouts); `state()` is the last answer."""

    def __init__(self, client: redis.Redis, inbox: str, interval: float = 1.0):
        super().__init__(daemon=True, name="redis-watch")
        self.client, self.inbox, self.interval = client, inbox, interval
        self.stop = threading.Event()
        self._state: dict = {"redis": False, "detail": "not checked yet", "inbox": None, "at": None}

    def check(self) -> None:
        try:
            backlog = int(self.client.xlen(self.inbox))
            self._state = {"redis": True, "detail": "ok", "inbox": backlog, "at": time.time()}
        except redis.RedisError as exc:
            self._state = {**self._state, "redis": False, "detail": f"{type(exc).__name__}: {exc}"}

    def run(self) -> None:
        while not self.stop.is_set():
            self.check()
            self.stop.wait(self.interval)

    def state(self) -> dict:
        return dict(self._state)
