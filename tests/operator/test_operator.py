"""The real kopf operator against kmock (a Kubernetes API emulator speaking the real HTTP protocol).

One emulator and one operator for the module, in a background thread with its own event loop;
the tests talk to the emulator over HTTP like kubectl would, and play the controllers the
emulator does not have (Deployment/StatefulSet status) where a test needs it. Each test uses
its own namespace. A real redis-server holds the run's streams.

kmock keeps no uid, resourceVersion, generation or creationTimestamp and has no garbage
collector; `Cluster` below adds exactly those (generation moves only when spec changes, as on
a real API server; deleting an object deletes the objects whose ownerReferences name its uid),
and trims kmock's request log, which it re-scans on every request.
It does not validate bodies against the CRD schema (tests/operator/test_crds.py covers the schema).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest
import redis
import requests
import yaml

os.environ.setdefault("RLFLEET_RESYNC_INTERVAL", "1")  # timers every second (read when the operator module is imported)

import kmock  # noqa: E402
from kmock._internal import dicts as kmock_dicts  # noqa: E402
from kmock._internal.enums import action  # noqa: E402
from support import REPO

from rlfleet.operator import names  # noqa: E402
from rlfleet.redis_server import EmbeddedRedis  # noqa: E402
from rlfleet.streams import RunKeys, encode_json  # noqa: E402

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"
TIMEOUT_S = 10
_versions = itertools.count(1)


class Cluster(kmock.KubernetesEmulator):
    """kmock plus uid/resourceVersion/generation/creationTimestamp and ownerReference garbage collection."""

    async def _handle(self, request):
        # kmock records every request and re-filters that record on each new request (O(n) per request);
        # a long-running operator makes thousands, so keep only the recent ones (these tests assert on objects).
        if len(self._requests) > 20:
            del self._requests[:-10]
            for payload in self._payloads:
                del payload._requests[:-10]
        key = (request.resource, request.namespace, request.name) if request.resource is not None else None
        existing = (
            self._objects[key]
            if key and request.name and key in self._objects and not self._objects[key].deleted
            else None
        )
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == action.CREATE:
                meta.update(
                    uid=str(uuid.uuid4()),
                    generation=1,
                    resourceVersion=str(next(_versions)),
                    creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                )
            elif request.action == action.UPDATE and existing is not None:
                meta["resourceVersion"] = str(next(_versions))
                after = kmock_dicts.patch_dict(copy.deepcopy(existing.raw), request.data)
                if request.subresource != "status" and after.get("spec") != existing.raw.get("spec"):
                    meta["generation"] = existing.raw["metadata"].get("generation", 1) + 1
        uid = existing.raw["metadata"].get("uid") if existing is not None else None
        response = await super()._handle(request)
        if uid and self._objects[key].deleted:
            await self._collect(uid)
        return response

    async def _collect(self, uid: str) -> None:
        async with self._lock:
            doomed = [
                (k, o)
                for k, o in self._objects.items()
                if not o.deleted
                and any(r.get("uid") == uid for r in o.raw.get("metadata", {}).get("ownerReferences", []))
            ]
            for k, o in doomed:
                raw = o.raw
                o.delete()
                await self._buses[k[0]].put({"type": "DELETED", "object": raw})
        for _, o in doomed:
            await self._collect(o.last.raw["metadata"]["uid"])


RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "v1/events": ("Event", True, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/services": ("Service", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "apps/v1/statefulsets": ("StatefulSet", True, {"status", "scale"}),
    f"{names.API_VERSION}/{names.RLRUN.plural}": ("RLRun", True, {"status"}),
    f"{names.API_VERSION}/{names.INFERENCE_POOL.plural}": ("InferencePool", True, {"status", "scale"}),
    f"{names.API_VERSION}/{names.RELAY_TIER.plural}": ("RelayTier", True, {"status", "scale"}),
}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@contextmanager
def running_operator():
    """Base URL of the emulator with the operator running against it (in a background thread)."""
    import kopf

    import rlfleet.operator.handlers  # noqa: F401  (registers the handlers)

    started, stop = threading.Event(), threading.Event()
    box: dict = {}

    @kopf.on.login()
    def login(**_):
        return kopf.ConnectionInfo(server=box["url"], default_namespace="default")

    async def main():
        async with Cluster() as cluster, kmock.Server(cluster) as server:
            for res, (kind, namespaced, subresources) in RESOURCES.items():
                cluster.resources[res] = kmock.ResourceInfo(
                    kind=kind,
                    namespaced=namespaced,
                    subresources=subresources,
                    verbs={"list", "watch", "get", "create", "patch", "delete"},
                )
            box["url"], box["cluster"] = str(server.url).rstrip("/"), cluster
            started.set()
            await kopf.operator(clusterwide=True, standalone=True, stop_flag=stop)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(10), "emulator did not start"
    try:
        yield box["url"]
    finally:
        stop.set()
        thread.join(10)


@pytest.fixture(scope="module")
def api():
    with running_operator() as url:
        yield url


def url_of(api: str, kind: str, ns: str, name: str | None = None, sub: str | None = None) -> str:
    group = {
        "ConfigMap": "api/v1",
        "Service": "api/v1",
        "Secret": "api/v1",
        "Event": "api/v1",
        "Deployment": "apis/apps/v1",
        "StatefulSet": "apis/apps/v1",
    }.get(kind, f"apis/{names.API_VERSION}")
    plural = names.KINDS[kind].plural if kind in names.KINDS else kind.lower() + "s"
    return "/".join(p for p in (api, group, "namespaces", ns, plural, name, sub) if p)


def get(api, kind, ns, name):
    r = requests.get(url_of(api, kind, ns, name), timeout=5)
    return r.json() if r.status_code == 200 else None


def create(api, ns, body):
    body = {**body, "metadata": {**body["metadata"], "namespace": ns}}
    r = requests.post(url_of(api, body["kind"], ns), json=body, timeout=5)
    assert r.status_code in (200, 201), r.text


def patch(api, kind, ns, name, body, sub=None):
    r = requests.patch(
        url_of(api, kind, ns, name, sub), json=body, timeout=5, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert r.status_code == 200, r.text


def wait_for(what: str, fn, timeout: float = TIMEOUT_S):
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except (KeyError, TypeError, IndexError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def condition(obj, type_="Ready"):
    return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == type_), None)


def example(redis_url: str | None = None, **spec) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    if redis_url:
        docs[0]["spec"].update(
            redis={"url": redis_url},
            store={"uri": "s3://ckpt/runs"},
            shardcast={"signingKeySecret": "arithmetic-signing"},
        )
    docs[0]["spec"].update(spec)
    return docs


def apply_example(api, ns, redis_url, **spec):
    for doc in example(redis_url, **spec):
        create(api, ns, doc)


def test_example_crs_become_children_with_owners_and_status(api, redis_url):
    ns = "t-apply"
    apply_example(api, ns, redis_url)
    run = wait_for(
        "RLRun Ready", lambda: (o := get(api, "RLRun", ns, "arithmetic")) and condition(o)["status"] == "True" and o
    )
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
    rollout = wait_for("rollout Deployment", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
    assert rollout["spec"]["replicas"] == 2
    assert (
        f"http://arithmetic-tier0-relay.{ns}.svc:8080" in rollout["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    relay = wait_for("relay Deployment", lambda: get(api, "Deployment", ns, "arithmetic-tier0-relay"))
    assert f"http://arithmetic-origin.{ns}.svc:8080" in relay["spec"]["template"]["spec"]["containers"][0]["args"]
    pool = wait_for(
        "pool status",
        lambda: (o := get(api, "InferencePool", ns, "arithmetic-cpu")) and o.get("status", {}).get("selector") and o,
    )
    assert (
        "app.kubernetes.io/instance=arithmetic-cpu" in pool["status"]["selector"]
        and condition(pool)["status"] == "True"
    )

    # progress comes from the run's Redis; readiness from the trainer StatefulSet (playing its controller)
    client = redis.Redis.from_url(redis_url)
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
    assert get(api, "RLRun", ns, "arithmetic")["status"]["phase"] == "Suspended"
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
    fixed = example(redis_url)[0]["spec"]
    patch(api, "RLRun", ns, "arithmetic", {"spec": {k: fixed[k] for k in ("redis", "store", "shardcast")}})
    wait_for("Ready after fix", lambda: condition(get(api, "RLRun", ns, "arithmetic"))["status"] == "True")
    assert get(api, "StatefulSet", ns, "arithmetic-trainer") is not None


def test_delete_removes_children_and_redis_keys(api, redis_url):
    ns = "t-delete"
    apply_example(api, ns, redis_url)
    wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    run = wait_for(
        "finalizer", lambda: (o := get(api, "RLRun", ns, "arithmetic")) and o["metadata"].get("finalizers") and o
    )
    assert run["metadata"]["finalizers"] == [f"{names.GROUP}/cleanup"]
    client = redis.Redis.from_url(redis_url)
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
    # pools and tiers are the user's objects: they stay, and their children stay with them
    assert get(api, "InferencePool", ns, "arithmetic-cpu") is not None
