"""Two operator replicas in a cluster in a box (issue #28): the chart installed with operator.replicas: 2 runs
them with kopf peering; the leader's container is killed (SIGKILL, as the OOM killer does) while a run is
in progress (held there: its pool has no workers yet), the standby takes over, scales the pool when told to,
and the run completes. Pods as processes only: what is tested
is the operators' peering through the API server, which both runner modes serve alike."""

from __future__ import annotations

import signal
import time

import kubernetes
import pytest

from rlfleet.operator import peering
from tests.cluster.inabox import Box, helm, kubelet
from tests.cluster.scenario import (
    NS,
    Kubectl,
    cluster_secrets,
    complete,
    example_docs,
    make_bucket,
    prebuilt_model,
    wait_for,
)

RUN, STEPS = "arithmetic", 3
PEERING = "rlfleet-operator"  # the chart names the peering after the operator's Deployment
LIFETIME_S = 6
VALUES = {
    "fullnameOverride": "rlfleet",
    "redis": {"enabled": True, "auth": {"existingSecret": "rlfleet-redis"}},
    "operator": {
        "replicas": 2,
        "peering": {"lifetime": LIFETIME_S},
        "extraEnv": [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "2"}],
    },
}


def peers(k: Kubectl) -> dict:
    """The peering object's entries: pod name (kopf's id, POD_ID) -> priority, lifetime, last keep-alive."""
    try:
        obj = k.custom.get_cluster_custom_object(peering.GROUP, peering.VERSION, peering.PLURAL, PEERING)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:  # not made yet
            return {}
        raise
    return obj.get("status") or {}


def leader_of(entries: dict) -> str:
    return max(entries, key=lambda pod: entries[pod]["priority"])


@pytest.fixture(scope="module")
def a(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box")) as box:
        cluster = box.cluster("a")
        cluster.s3_url = box.s3(cluster)
        make_bucket(box)
        k = Kubectl(cluster)
        cluster.redis_password = cluster_secrets(k, box.root)
        helm.install(cluster, VALUES, release="rlfleet", namespace=NS)
        wait_for("both operators in the peering object", lambda: len(peers(k)) == 2, 180)
        k.close()
        yield cluster


def test_two_operators_the_leader_killed_the_run_still_completes(a):
    k = Kubectl(a)
    try:
        before = peers(k)
        leader = leader_of(before)
        [standby] = [pod for pod in before if pod != leader]
        # The pool starts with no workers, so the run is held in progress (its trainer ready, waiting for groups)
        # until the kill: the 3 steps took 6 s once the workers ran, less than the test's 1 s poll of the phase
        # sometimes took to see "Running", and the test then waited for a phase that had come and gone.
        docs = example_docs(STEPS, a.s3_url, prebuilt_model())
        [pool] = [d for d in docs if d["kind"] == "InferencePool"]
        workers, pool["spec"]["replicas"] = pool["spec"]["replicas"], 0
        k.apply(docs)
        wait_for(
            "the run in progress", lambda: (k.get("RLRun", RUN) or {}).get("status", {}).get("phase") == "Running", 300
        )
        pod = a.runner.find(NS, leader)
        assert pod is not None, f"no operator pod {leader}: {[p['name'] for p in a.runner.snapshot()]}"
        with a.runner._lock:  # the container dies without a word; its kubelet restarts it later
            kubelet.signal_group(pod, signal.SIGKILL)
        killed = time.monotonic()
        at_kill = k.get("RLRun", RUN)["status"]
        assert not complete(k, RUN) and at_kill.get("step", 0) < STEPS, f"the run ended before the kill: {at_kill}"
        wait_for(
            "the standby leading", lambda: (now := peers(k)) and leader_of(now) == standby and now, LIFETIME_S + 60
        )
        print(f"the standby leads {time.monotonic() - killed:.1f}s after the leader's SIGKILL (lifetime {LIFETIME_S}s)")
        k.scale("InferencePool", pool["metadata"]["name"], workers)  # a change only the new leader can act on
        run = wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=900)
        assert run["status"]["phase"] == "Succeeded" and run["status"]["step"] == STEPS, run["status"]
        exits = [e for e in a.runner.events if e["pod"] == leader and e["event"] == "exited"]
        assert exits, "the leader was never killed"
    finally:
        k.close()
