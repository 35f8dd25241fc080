"""A trainer replica of 2 ranks in the cluster in a box (issue #25): the example with `ranksPerReplica: 2` and
a resume state every 3 steps; the operator's trainer pod runs one container, `rlfleet trainer --ranks 2`, whose
two rank processes (gloo on the CPU) have the torchrun environment and the pod's memory-backed /dev/shm, and
the run trains to completion with every step recorded once."""

from __future__ import annotations

import psutil
import pytest

from tests.cluster.inabox import Box, helm, kubelet
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
from tests.cluster.test_one_cluster import OPERATOR_SA, RUN, VALUES, pods_of

STEPS = 12


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box"), pods="processes") as b:
        yield b


def test_a_trainer_pod_of_two_ranks_trains_the_example_to_completion(box):
    cluster = box.cluster("a")
    cluster.s3_url = box.s3(cluster)
    make_bucket(box)
    k = Kubectl(cluster)
    try:
        cluster_secrets(k, box.root)
        helm.install(cluster, VALUES, release="rlfleet", namespace=NS)
        watching = lambda: [  # noqa: E731
            c for c in cluster.api.calls_of(OPERATOR_SA) if (c.call.verb, c.call.resource) == ("watch", "rlruns")
        ]
        wait_for("the operator watching RLRuns", watching, 120)
        docs = example_docs(STEPS, cluster.s3_url, prebuilt_model())
        docs[0]["spec"]["trainer"].update(ranksPerReplica=2, checkpointEvery=3)
        k.apply(docs)
        [pod] = wait_for("the trainer pod ready", lambda: pods_of(cluster, f"{RUN}-trainer", ready=True), 300)
        parent = psutil.Process(kubelet.main_pid(cluster.runner.find(NS, pod["name"])))
        ranks = wait_for("its 2 rank processes", lambda: len(parent.children()) == 2 and parent.children(), 120)
        environ = sorted((p.environ() for p in ranks), key=lambda e: e["LOCAL_RANK"])
        assert [(e["LOCAL_RANK"], e["RANK"], e["WORLD_SIZE"], e["GROUP_RANK"]) for e in environ] == [
            ("0", "0", "2", "0"),
            ("1", "1", "2", "0"),
        ]
        assert "--ranks" in parent.cmdline() and all(p.cmdline()[-2:] == ["--ranks", "2"] for p in ranks)
        shm = cluster.runner.find(NS, pod["name"]).volume_dir("shm")
        assert shm.is_dir(), "the pod's /dev/shm volume"
        wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=900, every=2)
        records = trainer_records(cluster, RUN)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        seen = [rid for r in records for rid in r["rollout_ids"]]
        assert len(seen) == len(set(seen)), "no group trained twice"
        exits = [e for e in cluster.runner.events if e["event"] == "exited"]
        assert not exits, f"containers that exited on their own: {exits}"
    finally:
        k.close()
