"""Clusters in a box: one testbed (testbed) holding, per cluster, a site (its bridge), a host for
its API server and one host per pod; a routed, shaped link between two sites is a WAN; S3 is moto's
server on a host of its own, reached like an external endpoint.

    with Box(tmp_path) as box:             # Box(tmp_path, pods="containers"): pods as podman containers
        a = box.cluster("a")               # API server + pod runner on bridge a
        s3 = box.s3(a)                     # http://s3.inabox.test:9000, a name every pod resolves
        helm.install(a, values)            # the chart, as `helm install` applies it
        ...
Public names (the box's "internet DNS": S3, and the hostnames the external-dns annotation of a
LoadBalancer Service asks for) resolve in every pod of every cluster; a cluster's Service names only
in its own pods. Teardown stops each cluster's pods (SIGTERM, then SIGKILL), its API server, moto,
then the testbed (whatever still runs in its namespaces, and the namespaces). The testbed is not
thread-safe, so every call into it takes the box's lock (the pod runners run in threads).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import kubernetes
import requests

from testbed import Host, Site, Testbed
from testbed.commands import NETNS_ETC, sh

from .apiserver import ApiServer
from .netns import PortForward
from .runner import PodRunner
from .zygote import ZYGOTES

S3_NAME, S3_PORT = "s3.inabox.test", 9000
OPEN: list[Box] = []  # boxes now open (the failure report of tests/cluster/conftest.py reads them)


class Cluster:
    """One cluster of the box: `api` (its API server), `runner` (its pod runner), `site` (its bridge)."""

    def __init__(self, box: Box, name: str, site: Site, api: ApiServer, runner: PodRunner):
        self.box, self.name, self.site, self.api, self.runner = box, name, site, api, runner
        self.kubeconfig = api.kubeconfig(box.root / name / "kubeconfig")

    def client(self) -> kubernetes.client.ApiClient:
        """A `kubernetes` client logged in as the admin (kubectl's side of the tests)."""
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=config)
        return kubernetes.client.ApiClient(config)

    def service_endpoint(self, namespace: str, service: str, timeout: float = 60) -> Host:
        """The host of a ready pod behind a Service (waits for one)."""
        from .controllers import endpoints

        deadline = time.monotonic() + timeout
        while True:
            svc = self.runner.api.get("Service", namespace, service)
            with self.runner._lock:
                alive = [p for p in self.runner.pods.values() if p.terminating_since is None]
                behind = endpoints(svc, alive) if svc else []
            if behind:
                return behind[0].host
            assert time.monotonic() < deadline, f"no ready endpoint of Service {namespace}/{service}"
            time.sleep(0.5)

    def port_forward(self, namespace: str, service: str, port: int) -> PortForward:
        """`kubectl port-forward svc/SERVICE PORT`: 127.0.0.1:forward.port to a ready endpoint (closed with the box)."""
        host = self.service_endpoint(namespace, service)
        forward = PortForward(host.netns, host.ip, port)
        self.box.forwards.append(forward)
        return forward


