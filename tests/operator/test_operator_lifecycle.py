"""A run's life as `kubectl wait` sees it: conditions Ready / Suspended / Complete / Failed with
observedGeneration, workloads released when the run is done, an optional deadline, a TTL after it
finishes, Normal Events for what the operator creates and for phase changes; pools and tiers tied to
their run without a finalizer of their own."""

from __future__ import annotations

import time

import pytest
import requests

from rlfleet.operator import names
from rlfleet.wire.streams import RunKeys, encode_json
from tests.operator.kubectl import (
    apply_example,
    condition,
    events,
    get,
    has_condition,
    patch,
    redis_db,
    unknown_status_fields,
    url_of,
)
from tests.support import redis_from_url, wait_for

WORKLOADS = [
    ("StatefulSet", "arithmetic-trainer"),
    ("Deployment", "arithmetic-verifier"),
    ("Deployment", "arithmetic-origin"),
    ("Deployment", "arithmetic-cpu-rollout"),
    ("Deployment", "arithmetic-tier0-relay"),
]


def publish(url: str, run: str, versions) -> None:
    client = redis_from_url(url)
    for v in versions:
        client.xadd(RunKeys(run).policy, encode_json({"version": v, "time": time.time()}))
    client.close()


def test_a_finished_run_is_complete_and_releases_every_workload(api, redis_url):
    """Bug: nothing stopped when a run finished: the trainer's StatefulSet restarted it (CrashLoopBackOff)
    and `Succeeded` left pools and verifiers holding their GPUs."""
    ns, url = "t-complete", redis_db(redis_url, 4)
    apply_example(api, ns, url, trainer={"steps": 3})
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    wait_for("rollout", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
    publish(url, "arithmetic", [1, 2, 3])
    run = wait_for("Complete", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Complete", "True"))
    assert run["status"]["phase"] == "Succeeded" and run["status"]["step"] == 3
    assert condition(run, "Complete")["observedGeneration"] == run["metadata"]["generation"]
    assert condition(run, "Ready")["status"] == "False" and condition(run, "Ready")["reason"] == "Complete"
    assert run["status"].get("completionTime")
    assert not unknown_status_fields(run), "the API server would prune these"
    for kind, name in WORKLOADS:
        wait_for(f"{kind} {name} released", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)
    trainer = get(api, "StatefulSet", ns, "arithmetic-trainer")
    args = trainer["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--hold-when-done" in args, "the trainer waits to be scaled down instead of exiting into a restart"
    pool = wait_for(
        "pool Complete",
        lambda: (o := get(api, "InferencePool", ns, "arithmetic-cpu"))["status"]["phase"] == "Complete" and o,
    )
    assert not unknown_status_fields(pool)
    assert [e for e in events(api, ns, "PhaseChanged") if "Succeeded" in e["message"]]


def test_ready_and_suspended_conditions_follow_the_spec(api, redis_url):
    ns, url = "t-conditions", redis_db(redis_url, 5)
    apply_example(api, ns, url)
    run = wait_for("Ready", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Suspended", "False"))
    assert condition(run, "Complete")["status"] == "False" and condition(run, "Failed")["status"] == "False"
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
    run = wait_for("Suspended", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Suspended", "True"))
    assert condition(run, "Suspended")["observedGeneration"] == 2 == run["status"]["observedGeneration"]
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": False}})
    wait_for("resumed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Suspended", "False"))
    created = {e["message"] for e in events(api, ns, "Created")}
    assert any("StatefulSet arithmetic-trainer" in m for m in created), created
    assert all(e["type"] == "Normal" for e in events(api, ns, "Created"))


def test_a_run_past_its_deadline_fails_and_releases_its_workloads(api, redis_url):
    ns, url = "t-deadline", redis_db(redis_url, 6)
    apply_example(api, ns, url, activeDeadlineSeconds=1)
    run = wait_for(
        "Failed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Failed", "True", "DeadlineExceeded")
    )
    assert run["status"]["phase"] == "Failed"
    for kind, name in WORKLOADS:
        wait_for(f"{kind} {name} released", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)


@pytest.mark.parametrize("late", [0.0, 3.0], ids=["prompt-api", "late-delete-answer"])
def test_a_finished_run_goes_after_its_ttl_with_its_pools_and_tiers(api, emulator, redis_url, late):
    """With `late`, the API answers the operator's DELETE of the run that long after the deletion's watch
    event (a loaded server): kopf then processes the deletion while the timer that sent the DELETE still
    waits for it (longer than the operator waits for a timer to exit, so its re-check runs too). Bug: kopf
    checked such a timer again only after 60 s, so the run outlived its TTL by a minute; under CI's load
    this test failed that way without any delay."""
    ns, url = f"t-ttl-{int(late * 10)}", redis_db(redis_url, 7)
    emulator.cluster.late[(names.RLRUN.plural, ns, "arithmetic")] = late
    apply_example(api, ns, url, trainer={"steps": 1}, ttlSecondsAfterFinished=1)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    publish(url, "arithmetic", [1])
    wait_for("RLRun deleted after its TTL", lambda: get(api, "RLRun", ns, "arithmetic") is None, timeout=20)
    # pools and tiers carry a (non-controller) owner reference to their run, so they go with it
    wait_for("pool gone", lambda: get(api, "InferencePool", ns, "arithmetic-cpu") is None)
    wait_for("tier gone", lambda: get(api, "RelayTier", ns, "arithmetic-tier0") is None)


def test_pools_and_tiers_hold_no_finalizer(api, redis_url):
    """Bug: kopf timers put a finalizer on every pool and tier (the docs said only RLRun has one), so
    `helm uninstall` of the operator left them stuck on delete."""
    ns, url = "t-finalizers", redis_db(redis_url, 9)
    apply_example(api, ns, url)
    wait_for("pool status", lambda: get(api, "InferencePool", ns, "arithmetic-cpu")["status"]["phase"])
    time.sleep(3)  # a few resync intervals: timers would have added their finalizer by now
    for kind, name in (("InferencePool", "arithmetic-cpu"), ("RelayTier", "arithmetic-tier0")):
        assert not get(api, kind, ns, name)["metadata"].get("finalizers"), f"{kind} {name} holds a finalizer"
    assert requests.delete(url_of(api, "InferencePool", ns, "arithmetic-cpu"), timeout=5).status_code == 200
    wait_for("pool deleted at once", lambda: get(api, "InferencePool", ns, "arithmetic-cpu") is None)


def test_pools_and_tiers_belong_to_their_run(api, redis_url):
    ns, url = "t-owners", redis_db(redis_url, 8)
    apply_example(api, ns, url)
    run = wait_for("run", lambda: get(api, "RLRun", ns, "arithmetic"))
    for kind, name in (("InferencePool", "arithmetic-cpu"), ("RelayTier", "arithmetic-tier0")):
        obj = wait_for(
            f"{kind} tied to its run",
            lambda: (o := get(api, kind, ns, name)) and o["metadata"].get("ownerReferences") and o,
        )
        [ref] = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == run["metadata"]["uid"] and ref["kind"] == "RLRun" and not ref.get("controller")
        assert obj["metadata"]["labels"][f"{names.GROUP}/run"] == "arithmetic"


def test_a_run_whose_model_cannot_be_had_fails_with_the_trainers_reason(api, redis_url):
    """The trainer records a fatal model error in the run's Redis (wire/runtime.py record_failure, what
    `rlfleet trainer` does when spec.model.path cannot be fetched); the operator sets Failed with its reason
    and message and releases the workloads, instead of the run sitting Pending while the trainer restarts."""
    from rlfleet.wire.runtime import record_failure

    ns, url = "t-model-failed", redis_db(redis_url, 13)
    apply_example(api, ns, url)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    message = "spec.model.path: 'hf://acme/nope': no repository acme/nope at http://hub (fix the id)"
    client = redis_from_url(url)
    record_failure(client, RunKeys("arithmetic"), "ModelUnavailable", message)
    client.close()
    run = wait_for(
        "Failed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Failed", "True", "ModelUnavailable")
    )
    assert run["status"]["phase"] == "Failed"
    assert condition(run, "Failed")["message"] == message
    assert condition(run, "Ready")["reason"] == "ModelUnavailable" and message in condition(run, "Ready")["message"]
    assert run["status"].get("completionTime") and not unknown_status_fields(run)
    for kind, name in WORKLOADS:
        wait_for(f"{kind} {name} released", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)
    warnings = events(api, ns, "ModelUnavailable")
    assert [e["type"] for e in warnings] == ["Warning"] and warnings[0]["message"].startswith(message)
