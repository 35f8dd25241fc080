"""One apply to a running run (issue 28): with the chart's Redis and store defaults handed to the operator
(RLFLEET_DEFAULT_*), examples/arithmetic/rlrun.yaml applied as it is gets its own signing key Secret and Redis
URL Secret, owned by the run, the chart's store, and only the trainer sees the private key
(rlfleet/operator/rundefaults.py). And the chart's pre-delete hook (rlfleet/operator/uninstall.py) lets no run
get stuck on its finalizer.

These tests run their own emulator and operator (the session's has no defaults, and other tests check the
errors a run without Redis or store gets there), against a real redis-server with a password.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

import pytest
import requests
from cryptography.hazmat.primitives import serialization

from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.operator import uninstall
from rlfleet.operator.kube import connect
from rlfleet.operator.options import OperatorOptions
from rlfleet.versions.signing import public_key_text
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys, encode_json
from tests.operator.cluster import EmulatedCluster
from tests.operator.conftest import CHART_ENV, RESYNC_INTERVAL_S, stop_operator, wait_until_healthy
from tests.operator.kubectl import apply_example, create, example, get, url_of
from tests.operator.rbac import denied
from tests.support import CHART, redis_from_url, render_chart, wait_for

PASSWORD = "p@ss/w:rd%1?"  # characters a URL must escape (an ACL file allows no spaces)
STORE = {"uri": "s3://ckpt/runs", "endpointUrl": "http://minio.minio.svc:9000", "credentialsSecret": "rlfleet-s3"}
CHART_VALUES = {"redis": {"enabled": True}, "defaults": {"store": STORE}}  # what hands the operator these defaults


@pytest.fixture(scope="module")
def guarded_redis(tmp_path_factory):
    acl = f"user default on >{PASSWORD} ~* &* +@all\n"
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), acl=acl, auth=("default", PASSWORD))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(guarded_redis, tmp_path_factory):
    """(emulator, its URL) with `rlfleet operator` running against it with the chart's defaults."""
    workdir = tmp_path_factory.mktemp("one-apply")
    with EmulatedCluster() as emulated:
        port, log_path = free_port(), workdir / "operator.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(
            KUBECONFIG=str(emulated.kubeconfig(workdir / "kubeconfig", token="operator")),
            RLFLEET_RESYNC_INTERVAL=RESYNC_INTERVAL_S,
            PYTHONUNBUFFERED="1",
            RLFLEET_DEFAULT_REDIS_URL=guarded_redis.base_url,  # as the chart sets them
            RLFLEET_DEFAULT_REDIS_PASSWORD=PASSWORD,
            RLFLEET_DEFAULT_STORE=json.dumps(STORE),
            **CHART_ENV,
        )
        command = [sys.executable, "-m", "rlfleet.cli", "operator", "--liveness", f"http://127.0.0.1:{port}/healthz"]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until_healthy(process, port, log_path, "the operator")
            assert PASSWORD not in log_path.read_text(), "the operator logged the Redis password"
            yield emulated, emulated.url
        finally:
            stop_operator(process)


def secret_data(api, ns, name) -> dict[str, str] | None:
    body = get(api, "Secret", ns, name)
    return None if body is None else {k: base64.b64decode(v).decode() for k, v in (body.get("data") or {}).items()}


def refs(workload: dict) -> list[tuple[str, str | None]]:
    """Every (Secret, key) a workload's pods read: env valueFrom, envFrom, volumes (key None: every key)."""
    pod = workload["spec"]["template"]["spec"]
    found = []
    for c in pod["containers"]:
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                found.append((ref["name"], ref["key"]))
        found += [(e["secretRef"]["name"], None) for e in c.get("envFrom") or [] if "secretRef" in e]
    for v in pod.get("volumes") or []:
        if "secret" in v:
            items = v["secret"].get("items")
            found += (
                [(v["secret"]["secretName"], i["key"]) for i in items] if items else [(v["secret"]["secretName"], None)]
            )
    return found


