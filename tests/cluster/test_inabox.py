"""The box itself, on small workloads of plain Python servers: what the pod runner promises (controllers,
kubelet, DNS, volumes, environment, restarts, probes) is what the operator's tests then rely on. Every
test runs twice: pods as processes, and pods as podman containers of the CPU image (`make images`;
skipped with the reason where podman or the image is missing)."""

from __future__ import annotations

import functools
import json
import os

import pytest
import requests

from testbed.commands import namespaces
from tests.cluster.inabox import Box, kubelet, oci, zygote
from tests.cluster.inabox.helm import create
from tests.containers import CPU_IMAGE, podman, require
from tests.support import wait_for as poll

NS = "web"
# Process mode runs any tag of the project's images from this checkout; container mode the image built here.
wait_for = functools.partial(poll, timeout=60, every=0.2)
IMAGE = {"processes": "ghcr.io/rlfleet/rlfleet:0.0.0", "containers": CPU_IMAGE}
# Serves GET /ready (200 once FILE /tmp/unready is absent), /env, /file?p=PATH, /get?url=URL (a fetch made
# from inside the pod), and exits with code 3 on /crash.
SERVER = r"""
import json, os, sys, urllib.parse, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        u = urllib.parse.urlparse(self.path); q = dict(urllib.parse.parse_qsl(u.query))
        if u.path == "/crash": os._exit(3)
        if u.path == "/ready": code, body = (503, b"") if os.path.exists("/tmp/unready") else (200, b"ok")
        elif u.path == "/env": code, body = 200, json.dumps(dict(os.environ)).encode()
        elif u.path == "/file": code, body = 200, open(q["p"], "rb").read()
        elif u.path == "/get":
            try: code, body = 200, urllib.request.urlopen(q["url"], timeout=5).read()
            except OSError as e: code, body = 502, str(e).encode()
        else: code, body = 404, b""
        self.send_response(code); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def workload(kind: str, name: str, replicas: int, image: str, extra_env: list[dict] | None = None) -> dict:
    labels = {"app": name}
    container = {
        "name": "web",
        "image": image,
        "command": ["python", "-c", SERVER],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "URL", "value": "redis://:$(PASSWORD)@redis:6379"},
            *(extra_env or []),
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1},
        "volumeMounts": [
            {"name": "settings", "mountPath": "/etc/web", "readOnly": True},
            {"name": "creds", "mountPath": "/var/run/web/creds", "readOnly": True},
            {"name": "scratch", "mountPath": "/var/cache/web"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    spec = {
        "replicas": replicas,
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "containers": [container],
                "terminationGracePeriodSeconds": 2,
                "volumes": [
                    {"name": "settings", "configMap": {"name": "settings"}},
                    {"name": "creds", "secret": {"secretName": "creds"}},
                    {"name": "scratch", "emptyDir": {}},
                    {"name": "tmp", "emptyDir": {}},
                ],
            },
        },
    }
    if kind == "StatefulSet":
        spec.update(serviceName=name, podManagementPolicy="Parallel")
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": NS}, "spec": spec}


def service(name: str, headless: bool = False) -> dict:
    spec = {"selector": {"app": name}, "ports": [{"name": "http", "port": 8080, "targetPort": "http"}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def ready_pods(cluster, owner: str) -> list[dict]:
    return [p for p in cluster.runner.snapshot() if p["owner"][1] == owner and p["ready"] and not p["terminating"]]


def pods(cluster, owner: str) -> list[dict]:
    return [p for p in cluster.runner.snapshot() if p["owner"][1] == owner]


def get_in(cluster, pod: dict, path: str) -> requests.Response:
    """GET http://POD_IP:8080/path through a port forward into the pod's network."""
    found = cluster.runner.find(NS, pod["name"])
    from tests.cluster.inabox.netns import PortForward

    with PortForward(found.host.netns, found.host.ip, 8080) as fwd:
        return requests.get(f"http://127.0.0.1:{fwd.port}{path}", timeout=10)


