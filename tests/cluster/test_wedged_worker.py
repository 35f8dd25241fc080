"""A wedged engine is restarted by its liveness probe (issue #26), in one cluster in a box: the chart and the
operator as test_one_cluster.py installs them, the arithmetic example with one worker whose torch engine
blocks forever after a few generations (tests/cluster/wedge/sitecustomize.py, on the pod's PYTHONPATH through
the pool's podTemplate; nothing in rlfleet knows of it). The worker's process stays alive and keeps serving
/metrics; its /healthz (rlfleet/wire/health.py) turns 503 once no forward step completed within the deadline,
the kubelet's liveness probe fails, the container is restarted (restartCount 1), and the restarted worker
passes its startup probe and produces accepted groups again.

The podTemplate keeps the test short: a 10 s deadline (RLFLEET_HEALTH_DEADLINE_S), a startup probe every 2 s,
a liveness probe every 5 s, and a 5 s termination grace (a wedged engine ignores SIGTERM: it is killed)."""

from __future__ import annotations

import pytest

from rlfleet.operator import names
from tests.cluster.inabox import Box, helm
from tests.cluster.inabox.images import REPO
from tests.cluster.scenario import (
    NS,
    Auditor,
    Kubectl,
    cluster_secrets,
    example_docs,
    make_bucket,
    prebuilt_model,
    run_redis,
    wait_for,
)
from tests.cluster.test_one_cluster import OPERATOR_SA, VALUES

RUN, POOL = "arithmetic", "arithmetic-cpu"
WEDGE = REPO / "tests" / "cluster" / "wedge"
WEDGE_AFTER = 10  # generations (groups and idle probes) before the engine blocks
MARKER = f"{names.CACHE_DIR}/wedged-once"  # on the pod's emptyDir: the restarted container does not wedge


def wedging_pool_template() -> dict:
    env = [
        {"name": "PYTHONPATH", "value": f"{WEDGE}:{REPO}"},  # the image's PYTHONPATH is the checkout
        {"name": "RLFLEET_TEST_WEDGE_AFTER", "value": str(WEDGE_AFTER)},
        {"name": "RLFLEET_TEST_WEDGE_MARKER", "value": MARKER},
        {"name": "RLFLEET_HEALTH_DEADLINE_S", "value": "10"},
        {"name": "RLFLEET_HEALTH_PROBE_INTERVAL_S", "value": "3"},
    ]
    # The startup probe every 2 s: it must pass in the seconds between the engine's first version and the wedge
    # (an engine that wedges before its startup probe passes is restarted when the startup budget runs out).
    probes = {"startupProbe": {"periodSeconds": 2}, "livenessProbe": {"periodSeconds": 5, "failureThreshold": 2}}
    container = {"name": names.ROLLOUT, "env": env, **probes}
    return {"spec": {"terminationGracePeriodSeconds": 5, "containers": [container]}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box")) as box:
        a = box.cluster("a")
        a.s3_url = box.s3(a)
        make_bucket(box)
        k = Kubectl(a)
        a.redis_password = cluster_secrets(k, box.root)
        helm.install(a, VALUES, release="rlfleet", namespace=NS)
        wait_for(
            "the operator watching RLRuns",
            lambda: [c for c in a.api.calls_of(OPERATOR_SA) if (c.call.verb, c.call.resource) == ("watch", "rlruns")],
            120,
        )
        yield a, k
        k.close()


def test_a_wedged_engine_fails_its_liveness_probe_and_is_restarted(cluster):
    a, k = cluster
    docs = example_docs(1000, a.s3_url, prebuilt_model())
    [pool] = [d for d in docs if d["kind"] == "InferencePool"]
    pool["spec"].update(replicas=1, podTemplate=wedging_pool_template())
    k.apply(docs)
    workload = ("Deployment", f"{POOL}-rollout")
    [pod] = wait_for("the worker's pod", lambda: [p for p in a.runner.all_pods() if p.owner[:2] == workload], 120)
    auditor = Auditor(run_redis(a, a.redis_password), RUN)
    auditor.start()
    try:
        wait_for("the worker wedged", lambda: "blocks forever" in pod.log.read_text(), 600, every=2)
        failed = wait_for(
            "its liveness probe failing",
            lambda: [e for e in a.runner.events if e["pod"] == pod.name and e["event"] == "livenessProbe failed"],
            120,
        )
        ran = [e for e in a.runner.events if e["pod"] == pod.name and e["t"] < failed[0]["t"]]
        assert not [e for e in ran if e["event"] == "exited"], "the process was alive: only liveness could tell"
        restarted = wait_for(
            "the container restarted",
            lambda: [
                e
                for e in a.runner.events
                if e["pod"] == pod.name
                and e["event"] == "started"
                and e.get("restarts") == 1
                and e["t"] > failed[0]["t"]
            ],
            120,
        )
        assert restarted
        status = wait_for(  # what the API server says (the kubelet writes it)
            "restartCount 1 in the pod's status",
            lambda: (
                (s := a.runner.api.get("Pod", NS, pod.name)["status"])["containerStatuses"][0]["restartCount"] >= 1
                and s
            ),
            30,
        )
        assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] != 0  # killed, not finished
        log = pod.log.read_text()
        assert "engine liveness: wedged: " in log, log[-3000:]
        wait_for("the restarted worker's startup probe", lambda: pod.ready and pod.restarts == 1, 300, every=2)
        # The first container made at most WEDGE_AFTER groups (its idle probes count as generations too).
        wait_for(
            "groups from the restarted worker",
            lambda: sum(1 for w in auditor.accepted.values() if w == pod.name) > WEDGE_AFTER,
            300,
            every=2,
        )
        assert pod.restarts == 1, "restarted once: the restarted engine stays alive"
        accepted = sum(1 for w in auditor.accepted.values() if w == pod.name)
        print(f"liveness failed -> restarted in {restarted[0]['t'] - failed[0]['t']:.0f}s; {accepted} groups accepted")
        assert not [e for e in a.runner.events if e["event"] == "livenessProbe failed" and e["pod"] != pod.name]
    finally:
        auditor.stop()
