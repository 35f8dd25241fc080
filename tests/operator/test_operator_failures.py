"""A run's failures as `kubectl get`, `kubectl describe` and `kubectl wait` see them: final states that
stay final when Redis comes back empty, a Redis that lost an active run's state said so, pod problems
named (pod, container, image, the scheduler's message) in conditions and Events, a trainer that cannot
start failing by its startup deadline, and a child the API refuses named in status without blocking
its siblings. The pods here are what a kubelet and a scheduler would report, written to the emulator."""

from __future__ import annotations

import time

from rlfleet.operator import names
from tests.operator.kubectl import apply_example, condition, create, events, get, has_condition, patch, redis_db
from tests.operator.test_operator_lifecycle import WORKLOADS, publish
from tests.support import redis_from_url, wait_for

MISSING_IMAGE = "registry.test/rlfleet:does-not-exist"


OWNERS = {  # component -> the workload whose pods it runs (the emulator has no controllers to make them)
    "trainer": ("StatefulSet", "arithmetic-trainer"),
    "rollout": ("Deployment", "arithmetic-cpu-rollout"),
    "verifier": ("Deployment", "arithmetic-verifier"),
    "origin": ("Deployment", "arithmetic-origin"),
}


def add_pod(api, ns: str, name: str, component: str, status: dict) -> None:
    """A pod of run `arithmetic` as its workload would make it (owned by it, so it goes with it), then its
    status as the kubelet reports it."""
    kind, owner = OWNERS[component]
    workload = wait_for(f"{kind} {owner}", lambda: get(api, kind, ns, owner))
    reference = {"apiVersion": "apps/v1", "kind": kind, "name": owner, "uid": workload["metadata"]["uid"]}
    labels = {
        names.RUN_LABEL: "arithmetic",
        "app.kubernetes.io/managed-by": names.FIELD_MANAGER,
        "app.kubernetes.io/component": component,
    }
    create(
        api,
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "ownerReferences": [{**reference, "controller": True}]},
            "spec": {"containers": [{"name": component, "image": MISSING_IMAGE}]},
        },
    )
    patch(api, "Pod", ns, name, {"status": status}, sub="status")


def waiting(container: str, reason: str, message: str = "", restarts: int = 0, last: dict | None = None) -> dict:
    return {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": container,
                "image": MISSING_IMAGE,
                "ready": False,
                "restartCount": restarts,
                "state": {"waiting": {"reason": reason, "message": message}},
                "lastState": {"terminated": last} if last else {},
            }
        ],
    }


