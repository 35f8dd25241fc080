"""A run whose model is a hub id, in the cluster in a box (issue #24): a hub (tests/hub_server.py) on a host of
the cluster's network serves the example's model as `acme/tiny-arithmetic`; the run's `spec.model.path` is
`hf://acme/tiny-arithmetic` and the trainer's podTemplate sets HF_ENDPOINT. The hub logs every request's
client address: only the trainer pod fetches the model; the rollout workers, which have neither the hub's
address nor any credential for it, start from version 0 as their relay serves it, and the run completes."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from rlfleet.operator import names
from tests.cluster.inabox import Box, helm, kubelet
from tests.cluster.inabox.images import REPO
from tests.cluster.scenario import (
    NS,
    Kubectl,
    cluster_secrets,
    complete,
    example_docs,
    make_bucket,
    prebuilt_model,
    trainer_records,
    wait_for,
)
from tests.cluster.test_one_cluster import OPERATOR_SA, POOL, RUN, VALUES, pods_of

# Enough steps that the workers are still up when the test reads them: with 3 the run was over 2 s after the
# workers started in CI, before the test saw a worker ready, and the test waited out its 180 s.
STEPS = 20
HUB_NAME, HUB_PORT = "hub.inabox.test", 8000


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box"), pods="processes") as b:
        yield b


def test_only_the_trainer_pod_fetches_a_hub_model_and_workers_start_from_version_0(box):
    cluster = box.cluster("a")
    cluster.s3_url = box.s3(cluster)
    make_bucket(box)
    model = shutil.copytree(prebuilt_model(), box.root / "hub" / "tiny-arithmetic")
    host = box.tb.host("hub", site=cluster.site)
    log = box.root / "hub-requests.jsonl"
    argv = [sys.executable, "-m", "tests.hub_server", "--repo", f"acme/tiny-arithmetic={model}"]
    argv += ["--port", str(HUB_PORT), "--log", str(log)]
    with open(box.root / "hub.log", "ab") as out:
        hub = box.popen(host, argv, cwd=REPO, stdout=out, stderr=out)
    box.publish(HUB_NAME, host.ip)
    k = Kubectl(cluster)
    try:
        cluster_secrets(k, box.root)
        helm.install(cluster, VALUES, release="rlfleet", namespace=NS)
        watching = lambda: [  # noqa: E731
            c for c in cluster.api.calls_of(OPERATOR_SA) if (c.call.verb, c.call.resource) == ("watch", "rlruns")
        ]
        wait_for("the operator watching RLRuns", watching, 120)
        docs = example_docs(STEPS, cluster.s3_url, model)
        spec = docs[0]["spec"]
        spec["model"]["path"] = "hf://acme/tiny-arithmetic"
        hub_env = [{"name": "HF_ENDPOINT", "value": f"http://{HUB_NAME}:{HUB_PORT}"}]
        spec["trainer"]["podTemplate"] = {"spec": {"containers": [{"name": "trainer", "env": hub_env}]}}
        k.apply(docs)
        # The waits add up to less than the suite's 600 s timeout, so a stall fails naming what it waited for, with
        # the pods' logs (conftest.py), instead of being killed by pytest-timeout (the run takes about 60 s here).
        [trainer] = wait_for("the trainer pod ready", lambda: pods_of(cluster, f"{RUN}-trainer", ready=True), 180)
        workers = wait_for("a worker ready", lambda: pods_of(cluster, f"{POOL}-rollout", ready=True), 180)
        for worker in workers:  # read while they run: a complete run scales them to 0
            environ = kubelet.environment_of(cluster.runner.find(NS, worker["name"]))
            assert environ.get(names.ENV_POD_NAME) == worker["name"], "the container's own environment"
            # HF_HOME is the image's cache location, no way to the hub; the hub's address and any credential are
            leaked = sorted(k for k in environ if k in ("HF_ENDPOINT", "HF_TOKEN") or k.startswith("AWS_"))
            assert leaked == [], f"{worker['name']} has {leaked}"
        wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=180, every=2)
        assert [r["step"] for r in trainer_records(cluster, RUN)] == list(range(1, STEPS + 1))
        requests = [json.loads(line) for line in log.read_text().splitlines()]
        model_requests = [r for r in requests if r["path"] != "/api/agent-harnesses"]  # the library's own look-up
        assert any("/resolve/" in r["path"] for r in model_requests), requests
        assert {r["client"] for r in model_requests} == {trainer["ip"]}, (requests, trainer["ip"])
        assert all(r["agent"].endswith("rlfleet/trainer") for r in model_requests), requests
    finally:
        k.close()
        hub.terminate()
        hub.wait(10)
