"""One cluster in a box, end to end (issue #13, items 1-4 and 6): the chart installed with the real Helm
SDK, the operator running as its Deployment runs it, the arithmetic example applied with the `kubernetes`
client and trained to completion through the operator; then trained on, scaled 2 -> 3 -> 1 and its
sampling temperature changed while it trains; then deleted.

The tests share one box and run in file order: each asserts one acceptance item on what the module's
fixtures did (`trained`: the run to completion; `extended`: the scaling and the spec change), so a
failure names the item. A failed test prints what every pod logged. The module runs twice: pods as
processes, then pods as podman containers of the images `make images` built (issue #18; skipped with
the reason where podman or the images are missing)."""

from __future__ import annotations

import base64
import time

import pytest
import requests

from rlfleet.wire.streams import RunKeys
from tests.cluster.inabox import Box, helm, kubelet
from tests.cluster.inabox.helm import BUILTIN
from tests.cluster.scenario import (
    NS,
    Auditor,
    Kubectl,
    cluster_secrets,
    complete,
    condition,
    example_docs,
    make_bucket,
    prebuilt_model,
    run_redis,
    tenths,
    trainer_records,
    wait_for,
)
from tests.containers import CPU_IMAGE, OPERATOR_IMAGE, require
from tests.operator.rbac import denied

RUN, POOL = "arithmetic", "arithmetic-cpu"
# 80 steps: the reward of the last tenth is about 0.88 in the local run, 0.43 in the first (README).
STEPS = 80
OPERATOR_SA = "system:serviceaccount:rlfleet:rlfleet-operator"
VALUES = {  # the chart's defaults, with its Redis (password from a Secret) and a short resync for a test
    "fullnameOverride": "rlfleet",
    "redis": {"enabled": True, "auth": {"existingSecret": "rlfleet-redis"}},
    "operator": {"extraEnv": [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "3"}]},
}
COMPONENT_OF = {  # workload -> what it is
    f"{RUN}-trainer": "trainer",
    f"{RUN}-verifier": "verifier",
    f"{RUN}-origin": "origin",
    f"{POOL}-rollout": "rollout",
    "arithmetic-tier0-relay": "relay",
    "rlfleet-operator": "operator",
    "rlfleet-redis": "redis",
}


def redis_entry(client, key: str):
    """What a Redis key holds, for a failure message: a stream's newest entry, a hash's fields, else its type."""
    kind = client.type(key).decode()
    if kind == "stream":
        newest = client.xrevrange(key, count=1)
        return [(i.decode(), {f.decode(): v[:200] for f, v in fields.items()}) for i, fields in newest]
    if kind == "hash":
        return {f.decode(): v[:200] for f, v in client.hgetall(key).items()}
    return kind


def pods_of(cluster, workload: str, ready: bool = False) -> list[dict]:
    return [
        p
        for p in cluster.runner.snapshot()
        if p["owner"][1] == workload and not p["terminating"] and (p["ready"] or not ready)
    ]


@pytest.fixture(scope="module", params=["processes", "containers"])
def box(request, tmp_path_factory):
    if request.param == "containers":
        require(CPU_IMAGE, OPERATOR_IMAGE)
    with Box(tmp_path_factory.mktemp("box"), pods=request.param) as b:
        yield b


@pytest.fixture(scope="module")
def a(box):
    """Cluster a: S3, the Secrets of docs/kubernetes.md, `helm install rlfleet charts/rlfleet`."""
    cluster = box.cluster("a")
    cluster.s3_url = box.s3(cluster)
    make_bucket(box)
    k = Kubectl(cluster)
    cluster.redis_password = cluster_secrets(k, box.root)
    cluster.rendered = helm.install(cluster, VALUES, release="rlfleet", namespace=NS)
    wait_for(
        "the operator watching RLRuns",
        lambda: [c for c in cluster.api.calls_of(OPERATOR_SA) if (c.call.verb, c.call.resource) == ("watch", "rlruns")],
        120,
    )
    yield cluster
    k.close()


@pytest.fixture(scope="module")
def k(a):
    kubectl = Kubectl(a)
    yield kubectl
    kubectl.close()


@pytest.fixture(scope="module")
def trained(a, k):
    """`kubectl apply` of the example; waits for condition Complete."""
    k.apply(example_docs(STEPS, a.s3_url, prebuilt_model()))
    started = time.monotonic()
    wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=600, every=2)
    return {"seconds": time.monotonic() - started, "events": len(a.runner.events)}


