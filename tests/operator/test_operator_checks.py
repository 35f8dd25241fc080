"""What the operator refuses or reports before a pod would fail: Secrets it cannot read or that lack a
key, files a pod cannot have, remote runs; and that deleting a run never hangs on them."""

from __future__ import annotations

import time

import requests
import yaml

from tests.operator.kubectl import (
    SIGNING_SECRET,
    apply_example,
    condition,
    create,
    events,
    example,
    get,
    has_condition,
    redis_db,
    secret,
    url_of,
)
from tests.support import REPO, wait_for


def test_deleting_a_run_whose_redis_secret_is_forbidden_finishes(api, emulator, redis_url):
    """Bug: an RBAC-denied Secret read made the delete handler retry forever (RLRun stuck Terminating)."""
    ns = "t-forbidden"
    emulator.cluster.forbidden.add(("secrets", ns, "redis-auth"))
    apply_example(api, ns, redis_url, redis={"urlSecret": "redis-auth"})
    run = wait_for(
        "the forbidden Secret reported",
        lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "SecretForbidden"),
    )
    assert "redis-auth" in condition(run)["message"] and "get" in condition(run)["message"]
    assert requests.delete(url_of(api, "RLRun", ns, "arithmetic"), timeout=5).status_code == 200
    started = time.monotonic()
    wait_for("RLRun gone", lambda: get(api, "RLRun", ns, "arithmetic") is None, timeout=20)
    assert time.monotonic() - started < 20


def test_a_signing_secret_without_its_public_key_is_reported_then_recovers(api, redis_url):
    """Bug: the multi-cluster steps made the signing Secret without `public-key`; origin, verifier and
    relay pods then fail with CreateContainerConfigError. The operator says which key is missing."""
    ns = "t-signing"
    secret(api, ns, "arithmetic-signing", {"signing-key": SIGNING_SECRET["signing-key"]})
    apply_example(api, ns, redis_db(redis_url, 1), signing_secret=False)
    run = wait_for(
        "SecretKeyMissing", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "SecretKeyMissing")
    )
    message = condition(run)["message"]
    assert "arithmetic-signing" in message and "public-key" in message
    assert events(api, ns, "SecretKeyMissing")[0]["type"] == "Warning"
    requests.delete(url_of(api, "Secret", ns, "arithmetic-signing"), timeout=5)
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    wait_for(
        "Pending (not blocked) once the key is there",
        lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "False", "Pending"),
    )


def test_a_remote_run_is_ready_with_only_its_config(api, redis_url):
    """Bug: `remote: true` made the reconcile handler raise KeyError('StatefulSet')."""
    ns = "t-remote"
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    docs = example(redis_url, remote=True, store={})
    for doc in docs[:1]:
        create(api, ns, doc)
    run = wait_for("remote run Ready", lambda: has_condition(api, "RLRun", ns, "arithmetic", "Ready", "True"))
    assert condition(run)["reason"] == "Remote"
    assert get(api, "ConfigMap", ns, "arithmetic-config") is not None
    for kind, name in (("StatefulSet", "arithmetic-trainer"), ("Deployment", "arithmetic-verifier")):
        assert get(api, kind, ns, name) is None


def _math_docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_files_a_pod_cannot_have_are_refused_with_the_fix(api, redis_url):
    """Bug: the math examples' dataset path is relative to the repository; in a pod it does not exist.
    And engine vllm without GPUs needs an image with vLLM for CPU, which neither default image has."""
    ns = "t-files"
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    run, pool, _tier = _math_docs(REPO / "examples" / "math" / "rlrun-vllm.yaml")
    run["metadata"]["name"] = "math-vllm"
    run["spec"]["task"]["dataset"]["path"] = "data/samples/tiny-math.jsonl"
    run["spec"].update(
        redis={"url": redis_db(redis_url, 2)},
        store={"uri": "s3://ckpt/runs"},
        shardcast={"signingKeySecret": "arithmetic-signing"},
    )
    pool["spec"].pop("gpus", None)
    create(api, ns, run)
    create(api, ns, pool)
    refused = wait_for(
        "InvalidSpec on the run", lambda: has_condition(api, "RLRun", ns, "math-vllm", "Ready", "False", "InvalidSpec")
    )
    assert "spec.task.dataset.path" in condition(refused)["message"]
    assert "s3://" in condition(refused)["message"] and "builtin://" in condition(refused)["message"]
    assert has_condition(api, "RLRun", ns, "math-vllm", "Failed", "True", "InvalidSpec")
    # fixing the run lets the pool be judged: vLLM on CPU in the default images is refused, naming the fix
    requests.patch(
        url_of(api, "RLRun", ns, "math-vllm"),
        json={"spec": {"task": {"dataset": {"path": "builtin://tiny-math"}}}},
        headers={"Content-Type": "application/merge-patch+json"},
        timeout=5,
    )
    wait_for("run accepted", lambda: has_condition(api, "RLRun", ns, "math-vllm", "Ready", "False", "Pending"))
    pool_obj = wait_for(
        "InvalidSpec on the pool",
        lambda: has_condition(api, "InferencePool", ns, "math-vllm-cpu", "Ready", "False", "InvalidSpec"),
    )
    assert "spec.engine" in condition(pool_obj)["message"] and "spec.gpus" in condition(pool_obj)["message"]


def test_pools_with_gpus_run_the_gpu_image_with_the_pull_settings(api, redis_url):
    """Bug: the chart set RLFLEET_GPU_IMAGE and RLFLEET_IMAGE_PULL_POLICY, which the operator never read,
    and no workload got imagePullSecrets."""
    ns = "t-images"
    secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    docs = example(redis_db(redis_url, 3))
    docs[1]["spec"]["gpus"] = 1
    for doc in docs:
        create(api, ns, doc)
    rollout = wait_for("rollout workload", lambda: get(api, "Deployment", ns, "arithmetic-cpu-rollout"))
    pod = rollout["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.test/rlfleet-gpu:9"
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    trainer = wait_for("trainer", lambda: get(api, "StatefulSet", ns, "arithmetic-trainer"))
    assert trainer["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.test/rlfleet:9"
