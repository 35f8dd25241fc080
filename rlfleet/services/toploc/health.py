"""The verifier's prefill liveness, what its /healthz answers (the rule: rlfleet/wire/health.py).

- busy: while a prefill runs (the gate's batches, one group alone, the API's /verify, from any thread):
  a forward pre-hook and an always-called forward hook on each loaded model's decoder body count the
  prefills in flight and beat when one completes, so a prefill stuck past the deadline is caught;
- idle: a prefill of 2 tokens on the model the gate used last, every RLFLEET_HEALTH_PROBE_INTERVAL_S.
  No lock: the gate's models are read-only (inference mode) and loaded next to the ones in use, never
  swapped in place. Before the first group no model is loaded (they load on demand), so there is
  nothing to wedge and the probe passes.
The verifier is ready once its gate is made (Redis connected, its consumer group in place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prometheus_client import Gauge

from rlfleet.models.policy import score
from rlfleet.wire.health import Liveness, LivenessSettings
from rlfleet.wire.runtime import Context

ALIVE = Gauge("rlfleet_verifier_engine_alive", "1 while the prefill model is alive by /healthz's rule, else 0")
PROBE_SECONDS = Gauge("rlfleet_verifier_engine_probe_seconds", "Latency of the last idle liveness probe (prefill)")


def prefill_liveness(ctx: Context, last_used: Callable[[], tuple | None]) -> Liveness:
    """The liveness of the gate's prefills; `last_used()` is the (model, tokenizer) to probe, None before any.
    Registered on ctx.health, its prober started; call `watch` on every model the gate loads."""

    def probe() -> None:
        held = last_used()
        if held is not None:
            model, tokenizer = held
            with torch.inference_mode():
                score(model, [[0, 1]], 1.0, tokenizer.pad_token_id or 0)

    live = Liveness(LivenessSettings.from_env(), probe, alive=ALIVE, probe_seconds=PROBE_SECONDS)
    ctx.health.register(live.check)
    return live.start(ctx.stop)


def watch(live: Liveness, model) -> None:
    """Count `model`'s prefills as the liveness's work (module docstring)."""

    def started(module, args) -> None:  # None: the forward's inputs are left as they are
        live.begin()

    def finished(module, args, output) -> None:  # None: its output too; called when it raises as well
        live.end()

    body = model.model  # the decoder every prefill runs (rlfleet.models.policy.Prefill)
    body.register_forward_pre_hook(started)
    body.register_forward_hook(finished, always_call=True)
