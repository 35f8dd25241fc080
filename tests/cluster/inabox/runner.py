"""The pod runner of one cluster in the box: the workload controllers, the kubelet and the cluster DNS
in one loop, against the cluster's API server (as its admin, over 127.0.0.1).

Every TICK_S it lists Deployments, StatefulSets and Services, and
1. removes the pods of workloads that are gone, and applies each workload's plan (controllers.py):
   new pods (each a testbed host of its own on the cluster's bridge, a Pod object in the API) and
   pods to remove (SIGTERM, SIGKILL after their grace period, then the Pod object is deleted: until then it
   stays in the API with its deletionTimestamp, as a real kubelet holds it);
2. steps each pod's kubelet (kubelet.py): start when due, count exits, back off, probe; a pod runs as
   processes (podexec.py, the fast default) or, in mode "containers", as a podman container of its
   image where that image is built here (oci.py; others, the chart's Redis, stay processes);
3. rewrites each pod's hosts file where its view of the Services changed;
4. writes back what changed: Pod status, workload status (replicas, readyReplicas, ...), and for a
   Service of type LoadBalancer its ingress IP (a ready endpoint's), publishing the name in its
   `external-dns.alpha.kubernetes.io/hostname` annotation to every cluster of the box.
`events` records every pod created, started, exited and removed, so a test can say exactly what
restarted; `errors` whatever went wrong in a tick (the loop goes on, as a controller retries).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import signal
import threading
import time
import traceback
from pathlib import Path

import requests

from . import controllers, kubelet, oci
from .kubelet import ConfigError, Pod

log = logging.getLogger("inabox")
MODES = ("processes", "containers")
TICK_S = 0.5
EXTERNAL_DNS = "external-dns.alpha.kubernetes.io/hostname"
KUBELET_FINALIZER = "inabox.test/kubelet"  # holds a terminating Pod object until its processes are gone
PATHS = {
    "Pod": ("api/v1", "pods"),
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "Service": ("api/v1", "services"),
    "ServiceAccount": ("api/v1", "serviceaccounts"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "StatefulSet": ("apis/apps/v1", "statefulsets"),
}


class AdminApi:
    """Plain JSON over HTTP to an API server's loopback address, as its admin."""

    def __init__(self, url: str):
        self.url, self.http = url, requests.Session()

    def path(self, kind: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = PATHS[kind]
        parts = [self.url, prefix, *(("namespaces", namespace) if namespace else ()), plural, name, sub]
        return "/".join(p for p in parts if p)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        r = self.http.get(self.path(kind, namespace, name), timeout=10)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def list(self, kind: str) -> list[dict]:
        r = self.http.get(self.path(kind), timeout=10)
        r.raise_for_status()
        return r.json().get("items") or []

    def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        r = self.http.post(self.path(obj["kind"], meta.get("namespace")), json=obj, timeout=10)
        r.raise_for_status()
        return r.json()

    def patch(self, kind: str, namespace: str, name: str, body: dict, sub: str | None = None) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        r = self.http.patch(self.path(kind, namespace, name, sub), json=body, headers=headers, timeout=10)
        if r.status_code != 404:
            r.raise_for_status()

    def delete(self, kind: str, namespace: str, name: str) -> None:
        r = self.http.delete(self.path(kind, namespace, name), timeout=10)
        if r.status_code != 404:
            r.raise_for_status()


class PodRunner:
    """The controllers, kubelet and DNS of one cluster (see the module docstring)."""

    def __init__(self, name: str, box, api_server, site, root: Path, mode: str = "processes"):
        if mode not in MODES:
            raise ValueError(f"pod runner mode {mode!r}: one of {MODES}")
        self.name, self.box, self.api_server, self.site, self.root = name, box, api_server, site, root
        self.mode = mode
        self.oci_id = f"{box.tb.tag}-{name}"  # the label of this runner's containers (container mode)
        self.api = AdminApi(api_server.url)
        self.pods: dict[tuple[str, str], Pod] = {}
        self.gone: list[Pod] = []
        self.events: list[dict] = []
        self.errors: list[str] = []
        self.problems: set[str] = set()
        self._services: list[dict] = []
        self._written: dict[tuple, dict] = {}  # what we last wrote: (kind, ns, name) -> status
        self._names: dict[tuple[str, str], dict] = {}
        self._results: collections.deque = collections.deque()
        self._probes = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"probe-{name}")
        self._stop = threading.Event()
        self._lock = threading.RLock()  # the pod table, for readers on other threads
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"runner-{name}")
        self._count = 0

    # ---- what the kubelet functions ask of the cluster ---------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.api.get(kind, namespace, name)

    @property
    def api_port(self) -> int:
        from .apiserver import API_PORT

        return API_PORT

    def hosts_file(self, pod: Pod) -> Path:
        return self.box.hosts_file(pod.host)

    def popen(self, pod: Pod, argv: list[str], **kwargs):
        return self.box.popen(pod.host, argv, **kwargs)

    def fork_pod(self, pod: Pod, argv: list[str], spec: Path, env: dict[str, str]):
        return self.box.fork_pod(pod.host, argv, spec, env, pod.log)

    # ---- the loop ----------------------------------------------------------------------------------

    def start(self) -> PodRunner:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # a tick that failed is tried again, as a controller retries
                self.errors.append(traceback.format_exc())
                log.exception("runner %s: tick failed", self.name)
            self._stop.wait(TICK_S)

    def _event(self, pod: Pod, what: str, **extra) -> None:
        self.events.append(
            {"t": time.monotonic(), "event": what, "namespace": pod.namespace, "pod": pod.name, "uid": pod.uid}
            | {"owner": pod.owner[:2], "revision": pod.revision}
            | extra
        )

    def tick(self) -> None:
        now = time.monotonic()
        workloads = self.api.list("Deployment") + self.api.list("StatefulSet")
        self._services = self.api.list("Service")
        live = {w["metadata"]["uid"]: w for w in workloads}
        with self._lock:
            for pod in list(self.pods.values()):
                if pod.terminating_since is None and pod.owner[2] not in live:
                    self.terminate(pod, now, "its workload was deleted")
            for w in workloads:
                self._control(w, now)
            while self._results:
                self._probed(*self._results.popleft(), now)
            for pod in list(self.pods.values()):
                self._kubelet(pod, now)
            self._dns()
            self._report(workloads)

    def _control(self, w: dict, now: float) -> None:
        uid = w["metadata"]["uid"]
        mine = [p for p in self.pods.values() if p.owner[2] == uid]
        alive = [p for p in mine if p.terminating_since is None]
        dying = [p for p in mine if p.terminating_since is not None]
        problems = kubelet.pod_problems(w["spec"]["template"])
        if problems:
            self.problems.add(f"{w['kind']} {w['metadata']['name']}: {'; '.join(problems)}")
            return
        plan = (controllers.plan_deployment if w["kind"] == "Deployment" else controllers.plan_statefulset)(
            w, alive, dying
        )
        for pod in plan.delete:
            self.terminate(pod, now, "scaled down or replaced by its controller")
        for ordinal in plan.create:
            self._create(w, ordinal, now)

    def _create(self, w: dict, ordinal: int | None, now: float) -> None:
        meta, template = w["metadata"], w["spec"]["template"]
        rev = controllers.revision(template)
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        spec = dict(template["spec"], nodeName=f"node-{self.name}")
        if w["kind"] == "StatefulSet":
            name = f"{meta['name']}-{ordinal}"
            labels.update(
                {
                    "controller-revision-hash": f"{meta['name']}-{rev}",
                    "statefulset.kubernetes.io/pod-name": name,
                    "apps.kubernetes.io/pod-index": str(ordinal),
                }
            )
            spec.update(hostname=name, subdomain=w["spec"].get("serviceName"))
        else:
            name = f"{meta['name']}-{rev}-{secrets.token_hex(3)[:5]}"
            labels["pod-template-hash"] = rev
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                # A real API server keeps a deleted pod (deletionTimestamp set) until its kubelet says its
                # containers are gone; the emulator removes an object whose deletionTimestamp is set at once
                # unless a finalizer holds it, so this one stands for the kubelet's hold (`terminate`, `_kubelet`).
                "finalizers": [KUBELET_FINALIZER],
            },
            "spec": spec,
        }
        created = self.api.create(body)
        self._count += 1
        host = self.box.new_host(f"{self.name}-p{self._count}", self.site)
        directory = self.root / meta["namespace"] / f"{name}-{created['metadata']['uid'][:8]}"
        directory.mkdir(parents=True)
        pod = Pod(
            namespace=meta["namespace"],
            name=name,
            uid=created["metadata"]["uid"],
            owner=(w["kind"], meta["name"], meta["uid"]),
            revision=rev,
            template={"metadata": body["metadata"], "spec": spec},
            labels=labels,
            host=host,
            dir=directory,
            ordinal=ordinal,
            created=now,
        )
        self.pods[(pod.namespace, name)] = pod
        self._event(pod, "created")

    def terminate(self, pod: Pod, now: float, why: str) -> None:
        if pod.terminating_since is not None:
            return
        pod.terminating_since, pod.ready = now, False
        kubelet.signal_group(pod, signal.SIGTERM)
        self._event(pod, "terminating", why=why)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.api.patch("Pod", pod.namespace, pod.name, {"metadata": {"deletionTimestamp": stamp}})

    def _kubelet(self, pod: Pod, now: float) -> None:
        if pod.terminating_since is not None:
            if pod.running:
                if now - pod.terminating_since > kubelet.grace_seconds(pod):
                    kubelet.signal_group(pod, signal.SIGKILL)
                return
            if pod.proc is not None:
                pod.proc.wait()
            self.api.patch("Pod", pod.namespace, pod.name, {"metadata": {"finalizers": None}})  # the pod goes now
            del self.pods[(pod.namespace, pod.name)]
            self.gone.append(pod)
            self._event(pod, "removed", exit=None if pod.proc is None else pod.proc.returncode)
            return
        if pod.proc is not None and pod.proc.poll() is not None:
            kubelet.exited(pod, now)
            self._event(pod, "exited", exit=pod.last_exit, restarts=pod.restarts)
        if pod.killing_since is not None and pod.running:
            if now - pod.killing_since > kubelet.grace_seconds(pod):
                kubelet.signal_group(pod, signal.SIGKILL)
        if pod.proc is None:
            if now >= pod.next_start:
                try:
                    self._names_for(pod)
                    kubelet.start(pod, self, now)
                    pod.killing_since = None
                    self._event(pod, "started", restarts=pod.restarts)
                except ConfigError as exc:
                    pulled_before = pod.waiting in ("ErrImagePull", "ImagePullBackOff")
                    reason = "ImagePullBackOff" if exc.reason == "ErrImagePull" and pulled_before else exc.reason
                    pod.waiting, pod.message, pod.next_start = reason, str(exc), now + 2
            return
        for kind, probe in pod.probes.items():
            gated = (kind == "startupProbe") == pod.startup_done
            if probe.running or now < probe.due or gated:
                continue
            probe.running = True
            started = pod.started_at
            future = self._probes.submit(kubelet.check, pod, probe.spec)
            future.add_done_callback(
                lambda f, pod=pod, kind=kind, started=started: self._results.append(
                    (pod, kind, started, not f.exception() and f.result())
                )
            )
        if "readinessProbe" not in pod.probes:
            pod.ready = pod.running and pod.startup_done

    def _probed(self, pod: Pod, kind: str, started: float | None, ok: bool, now: float) -> None:
        if pod.started_at != started or kind not in pod.probes or pod.terminating_since is not None:
            return  # the container it probed is gone
        verdict = kubelet.record(pod.probes[kind], ok, now)
        if kind == "readinessProbe" and verdict:
            pod.ready = verdict == "success"
        elif kind == "startupProbe" and verdict == "success":
            pod.startup_done = True
            for other in pod.probes.values():
                other.due = now
        elif verdict == "failure" and pod.killing_since is None:
            pod.killing_since = now
            kubelet.signal_group(pod, signal.SIGTERM)
            self._event(pod, f"{kind} failed")

    def _names_for(self, pod: Pod) -> None:
        alive = [p for p in self.pods.values() if p.terminating_since is None]
        extra = {"kubernetes.default.svc.cluster.local": self.api_server.host.ip}
        extra.update({"kubernetes.default.svc": self.api_server.host.ip, "kubernetes.default": self.api_server.host.ip})
        extra.update(self.box.public_names())
        entries = controllers.hosts_entries(pod, self._services, alive, extra)
        if self._names.get((pod.namespace, pod.name)) != entries:
            self._names[(pod.namespace, pod.name)] = entries
            self.box.set_names(pod.host, entries)

    def _dns(self) -> None:
        alive = [p for p in self.pods.values() if p.terminating_since is None]
        for pod in alive:
            self._names_for(pod)
        for service in self._services:
            self.problems.update(controllers.port_problems(service, controllers.endpoints(service, alive)))

    def _write_status(self, kind: str, namespace: str, name: str, status: dict) -> None:
        key = (kind, namespace, name)
        if self._written.get(key) != status:
            self.api.patch(kind, namespace, name, {"status": status}, sub="status")
            self._written[key] = status

    def _report(self, workloads: list[dict]) -> None:
        for pod in self.pods.values():
            if pod.terminating_since is None:
                self._write_status("Pod", pod.namespace, pod.name, kubelet.status(pod))
        for w in workloads:
            mine = [p for p in self.pods.values() if p.owner[2] == w["metadata"]["uid"] and p.terminating_since is None]
            self._write_status(
                w["kind"], w["metadata"]["namespace"], w["metadata"]["name"], controllers.workload_status(w, mine)
            )
        alive = [p for p in self.pods.values() if p.terminating_since is None]
        for service in self._services:
            if service["spec"].get("type") != "LoadBalancer":
                continue
            behind = controllers.endpoints(service, alive)
            ingress = [{"ip": behind[0].host.ip}] if behind else []
            meta = service["metadata"]
            self._write_status("Service", meta["namespace"], meta["name"], {"loadBalancer": {"ingress": ingress}})
            hostname = (meta.get("annotations") or {}).get(EXTERNAL_DNS)
            if hostname:
                self.box.publish(hostname, behind[0].host.ip if behind else None)

    # ---- stopping and reading --------------------------------------------------------------------

    def stop(self, grace: float = 10.0) -> None:
        """Stop the loop, then every pod: SIGTERM, SIGKILL after `grace` s."""
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            pods = list(self.pods.values())
            for pod in pods:
                kubelet.signal_group(pod, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for pod in pods:
                if pod.proc is None:
                    continue
                try:
                    pod.proc.wait(max(0.1, deadline - time.monotonic()))
                except Exception:
                    kubelet.signal_group(pod, signal.SIGKILL)
                    pod.proc.wait(30)
        if self.mode == "containers":
            oci.remove_all(self.oci_id)
        self._probes.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> list[dict]:
        """Every pod now (terminating ones included), as kubelet.describe() says."""
        with self._lock:
            return [kubelet.describe(p) for p in self.pods.values()]

    def all_pods(self) -> list[Pod]:
        with self._lock:
            return list(self.pods.values()) + list(self.gone)

    def find(self, namespace: str, name: str) -> Pod | None:
        with self._lock:
            return self.pods.get((namespace, name))