def test_1_the_chart_installs_and_the_operator_runs_as_its_deployment(a):
    hooks = helm.hooks(a.rendered, "pre-delete")  # run by `helm uninstall`, never created by the install
    assert [o["kind"] for o in hooks] == ["Job"], "the chart's uninstall hook (charts/rlfleet/templates)"
    for obj in (o for o in a.rendered if o not in hooks):
        prefix, plural, namespaced = BUILTIN[obj["kind"]]
        ns = f"namespaces/{obj['metadata'].get('namespace', NS)}/" if namespaced else ""
        url = f"{a.api.url}/{prefix}/{ns}{plural}/{obj['metadata']['name']}"
        assert requests.get(url, timeout=10).status_code == 200, f"{obj['kind']} {obj['metadata']['name']} not applied"
    [deployment] = [o for o in a.rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "rlfleet-operator"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    [pod] = pods_of(a, "rlfleet-operator", ready=True)
    pid = kubelet.main_pid(a.runner.find(NS, pod["name"]))
    environ = kubelet.environment_of(a.runner.find(NS, pod["name"]))
    argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().rstrip("\0").split("\0")
    assert argv[-len(container["args"]) :] == container["args"], argv  # `rlfleet operator` with the chart's args
    fields = {"metadata.namespace": NS, "metadata.name": pod["name"]}  # what the kubelet resolves a fieldRef to

    def secret_value(ref: dict) -> str:  # a secretKeyRef as the kubelet resolves it (the chart's Redis password)
        url = f"{a.api.url}/api/v1/namespaces/{NS}/secrets/{ref['name']}"
        return base64.b64decode(requests.get(url, timeout=10).json()["data"][ref["key"]]).decode()

    for item in container["env"]:
        source = item.get("valueFrom", {})
        field_path = source.get("fieldRef", {}).get("fieldPath")
        expected = item.get("value", fields.get(field_path))
        if "secretKeyRef" in source:
            expected = secret_value(source["secretKeyRef"])
        assert expected is not None, item  # a value, a fieldRef this test knows or a Secret's key
        assert environ.get(item["name"]) == expected, item["name"]
    assert environ["KUBERNETES_SERVICE_HOST"] == a.api.host.ip  # in-cluster login, over TLS, as its account
    calls = a.api.calls_of(OPERATOR_SA)
    assert calls and all(c.allowed for c in calls), [c.call for c in calls if not c.allowed]
    assert not denied([c.call for c in calls], a.rendered)


def test_2_the_example_trains_to_completion_through_the_operator(a, k, trained):
    run = k.get("RLRun", RUN)
    assert run["status"]["step"] == run["spec"]["trainer"]["steps"] == STEPS
    assert condition(run, "Complete")["reason"] == "StepsDone" and run["status"]["phase"] == "Succeeded"
    records = trainer_records(a, RUN)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    first, last = tenths(records)
    print(f"{STEPS} steps in {trained['seconds']:.0f}s: reward {first:.2f} -> {last:.2f}")
    assert last >= 0.8 and last - first >= 0.3, (first, last)
    # released: the run's workloads are scaled to 0; nothing crash-looped on the way
    wait_for(
        "the run's pods gone",
        lambda: (
            not [
                p
                for p in a.runner.snapshot()
                if p["owner"][1] in COMPONENT_OF and COMPONENT_OF[p["owner"][1]] not in ("operator", "redis")
            ]
        ),
        60,
    )
    exits = [e for e in a.runner.events if e["event"] == "exited"]
    assert not exits, f"containers that exited on their own: {exits}"
    assert all(p["restarts"] == 0 and p["ready"] for p in a.runner.snapshot()), a.runner.snapshot()
    if a.runner.mode == "containers":  # every pod of the project's images ran from its image; Redis as a process
        pods = a.runner.all_pods()
        assert {p.owner[1] for p in pods if p.container_name} == set(COMPONENT_OF) - {"rlfleet-redis"}, pods
        assert {p.owner[1] for p in pods if not p.container_name} == {"rlfleet-redis"}, pods
        images = {p.owner[1]: p.container["image"] for p in pods if p.container_name}
        assert images.pop("rlfleet-operator") == OPERATOR_IMAGE and set(images.values()) == {CPU_IMAGE}, images


@pytest.fixture(scope="module")
def extended(a, k, trained):
    """The run trains on (trainer.steps raised); while it does, the pool is scaled 2 -> 3 -> 1, then the
    sampling temperature changes. Records the runner's events of each phase and the audit."""
    client = run_redis(a, a.redis_password)
    auditor = Auditor(client, RUN)
    auditor.start()
    k.patch("RLRun", RUN, {"spec": {"trainer": {"steps": STEPS + 1000}}})
    step = lambda: (k.get("RLRun", RUN).get("status") or {}).get("step", 0)  # noqa: E731
    wait_for("training again", lambda: step() >= STEPS + 2 and len(pods_of(a, f"{POOL}-rollout", ready=True)) == 2, 240)
    facts = {}
    mark = len(a.runner.events)
    k.scale("InferencePool", POOL, 3)
    three = wait_for(
        "3 ready workers",
        lambda: len(pods_of(a, f"{POOL}-rollout", ready=True)) == 3 and pods_of(a, f"{POOL}-rollout"),
        120,
    )
    new = {p["name"] for p in three} - {e["pod"] for e in a.runner.events[:mark]}
    wait_for("an accepted group from the new worker", lambda: new & set(auditor.accepted.values()), 120)
    facts["up"] = a.runner.events[mark:]
    mark = len(a.runner.events)
    k.scale("InferencePool", POOL, 1)
    wait_for(
        "one worker left", lambda: len([p for p in a.runner.snapshot() if p["owner"][1] == f"{POOL}-rollout"]) == 1, 120
    )
    facts["down"] = a.runner.events[mark:]
    at = step()
    wait_for("3 more steps", lambda: step() >= at + 3, 120)
    # What was accepted, then the stream, then what was trained: an accepted group leaves the stream only
    # in the trainer's commit, which its metrics record follows, so one in neither is lost. (Accepted last,
    # a group the gate accepted after the stream was read would count as lost.) A step committed just before
    # the stream was read may not have written its record yet; the trainer's steps run one after another, so
    # that can only be the step after the last record read then: the records are taken once it is there.
    facts["accepted"] = dict(auditor.accepted)
    facts["queued"] = auditor.queued()
    after = trainer_records(a, RUN)[-1]["step"] + 1
    facts["records"] = wait_for(
        f"the record of step {after}", lambda: (r := trainer_records(a, RUN)) and r[-1]["step"] >= after and r, 120
    )
    # the spec change
    facts["before"] = {p["name"]: p for p in a.runner.snapshot()}
    mark = len(a.runner.events)
    k.patch("RLRun", RUN, {"spec": {"sampling": {"temperature": 0.9}}})
    rolled = lambda: all(  # noqa: E731
        (s := a.runner.api.get(kind, NS, name)["status"])["updatedReplicas"] == s["readyReplicas"] == s["replicas"] >= 1
        and s["observedGeneration"] == a.runner.api.get(kind, NS, name)["metadata"]["generation"]
        for kind, name in (
            ("StatefulSet", f"{RUN}-trainer"),
            ("Deployment", f"{RUN}-verifier"),
            ("Deployment", f"{POOL}-rollout"),
        )
    )
    wait_for("the roll-out", lambda: time.sleep(3) or rolled(), 240)
    at = step()
    wait_for("2 more steps at the new temperature", lambda: step() >= at + 2, 180)
    # A replaced rollout worker finishes the batch it generates before it exits (nothing it made is lost), so
    # it may still be stopping here, past the roll-out: its removal is waited for (its grace period is 30 s,
    # after which the box kills it) before the pods are compared. A trainer saving its resume state on a loaded
    # machine can take longer and be killed (stop 48's CI, containers): that is not asserted against here.
    terminated = {e["uid"] for e in a.runner.events[mark:] if e["event"] == "terminating"}
    stopped = lambda: not terminated & {p["uid"] for p in a.runner.snapshot()}  # noqa: E731
    wait_for("the replaced pods removed", stopped, 90, every=1)
    facts["roll"] = a.runner.events[mark:]
    facts["after"] = {p["name"]: p for p in a.runner.snapshot()}
    auditor.stop()
    return facts


def test_3_scaling_the_pool_adds_and_removes_exactly_that_and_loses_no_rollout(extended):
    up, down = extended["up"], extended["down"]
    assert [e["event"] for e in up if e["owner"] == ("Deployment", f"{POOL}-rollout")].count("created") == 1
    assert [e for e in up if e["event"] != "started" and e["event"] != "created"] == [], up
    assert {e["owner"] for e in up} == {("Deployment", f"{POOL}-rollout")}, up
    removed = {e["pod"] for e in down if e["event"] == "removed"}
    assert len(removed) == 2 and {e["owner"] for e in down} == {("Deployment", f"{POOL}-rollout")}, down
    assert not [e for e in down if e["event"] in ("created", "started", "exited")], down
    records, accepted, queued = extended["records"], extended["accepted"], extended["queued"]
    trained = {rid for r in records for rid in r["rollout_ids"]}
    dropped = {rid for r in records for ids in (r.get("dropped_rollout_ids") or {}).values() for rid in ids}
    lost = set(accepted) - trained - dropped - queued
    print(
        f"scale 2->3->1: {len(up)} events up, {len(removed)} pods removed; {len(accepted)} accepted groups from "
        f"{len(set(accepted.values()))} workers: {len(accepted.keys() & trained)} trained, "
        f"{len(accepted.keys() & dropped)} dropped by design, {len(accepted.keys() & queued)} queued, {len(lost)} lost"
    )
    assert not lost, f"{len(lost)} accepted rollouts neither trained, dropped by design nor queued"
    assert len(set(accepted.values())) >= 3, "groups of every worker, the removed ones included, were audited"


def test_4_a_temperature_change_rolls_the_pods_that_read_it_and_only_those(extended):
    before, after = extended["before"], extended["after"]
    replaced = {COMPONENT_OF[p["owner"][1]] for n, p in before.items() if n not in after or after[n]["uid"] != p["uid"]}
    roll = [(round(e["t"], 1), e["event"], e["pod"], e.get("exit")) for e in extended["roll"]]
    assert replaced == {"trainer", "verifier", "rollout"}, (replaced, roll)
    for name, p in before.items():
        if COMPONENT_OF[p["owner"][1]] in ("relay", "origin", "operator", "redis"):
            assert after[name]["uid"] == p["uid"] and after[name]["restarts"] == p["restarts"], name
    assert not [e for e in extended["roll"] if e["event"] == "exited"], "nothing crashed during the roll-out"


def test_6_deleting_the_run_removes_its_children_and_redis_keys(a, k, extended):
    client = run_redis(a, a.redis_password)
    assert client.exists(*RunKeys(RUN).all()) > 0
    k.delete("RLRun", RUN)
    wait_for("the run gone", lambda: k.get("RLRun", RUN) is None, 60)
    wait_for("its children gone", lambda: not k.children(RUN), 60)
    assert not k.list("InferencePool") and not k.list("RelayTier"), "its pools and tiers go with it"
    wait_for(
        "its pods gone",
        lambda: (
            not [
                p
                for p in a.runner.snapshot()
                if p["owner"][1] in COMPONENT_OF and COMPONENT_OF[p["owner"][1]] not in ("operator", "redis")
            ]
        ),
        60,
    )
    left = {key: redis_entry(client, key) for key in RunKeys(RUN).all() if client.exists(key)}
    assert not left, f"the run's Redis keys are deleted; left, with their newest entry: {left}"
    leftover = [key for key in client.scan_iter(f"rlfleet:{RUN}:*") if client.ttl(key) < 0]
    assert not leftover, leftover
    terminating = [
        (res, name) for (res, _, name), o in list(a.api.cluster._objects.items())
        if not o.deleted and (o.raw.get("metadata") or {}).get("deletionTimestamp")
    ]  # fmt: skip
    assert not terminating, f"left Terminating: {terminating}"
    # every request the operator made, through the whole module, was one its chart-given RBAC allows
    calls = a.api.calls_of(OPERATOR_SA)
    assert all(c.allowed for c in calls) and not denied([c.call for c in calls], a.rendered)
    # the delete handler read the run's Redis Secret and waited for its pods, as its RBAC allows
    assert {("get", "secrets"), ("list", "pods")} <= {(c.call.verb, c.call.resource) for c in calls}
    assert not a.runner.errors and not a.runner.problems, (a.runner.errors[-3:], a.runner.problems)
