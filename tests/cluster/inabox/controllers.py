"""The workload controllers and the cluster DNS of the box, as pure functions of the objects and the pods.

Deployment (the Deployment and ReplicaSet controllers in one): a pod's revision is the hash of the
template it was made from (label pod-template-hash, name DEPLOY-HASH-xxxxx).
  RollingUpdate (maxSurge / maxUnavailable, default 25% each): new-revision pods are added while the
  total stays within replicas + maxSurge; old ones are removed while the ready pods stay at least
  replicas - maxUnavailable (old pods that are not ready go first). Recreate: every old pod goes,
  and new ones come once none is left. Scaling down removes pods that are not ready first, then
  the newest. So a scale change adds or removes exactly the difference and touches nothing else.
StatefulSet: pods NAME-0..N-1 (label controller-revision-hash NAME-HASH, apps.kubernetes.io/pod-index),
  hostname = pod name, subdomain = serviceName. Parallel: missing ordinals are created together,
  ordinals >= replicas removed together; OrderedReady: one at a time, in order. RollingUpdate: the
  highest ordinal on an old revision is removed (and recreated by the rule above) only when every
  other pod is ready; a name is reused only after its old pod is gone.
DNS (what a pod's hosts file says): every Service with a ready endpoint (publishNotReadyAddresses:
  any running one) as NAME.NS.svc.cluster.local, NAME.NS.svc, NAME.NS and, in its own namespace,
  NAME, each pointing at one endpoint picked per client pod (spreading clients as kube-proxy would,
  without a virtual IP); StatefulSet pods as POD.SUBDOMAIN.NS.svc(.cluster.local) when a headless
  Service of that name exists. There is no port translation: a Service port must equal its target
  port, and the box reports a Service where it does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass, field

from .kubelet import ConfigError, Pod, port_number

DOMAIN = "svc.cluster.local"


def revision(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def selected(selector: dict | None, labels: dict) -> bool:
    """A Service's selector (a plain label map; an empty one selects no pod here: no manual Endpoints)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass
class Plan:
    create: list[int | None] = field(default_factory=list)  # StatefulSet ordinals, None for a Deployment pod
    delete: list[Pod] = field(default_factory=list)