@pytest.fixture(scope="module", params=["processes", "containers"])
def cluster(request, tmp_path_factory):
    mode = request.param
    if mode == "containers":
        require(CPU_IMAGE)
    with Box(tmp_path_factory.mktemp("box"), pods=mode) as box:
        c = box.cluster("t")
        c.image = IMAGE[mode]
        client = c.client()
        create(client, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        create(
            client,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "settings", "namespace": NS},
                "data": {"greeting": "hello"},
            },
        )
        create(
            client,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "creds", "namespace": NS},
                "stringData": {"password": "s3cret"},
            },
        )
        for obj in (
            service("web"),
            service("db", headless=True),
            workload("Deployment", "web", 2, c.image),
            workload("StatefulSet", "db", 2, c.image),
        ):
            create(client, obj)
        client.close()
        yield c
        tag = box.tb.tag
    assert not [ns for ns in namespaces() if ns.startswith(tag)], "the box left network namespaces behind"
    if mode == "containers":
        left = podman("ps", "--all", "--quiet", f"--filter=label={oci.LABEL}={c.runner.oci_id}").stdout.split()
        assert not left, f"the box left containers behind: {left}"


def test_pods_get_their_env_volumes_names_and_reach_each_other_by_service_names(cluster):
    web = wait_for("2 ready web pods", lambda: len(ready_pods(cluster, "web")) == 2 and ready_pods(cluster, "web"))
    db = wait_for("2 ready db pods", lambda: len(ready_pods(cluster, "db")) == 2 and ready_pods(cluster, "db"))
    assert sorted(p["name"] for p in db) == ["db-0", "db-1"]
    assert len({p["ip"] for p in web + db}) == 4, "each pod has its own IP"
    env = get_in(cluster, web[0], "/env").json()
    assert env["POD"] == web[0]["name"] and env["POD_IP"] == web[0]["ip"] and env["HOSTNAME"] == web[0]["name"]
    assert env["GREETING"] == "hello" and env["PASSWORD"] == "s3cret" and env["URL"] == "redis://:s3cret@redis:6379"
    assert get_in(cluster, web[0], "/file?p=/etc/web/greeting").text == "hello"
    assert get_in(cluster, web[0], "/file?p=/var/run/web/creds/password").text == "s3cret"
    token = get_in(cluster, web[0], "/file?p=/var/run/secrets/kubernetes.io/serviceaccount/namespace").text
    assert token == NS
    for url in (
        "http://db-1.db.web.svc.cluster.local:8080/ready",
        "http://db.web.svc:8080/ready",
        "http://web:8080/ready",
        "http://web.web.svc.cluster.local:8080/ready",
    ):
        answer = get_in(cluster, web[0], f"/get?url={url}")
        assert answer.status_code == 200 and answer.text == "ok", (url, answer.text)
    assert not cluster.runner.problems and not cluster.runner.errors
    status = cluster.runner.api.get("Deployment", NS, "web")["status"]
    assert status["readyReplicas"] == 2 and status["replicas"] == 2


def test_scaling_adds_and_removes_exactly_the_difference(cluster):
    wait_for("2 ready web pods", lambda: len(ready_pods(cluster, "web")) == 2)
    before = {p["name"] for p in pods(cluster, "web")}
    api = cluster.runner.api
    api.patch("Deployment", NS, "web", {"spec": {"replicas": 3}})
    three = wait_for("3 ready", lambda: len(ready_pods(cluster, "web")) == 3 and ready_pods(cluster, "web"))
    assert before < {p["name"] for p in three}
    api.patch("Deployment", NS, "web", {"spec": {"replicas": 1}})
    one = wait_for("1 pod", lambda: len(pods(cluster, "web")) == 1 and pods(cluster, "web"))
    assert one[0]["name"] in {p["name"] for p in three}
    assert all(p["restarts"] == 0 for p in three)
    api.patch("StatefulSet", NS, "db", {"spec": {"replicas": 1}})
    wait_for("db-1 removed", lambda: [p["name"] for p in pods(cluster, "db")] == ["db-0"])