def test_the_example_as_it_is_runs_on_the_charts_redis_store_and_its_own_signing_key(cluster, guarded_redis):
    """Bug: the example needed a signing key Secret made by hand, a Redis URL and a store (InvalidSpec otherwise)."""
    emulator, api = cluster
    ns = "t-one-apply"
    for doc in example():  # examples/arithmetic/rlrun.yaml, unchanged
        create(api, ns, doc)
    trainer = wait_for("the trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"), timeout=30)
    run = get(api, "RLRun", ns, "arithmetic")
    spec = wait_for(
        "the defaults written into the run",
        lambda: (s := get(api, "RLRun", ns, "arithmetic")["spec"]).get("store") and s,
    )
    assert spec["redis"]["urlSecret"] == "arithmetic-redis-url"
    assert spec["store"] == STORE
    assert spec["shardcast"]["signingKeySecret"] == "arithmetic-signing-key"

    owner = {"kind": "RLRun", "name": "arithmetic", "uid": run["metadata"]["uid"], "controller": True}
    keys = secret_data(api, ns, "arithmetic-signing-key")
    private = serialization.load_pem_private_key(keys["signing-key"].encode(), password=None)
    assert public_key_text(private) == keys["public-key"], "the public key is the private key's"
    assert secret_data(api, ns, "arithmetic-redis-url")["url"] == guarded_redis.url.replace("default:", ":", 1)
    for name in ("arithmetic-signing-key", "arithmetic-redis-url"):
        [ref] = get(api, "Secret", ns, name)["metadata"]["ownerReferences"]
        assert {k: ref[k] for k in owner} == owner, f"Secret {name} must go with the run"

    # the private half reaches the trainer alone; the others read the public key, or nothing of the Secret
    assert ("arithmetic-signing-key", "signing-key") in refs(trainer)
    assert ("arithmetic-redis-url", "url") in refs(trainer) and ("rlfleet-s3", None) in refs(trainer)
    others = [get(api, kind, ns, name) for kind, name in (
        ("Deployment", "arithmetic-verifier"), ("Deployment", "arithmetic-origin"),
        ("Deployment", "arithmetic-cpu-rollout"), ("Deployment", "arithmetic-tier0-relay"),
    )]  # fmt: skip
    for workload in others:
        read = refs(workload)
        assert ("arithmetic-signing-key", "signing-key") not in read and ("arithmetic-signing-key", None) not in read
    assert ("arithmetic-signing-key", "public-key") in refs(others[2]), "workers verify with the public key"

    # the operator itself reads progress from the chart's Redis, password and all
    client = redis_from_url(guarded_redis.url)
    client.xadd(RunKeys("arithmetic").policy, encode_json({"version": 1, "time": time.time(), "reward": 0.5}))
    client.close()
    wait_for("progress in status", lambda: get(api, "RLRun", ns, "arithmetic")["status"].get("step") == 1, timeout=20)

    # a run that names its own Secrets gets none made
    apply_example(api, "t-one-apply-own", guarded_redis.url)
    wait_for("its trainer", lambda: get(api, "StatefulSet", "t-one-apply-own", "arithmetic-trainer"), timeout=30)
    assert get(api, "Secret", "t-one-apply-own", "arithmetic-signing-key") is None

    requests.delete(url_of(api, "RLRun", ns, "arithmetic"), timeout=5)
    wait_for("the run's Secrets gone with it", lambda: not (
        get(api, "Secret", ns, "arithmetic-signing-key") or get(api, "Secret", ns, "arithmetic-redis-url")
    ), timeout=30)  # fmt: skip

    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(CHART) as chart:
        objects = render_chart(chart, CHART_VALUES)
    calls = [c for c in emulator.cluster.calls if c.token == "operator"]
    assert any(c.verb == "create" and c.resource == "secrets" for c in calls)
    refused = sorted({(c.verb, c.group, c.resource) for c in denied(calls, objects)})
    assert not refused, f"requests the chart's RBAC denies: {refused}"


def labelled(doc: dict, release: str) -> dict:
    """A document as the chart renders it from values (`runs:`): the release's labels."""
    labels = {"app.kubernetes.io/instance": release, "app.kubernetes.io/managed-by": "Helm"}
    return {**doc, "metadata": {**doc["metadata"], "labels": labels}}


def test_the_uninstall_hook_lets_no_run_get_stuck_on_its_finalizer(cluster, guarded_redis, tmp_path):
    """Bug: `helm uninstall` deleted the release's runs and the operator together; the runs, holding the operator's
    finalizer, stayed Terminating for good."""
    emulator, api = cluster
    ours, theirs = "t-uninstall", "t-uninstall-other"
    for doc in example():
        create(api, ours, labelled(doc, "rl"))
    apply_example(api, theirs, guarded_redis.url)
    for ns in (ours, theirs):
        wait_for("the finalizer", lambda ns=ns: get(api, "RLRun", ns, "arithmetic")["metadata"].get("finalizers"))

    client = connect(str(emulator.kubeconfig(tmp_path / "hook", token="hook")))
    said: list[str] = []
    try:
        # another run exists: refused before anything is deleted (Helm stops the uninstall)
        assert uninstall.uninstall(client, "rl", delete_runs="release", say=said.append) == 1
        assert "t-uninstall-other/arithmetic" in said[-1] and "uninstall.deleteRuns: all" in said[-1]
        assert get(api, "RLRun", ours, "arithmetic") and get(api, "RLRun", theirs, "arithmetic")

        # with `all`, both go, and the hook returns once the operator has let them go
        assert uninstall.uninstall(client, "rl", delete_runs="all", timeout_s=60, poll_s=0.5, say=said.append) == 0
        assert get(api, "RLRun", ours, "arithmetic") is None and get(api, "RLRun", theirs, "arithmetic") is None
    finally:
        client.close()

    helm = pytest.importorskip("helm_python")
    with helm.Chart.load(CHART) as chart:
        objects = render_chart(chart, CHART_VALUES)
    [job] = [o for o in objects if o["kind"] == "Job"]
    hook_sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    [operator_sa] = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
    assert hook_sa == operator_sa, "the hook runs with the operator's grants"
    calls = [c for c in emulator.cluster.calls if c.token == "hook"]
    refused = sorted({(c.verb, c.group, c.resource) for c in denied(calls, objects)})
    assert calls and not refused, f"requests of the hook the chart's RBAC denies: {refused}"


def test_bad_store_defaults_stop_the_operator_with_the_value_to_fix(monkeypatch):
    monkeypatch.setenv("RLFLEET_DEFAULT_STORE", '{"uri": "file:///data"}')
    with pytest.raises(SystemExit, match=r"defaults.store.*s3://bucket/prefix"):
        OperatorOptions.from_env()
    monkeypatch.setenv("RLFLEET_DEFAULT_STORE", '{"uri": "s3://b/p", "credentialsSecret": "Not_A_Name"}')
    with pytest.raises(SystemExit, match=r"defaults.store.*credentialsSecret"):
        OperatorOptions.from_env()