class Box:
    """See the module docstring."""

    def __init__(self, root: Path, pods: str = "processes"):
        self.root, self.pods = root, pods  # pods: the runners' mode, "processes" or "containers" (runner.py)
        self.tb = Testbed()
        self.clusters: dict[str, Cluster] = {}
        self.forwards: list[PortForward] = []
        self._public: dict[str, str] = {}
        self._lock = threading.RLock()
        self._s3 = None

    def __enter__(self) -> Box:
        self.tb.__enter__()
        OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        try:
            for forward in self.forwards:
                forward.close()
            for cluster in self.clusters.values():
                cluster.runner.stop()
            for cluster in self.clusters.values():
                cluster.api.__exit__(None, None, None)
        finally:
            OPEN.remove(self)
            self.tb.close()

    # ---- building --------------------------------------------------------------------------------

    def cluster(self, name: str) -> Cluster:
        with self._lock:
            site = self.tb.site(name)
            api_host = self.tb.host(f"{name}-apiserver", site=site)
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        api = ApiServer(directory, api_host).__enter__()
        runner = PodRunner(name, self, api, site, directory / "pods", self.pods)
        cluster = self.clusters[name] = Cluster(self, name, site, api, runner)
        runner.start()
        return cluster

    def s3(self, cluster: Cluster) -> str:
        """moto's S3 server on a host of cluster's bridge; its public endpoint URL."""
        if self._s3 is None:
            with self._lock:
                host = self.tb.host("s3", site=cluster.site)
                log = open(self.root / "s3.log", "ab")
                # path-style buckets at any host name (moto would read a bucket from a dotted host name)
                env = {**os.environ, "S3_IGNORE_SUBDOMAIN_BUCKETNAME": "true"}
                argv = [sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p", str(S3_PORT)]
                proc = self.tb.popen(host, argv, stdout=log, stderr=log, env=env)
            self._s3 = (host, proc)
            self.publish(S3_NAME, host.ip)
            with PortForward(host.netns, host.ip, S3_PORT) as forward:
                deadline = time.monotonic() + 60
                while True:
                    assert proc.poll() is None, (self.root / "s3.log").read_text()
                    with contextlib.suppress(requests.ConnectionError):
                        requests.get(f"http://127.0.0.1:{forward.port}/", timeout=2)
                        break
                    assert time.monotonic() < deadline, "moto's S3 server did not start"
                    time.sleep(0.5)
        return f"http://{S3_NAME}:{S3_PORT}"

    def s3_forward(self) -> PortForward:
        host = self._s3[0]
        forward = PortForward(host.netns, host.ip, S3_PORT)
        self.forwards.append(forward)
        return forward

    def connect(self, a: Cluster, b: Cluster, rate):
        """A routed WAN link between two clusters' bridges, shaped to `rate` each way."""
        with self._lock:
            return self.tb.connect(a.site, b.site, rate)

    def outside(self, name: str, cluster: Cluster, rate=None) -> Site:
        """A site of machines outside every cluster (the internet's), routed to `cluster`'s bridge; a host on
        it (`new_host`) is in no cluster: it resolves only the names `set_names` gives it (`public_names`)."""
        with self._lock:
            site = self.tb.site(name)
            self.tb.connect(cluster.site, site, rate)
        return site

    def link_bytes(self, link) -> tuple[int, int]:
        """(bytes a sent to b, bytes b sent to a) over a WAN link so far, from its interfaces' counters."""
        import json

        with self._lock:
            stats = json.loads(sh("ip", "-j", "-s", "link", "show", link.a_dev, netns=link.a.netns))
        return stats[0]["stats64"]["tx"]["bytes"], stats[0]["stats64"]["rx"]["bytes"]

    # ---- what the pod runners ask of the testbed ---------------------------------------------------

    def new_host(self, name: str, site: Site) -> Host:
        with self._lock:
            return self.tb.host(name, site=site)

    def set_names(self, host: Host, names: dict[str, str]) -> None:
        with self._lock:
            self.tb.set_names(host, names)

    def hosts_file(self, host: Host) -> Path:
        return NETNS_ETC / host.netns / "hosts"

    def popen(self, host: Host, argv: list[str], **kwargs):
        with self._lock:
            return self.tb.popen(host, argv, **kwargs)

    def fork_pod(self, host: Host, argv: list[str], spec: Path, env: dict[str, str], log: Path):
        """A pod's program forked from a zygote inside `host` (zygote.py); None when it must start by exec. A zygote
        that has to start first does so outside the box's lock (the other clusters' runners go on meanwhile)."""
        path = ZYGOTES.socket_for(env)
        if path is None:
            return None
        with self._lock:
            return self.tb.start_in(host, lambda netns: ZYGOTES.fork(path, argv, spec, netns, log))

    def publish(self, name: str, ip: str | None) -> None:
        with self._lock:
            if ip is None:
                self._public.pop(name, None)
            else:
                self._public[name] = ip

    def public_names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._public)

    # ---- reports -------------------------------------------------------------------------------------

    def report(self, lines_per_pod: int = 40) -> str:
        """What every pod logged (its last lines), the runners' errors and problems: for a failed test."""
        out = []
        for cluster in self.clusters.values():
            runner = cluster.runner
            for problem in sorted(runner.problems):
                out.append(f"[{cluster.name}] problem: {problem}")
            for error in runner.errors[-5:]:
                out.append(f"[{cluster.name}] runner error: {error}")
            for pod in runner.all_pods():
                state = "removed" if pod in runner.gone else ("running" if pod.running else pod.waiting)
                out.append(f"==== [{cluster.name}] {pod.namespace}/{pod.name} ({state}, restarts {pod.restarts})")
                if pod.log.exists():
                    out += pod.log.read_text(errors="replace").splitlines()[-lines_per_pod:]
        return "\n".join(out)
