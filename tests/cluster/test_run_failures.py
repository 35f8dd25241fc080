"""A run's end in a cluster in a box (issue #28): the chart installed, the operator running as its
Deployment runs it. A run whose image is missing goes Failed, the image named, once its startup deadline
passed; a run that completed stays Complete, with no pod of it recreated, when its Redis restarts
empty (the chart's Redis keeps its data in an emptyDir). Pods as processes only: what is tested is the
operator's reading of pod states, which both runner modes report alike."""

from __future__ import annotations

import time

import pytest

from tests.cluster.inabox import Box, helm
from tests.cluster.scenario import (
    NS,
    Kubectl,
    cluster_secrets,
    complete,
    condition,
    example_docs,
    make_bucket,
    prebuilt_model,
    wait_for,
)

RUN = "arithmetic"
OPERATOR_SA = "system:serviceaccount:rlfleet:rlfleet-operator"
VALUES = {
    "fullnameOverride": "rlfleet",
    "redis": {"enabled": True, "auth": {"existingSecret": "rlfleet-redis"}},
    "operator": {"extraEnv": [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "2"}]},
}
MISSING_IMAGE = "registry.inabox.test/rlfleet:no-such-tag"
RUN_WORKLOADS = (f"{RUN}-trainer", f"{RUN}-verifier", f"{RUN}-origin", f"{RUN}-cpu-rollout", f"{RUN}-tier0-relay")


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box")) as box:
        cluster = box.cluster("a")
        cluster.s3_url = box.s3(cluster)
        make_bucket(box)
        k = Kubectl(cluster)
        cluster.redis_password = cluster_secrets(k, box.root)
        helm.install(cluster, VALUES, release="rlfleet", namespace=NS)
        k.close()
        wait_for(
            "the operator watching RLRuns",
            lambda: [
                c for c in cluster.api.calls_of(OPERATOR_SA) if (c.call.verb, c.call.resource) == ("watch", "rlruns")
            ],
            120,
        )
        yield cluster


@pytest.fixture
def k(a):
    kubectl = Kubectl(a)
    yield kubectl
    kubectl.delete("RLRun", RUN)
    wait_for("the run gone", lambda: kubectl.get("RLRun", RUN) is None, 120)
    kubectl.close()


def run_pods(a) -> list[dict]:
    return [p for p in a.runner.snapshot() if p["owner"][1] in RUN_WORKLOADS and not p["terminating"]]


def test_a_run_whose_image_is_missing_fails_naming_the_image(a, k):
    docs = example_docs(2, a.s3_url, prebuilt_model())
    docs[0]["spec"].update(image=MISSING_IMAGE, startupDeadlineSeconds=20)
    k.apply(docs)
    run = wait_for(
        "Failed", lambda: (r := k.get("RLRun", RUN)) and condition(r, "Failed").get("status") == "True" and r, 120
    )
    failed = condition(run, "Failed")
    assert failed["reason"] == "StartupDeadlineExceeded" and run["status"]["phase"] == "Failed", failed
    assert MISSING_IMAGE in failed["message"] and f"pod {RUN}-trainer-0 container trainer" in failed["message"]
    assert any(reason in failed["message"] for reason in ("ErrImagePull", "ImagePullBackOff")), failed["message"]
    wait_for("its pods stopped", lambda: not run_pods(a), 60)


def test_redis_restarted_empty_after_complete_leaves_the_run_complete(a, k):
    k.apply(example_docs(2, a.s3_url, prebuilt_model()))
    wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=600, every=2)
    wait_for("its pods stopped", lambda: not run_pods(a), 120)
    done = k.get("RLRun", RUN)
    mark = len(a.runner.events)
    [redis_pod] = [p for p in a.runner.snapshot() if p["owner"][1] == "rlfleet-redis" and not p["terminating"]]
    with a.runner._lock:  # `kubectl delete pod`: its Deployment makes a new one, with a new (empty) emptyDir
        a.runner.terminate(a.runner.find(NS, redis_pod["name"]), time.monotonic(), "kubectl delete pod")
    wait_for(
        "a new Redis pod ready",
        lambda: [
            p
            for p in a.runner.snapshot()
            if p["owner"][1] == "rlfleet-redis" and p["ready"] and p["uid"] != redis_pod["uid"]
        ],
        120,
    )
    time.sleep(10)  # several resync intervals (2 s) of the operator reading the empty Redis
    run = k.get("RLRun", RUN)
    assert run["status"]["phase"] == "Succeeded" and condition(run, "Complete")["status"] == "True", run["status"]
    assert run["status"]["step"] == 2 and run["status"]["completionTime"] == done["status"]["completionTime"]
    assert not run_pods(a), "a pod of the finished run was recreated"
    created = [e for e in a.runner.events[mark:] if e["event"] == "created" and e["pod"].startswith(f"{RUN}-")]
    assert not created, created