def test_a_complete_run_stays_complete_when_redis_comes_back_empty(api, redis_url):
    """Bug: with Redis restarted empty (the chart's emptyDir Redis), the operator read step 0 and took the
    finished run back to Pending: every workload scaled up again and its TTL never fired."""
    ns, url = "t-final", redis_db(redis_url, 10)
    apply_example(api, ns, url, trainer={"steps": 2})
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    publish(url, "arithmetic", [1, 2])
    done = wait_for("Complete", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Complete", "True"))
    for kind, name in WORKLOADS:
        wait_for(f"{kind} {name} released", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)
    client = redis_from_url(url)
    client.flushdb()  # Redis restarted without persistence
    client.close()
    time.sleep(4)  # several resync intervals of the operator reading the empty Redis
    run = get(api, "RLRun", ns, "arithmetic")
    assert run["status"]["phase"] == "Succeeded", run["status"]
    assert condition(run, "Complete")["status"] == "True"
    assert run["status"]["step"] == 2 and run["status"]["completionTime"] == done["status"]["completionTime"]
    for kind, name in WORKLOADS:
        assert get(api, kind, ns, name)["spec"]["replicas"] == 0, f"{kind} {name} scaled up again"


def test_an_active_run_whose_redis_lost_its_state_says_so(api, redis_url):
    ns, url = "t-lost", redis_db(redis_url, 11)
    apply_example(api, ns, url, trainer={"steps": 10})
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    publish(url, "arithmetic", [1, 2, 3])
    wait_for("step 3", lambda: (get(api, "RLRun", ns, "arithmetic").get("status") or {}).get("step") == 3)
    client = redis_from_url(url)
    client.flushdb()
    client.close()
    run = wait_for(
        "StateLost", lambda: has_condition(api, "RLRun", ns, "arithmetic", "StateLost", "True", "RedisStateLost")
    )
    assert "step 3" in condition(run, "StateLost")["message"]
    assert condition(run, "Complete")["status"] == "False" and condition(run, "Failed")["status"] == "False"
    [event] = events(api, ns, "RedisStateLost")
    assert event["type"] == "Warning" and "step 3" in event["message"]
    time.sleep(2)
    assert len(events(api, ns, "RedisStateLost")) == 1, "said once, not on every resync"


def test_pod_problems_are_named_in_conditions_and_events(api, redis_url):
    ns, url = "t-pods", redis_db(redis_url, 12)
    apply_example(api, ns, url)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    add_pod(api, ns, "arithmetic-trainer-0", "trainer", waiting("trainer", "ImagePullBackOff", "Back-off pulling"))
    oom = {"exitCode": 137, "reason": "OOMKilled"}
    add_pod(api, ns, "arithmetic-cpu-rollout-0", "rollout", waiting("rollout", "CrashLoopBackOff", "", 3, oom))
    crash = {"exitCode": 1, "reason": "Error"}
    add_pod(api, ns, "arithmetic-verifier-0", "verifier", waiting("verifier", "CrashLoopBackOff", "back-off", 2, crash))
    scheduler = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    unschedulable = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduler}],
    }
    add_pod(api, ns, "arithmetic-origin-0", "origin", unschedulable)
    run = wait_for(
        "Ready names the trainer's problem",
        lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "ImagePullBackOff"),
    )
    ready = condition(run, "Ready")["message"]
    assert "pod arithmetic-trainer-0 container trainer" in ready and MISSING_IMAGE in ready, ready
    run = wait_for(
        "PodsHealthy names every pod",
        lambda: (
            (r := has_condition(api, "RLRun", ns, "arithmetic", "PodsHealthy", "False", "ImagePullBackOff"))
            and "arithmetic-origin-0" in condition(r, "PodsHealthy")["message"]
            and r
        ),
    )
    healthy = condition(run, "PodsHealthy")["message"]
    assert "pod arithmetic-cpu-rollout-0 container rollout: OOMKilled" in healthy, healthy
    assert "pod arithmetic-verifier-0 container verifier: CrashLoopBackOff: exited with code 1" in healthy
    assert f"pod arithmetic-origin-0: Unschedulable: {scheduler}" in healthy
    for reason, pod in (
        ("ImagePullBackOff", "arithmetic-trainer-0"),
        ("OOMKilled", "arithmetic-cpu-rollout-0"),
        ("CrashLoopBackOff", "arithmetic-verifier-0"),
        ("Unschedulable", "arithmetic-origin-0"),
    ):
        found = wait_for(f"{reason} Event", lambda: events(api, ns, reason))
        assert found[0]["type"] == "Warning" and pod in found[0]["message"]
    time.sleep(2)
    assert len(events(api, ns, "OOMKilled")) == 1, "an Event when a problem appears, not on every resync"
    assert condition(get(api, "RLRun", ns, "arithmetic"), "Failed")["status"] == "False"


def test_a_trainer_that_cannot_start_fails_by_its_startup_deadline(api, redis_url):
    """`kubectl wait --for=condition=Failed` ends: Failed was only ever set by activeDeadlineSeconds or an
    invalid spec, so a run whose image is missing stayed Pending forever."""
    ns, url = "t-startup", redis_db(redis_url, 13)
    apply_example(api, ns, url, startupDeadlineSeconds=3)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    message = f'Failed to pull image "{MISSING_IMAGE}": not found'
    add_pod(api, ns, "arithmetic-trainer-0", "trainer", waiting("trainer", "ErrImagePull", message))
    run = wait_for(
        "Failed",
        lambda: has_condition(api, "RLRun", ns, "arithmetic", "Failed", "True", "StartupDeadlineExceeded"),
        timeout=20,
    )
    failed = condition(run, "Failed")["message"]
    assert "spec.startupDeadlineSeconds (3 s)" in failed and MISSING_IMAGE in failed and "ErrImagePull" in failed
    assert run["status"]["phase"] == "Failed" and run["status"].get("completionTime")
    for kind, name in WORKLOADS:
        wait_for(f"{kind} {name} released", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)
    [event] = wait_for("Event", lambda: events(api, ns, "StartupDeadlineExceeded"))
    assert event["type"] == "Warning" and MISSING_IMAGE in event["message"]
    patch(api, "Pod", ns, "arithmetic-trainer-0", {"status": {"phase": "Running", "containerStatuses": []}}, "status")
    time.sleep(2)
    assert condition(get(api, "RLRun", ns, "arithmetic"), "Failed")["status"] == "True", "Failed is final"


