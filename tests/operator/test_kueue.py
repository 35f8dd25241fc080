"""Kueue's pod groups (rlfleet/operator/kueue.py): a queue-name label on an RLRun reaches the pods of every
workload the operator builds for it, the run's own pods as one group whose size is their count, each pool
and tier as a group of its own; suspending leaves the pod templates as they were (no roll on resume).
The emulator runs no controllers: a pod here is what a ReplicaSet or StatefulSet makes from the template."""

from __future__ import annotations

from rlfleet.operator import kueue
from tests.operator.kubectl import SIGNING_SECRET, create, example, get, patch, redis_db, secret
from tests.operator.test_operator_lifecycle import WORKLOADS
from tests.support import wait_for

RUN_POD_WORKLOADS = WORKLOADS[:3]  # trainer, verifier, origin: the run's own pods (the example has no ingest)


def pod_of(workload: dict) -> dict:
    """The pod metadata a workload's controller gives each pod: its template's labels and annotations."""
    meta = workload["spec"]["template"].get("metadata") or {}
    return {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}


def apply_queued(api, ns: str, url: str, run_queue: str | None, pool_queue: str | None = None) -> None:
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    docs = example(url)
    if run_queue:
        docs[0]["metadata"].setdefault("labels", {})[kueue.QUEUE_LABEL] = run_queue
    if pool_queue:
        [pool] = [d for d in docs if d["kind"] == "InferencePool"]
        pool["metadata"].setdefault("labels", {})[kueue.QUEUE_LABEL] = pool_queue
    for doc in docs:
        create(api, ns, doc)


def group(workload: dict) -> tuple[str | None, str | None, str | None]:
    pod = pod_of(workload)
    labels, annotations = pod["labels"], pod["annotations"]
    return (labels.get(kueue.QUEUE_LABEL), labels.get(kueue.GROUP_LABEL), annotations.get(kueue.GROUP_SIZE_ANNOTATION))


def test_a_queued_run_reaches_its_pods_as_pod_groups(api, redis_url):
    ns, url = "t-kueue", redis_db(redis_url, 7)
    apply_queued(api, ns, url, "team-a", pool_queue="team-a-workers")
    live = {key: wait_for(f"{key}", lambda key=key: get(api, key[0], ns, key[1])) for key in WORKLOADS}
    for kind, name in RUN_POD_WORKLOADS:
        assert group(live[(kind, name)]) == ("team-a", "arithmetic", "3"), (
            f"{kind} {name}: {pod_of(live[(kind, name)])}"
        )
    pool = live[("Deployment", "arithmetic-cpu-rollout")]
    assert group(pool) == ("team-a-workers", "arithmetic-cpu-rollout", "2"), "the pool's own queue, its own group"
    tier = live[("Deployment", "arithmetic-tier0-relay")]
    assert group(tier) == ("team-a", "arithmetic-tier0-relay", "1"), "a tier without a queue takes its run's"
    for kind, name in WORKLOADS:  # only the pods: Kueue's deployment/statefulset integrations must not take these
        assert kueue.QUEUE_LABEL not in (live[(kind, name)]["metadata"].get("labels") or {}), f"{kind} {name}"

    templates = {key: live[key]["spec"]["template"] for key in WORKLOADS}
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
    for kind, name in WORKLOADS:
        suspended = wait_for(f"{name} at 0", lambda kind=kind, name=name: _scaled(api, kind, ns, name, 0))
        assert suspended["spec"]["template"] == templates[(kind, name)], f"suspending changed {name}'s pods"
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": False}})
    resumed = wait_for("trainer back", lambda: _scaled(api, "StatefulSet", ns, "arithmetic-trainer", 1))
    assert group(resumed) == ("team-a", "arithmetic", "3")
    assert resumed["spec"]["template"] == templates[("StatefulSet", "arithmetic-trainer")], "resuming rolled pods"


def test_a_run_without_a_queue_has_no_kueue_keys(api, redis_url):
    ns, url = "t-kueue-none", redis_db(redis_url, 8)
    apply_queued(api, ns, url, None)
    for kind, name in WORKLOADS:
        pod = pod_of(wait_for(f"{name}", lambda kind=kind, name=name: get(api, kind, ns, name)))
        keys = set(pod["labels"]) | set(pod["annotations"])
        assert not {k for k in keys if k.startswith("kueue.x-k8s.io/")}, f"{name}: {pod}"


def _scaled(api, kind, ns, name, replicas):
    obj = get(api, kind, ns, name)
    return obj if obj and obj["spec"]["replicas"] == replicas else None
