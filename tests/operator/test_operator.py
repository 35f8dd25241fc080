"""The real operator (`rlfleet operator`, a process) against the API emulator (cluster.py), with a real
redis-server holding the runs' streams (conftest.py starts all three, once per session).

The tests talk to the emulator over HTTP like kubectl would, and play the controllers the emulator
does not have (Deployment/StatefulSet status) where a test needs it. Each test uses its own namespace.
"""

from __future__ import annotations

import time

import requests

from rlfleet.operator import names
from rlfleet.wire.streams import RunKeys, encode_json
from tests.operator.kubectl import (
    SIGNING_SECRET,
    apply_example,
    condition,
    create,
    example,
    get,
    has_condition,
    patch,
    redis_db,
    secret,
    url_of,
)
from tests.support import redis_from_url, wait_for


def test_example_crs_become_children_with_owners_and_status(api, redis_url):
    ns = "t-apply"
    apply_example(api, ns, redis_url)
    run = wait_for("RLRun Pending", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "Pending"))
    assert run["status"]["observedGeneration"] == 1 and run["status"]["phase"] == "Pending"
    expected = {
        ("ConfigMap", "arithmetic-config"),
        ("Service", "arithmetic-origin"),
        ("Deployment", "arithmetic-origin"),
        ("Service", "arithmetic-trainer"),
        ("StatefulSet", "arithmetic-trainer"),
        ("Deployment", "arithmetic-verifier"),
    }
    for kind, name in expected:
        child = wait_for(f"{kind} {name}", lambda: get(api, kind, ns, name))
        assert child["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
        assert child["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlfleet"
    # Applied in file order, the pool is first built before its tier exists (pointing at the origin); the
    # tier's creation repoints it (test_relay_order.py), so this waits for that rather than the first write.
    tier0 = f"http://arithmetic-tier0-relay.{ns}.svc:8080"
    rollout = wait_for(
        "rollout Deployment downloading from tier 0",
        lambda: (
            (o := get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
            and tier0 in o["spec"]["template"]["spec"]["containers"][0]["args"]
            and o
        ),
    )
    assert rollout["spec"]["replicas"] == 2
    relay = wait_for("relay Deployment", lambda: get(api, "Deployment", ns, "arithmetic-tier0-relay"))
    assert f"http://arithmetic-origin.{ns}.svc:8080" in relay["spec"]["template"]["spec"]["containers"][0]["args"]
    pool = wait_for(
        "pool status",
        lambda: (o := get(api, "InferencePool", ns, "arithmetic-cpu")) and o.get("status", {}).get("selector") and o,
    )
    assert "app.kubernetes.io/instance=arithmetic-cpu" in pool["status"]["selector"]
    assert condition(pool)["reason"] == "Pending" and pool["status"]["phase"] == "Pending"

    # progress comes from the run's Redis; readiness from the trainer StatefulSet (playing its controller)
    client = redis_from_url(redis_url)
    keys = RunKeys("arithmetic")
    for v in (1, 2, 3):
        client.xadd(keys.policy, encode_json({"version": v, "time": time.time(), "reward": 0.25 * v}))
    client.hset(keys.stats, mapping={"accepted": 40, "rejected": 2})
    patch(api, "StatefulSet", ns, "arithmetic-trainer", {"status": {"replicas": 1, "readyReplicas": 1}}, sub="status")
    run = wait_for(
        "progress in status",
        lambda: (
            (o := get(api, "RLRun", ns, "arithmetic"))
            and o["status"].get("step") == 3
            and o["status"].get("phase") == "Running"
            and o
        ),
    )
    assert condition(run)["status"] == "True" and condition(run)["reason"] == "Running"
    assert run["status"]["policyVersion"] == 3 and run["status"]["reward"] == 0.75
    assert (run["status"]["accepted"], run["status"]["rejected"]) == (40, 2)
    assert run["status"]["readyReplicas"] == 1


def test_scale_subresource_moves_the_rollout_deployment(api, redis_url):
    ns = "t-scale"
    apply_example(api, ns, redis_url)
    wait_for("rollout Deployment", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
    # `kubectl scale inferencepool.rlfleet.io/arithmetic-cpu --replicas=5`
    # (the emulator maps the Scale body onto the object)
    patch(api, "InferencePool", ns, "arithmetic-cpu", {"spec": {"replicas": 5}}, sub="scale")
    wait_for("Deployment at 5", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout")["spec"]["replicas"] == 5)
    patch(
        api, "Deployment", ns, "arithmetic-cpu-rollout", {"status": {"replicas": 5, "readyReplicas": 5}}, sub="status"
    )
    pool = wait_for(
        "pool status.replicas 5",
        lambda: (o := get(api, "InferencePool", ns, "arithmetic-cpu"))["status"].get("replicas") == 5 and o,
    )
    assert pool["status"]["readyReplicas"] == 5 and pool["status"]["phase"] == "Running"
    assert pool["status"]["observedGeneration"] == pool["metadata"]["generation"] == 2


def test_spec_change_rolls_out_and_suspend_scales_to_zero(api, redis_url):
    ns = "t-update"
    apply_example(api, ns, redis_url)
    sts = wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    old_hash = sts["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
    patch(api, "RLRun", ns, "arithmetic", {"spec": {"sampling": {"groupSize": 4}}})
    wait_for(
        "ConfigMap updated",
        lambda: "groupSize: 4" in get(api, "ConfigMap", ns, "arithmetic-config")["data"]["rlrun.yaml"],
    )
    wait_for(
        "trainer pods roll (new config hash)",
        lambda: (
            get(api, "StatefulSet", ns, "arithmetic-trainer")["spec"]["template"]["metadata"]["annotations"][
                names.CONFIG_HASH_ANNOTATION
            ]
            != old_hash
        ),
    )
    wait_for("observedGeneration 2", lambda: get(api, "RLRun", ns, "arithmetic")["status"]["observedGeneration"] == 2)

    patch(api, "RLRun", ns, "arithmetic", {"spec": {"suspend": True}})
    for kind, name in [
        ("StatefulSet", "arithmetic-trainer"),
        ("Deployment", "arithmetic-verifier"),
        ("Deployment", "arithmetic-origin"),
        ("Deployment", "arithmetic-cpu-rollout"),
        ("Deployment", "arithmetic-tier0-relay"),
    ]:
        wait_for(f"{kind} {name} at 0", lambda: get(api, kind, ns, name)["spec"]["replicas"] == 0)
    # the workloads scale first; the status patch lands when the reconcile returns
    wait_for("run Suspended", lambda: get(api, "RLRun", ns, "arithmetic")["status"]["phase"] == "Suspended")
    wait_for(
        "pool Suspended", lambda: get(api, "InferencePool", ns, "arithmetic-cpu")["status"]["phase"] == "Suspended"
    )


def test_bad_spec_sets_a_condition_and_an_event_then_recovers(api, redis_url):
    ns = "t-bad"
    for doc in example(None):  # the local example as-is: no Redis URL, no store, no signing key
        create(api, ns, doc)
    run = wait_for(
        "InvalidSpec",
        lambda: (
            (o := get(api, "RLRun", ns, "arithmetic")) and (condition(o) or {}).get("reason") == "InvalidSpec" and o
        ),
    )
    assert condition(run)["status"] == "False" and run["status"]["phase"] == "Failed"
    assert "spec.redis.url: required on a cluster" in condition(run)["message"]
    assert "spec.store.uri" in condition(run)["message"]
    events = wait_for(
        "Warning Event",
        lambda: [
            e
            for e in requests.get(url_of(api, "Event", ns), timeout=5).json()["items"]
            if e.get("reason") == "InvalidSpec"
        ],
    )
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "arithmetic"
    assert get(api, "StatefulSet", ns, "arithmetic-trainer") is None

    # a field the models reject on an InferencePool: condition names the field, nothing crashes
    patch(api, "InferencePool", ns, "arithmetic-cpu", {"spec": {"replicaz": 3}})
    pool = wait_for(
        "pool InvalidSpec",
        lambda: (
            (o := get(api, "InferencePool", ns, "arithmetic-cpu"))
            and (condition(o) or {}).get("reason") == "InvalidSpec"
            and o
        ),
    )
    assert "spec.replicaz: unknown field" in condition(pool)["message"]

    # fixing the spec recovers without restarting anything
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    fixed = example(redis_url)[0]["spec"]
    patch(api, "RLRun", ns, "arithmetic", {"spec": {k: fixed[k] for k in ("redis", "store", "shardcast")}})
    wait_for("fixed", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "Pending"))
    assert condition(get(api, "RLRun", ns, "arithmetic"), "Failed")["status"] == "False"
    assert get(api, "StatefulSet", ns, "arithmetic-trainer") is not None


def test_delete_removes_children_and_redis_keys(api, redis_url):
    ns = "t-delete"
    apply_example(api, ns, redis_url)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    run = wait_for(
        "finalizer", lambda: (o := get(api, "RLRun", ns, "arithmetic")) and o["metadata"].get("finalizers") and o
    )
    assert run["metadata"]["finalizers"] == [f"{names.GROUP}/cleanup"]
    client = redis_from_url(redis_url)
    keys = RunKeys("arithmetic")
    client.xadd(keys.policy, encode_json({"version": 1}))
    client.hset(keys.stats, "accepted", 1)
    assert requests.delete(url_of(api, "RLRun", ns, "arithmetic"), timeout=5).status_code == 200
    wait_for("RLRun gone", lambda: get(api, "RLRun", ns, "arithmetic") is None)
    assert client.exists(*keys.all()) == 0
    for kind, name in [
        ("ConfigMap", "arithmetic-config"),
        ("StatefulSet", "arithmetic-trainer"),
        ("Deployment", "arithmetic-verifier"),
    ]:
        wait_for(f"{kind} {name} collected", lambda: get(api, kind, ns, name) is None)
    # the run's pools and tiers carry a (non-controller) owner reference to it: they go too, with their children
    for kind, name in [
        ("InferencePool", "arithmetic-cpu"),
        ("RelayTier", "arithmetic-tier0"),
        ("Deployment", "arithmetic-cpu-rollout"),
        ("Deployment", "arithmetic-tier0-relay"),
    ]:
        wait_for(f"{kind} {name} collected", lambda: get(api, kind, ns, name) is None)


def test_a_deleted_runs_redis_keys_go_after_its_pods(api, redis_url):
    """Bug (found by the cluster in a box): the keys were deleted as soon as the run was, while its pods
    still ran: a worker's XADD or the trainer's consumer group made them again, and they stayed. The
    operator now deletes the run's workloads and deletes the keys once no pod of the run is left."""
    ns = "t-delete-pods"
    apply_example(api, ns, redis_db(redis_url, 5))
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    wait_for("finalizer", lambda: get(api, "RLRun", ns, "arithmetic")["metadata"].get("finalizers"))
    labels = names.labels("InferencePool", "arithmetic-cpu", names.ROLLOUT, "arithmetic")
    create(api, ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker-0", "labels": labels}})
    client = redis_from_url(redis_db(redis_url, 5))
    keys = RunKeys("arithmetic")
    client.hset(keys.stats, "accepted", 1)
    assert requests.delete(url_of(api, "RLRun", ns, "arithmetic"), timeout=5).status_code == 200
    wait_for("its workloads deleted", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer") is None)
    time.sleep(3)  # a few tries of the delete handler
    run = get(api, "RLRun", ns, "arithmetic")
    assert run and run["metadata"].get("deletionTimestamp"), "the run stays Terminating while its pod is there"
    assert client.exists(keys.stats) == 1, "the keys stay while a pod of the run may write them"
    assert requests.delete(url_of(api, "Pod", ns, "worker-0"), timeout=5).status_code == 200
    wait_for("RLRun gone", lambda: get(api, "RLRun", ns, "arithmetic") is None)
    assert client.exists(*keys.all()) == 0