def test_a_template_change_rolls_every_pod_and_a_crash_restarts_with_backoff(cluster):
    api = cluster.runner.api
    api.patch("Deployment", NS, "web", {"spec": {"replicas": 2}})
    old = wait_for("2 ready", lambda: len(ready_pods(cluster, "web")) == 2 and ready_pods(cluster, "web"))
    template = workload("Deployment", "web", 2, cluster.image, [{"name": "V", "value": "2"}])["spec"]["template"]
    api.patch("Deployment", NS, "web", {"spec": {"template": template}})
    new = wait_for(
        "2 new ready pods",
        lambda: (
            len(ready_pods(cluster, "web")) == 2
            and not {p["name"] for p in pods(cluster, "web")} & {p["name"] for p in old}
            and ready_pods(cluster, "web")
        ),
    )
    assert get_in(cluster, new[0], "/env").json()["V"] == "2"
    created = [e for e in cluster.runner.events if e["event"] == "created" and e["owner"] == ("Deployment", "web")]
    assert {e["pod"] for e in created} >= {p["name"] for p in new}
    # a crash: the same pod restarts (restartCount 1), after a back-off, and is ready again
    victim = new[0]
    with pytest.raises(requests.ConnectionError):
        get_in(cluster, victim, "/crash")
    pod = wait_for(
        "the restart",
        lambda: (
            next(p for p in pods(cluster, "web") if p["name"] == victim["name"])["restarts"] == 1
            and cluster.runner.find(NS, victim["name"])
        ),
    )
    assert pod.last_exit == 3 and pod.waiting in (None, "CrashLoopBackOff")
    wait_for("ready again", lambda: cluster.runner.find(NS, victim["name"]).ready, timeout=40)
    status = cluster.runner.api.get("Pod", NS, victim["name"])["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1 and status["lastState"]["terminated"]["exitCode"] == 3


def test_readiness_decides_the_endpoints(cluster):
    web = wait_for("2 ready", lambda: len(ready_pods(cluster, "web")) == 2 and ready_pods(cluster, "web"))
    sick, well = web
    found = cluster.runner.find(NS, sick["name"])
    get_in(cluster, sick, "/file?p=/etc/hostname")  # still served
    (found.volume_dir("tmp") / "unready").write_text("")
    wait_for("not ready", lambda: not cluster.runner.find(NS, sick["name"]).ready, timeout=20)
    for _ in range(3):  # every client now reaches the ready one through the Service name
        answer = get_in(cluster, sick, "/get?url=http://web:8080/env")
        assert answer.status_code == 200 and json.loads(answer.text)["POD"] == well["name"]


def test_namespaces_are_listed_as_kopf_lists_them(cluster):
    """An operator watching named namespaces lists and watches Namespaces first (kopf's observer)."""
    listed = requests.get(f"{cluster.api.url}/api/v1/namespaces", timeout=10)
    assert listed.status_code == 200, listed.text
    assert {"default", NS} <= {item["metadata"]["name"] for item in listed.json()["items"]}
    watched = requests.get(f"{cluster.api.url}/api/v1/namespaces?watch=true&timeoutSeconds=1", timeout=10)
    assert watched.status_code == 200 and watched.text == ""


def test_a_pod_runs_in_the_runtime_its_mode_names(cluster):
    """Process mode: the program is the pod's process, on this machine's filesystem. Container mode: it runs
    in a container of its image (the image's filesystem, its non-root user), named after the pod."""
    web = wait_for("a ready web pod", lambda: ready_pods(cluster, "web"))
    pod = cluster.runner.find(NS, web[0]["name"])
    pid = kubelet.main_pid(pod)
    assert open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:2] == [b"python", b"-c"]
    uid = next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("Uid:"))
    image_root = f"/proc/{pid}/root/opt/rlfleet/examples"  # the CPU image's WORKDIR holds the examples
    if cluster.runner.mode == "containers":
        [inspected] = json.loads(podman("container", "inspect", pod.container_name).stdout)
        assert inspected["ImageName"] == CPU_IMAGE and inspected["Config"]["Hostname"] == pod.name
        assert uid == "10001" and os.path.isdir(image_root)
    else:
        assert pod.container_name is None and uid == "0" and not os.path.isdir(image_root)


