"""The operator's Prometheus metrics, served on `rlfleet operator --metrics-port` (/metrics, beside /healthz).

    rlfleet_operator_reconciles_total{kind,result}      one per reconcile of an RLRun, InferencePool or
                                                        RelayTier; result ok (it returned, its status
                                                        written) or error (it raised: kopf, or the run's
                                                        timer, tries again)
    rlfleet_operator_reconcile_errors_total{kind,reason} what went wrong: ApplyFailed (the API refused a
                                                        child; one per refusal, not per back-off wait),
                                                        InvalidSpec (the object's spec is invalid), or the
                                                        class of the exception a reconcile raised
                                                        (Unavailable, Forbidden, Conflict, TimeoutError...)
    rlfleet_operator_reconcile_seconds{kind}            latency of each reconcile (histogram), errors included
    rlfleet_operator_active                             1 while this replica reconciles: always when
                                                        standalone; with --peering, while no live peer has a
                                                        higher priority (kopf's rule, peering.py); 0 on standby
    rlfleet_operator_runs{phase}                        RLRuns by the phase this replica last wrote (a deleted
                                                        run leaves the count)
Every labelled series exists from the start (at 0), so `rate()` and alerts see the first error.
Module-level metrics in the default registry, as every rlfleet service does (the dashboards' tests import
this module to learn what is exported).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram

KINDS = ("RLRun", "InferencePool", "RelayTier")
PHASES = ("Pending", "Running", "Suspended", "Succeeded", "Failed")  # lifecycle.run_state
KNOWN_REASONS = ("ApplyFailed", "InvalidSpec", "Unavailable", "Forbidden", "Conflict", "NotFound", "Invalid")

RECONCILES = Counter("rlfleet_operator_reconciles", "Reconciles by kind and result (ok, error)", ["kind", "result"])
ERRORS = Counter(
    "rlfleet_operator_reconcile_errors",
    "Reconcile errors by kind and reason (ApplyFailed, InvalidSpec, or the exception's class)",
    ["kind", "reason"],
)
LATENCY = Histogram(
    "rlfleet_operator_reconcile_seconds",
    "Time of one reconcile, by kind (API calls, Redis progress read, Events)",
    ["kind"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ACTIVE = Gauge("rlfleet_operator_active", "1 while this replica reconciles (standalone, or the peering leader)")
RUNS = Gauge("rlfleet_operator_runs", "RLRuns by the phase this replica last wrote on them", ["phase"])

for _kind in KINDS:
    for _result in ("ok", "error"):
        RECONCILES.labels(_kind, _result)
    for _reason in KNOWN_REASONS:
        ERRORS.labels(_kind, _reason)
    LATENCY.labels(_kind)
for _phase in PHASES:
    RUNS.labels(_phase)

_run_phases: dict[str, str] = {}  # run uid -> the phase last written on it

Result = TypeVar("Result")


def error(kind: str, reason: str) -> None:
    ERRORS.labels(kind, reason).inc()


def observed(reconcile: Callable[..., Awaitable[Result]]) -> Callable[..., Awaitable[Result]]:
    """Count and time `reconcile(ctx, body, ...)` under the kind of `body`; an InvalidSpec outcome counts
    as an error of that reason, a raised exception as an error of its class (and is re-raised)."""

    @functools.wraps(reconcile)
    async def wrapper(ctx: Any, body: dict, *args: Any, **kwargs: Any) -> Result:
        kind, started = body.get("kind") or "unknown", time.monotonic()
        try:
            outcome = await reconcile(ctx, body, *args, **kwargs)
        except Exception as exc:
            RECONCILES.labels(kind, "error").inc()
            error(kind, type(exc).__name__)
            raise
        finally:
            LATENCY.labels(kind).observe(time.monotonic() - started)
        RECONCILES.labels(kind, "ok").inc()
        status = getattr(outcome, "status", None) or {}
        ready: dict = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        if ready.get("reason") == "InvalidSpec":
            error(kind, "InvalidSpec")
        if kind == "RLRun" and status.get("phase"):
            run_phase(body["metadata"].get("uid", ""), status["phase"])
        return outcome

    return wrapper


def run_phase(uid: str, phase: str | None) -> None:
    """Record the phase written on run `uid` (None: the run is gone) and refresh the runs gauge."""
    if phase is None:
        _run_phases.pop(uid, None)
    else:
        _run_phases[uid] = phase
    counts = dict.fromkeys(PHASES, 0)
    for value in _run_phases.values():
        counts[value] = counts.get(value, 0) + 1
    for name, count in counts.items():
        RUNS.labels(name).set(count)
