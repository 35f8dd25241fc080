"""A run's state from what the operator observes, as a pure function: phase, conditions, whether its
workloads run, when it finished, whether its TTL is up.

    Complete   True once the policy stream reached spec.trainer.steps (reason StepsDone); while Redis
               cannot be read, the last known value holds. Raising trainer.steps makes it False again.
    Failed     True when spec.activeDeadlineSeconds passed (from creation) before completion (reason
               DeadlineExceeded), when a component recorded a fatal config error in the run's Redis (its
               reason, e.g. ModelUnavailable: spec.model.path cannot be fetched; read by progress.py), or the
               spec is invalid (reason InvalidSpec, set by the reconciler).
    Suspended  spec.suspend.
    Ready      True while the run trains: active, not suspended, every trainer pod ready, nothing
               blocking (a Secret the pods need); otherwise False with the reason. A remote run
               (trained in another cluster) is Ready with reason Remote.
    phase      Failed > Succeeded > Suspended > Running (Ready) > Pending.
A run is `active` (its workloads run) unless it is complete or failed; a finished run keeps its objects
until spec.ttlSecondsAfterFinished after status.completionTime, then the operator deletes it.
Every condition carries observedGeneration; lastTransitionTime moves only when its status changes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from rlfleet.config import RLRun
from rlfleet.operator import conditions

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def timestamp(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime(TIME_FORMAT)


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, TIME_FORMAT).replace(tzinfo=datetime.UTC)


@dataclass(frozen=True)
class Observation:
    """What the operator saw of a run this time."""

    now: datetime.datetime
    created: datetime.datetime | None  # metadata.creationTimestamp
    step: int | None  # steps committed (the policy stream); None: Redis not readable now
    trainer_ready: int = 0  # ready trainer pods
    blocked: tuple[str, str] | None = None  # (reason, message): something the pods need is missing
    failure: tuple[str, str] | None = None  # (reason, message): a fatal config error a component recorded in Redis
    status: dict = field(default_factory=dict)  # the status as it is


@dataclass(frozen=True)
class RunState:
    phase: str
    conditions: list[dict]  # every condition, merged over the previous ones
    active: bool  # workloads run (neither complete nor failed)
    finished_at: str | None  # status.completionTime
    expired: bool  # ttlSecondsAfterFinished is up: delete the run


def _previous(status: dict, type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in status.get("conditions") or [])


def run_state(run: RLRun, generation: int | None, seen: Observation) -> RunState:
    spec, now = run.spec, timestamp(seen.now)
    steps = spec.trainer.steps
    complete = seen.step >= steps if seen.step is not None else _previous(seen.status, "Complete")
    deadline = spec.active_deadline_seconds
    late = bool(deadline and seen.created and (seen.now - seen.created).total_seconds() >= deadline)
    # Once Failed, a run stays failed while Redis is unreadable (as Complete holds its last known value).
    fault = seen.failure if not complete else None
    if fault is None and not complete and seen.step is None:
        fault = _previous_failure(seen.status)
    failed = (late or fault is not None) and not complete
    finished_at = seen.status.get("completionTime") if (complete or failed) else None
    if (complete or failed) and not finished_at:
        finished_at = now
    ttl = spec.ttl_seconds_after_finished
    finished = parse_time(finished_at)
    expired = bool(finished and ttl is not None and (seen.now - finished).total_seconds() >= ttl)
    done = f"{seen.step if seen.step is not None else '?'} of {steps} steps committed"

    if spec.remote:
        ready = (True, "Remote", "trained in another cluster: this one hosts its pools and relay tiers")
    elif failed and fault is not None:
        ready = (False, fault[0], f"{fault[1]}; workloads scaled to 0")
    elif failed:
        ready = (False, "DeadlineExceeded", f"not complete {deadline} s after creation; workloads scaled to 0")
    elif complete:
        ready = (False, "Complete", f"{done}; workloads scaled to 0")
    elif spec.suspend:
        ready = (False, "Suspended", "spec.suspend is true: workloads scaled to 0")
    elif seen.blocked:
        ready = (False, *seen.blocked)
    elif seen.trainer_ready >= spec.trainer.replicas:
        ready = (True, "Running", f"{seen.trainer_ready} trainer pods ready; {done}")
    else:
        ready = (False, "Pending", f"{seen.trainer_ready} of {spec.trainer.replicas} trainer pods ready")

    if failed:
        phase = "Failed"
    elif complete:
        phase = "Succeeded"
    elif spec.suspend:
        phase = "Suspended"
    else:
        phase = "Running" if ready[0] else "Pending"
    previous = list(seen.status.get("conditions") or [])

    def cond(type_: str, ok: bool, reason: str, message: str) -> dict:
        return conditions.build_condition(type_, ok, reason, message, generation, now, previous)

    new = [
        cond("Ready", *ready),
        cond("Complete", complete, "StepsDone" if complete else "Training", done),
        cond("Failed", failed, *_failed_reason(failed, fault, deadline)),
        cond(
            "Suspended",
            spec.suspend,
            "Suspended" if spec.suspend else "NotSuspended",
            "spec.suspend is true" if spec.suspend else "",
        ),
    ]
    return RunState(
        phase=phase,
        conditions=conditions.merge_conditions(previous, *new),
        active=not (complete or failed),
        finished_at=finished_at,
        expired=expired,
    )


def _failed_reason(failed: bool, fault: tuple[str, str] | None, deadline: int | None) -> tuple[str, str]:
    if not failed:
        return "NoFailure", ""
    if fault is not None:
        return fault
    return "DeadlineExceeded", f"spec.activeDeadlineSeconds {deadline} passed before completion"


def _previous_failure(status: dict) -> tuple[str, str] | None:
    """The recorded fault of a run already Failed for one (not the deadline, which is recomputed, nor InvalidSpec,
    which the reconciler sets)."""
    for c in status.get("conditions") or []:
        if (
            c.get("type") == "Failed"
            and c.get("status") == "True"
            and c.get("reason") not in ("DeadlineExceeded", "InvalidSpec")
        ):
            return c.get("reason", "Failed"), c.get("message", "")
    return None


def invalid_conditions(status: dict, generation: int | None, now: datetime.datetime, message: str) -> list[dict]:
    """Conditions of a spec the operator cannot reconcile: Ready False and Failed True, reason InvalidSpec."""
    previous, at = list(status.get("conditions") or []), timestamp(now)
    return conditions.merge_conditions(
        previous,
        conditions.build_condition("Ready", False, "InvalidSpec", message, generation, at, previous),
        conditions.build_condition("Failed", True, "InvalidSpec", message, generation, at, previous),
    )


def scalable_conditions(
    status: dict, generation: int | None, now: datetime.datetime, ready: bool, reason: str, message: str
) -> list[dict]:
    """A pool's or a tier's Ready condition (and Failed False: its spec is fine)."""
    previous, at = list(status.get("conditions") or []), timestamp(now)
    return conditions.merge_conditions(
        previous,
        conditions.build_condition("Ready", ready, reason, message, generation, at, previous),
        conditions.build_condition("Failed", False, "NoFailure", "", generation, at, previous),
    )