def test_a_pod_that_cannot_start_waits_with_the_reason(cluster):
    """As a kubelet: container mode refuses a container with runAsNonRoot whose image's user is root (the
    base image's): the pod waits in CreateContainerConfigError; process mode has no entry for that image:
    the pod waits in ErrImagePull, then ImagePullBackOff, the image named. Either way it never starts."""
    base = "localhost/rlfleet-base:bookworm"  # `make images` builds it first; its user is root
    rooted = workload("Deployment", "rooted", 1, base)
    rooted["spec"]["template"]["spec"]["securityContext"] = {"runAsNonRoot": True}
    client = cluster.client()
    create(client, rooted)
    client.close()
    [pod] = wait_for("the refused pod", lambda: pods(cluster, "rooted") or None)
    found = cluster.runner.find(NS, pod["name"])
    containers = cluster.runner.mode == "containers"
    if containers:
        wait_for("its reason", lambda: found.waiting == "CreateContainerConfigError")
    else:
        wait_for("its reason", lambda: found.waiting == "ImagePullBackOff")  # after ErrImagePull
    reason = "runAsNonRoot" if containers else f'Failed to pull image "{base}"'
    status = kubelet.status(found)["containerStatuses"][0]
    assert status["state"]["waiting"]["reason"] == found.waiting and status["image"] == base
    assert reason in found.message and found.proc is None and found.restarts == 0, found.message
    cluster.runner.api.delete("Deployment", NS, "rooted")


# A relay needs no Redis and no upstream to serve: the smallest rlfleet program that keeps running.
RELAY_RUN = """apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {name: relay-only}
spec:
  model: {path: "builtin://tiny-arithmetic"}
  task: {type: arithmetic}
  shardcast: {requireSignatures: false}
"""


def relay_workload(name: str, image: str, config: str) -> dict:
    """`rlfleet relay` on port 8080 of a Deployment of one pod, its RLRun from ConfigMap `relay-run` at /etc/relay."""
    relay = workload("Deployment", name, 1, image)
    template = relay["spec"]["template"]["spec"]
    container = template["containers"][0]
    container["command"] = ["rlfleet", "relay", "--config", config, "--metrics-port", "0", "--host", "0.0.0.0"]
    container["command"] += ["--port", "8080", "--upstream", "http://127.0.0.1:9", "--cache-dir", "/var/cache/web/r"]
    container["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1}
    container["volumeMounts"].append({"name": "relay-run", "mountPath": "/etc/relay", "readOnly": True})
    template["volumes"].append({"name": "relay-run", "configMap": {"name": "relay-run"}})
    return relay


def test_an_rlfleet_container_is_forked_into_the_pods_namespaces_and_behaves_as_started(cluster):
    """Process mode forks an `rlfleet <component>` container from a zygote that imported the components' code
    (zygote.py): its program is in the pod's network namespace (it serves on the pod's IP), runs with exactly the
    pod's environment and volumes, stops on the pod's SIGTERM with the status it exits with, and a crashing one
    exits with the status and last line the exec'd program gives. Container mode runs it in the image as before."""
    client = cluster.client()
    run = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "relay-run", "namespace": NS}}
    create(client, {**run, "data": {"rlrun.yaml": RELAY_RUN}})
    create(client, relay_workload("relay", cluster.image, "/etc/relay/rlrun.yaml"))
    create(client, relay_workload("broken", cluster.image, "/etc/relay/none.yaml"))
    client.close()
    [pod] = wait_for("a ready relay pod", lambda: ready_pods(cluster, "relay") or None)
    found = cluster.runner.find(NS, pod["name"])
    forked = cluster.runner.mode == "processes"
    assert isinstance(found.proc, zygote.ForkedPod) == forked
    assert get_in(cluster, pod, "/healthz").status_code < 500  # the relay answers on the pod's IP
    environ = kubelet.environment_of(found)
    assert environ["POD"] == pod["name"] and environ["GREETING"] == "hello", environ
    assert environ["URL"] == "redis://:s3cret@redis:6379"
    if forked:
        net = os.stat(f"/proc/{kubelet.main_pid(found)}/ns/net").st_ino
        assert net == os.stat(f"/run/netns/{found.host.netns}").st_ino, "the pod's network namespace"
    [crashing] = wait_for("the broken pod", lambda: pods(cluster, "broken") or None)
    crashed = cluster.runner.find(NS, crashing["name"])
    wait_for("its crash", lambda: crashed.restarts >= 1, timeout=120)
    assert isinstance(crashed.last_exit, int) and crashed.last_exit == 2, crashed.last_exit
    said = "/etc/relay/none.yaml: cannot read: No such file or directory"  # as the exec'd program says it
    assert said in crashed.log.read_text().splitlines()
    proc = found.proc
    cluster.runner.api.delete("Deployment", NS, "relay")
    cluster.runner.api.delete("Deployment", NS, "broken")
    assert proc.wait(30) in (0, -15, 143), "stopped by the pod's SIGTERM"
