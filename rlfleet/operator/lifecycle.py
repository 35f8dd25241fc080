"""A run's state from what the operator observes, as a pure function: phase, conditions, whether its
workloads run, when it finished, whether its TTL is up.

    Complete   True once the policy stream reached spec.trainer.steps (reason StepsDone). Final: read from
               the status, never recomputed from Redis (a Redis that came back empty leaves it Complete);
               only raising trainer.steps while Redis still holds the completed step makes it False again.
    Failed     True when spec.activeDeadlineSeconds passed before completion, counted from creation less the
               time spent suspended (status.suspendedSeconds; reason DeadlineExceeded); when the trainer did
               not start within spec.startupDeadlineSeconds (default DEFAULT_STARTUP_DEADLINE_S, from creation
               or the last resume; reason
               StartupDeadlineExceeded, the message naming what kept its pods from starting); when a
               component reported a failure (Observation.failure, its own reason, e.g. ModelUnavailable: the
               trainer recorded in the run's Redis that spec.model.path cannot be fetched; progress.py reads
               it); or the spec is invalid (reason InvalidSpec, set by the reconciler; the only one that a
               fixed spec clears). Final.
    Suspended  spec.suspend.
    Ready      True while the run trains: active, not suspended, every trainer pod ready, nothing
               blocking (a Secret the pods need, a child the API refused); otherwise False with the reason,
               a trainer pod's problem (health.py) when it has one. A remote run (trained in another
               cluster) is Ready with reason Remote.
    TrainerStarted  True once every trainer pod was ready (or a step was committed); stays True.
    PodsHealthy     False while any pod of the run has a problem (health.py): reason the first one's,
               message every one, each naming the pod and the container.
    StateLost  True once Redis held fewer steps than the status recorded while the run was active: Redis
               lost the run's state (an emptyDir Redis restarted) and the trainer starts over from
               what is left. Stays True.
    phase      Failed > Succeeded > Suspended > Running (Ready) > Pending.
No deadline runs while the run is suspended, and neither counts time it spent suspended.
A run is `active` (its workloads run) unless it is complete or failed; a finished run keeps its objects
until spec.ttlSecondsAfterFinished after status.completionTime, then the operator deletes it.
Every condition carries observedGeneration; lastTransitionTime moves only when its status changes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from rlfleet.config import RLRun
from rlfleet.operator import conditions
from rlfleet.operator.health import PodProblem, summary
from rlfleet.wire.components import TRAINER

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
DEFAULT_STARTUP_DEADLINE_S = 1200  # image pulls of the GPU image and model downloads fit; a stuck pod does not


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
    status: dict = field(default_factory=dict)  # the status as it is
    problems: tuple[PodProblem, ...] = ()  # what is wrong with the run's pods (health.pod_problems)
    failure: tuple[str, str] | None = None  # (reason, message): a component reported the run cannot go on


@dataclass(frozen=True)
class RunState:
    phase: str
    conditions: list[dict]  # every condition, merged over the previous ones
    active: bool  # workloads run (neither complete nor failed)
    finished_at: str | None  # status.completionTime
    expired: bool  # ttlSecondsAfterFinished is up: delete the run
    suspended_seconds: int = 0  # status.suspendedSeconds: time spent in the suspensions that ended


def condition(status: dict, type_: str) -> dict:
    """The status's condition of this type ({} when it has none)."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _previous(status: dict, type_: str) -> bool:
    return condition(status, type_).get("status") == "True"


def _final_failure(seen: Observation, run: RLRun, complete: bool) -> tuple[str, str] | None:
    """(reason, message) of the run's failure, or None: a recorded one holds (InvalidSpec aside, which the
    reconciler clears when the spec is fixed); else a reported failure, a passed deadline, a trainer that
    did not start in time."""
    old = condition(seen.status, "Failed")
    if old.get("status") == "True" and old.get("reason") != "InvalidSpec":
        return old.get("reason") or "Failed", old.get("message") or ""
    if complete:
        return None
    if seen.failure:
        return seen.failure
    spec = run.spec
    if spec.suspend:  # no deadline runs while the run is suspended
        return None
    deadline = spec.active_deadline_seconds
    if deadline and seen.created:
        unsuspended = (seen.now - seen.created).total_seconds() - suspended_seconds(run, seen)
        if unsuspended >= deadline:
            return "DeadlineExceeded", f"spec.activeDeadlineSeconds {deadline} passed before completion"
    if spec.remote or _started(run, seen):
        return None
    limit = spec.startup_deadline_seconds or DEFAULT_STARTUP_DEADLINE_S
    since = max((t for t in (seen.created, _last_resume(seen)) if t), default=None)
    if since and (seen.now - since).total_seconds() >= limit:
        why = summary([p for p in seen.problems if p.component == TRAINER] or list(seen.problems))
        return "StartupDeadlineExceeded", (
            f"the trainer did not start within spec.startupDeadlineSeconds ({limit} s): "
            f"{why or f'{seen.trainer_ready} of {spec.trainer.replicas} trainer pods ready'}"
        )
    return None


def _last_resume(seen: Observation) -> datetime.datetime | None:
    """When the run was last resumed: now when the status still says Suspended (this look is the first since
    spec.suspend went false), else when the Suspended condition last went False (about the creation for a
    run never suspended)."""
    old = condition(seen.status, "Suspended")
    if old.get("status") == "True":
        return seen.now
    return parse_time(old.get("lastTransitionTime"))


