"""One apply to a running run in a cluster in a box (issue 28): the chart installed with its Redis (a generated
password, nothing named) and a store in `defaults.store`, then examples/arithmetic/rlrun.yaml applied as it
is: no signing key Secret, no Redis URL, no store in it. The operator makes the run's Secrets, every pod
reaches the password-protected Redis, and the run completes. Then `helm uninstall`'s pre-delete hook runs (its
Job's pod template, which the box runs as a Deployment: it has no Job controller) and the run goes, finalizer and all.

What differs from the file: trainer.steps (3, not 150: what is tested is the wiring, not the learning) and
the trainer's podTemplate mounting the node's prebuilt model (the box's stand-in for a pre-pulled model).
Pods as processes only: the wiring is the same in both runner modes. The same again, in a box of its own, for
examples/calculator/rlrun.yaml, whose workers send multi-turn episodes of a tool-using model (#44).
"""

from __future__ import annotations

import pytest
import redis
import yaml

from rlfleet.wire.streams import RunKeys
from tests.cluster.inabox import Box, helm
from tests.cluster.scenario import (
    BUCKET,
    EXAMPLE,
    NS,
    Kubectl,
    complete,
    make_bucket,
    node_model_cache,
    prebuilt_model,
    run_redis,
    trainer_records,
    wait_for,
)
from tests.support import REPO

STEPS = 3
CALCULATOR = REPO / "examples" / "calculator" / "rlrun.yaml"  # multi-turn episodes of a tool-using model (#44)
HOOK = "rlfleet-uninstall-hook"


def job_stand_in(job: dict) -> dict:
    """The hook Job's pod template as a one-replica Deployment: the box's kubelet runs the pods of Deployments and
    StatefulSets only (it has no Job controller). Its restarts after the first exit do not matter: the test reads
    the first exit code."""
    template = job["spec"]["template"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": HOOK, "namespace": NS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": template["metadata"]["labels"]},
            "template": {**template, "spec": {**template["spec"], "restartPolicy": "Always"}},
        },
    }


def values(s3_url: str) -> dict:
    store = {"uri": f"s3://{BUCKET}/runs", "endpointUrl": s3_url, "credentialsSecret": "rlfleet-s3"}
    return {
        "fullnameOverride": "rlfleet",
        "redis": {"enabled": True},  # auth.enabled by default: a generated password
        "defaults": {"store": store},
        "uninstall": {"deleteRuns": "all"},  # the run was applied with kubectl, not rendered by the release
        "operator": {"extraEnv": [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "2"}]},
    }


@pytest.fixture
def box(tmp_path):
    with Box(tmp_path / "box") as opened:
        yield opened


@pytest.mark.parametrize("example", [EXAMPLE, CALCULATOR], ids=["arithmetic", "calculator"])
def test_the_example_applied_as_it_is_completes_and_uninstall_lets_it_go(box, example):
    a = box.cluster("a")
    s3_url = box.s3(a)
    make_bucket(box)
    k = Kubectl(a)
    try:
        k.secret("rlfleet-s3", {"AWS_ACCESS_KEY_ID": "rlfleet", "AWS_SECRET_ACCESS_KEY": "box-secret",
                                "AWS_DEFAULT_REGION": "us-east-1"})  # fmt: skip
        objects = helm.install(a, values(s3_url), release="rlfleet", namespace=NS)
        docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
        docs[0]["spec"]["trainer"].update(steps=STEPS, podTemplate=node_model_cache(prebuilt_model(example)))
        k.apply(docs)
        name = docs[0]["metadata"]["name"]

        run = wait_for(f"RLRun {name} Complete", lambda: complete(k, name), timeout=900)
        assert run["status"]["phase"] == "Succeeded" and run["status"]["step"] == STEPS, run["status"]
        assert run["spec"]["store"]["uri"] == f"s3://{BUCKET}/runs"
        turns = [r["turns_mean"] for r in trainer_records(a, name)]
        assert len(turns) == STEPS and all(t > 1 if example == CALCULATOR else t == 1 for t in turns), turns
        signing = k.read_secret(f"{name}-signing-key")
        assert signing["public-key"].startswith("ed25519:") and "PRIVATE KEY" in signing["signing-key"]
        password = k.read_secret("rlfleet-redis-auth")["password"]
        assert k.read_secret(f"{name}-redis-url")["url"].startswith(f"redis://:{password}@rlfleet-redis.")
        client = run_redis(a, password)
        assert client.exists(RunKeys(name).policy), "the run's versions went through the chart's Redis"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=client.connection_pool.connection_kwargs["port"]).ping()

        # `helm uninstall`: the pre-delete hook first, while the operator runs
        [job] = helm.hooks(objects, "pre-delete")
        helm.create(a.client(), job_stand_in(job))
        exit_event = wait_for(
            "the hook's exit",
            lambda: next((e for e in a.runner.events if e["pod"].startswith(HOOK) and e["event"] == "exited"), None),
            timeout=300,
        )
        assert exit_event["exit"] == 0, f"the hook failed: {exit_event}"
        assert k.get("RLRun", name) is None, "the hook returned with the run still there"
        assert not client.exists(RunKeys(name).policy), "the operator deleted the run's Redis keys before letting it go"
    finally:
        k.close()
