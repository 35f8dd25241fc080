"""A rollout worker's engine liveness, what its /healthz answers (the rule: rlfleet/wire/health.py).

- starting: until the engine is made and the first policy version is loaded into it (vLLM takes
  minutes on a GPU; the startup probe's budget covers it);
- busy: while the worker generates a group (`Worker` holds `working()` around `generate`): the engine's
  heartbeat must advance within the deadline (base.py: the torch engine's decode steps, vLLM's engine steps,
  both read in this process);
- swapping: while it loads a new version's weights (`swapping()` around `load_weights`), which beat
  nothing: the swap must end within its own budget, the deadline plus the version's bytes at
  RLFLEET_HEALTH_SWAP_MIN_RATE (`Worker.swap_bytes`);
- idle (paused by backpressure, waiting for a ticket or for the ingest, building proofs): a 1-token
  `Engine.probe` every RLFLEET_HEALTH_PROBE_INTERVAL_S, holding the same lock as generations and
  swaps, so it never runs inside a swap and a group never waits more than one probe for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import Gauge

from rlfleet.engines import Engine
from rlfleet.wire.health import Liveness, LivenessSettings
from rlfleet.wire.runtime import Context

ALIVE = Gauge("rlfleet_rollout_engine_alive", "1 while the engine is alive by /healthz's rule, else 0")
PROBE_SECONDS = Gauge("rlfleet_rollout_engine_probe_seconds", "Latency of the last idle liveness probe (1 token)")


def engine_liveness(ctx: Context, engine: Callable[[], Engine | None]) -> Liveness:
    """The liveness of the engine `engine()` returns (None until it is made), registered on ctx.health,
    its prober started."""

    def heartbeat() -> float:
        made = engine()
        return made.heartbeat if made is not None else 0.0

    def probe() -> None:
        made = engine()
        assert made is not None  # probed only once ready(), after the engine is made
        made.probe()

    live = Liveness(
        LivenessSettings.from_env(),
        probe,
        heartbeat=heartbeat,
        lock=threading.Lock(),
        alive=ALIVE,
        probe_seconds=PROBE_SECONDS,
    )
    live.starting("loading the engine and the first policy version")
    ctx.health.register(live.check)
    return live.start(ctx.stop)
