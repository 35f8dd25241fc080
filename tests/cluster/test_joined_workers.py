"""Outside workers that join by themselves (issue 29): a run in a cluster of the box whose ingest admits anyone
(`spec.ingest.admission.mode: open`) gets all its groups from three machines outside the cluster, each started
as an outside worker starts, from the run document's URL alone: two run `rlfleet join URL`, the third is the
same worker cheating (tests/cluster/cheating_worker.py: every group it posts is a forced answer, proven by a
real prefill). The run completes; the cheat is banned and none of its groups is trained; both honest workers'
groups are trained and neither is banned.

The cluster: the chart with its Redis, the run's ingest and its relay tier exposed through LoadBalancer Services
with external-dns names (`exposeIngests`, `exposeRelays`; the run announces the relay's public URL in
`admission.relayUrls`). The outside machines are hosts of a site of their own routed to the cluster's bridge:
they resolve only those public names and are given nothing of the run but the URL.

What differs from examples/arithmetic/rlrun.yaml: no InferencePool (every group comes through the door), the
admission, trainer.steps (10), the probation rate (60 groups a minute: the default 6 would make the run wait on
it), the node's model cache for the trainer, the box's S3. Pods as processes."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from rlfleet.config import BanPolicySpec
from rlfleet.fleet.reputation import worker_stats
from rlfleet.wire.streams import RunKeys
from tests.cluster.inabox import Box, helm
from tests.cluster.inabox.images import REPO
from tests.cluster.inabox.runner import EXTERNAL_DNS
from tests.cluster.scenario import (
    NS,
    Kubectl,
    cluster_secrets,
    complete,
    example_docs,
    make_bucket,
    prebuilt_model,
    run_redis,
    trainer_records,
    wait_for,
)

RUN, TIER, STEPS = "arithmetic", "arithmetic-tier0", 10
INGEST, RELAY = "ingest.rlfleet-box.example.org", "relay.rlfleet-box.example.org"
URL = f"http://{INGEST}:8080/v1/{RUN}"  # the run document: what the run's owner hands out
WORKERS = {"honest-a": False, "honest-b": False, "cheat": True}  # outside machine -> cheats
VALUES = {  # the chart's defaults, its Redis (password from a Secret), the run's ingest and relay tier exposed
    "fullnameOverride": "rlfleet",
    "redis": {"enabled": True, "auth": {"existingSecret": "rlfleet-redis"}},
    "operator": {"extraEnv": [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "3"}]},
    "exposeIngests": [{"run": RUN, "type": "LoadBalancer", "annotations": {EXTERNAL_DNS: INGEST}}],
    "exposeRelays": [{"tier": TIER, "type": "LoadBalancer", "annotations": {EXTERNAL_DNS: RELAY}}],
}


def open_run(s3_url: str) -> list[dict]:
    """The arithmetic example as the module docstring says: the RLRun and its relay tier, no pool."""
    docs = [d for d in example_docs(STEPS, s3_url, prebuilt_model()) if d["kind"] != "InferencePool"]
    admission = {"mode": "open", "relayUrls": [f"http://{RELAY}:8080"], "probationRatePerMinute": 60}
    docs[0]["spec"]["ingest"] = {"admission": admission}
    return docs


def outside_worker(box: Box, site, name: str, cheats: bool, directory):
    """A machine outside the cluster running `rlfleet join URL` (or the cheat's same command); its process."""
    host = box.new_host(name, site)
    box.set_names(host, box.public_names())  # the internet's DNS: the exposed ingest and relay
    module = "tests.cluster.cheating_worker" if cheats else "rlfleet.cli"
    argv = [sys.executable, "-m", module, *([] if cheats else ["join"]), URL, "--work-dir", str(directory / name)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}  # nothing of the run's
    environ.update(PYTHONPATH=str(REPO), RLFLEET_TORCH_THREADS="1")
    with open(directory / f"{name}.log", "wb") as log:
        return box.popen(host, argv, stdout=log, stderr=log, env=environ, cwd=REPO)


@pytest.fixture(scope="module")
def joined(tmp_path_factory):
    with Box(tmp_path_factory.mktemp("box")) as box:
        a = box.cluster("a")
        s3_url = box.s3(a)
        make_bucket(box)
        k = Kubectl(a)
        password = cluster_secrets(k, box.root)
        helm.install(a, VALUES, release="rlfleet", namespace=NS)
        k.apply(open_run(s3_url))
        wait_for("the exposed ingest and relay named", lambda: {INGEST, RELAY} <= set(box.public_names()), 300)
        internet = box.outside("internet", a)
        directory = box.root / "outside"
        directory.mkdir()
        workers = {name: outside_worker(box, internet, name, cheats, directory) for name, cheats in WORKERS.items()}
        started = time.monotonic()
        wait_for(f"RLRun {RUN} Complete", lambda: complete(k, RUN), timeout=600, every=2)
        seconds = time.monotonic() - started
        wait_for("the cheat's worker ended by a refusal", lambda: workers["cheat"].poll() is not None, 60)
        ids = {}
        for name, proc in workers.items():
            ids[name] = json.loads((directory / name / "credentials.json").read_text())["worker_id"]
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        yield {
            "k": k, "ids": ids, "seconds": seconds, "logs": directory, "cheat_exit": workers["cheat"].returncode,
            "stats": worker_stats(run_redis(a, password), RunKeys(RUN)), "records": trainer_records(a, RUN),
        }  # fmt: skip
        k.close()


def test_outside_workers_join_through_the_door_and_the_run_completes_with_one_of_three_cheating(joined):
    ids, stats, records = joined["ids"], joined["stats"], joined["records"]
    run = joined["k"].get("RLRun", RUN)
    assert run["status"]["step"] == STEPS, run["status"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # three distinct workers joined through the door (each its own id and token)
    assert len(set(ids.values())) == 3, ids
    cheat, honest = ids["cheat"], {ids["honest-a"], ids["honest-b"]}
    trained = [w for r in records for w in r["worker_ids"]]
    print(
        f"{STEPS} steps in {joined['seconds']:.0f}s from joined workers; trained groups per worker: "
        f"{ {name: trained.count(w) for name, w in ids.items()} }; cheat: {stats[cheat]}"
    )
    # the cheat: banned on a check an honest worker cannot fail (every group of a worker on probation is
    # prefill-checked), none of its groups ever accepted or trained, its next request refused
    ban = stats[cheat]["banned"]
    assert ban is not None and ban["reason"] in BanPolicySpec().ban_on, stats[cheat]
    assert stats[cheat]["counters"].get("accepted", 0) == 0, stats[cheat]
    assert cheat not in trained
    log = (joined["logs"] / "cheat.log").read_text(errors="replace")
    refused = "HTTP 403" in log and f"worker '{cheat}' is banned from run '{RUN}'" in log
    assert joined["cheat_exit"] != 0 and refused, log[-3000:]
    # the honest: every trained group is theirs, both were trained, neither was banned nor rejected for content
    assert set(trained) == honest, set(trained)
    for name in ("honest-a", "honest-b"):
        counters, banned = stats[ids[name]]["counters"], stats[ids[name]]["banned"]
        verdicts = {c for c in counters if c.startswith("rejected:") and c != "rejected:stale_version"}
        assert banned is None and not verdicts and counters["accepted"] > 0, (name, counters, banned)