def _scaled(value, replicas: int, up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        x = replicas * float(value[:-1]) / 100
        return math.ceil(x) if up else math.floor(x)
    return int(value)


def _doomed_first(pods: list[Pod]) -> list[Pod]:
    """Scale-down order: not ready before ready, then the newest first."""
    return sorted(pods, key=lambda p: (p.ready, -p.created))


def plan_deployment(obj: dict, pods: list[Pod], terminating: list[Pod]) -> Plan:
    spec, rev = obj["spec"], revision(obj["spec"]["template"])
    replicas = int(spec.get("replicas", 1))
    new = [p for p in pods if p.revision == rev]
    old = [p for p in pods if p.revision != rev]
    plan = Plan()
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "Recreate":
        if old:
            plan.delete = old
        elif not any(p.revision != rev for p in terminating):
            plan.create = [None] * max(0, replicas - len(new))
            plan.delete = _doomed_first(new)[: max(0, len(new) - replicas)]
        return plan
    rolling = strategy.get("rollingUpdate") or {}
    surge = _scaled(rolling.get("maxSurge", "25%"), replicas, up=True)
    unavailable = _scaled(rolling.get("maxUnavailable", "25%"), replicas, up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    plan.create = [None] * max(0, min(replicas + surge - len(pods), replicas - len(new)))
    if old:
        ready = sum(p.ready for p in pods)
        removable = max(0, ready - (replicas - unavailable))
        not_ready = [p for p in old if not p.ready]
        plan.delete = not_ready + _doomed_first([p for p in old if p.ready])[:removable]
    elif len(new) > replicas:
        plan.delete = _doomed_first(new)[: len(new) - replicas]
    return plan


def plan_statefulset(obj: dict, pods: list[Pod], terminating: list[Pod]) -> Plan:
    spec, rev = obj["spec"], revision(obj["spec"]["template"])
    replicas = int(spec.get("replicas", 1))
    parallel = spec.get("podManagementPolicy") == "Parallel"
    taken = {p.ordinal for p in pods} | {p.ordinal for p in terminating}
    by_ordinal = {p.ordinal: p for p in pods}
    plan = Plan()
    for i in range(replicas):
        if i in taken:
            continue
        if parallel or all(j in by_ordinal and by_ordinal[j].ready for j in range(i)):
            plan.create.append(i)
        if not parallel:
            break
    extra = sorted((p for p in pods if p.ordinal >= replicas), key=lambda p: -p.ordinal)
    if extra:
        plan.delete = extra if parallel else ([] if terminating else extra[:1])
        return plan
    update = spec.get("updateStrategy") or {}
    if update.get("type", "RollingUpdate") != "RollingUpdate" or terminating or len(pods) < replicas:
        return plan
    stale = sorted((p for p in pods if p.revision != rev), key=lambda p: -p.ordinal)
    if stale and all(p.ready for p in pods if p is not stale[0]):
        plan.delete = [stale[0]]
    return plan


def workload_status(obj: dict, pods: list[Pod]) -> dict:
    rev = revision(obj["spec"]["template"])
    ready = [p for p in pods if p.ready]
    status = {
        "observedGeneration": obj["metadata"].get("generation", 1),
        "replicas": len(pods),
        "updatedReplicas": sum(p.revision == rev for p in pods),
        "readyReplicas": len(ready),
        "availableReplicas": len(ready),
    }
    if obj["kind"] == "StatefulSet":
        current = {p.revision for p in pods}
        status.update(
            currentReplicas=sum(p.revision == rev for p in pods),
            updateRevision=f"{obj['metadata']['name']}-{rev}",
            currentRevision=f"{obj['metadata']['name']}-{rev if current <= {rev} else sorted(current - {rev})[0]}",
        )
    else:
        status["unavailableReplicas"] = max(0, int(obj["spec"].get("replicas", 1)) - len(ready))
    return status


# ---- DNS -------------------------------------------------------------------------------------------


def endpoints(service: dict, pods: list[Pod]) -> list[Pod]:
    """The pods behind a Service: selected, in its namespace, ready (or running, with publishNotReadyAddresses)."""
    spec, ns = service["spec"], service["metadata"]["namespace"]
    any_running = spec.get("publishNotReadyAddresses", False)
    return sorted(
        (
            p
            for p in pods
            if p.namespace == ns
            and p.terminating_since is None
            and selected(spec.get("selector"), p.labels)
            and (p.ready or (any_running and p.running))
        ),
        key=lambda p: p.name,
    )


def port_problems(service: dict, pods: list[Pod]) -> list[str]:
    """Service ports the box cannot serve: those whose target port differs (no kube-proxy to translate)."""
    out = []
    for port in service["spec"].get("ports") or []:
        for pod in pods:
            try:
                target = port_number(pod, port.get("targetPort", port["port"]))
            except ConfigError as exc:
                out.append(f"Service {service['metadata']['name']} port {port['port']}: {exc}")
                continue
            if target != port["port"]:
                out.append(
                    f"Service {service['metadata']['name']} port {port['port']} targets {target} on pod {pod.name}: "
                    "the box resolves names to pod IPs and cannot translate ports"
                )
    return out


def pick(candidates: list[Pod], client: Pod) -> Pod:
    return candidates[zlib.crc32(client.name.encode()) % len(candidates)]


def service_names(name: str, namespace: str, client: Pod) -> list[str]:
    out = [f"{name}.{namespace}.{DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    return out + ([name] if namespace == client.namespace else [])


def hosts_entries(client: Pod, services: list[dict], pods: list[Pod], extra: dict[str, str]) -> dict[str, str]:
    """name -> IP: what `client`'s hosts file holds (see the module docstring); `extra` first (the API
    server's and the box's public names), the pod's own names last."""
    out = dict(extra)
    headless = {}
    for service in services:
        meta = service["metadata"]
        if service["spec"].get("type") == "ExternalName":
            continue
        behind = endpoints(service, pods)
        if service["spec"].get("clusterIP") == "None":
            headless[(meta["namespace"], meta["name"])] = {p.name for p in behind}
        if behind:
            ip = pick(behind, client).host.ip
            out.update({n: ip for n in service_names(meta["name"], meta["namespace"], client)})
    for pod in pods:
        sub = pod.spec.get("subdomain")
        if sub and pod.name in headless.get((pod.namespace, sub), ()):
            base = f"{pod.spec.get('hostname', pod.name)}.{sub}.{pod.namespace}"
            out.update({f"{base}.{DOMAIN}": pod.host.ip, f"{base}.svc": pod.host.ip})
    own = client.spec.get("hostname", client.name)
    out[own] = client.host.ip
    if client.spec.get("subdomain"):
        out[f"{own}.{client.spec['subdomain']}.{client.namespace}.{DOMAIN}"] = client.host.ip
    return out
