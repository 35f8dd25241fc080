"""/healthz beside /metrics, and the engine liveness rule a component's /healthz answers with.

Server (`serve`): one threaded WSGI server on the component's metrics port. `/healthz` answers from
`Health` in memory, never waiting on the component's work: 200 and a JSON body
`{"status": ..., "detail": ...}` when every registered check passes, 503 and the failing check's
status and reason when one does not. Every other path is prometheus_client's exposition app, the
/metrics that `start_http_server` served (the same content negotiation, gzip and `name[]` filters).
A component that registers no check answers 200 while its process serves.

Engine liveness (`Liveness`), for a component whose work is model forwards (a rollout worker's engine,
the verifier's prefill model). A live process says nothing of an engine wedged in a forward (a hung
CUDA kernel, a vLLM engine core that never answers), so its check says:
  starting  until `ready()` (the model loaded, the first version in): 503, so the startup probe
            waits; its failure budget covers the model load (the operator's startupProbe);
  busy      while work is in flight (`working()`, or `begin`/`end`): alive iff the newest progress
            (a completed forward step, `beat()` or the engine's `heartbeat`; the work's start) is at
            most `deadline_s` old;
  swapping  while new weights are loaded (`swapping(nbytes)`), which beats no forward step: alive iff
            the swap has run at most its own budget, deadline_s + nbytes / swap_min_bytes_per_s (a
            32B model's 65 GB take 35-65 s to reload on a GPU, more from a slow disk: a fixed deadline
            would restart a worker mid-swap);
  idle      otherwise: the prober thread runs a tiny forward (`probe`: one generated token, a short
            prefill) once `probe_every_s` has passed without progress, holding `lock`, the lock the
            work holds, so a probe never interleaves with a generation or a weight swap; alive iff
            the newest progress (a finished probe counts) is at most probe_every_s + deadline_s old,
            the probe in flight has run at most deadline_s, and no probe failed since that progress.
The verdict is a pure function of those recorded times and `now` (`verdict`), computed when /healthz is
asked; /healthz never runs a forward. A wedged engine answers 503 within deadline_s (busy) or
probe_every_s + deadline_s (idle), and the kubelet restarts it after the liveness probe's
failureThreshold x periodSeconds (3 x 20 s in the operator's pods).
Settings: env RLFLEET_HEALTH_DEADLINE_S, RLFLEET_HEALTH_PROBE_INTERVAL_S and RLFLEET_HEALTH_SWAP_MIN_RATE
(env.py), read when the process starts: per-process operational settings, not part of the run (changing
them rolls no pod's config hash; set them through a pool's or the verifier's podTemplate env).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, Gauge, make_wsgi_app

from rlfleet.wire import env

log = logging.getLogger("rlfleet.health")

HEALTH_PATH = "/healthz"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    status: str  # ok, starting, busy, idle, wedged, probe_failed
    detail: str = ""

    def body(self) -> bytes:
        return json.dumps({"status": self.status, "detail": self.detail}).encode()


def _wedged(what: str, allowed: float) -> Verdict:
    return Verdict(False, "wedged", f"{what} ({allowed:g} s allowed)")


SERVING = Verdict(True, "ok", "the process serves (no health check registered)")


PENDING = Verdict(False, "starting", "the process is starting (its health check is not registered yet)")


class Health:
    """What /healthz answers: the registered checks, each a function of memory only (never blocking).
    `pending`: the component will register a check; until it does, "starting" (503), so a startup probe
    that asks in the first second never passes before the check that covers the model load is in."""

    def __init__(self, pending: bool = False) -> None:
        self._checks: list[Callable[[], Verdict]] = []
        self._pending = pending

    def register(self, check: Callable[[], Verdict]) -> None:
        self._checks.append(check)
        self._pending = False

    def verdict(self) -> Verdict:
        """The first failing check's verdict, else the last check's (SERVING with none)."""
        if self._pending:
            return PENDING
        out = SERVING
        for check in self._checks:
            out = check()
            if not out.ok:
                return out
        return out


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # probes and scrapes every few seconds: nothing to log
        pass


def health_app(health: Health, metrics_app=None):
    """The WSGI app: /healthz from `health`, anything else the Prometheus exposition."""
    metrics_app = metrics_app or make_wsgi_app(REGISTRY)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)
        verdict = health.verdict()
        body = verdict.body()
        status = "200 OK" if verdict.ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve(port: int, addr: str, health: Health) -> WSGIServer:
    """/metrics and /healthz on `addr:port`, served by daemon threads; the server (its `server_port`)."""
    server = make_server(addr, port, health_app(health), _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-healthz").start()
    return server


@dataclass(frozen=True)
class LivenessSettings:
    deadline_s: float = 60.0  # a forward step (busy) or a probe (idle) must complete within this
    probe_every_s: float = 30.0  # idle: a probe once this long has passed without progress
    swap_min_bytes_per_s: float = 128 * 2**20  # the slowest weight load that is not a hang (a slow network disk)

    @classmethod
    def from_env(cls) -> LivenessSettings:
        values = {
            name: env.get_float(name, default)
            for name, default in (
                (env.HEALTH_DEADLINE_S, cls.deadline_s),
                (env.HEALTH_PROBE_INTERVAL_S, cls.probe_every_s),
                (env.HEALTH_SWAP_MIN_RATE, cls.swap_min_bytes_per_s),
            )
        }
        for name, value in values.items():
            if not value > 0:
                what = "bytes per second" if name == env.HEALTH_SWAP_MIN_RATE else "seconds"
                raise SystemExit(f"environment variable {name}={value:g}: {what}, above 0; unset it for the default")
        return cls(
            deadline_s=values[env.HEALTH_DEADLINE_S],
            probe_every_s=values[env.HEALTH_PROBE_INTERVAL_S],
            swap_min_bytes_per_s=values[env.HEALTH_SWAP_MIN_RATE],
        )

    def swap_budget_s(self, nbytes: int) -> float:
        """How long a swap of `nbytes` of weights may run before it counts as a hang."""
        return self.deadline_s + nbytes / self.swap_min_bytes_per_s


class Liveness:
    """The engine liveness rule of the module docstring; `check` is what /healthz asks (register it)."""

    def __init__(
        self,
        settings: LivenessSettings,
        probe: Callable[[], None] | None = None,
        *,
        heartbeat: Callable[[], float] = lambda: 0.0,
        lock: threading.Lock | None = None,
        alive: Gauge | None = None,
        probe_seconds: Gauge | None = None,
    ):
        self.settings = settings
        self.probe = probe  # raises when the engine is broken; None: nothing to probe
        self.heartbeat = heartbeat  # time.monotonic() of the engine's last completed forward step
        self.lock = lock  # held by the work and by the probe (None: they may overlap)
        self.alive, self.probe_seconds = alive, probe_seconds
        self._state = threading.Lock()
        self._ready = False
        self._starting = "loading the model"
        self._progress = time.monotonic()
        self._in_flight = 0
        self._busy_since = 0.0
        self._probe_started: float | None = None
        self._probe_failed: tuple[float, str] | None = None  # (when, why)
        self._swap: tuple[float, float, int] | None = None  # (started, budget s, bytes) of the swap in progress
        self._thread: threading.Thread | None = None
        self._was_ok = True  # the last verdict once ready: a change is logged

    # ---- what the component reports

    def starting(self, detail: str) -> None:
        self._starting = detail

    def ready(self) -> None:
        """The model is loaded and serves: from now on the busy and idle rules apply."""
        self.beat()
        self._ready = True

    def beat(self) -> None:
        """A forward step completed."""
        self._progress = time.monotonic()

    def begin(self) -> None:
        with self._state:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1

    def end(self) -> None:
        with self._state:
            self._in_flight -= 1
            self._progress = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Work on the engine (a generation, a weight swap): holds `lock`, busy until it returns or raises."""
        with self.lock or contextlib.nullcontext():
            self.begin()
            try:
                yield
            finally:
                self.end()

    @contextlib.contextmanager
    def swapping(self, nbytes: int) -> Iterator[None]:
        """A weight swap of `nbytes`: work like `working()`, judged by its own budget (module docstring)."""
        with self.working():
            self._swap = (time.monotonic(), self.settings.swap_budget_s(nbytes), nbytes)
            try:
                yield
            finally:
                self._swap = None

    # ---- the prober

    def start(self, stop: threading.Event) -> Liveness:
        """Start the prober thread (a daemon; it ends with `stop`)."""
        self._thread = threading.Thread(target=self._probe_loop, args=(stop,), daemon=True, name="liveness-probe")
        self._thread.start()
        return self

    def _probe_loop(self, stop: threading.Event) -> None:
        tick = max(0.05, min(1.0, self.settings.probe_every_s / 4))
        while not stop.wait(tick):
            idle_for = time.monotonic() - self.progress()
            if self._ready and self._in_flight == 0 and idle_for >= self.settings.probe_every_s:
                self.probe_once()
            self.check()  # keeps the alive gauge current between scrapes of /healthz

    def probe_once(self) -> None:
        """One probe, holding `lock`; skipped when work began while it waited for the lock."""
        if self.probe is None:
            self.beat()
            return
        with self.lock or contextlib.nullcontext():
            if self._in_flight:
                return
            started = self._probe_started = time.monotonic()
            try:
                self.probe()
            except Exception as exc:  # the verdict reports it; the component's work meets the same error itself
                self._probe_failed = (time.monotonic(), f"{type(exc).__name__}: {str(exc)[:300]}")
                log.warning("the engine's liveness probe failed: %s", self._probe_failed[1])
            else:
                self.beat()
                if self.probe_seconds is not None:
                    self.probe_seconds.set(time.monotonic() - started)
            finally:
                self._probe_started = None

    # ---- the verdict

    def progress(self) -> float:
        return max(self._progress, self.heartbeat())

    def verdict(self, now: float) -> Verdict:
        s = self.settings
        if not self._ready:
            return Verdict(False, "starting", self._starting)
        progress = self.progress()
        failed = self._probe_failed
        if failed is not None and failed[0] >= progress:
            return Verdict(False, "probe_failed", f"the idle probe failed: {failed[1]}")
        swap = self._swap
        if swap is not None:
            started, budget, nbytes = swap
            if now - started > budget:
                what = f"the weight swap ({nbytes / 2**30:.2f} GiB) has run {now - started:.0f} s"
                return _wedged(what, budget)
            return Verdict(True, "swapping", f"loading {nbytes / 2**30:.2f} GiB of weights for {now - started:.1f} s")
        if self._in_flight:
            age = now - max(progress, self._busy_since)
            if age > s.deadline_s:
                return _wedged(f"no forward step completed in {age:.0f} s while busy", s.deadline_s)
            return Verdict(True, "busy", f"last forward step {age:.1f} s ago")
        probing = self._probe_started
        if probing is not None and now - probing > s.deadline_s:
            return _wedged(f"the idle probe has run {now - probing:.0f} s", s.deadline_s)
        age = now - progress
        if age > s.probe_every_s + s.deadline_s:
            return _wedged(
                f"no forward step or probe completed in {age:.0f} s while idle", s.probe_every_s + s.deadline_s
            )
        return Verdict(True, "idle", f"last forward step or probe {age:.1f} s ago")

    def check(self) -> Verdict:
        verdict = self.verdict(time.monotonic())
        if self.alive is not None:
            self.alive.set(1 if verdict.ok else 0)
        if self._ready:  # the log says when and why liveness failed, and when it came back
            if verdict.ok != self._was_ok:
                (log.info if verdict.ok else log.warning)("engine liveness: %s: %s", verdict.status, verdict.detail)
            self._was_ok = verdict.ok
        return verdict
