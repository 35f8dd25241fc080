"""lifecycle.run_state and health.pod_problems as pure functions: which end states are final, what
reopens a complete run, what a reported failure does, and the pod states each problem reads."""

from __future__ import annotations

import datetime

import yaml

from rlfleet.config import parse_bundle
from rlfleet.operator import health, lifecycle
from tests.operator.kubectl import example

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def run(**spec):
    return parse_bundle(yaml.safe_dump_all(example("redis://r:6379/0", **spec))).run


def state(r, step, status=None, at=60.0, **seen):
    observed = lifecycle.Observation(
        now=T0 + datetime.timedelta(seconds=at), created=T0, step=step, status=status or {}, **seen
    )
    return lifecycle.run_state(r, 1, observed)


def status_of(s: lifecycle.RunState, step: int) -> dict:
    return {"phase": s.phase, "conditions": s.conditions, "step": step, "completionTime": s.finished_at}


def test_complete_is_final_unless_steps_are_raised_over_a_redis_that_still_holds_them():
    done = status_of(state(run(trainer={"steps": 3}), 3), 3)
    assert lifecycle.condition(done, "Complete")["status"] == "True"
    for step in (0, None, 3):  # Redis emptied, unreadable, or as it was
        again = state(run(trainer={"steps": 3}), step, done)
        assert again.phase == "Succeeded" and not again.active and again.finished_at == done["completionTime"]
    reopened = state(run(trainer={"steps": 5}), 3, done)
    assert reopened.active and reopened.phase == "Pending"
    kept = state(run(trainer={"steps": 5}), 0, done)  # steps raised but the state is gone: no silent restart
    assert not kept.active and kept.phase == "Succeeded"


def test_a_reported_failure_is_final_and_an_invalid_spec_is_not():
    r = run()
    failed = state(r, 1, failure=("ModelUnusable", "spec.model.path: no such directory"))
    assert failed.phase == "Failed" and not failed.active
    cond = lifecycle.condition({"conditions": failed.conditions}, "Failed")
    assert (cond["reason"], cond["message"]) == ("ModelUnusable", "spec.model.path: no such directory")
    later = state(r, 1, status_of(failed, 1), trainer_ready=1)
    assert later.phase == "Failed" and not later.active
    invalid = {"conditions": lifecycle.invalid_conditions({}, 1, T0, "spec.x: bad")}
    assert state(r, 0, invalid).active, "a fixed spec clears InvalidSpec"


def test_the_startup_deadline_counts_from_the_last_resume_and_spares_a_started_trainer():
    r = run(startupDeadlineSeconds=30)
    assert state(r, 0, at=29).active and not state(r, 0, at=31).active
    resumed = {"conditions": [{"type": "Suspended", "status": "False", "lastTransitionTime": "2026-01-01T00:00:20Z"}]}
    assert state(r, 0, resumed, at=45).active and not state(r, 0, resumed, at=51).active
    assert state(r, 0, at=31, trainer_ready=1).active
    assert state(run(startupDeadlineSeconds=30, suspend=True), 0, at=100).phase == "Suspended"


def _container(**fields) -> dict:
    return {"name": "trainer", "image": "img:1", "restartCount": 0, "state": {}, "lastState": {}, **fields}


def _pod(*containers, **status) -> dict:
    meta = {"name": "p-0", "labels": {"app.kubernetes.io/component": "trainer"}}
    return {"metadata": meta, "status": {"containerStatuses": list(containers), **status}}


def test_pod_problems_read_each_state():
    waiting = lambda reason, **kw: _container(state={"waiting": {"reason": reason, "message": "m"}}, **kw)  # noqa: E731
    cases = {
        "ImagePullBackOff": _pod(waiting("ImagePullBackOff")),
        "CreateContainerConfigError": _pod(waiting("CreateContainerConfigError")),
        "OOMKilled": _pod(waiting("CrashLoopBackOff", lastState={"terminated": {"reason": "OOMKilled"}})),
        "CrashLoopBackOff": _pod(waiting("CrashLoopBackOff", lastState={"terminated": {"exitCode": 2}})),
        "RestartLimitExceeded": _pod(_container(restartCount=health.RESTART_LIMIT, state={"running": {}})),
    }
    for reason, pod in cases.items():
        [problem] = health.pod_problems([pod])
        assert (problem.reason, problem.pod, problem.container, problem.component) == (
            reason,
            "p-0",
            "trainer",
            "trainer",
        )
    assert "img:1" in health.pod_problems([cases["ImagePullBackOff"]])[0].detail
    healthy = _pod(_container(restartCount=health.RESTART_LIMIT - 1, state={"running": {}}))
    going = {**cases["CrashLoopBackOff"], "metadata": {"name": "p-1", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert health.pod_problems([healthy, going]) == []


def _status(s: lifecycle.RunState) -> dict:
    """The status the reconciler writes back (conditions and suspendedSeconds, in one patch)."""
    return {"phase": s.phase, "conditions": s.conditions, "suspendedSeconds": s.suspended_seconds}


def test_the_deadlines_do_not_count_time_spent_suspended():
    """Bug: spec.activeDeadlineSeconds counted from creation whatever the run spent suspended (a run queued
    suspended for an hour failed the moment it was resumed), and ran out while the run was suspended; the
    first look after a resume started the startup deadline at the suspension's start, so a run suspended
    longer than spec.startupDeadlineSeconds failed with StartupDeadlineExceeded as soon as it resumed."""
    suspended, resumed = dict(activeDeadlineSeconds=3600, suspend=True), dict(activeDeadlineSeconds=3600)
    s = state(run(**suspended), 0, at=10)  # created suspended (as a queue such as Kueue creates it)
    assert s.phase == "Suspended" and s.suspended_seconds == 0
    s = state(run(**suspended), 0, _status(s), at=10_000)  # past both deadlines, still suspended
    assert s.phase == "Suspended" and s.active, "no deadline runs while suspended"
    s = state(run(**resumed), 0, _status(s), at=20_000)  # resumed: the first look since
    assert s.active and s.phase == "Pending", "neither deadline counts the 19990 s suspended"
    assert s.suspended_seconds == 19_990
    s = state(run(**resumed), 0, _status(s), at=20_000 + 1199, trainer_ready=0)
    assert s.active, "the startup deadline (1200 s) counts from the resume"
    s = state(run(**resumed), 0, _status(s), at=20_000 + 1200)
    assert lifecycle.condition({"conditions": s.conditions}, "Failed")["reason"] == "StartupDeadlineExceeded"


def test_the_active_deadline_counts_the_time_unsuspended_across_suspensions():
    spec = dict(activeDeadlineSeconds=3600)
    s = state(run(**spec), 0, at=10, trainer_ready=1)  # training from the start
    s = state(run(**spec, suspend=True), 1, _status(s), at=1000, trainer_ready=1)  # suspended after 1000 s
    s = state(run(**spec, suspend=True), 1, _status(s), at=50_000)
    s = state(run(**spec), 1, _status(s), at=60_000)  # resumed: 59000 s suspended
    assert s.active and s.suspended_seconds == 59_000
    s = state(run(**spec), 1, _status(s), at=60_000 + 2599, trainer_ready=1)  # 3599 s unsuspended
    assert s.active and s.suspended_seconds == 59_000
    s = state(run(**spec), 1, _status(s), at=60_000 + 2600, trainer_ready=1)  # 3600 s unsuspended
    failed = lifecycle.condition({"conditions": s.conditions}, "Failed")
    assert not s.active and failed["reason"] == "DeadlineExceeded"