def suspended_seconds(run: RLRun, seen: Observation) -> int:
    """Seconds the run spent suspended in the suspensions that ended: status.suspendedSeconds, plus the
    suspension that ends at this look (the status still says Suspended, since its lastTransitionTime, and
    spec.suspend is false now). Written back to the status with the Suspended condition, in one patch, so each
    suspension is counted once. A suspension and resume between two looks (one resync interval) is missed."""
    total = int(seen.status.get("suspendedSeconds") or 0)
    old = condition(seen.status, "Suspended")
    since = parse_time(old.get("lastTransitionTime"))
    if old.get("status") == "True" and not run.spec.suspend and since:
        total += max(0, int((seen.now - since).total_seconds()))
    return total


def _started(run: RLRun, seen: Observation) -> bool:
    return (
        _previous(seen.status, "TrainerStarted")
        or seen.trainer_ready >= run.spec.trainer.replicas
        or (seen.step or 0) > 0
        or int(seen.status.get("step") or 0) > 0
    )


def _complete(run: RLRun, seen: Observation) -> bool:
    """Complete is final; raising trainer.steps reopens it only while Redis still holds the completed step
    (an emptied Redis must not restart a finished run)."""
    steps, recorded = run.spec.trainer.steps, int(seen.status.get("step") or 0)
    if _previous(seen.status, "Complete"):
        return not (seen.step is not None and recorded <= seen.step < steps)
    return seen.step is not None and seen.step >= steps


def _state_lost(seen: Observation, finished: bool) -> tuple[bool, str]:
    old = condition(seen.status, "StateLost")
    if old.get("status") == "True":
        return True, old.get("message") or ""
    recorded = int(seen.status.get("step") or 0)
    if not finished and seen.step is not None and seen.step < recorded:
        return True, (
            f"Redis holds step {seen.step} of this run where its status recorded step {recorded}: Redis lost the "
            "run's state while it was active (a Redis without persistence restarted?); training goes on from what "
            "Redis and the store still hold"
        )
    return False, ""


def run_state(run: RLRun, generation: int | None, seen: Observation) -> RunState:
    spec, now = run.spec, timestamp(seen.now)
    steps = spec.trainer.steps
    complete = _complete(run, seen)
    failure = _final_failure(seen, run, complete)
    failed = failure is not None
    complete = complete and not failed  # a failure recorded before completion stays the outcome
    finished_at = seen.status.get("completionTime") if (complete or failed) else None
    if (complete or failed) and not finished_at:
        finished_at = now
    ttl = spec.ttl_seconds_after_finished
    finished = parse_time(finished_at)
    expired = bool(finished and ttl is not None and (seen.now - finished).total_seconds() >= ttl)
    step = seen.step if seen.step is not None and not (complete or failed) else seen.status.get("step", seen.step)
    done = f"{step if step is not None else '?'} of {steps} steps committed"
    trainer_problems = [p for p in seen.problems if p.component == TRAINER]
    started = spec.remote or _started(run, seen)
    lost, lost_message = _state_lost(seen, complete or failed)

    if spec.remote:
        ready = (True, "Remote", "trained in another cluster: this one hosts its pools and relay tiers")
    elif failure:
        ready = (False, failure[0], f"{failure[1]}; workloads scaled to 0")
    elif complete:
        ready = (False, "Complete", f"{done}; workloads scaled to 0")
    elif spec.suspend:
        ready = (False, "Suspended", "spec.suspend is true: workloads scaled to 0")
    elif seen.blocked:
        ready = (False, *seen.blocked)
    elif seen.trainer_ready >= spec.trainer.replicas:
        ready = (True, "Running", f"{seen.trainer_ready} trainer pods ready; {done}")
    elif trainer_problems:
        ready = (False, trainer_problems[0].reason, summary(trainer_problems))
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

    problems = list(seen.problems)
    new = [
        cond("Ready", *ready),
        cond("Complete", complete, "StepsDone" if complete else "Training", done),
        cond("Failed", failed, *(failure or ("NoFailure", ""))),
        cond(
            "Suspended",
            spec.suspend,
            "Suspended" if spec.suspend else "NotSuspended",
            "spec.suspend is true" if spec.suspend else "",
        ),
        cond(
            "TrainerStarted",
            started,
            ("Remote" if spec.remote else "TrainerReady") if started else "NotStarted",
            "" if started else f"{seen.trainer_ready} of {spec.trainer.replicas} trainer pods ready so far",
        ),
        cond("PodsHealthy", not problems, problems[0].reason if problems else "Healthy", summary(problems)),
        cond("StateLost", lost, "RedisStateLost" if lost else "StateKept", lost_message),
    ]
    return RunState(
        phase=phase,
        conditions=conditions.merge_conditions(previous, *new),
        active=not (complete or failed),
        finished_at=finished_at,
        expired=expired,
        suspended_seconds=suspended_seconds(run, seen),
    )


def failed_conditions(
    status: dict, generation: int | None, now: datetime.datetime, reason: str, message: str
) -> list[dict]:
    """Conditions of a failed object: Ready False and Failed True with `reason` and `message`, the others kept."""
    previous, at = list(status.get("conditions") or []), timestamp(now)
    return conditions.merge_conditions(
        previous,
        conditions.build_condition("Ready", False, reason, message, generation, at, previous),
        conditions.build_condition("Failed", True, reason, message, generation, at, previous),
    )


def invalid_conditions(status: dict, generation: int | None, now: datetime.datetime, message: str) -> list[dict]:
    """Conditions of a spec the operator cannot reconcile: Ready False and Failed True, reason InvalidSpec."""
    return failed_conditions(status, generation, now, "InvalidSpec", message)


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