def test_a_started_trainer_is_never_failed_by_the_startup_deadline(api, redis_url):
    ns, url = "t-started", redis_db(redis_url, 14)
    apply_example(api, ns, url, startupDeadlineSeconds=2, trainer={"steps": 10})
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    publish(url, "arithmetic", [1])
    wait_for("TrainerStarted", lambda: has_condition(api, "RLRun", ns, "arithmetic", "TrainerStarted", "True"))
    time.sleep(3)
    run = get(api, "RLRun", ns, "arithmetic")
    assert condition(run, "Failed")["status"] == "False", condition(run, "Failed")


def test_a_refused_child_is_named_in_status_and_its_siblings_still_apply(api, emulator, redis_url):
    """Bug: the API's 422 escaped apply_children: no status was written, kopf retried forever, and the
    children after the refused one were never applied."""
    ns, url = "t-refused", redis_db(redis_url, 15)
    denial = 'admission webhook "quota.example" denied the request: cpu request over the namespace quota'
    emulator.cluster.refused[("statefulsets", ns, "arithmetic-trainer")] = denial
    apply_example(api, ns, url)
    run = wait_for(
        "ApplyFailed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "ApplyFailed")
    )
    message = condition(run, "Ready")["message"]
    assert "StatefulSet arithmetic-trainer" in message and denial in message and "HTTP 422" in message, message
    for kind, name in WORKLOADS[1:]:  # everything after the trainer still applied
        wait_for(f"{kind} {name}", lambda: get(api, kind, ns, name))
    event = wait_for("Warning", lambda: events(api, ns, "ApplyFailed"))[0]
    assert event["type"] == "Warning" and denial in event["message"]
    time.sleep(3)  # retries with back-off meanwhile
    assert len(events(api, ns, "ApplyFailed")) == 1, "one Event per refusal, not one per retry"
    del emulator.cluster.refused[("statefulsets", ns, "arithmetic-trainer")]
    wait_for("retried after back-off", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"), timeout=30)
    wait_for(
        "Ready no longer ApplyFailed",
        lambda: condition(get(api, "RLRun", ns, "arithmetic"), "Ready")["reason"] != "ApplyFailed",
    )


def test_one_refused_member_leaves_the_others_current(api, emulator, redis_url):
    """Bug: in the run's timer, one tier whose child the API refused stopped every pool after it, so a
    suspended run's pools never showed it."""
    ns, url = "t-members", redis_db(redis_url, 1)
    denial = 'admission webhook "policy.example" denied the request: no relays in this namespace'
    emulator.cluster.refused[("deployments", ns, "arithmetic-tier0-relay")] = denial
    apply_example(api, ns, url)
    wait_for("pool", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
    wait_for(
        "pool Suspended",
        lambda: (get(api, "InferencePool", ns, "arithmetic-cpu").get("status") or {}).get("phase") == "Suspended",
    )
    tier = wait_for(
        "tier ApplyFailed",
        lambda: has_condition(api, "RelayTier", ns, "arithmetic-tier0", "Ready", "False", "ApplyFailed"),
    )
    assert (
        denial in condition(tier, "Ready")["message"]
        and "Deployment arithmetic-tier0-relay" in condition(tier)["message"]
    )
    del emulator.cluster.refused[("deployments", ns, "arithmetic-tier0-relay")]


def test_a_run_the_api_fails_for_still_keeps_its_members_current(api, emulator, redis_url):
    """A 403 on the run's own child (RBAC, not the child: kopf retries the run) must not keep the run's
    timer from its pools and tiers."""
    ns, url = "t-run-error", redis_db(redis_url, 2)
    emulator.cluster.forbidden.add(("statefulsets", ns, "arithmetic-trainer"))
    try:
        apply_example(api, ns, url)
        wait_for("pool", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
        patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
        wait_for(
            "pool Suspended",
            lambda: (get(api, "InferencePool", ns, "arithmetic-cpu").get("status") or {}).get("phase") == "Suspended",
        )
    finally:
        emulator.cluster.forbidden.discard(("statefulsets", ns, "arithmetic-trainer"))
