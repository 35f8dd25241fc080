"""The kubelet of the box: one pod = one process group (or one container) in a network namespace of its
own (a testbed host: its own IP on the cluster's bridge), started, probed, restarted and stopped as a
kubelet would.

- Volumes (made once per pod, under the pod's directory): configMap and secret (keys or `items` as
  files; missing and not optional: the container waits in CreateContainerConfigError and is tried
  again), emptyDir, hostPath, and the service-account token the API server issued
  (/var/run/secrets/kubernetes.io/serviceaccount: token, ca.crt, namespace) unless
  automountServiceAccountToken is false.
- Environment (resolved at each container start, as a kubelet does): the image's, then envFrom, then env
  in order: value with $(VAR) expansion, secretKeyRef, configMapKeyRef, fieldRef (name, namespace,
  uid, labels, annotations, pod IP, node name, service account), resourceFieldRef; then
  KUBERNETES_SERVICE_HOST/PORT and HOSTNAME. `$(VAR)` in command and args too.
- Start: podexec.py in the pod's namespace (mounts, exec); the pod's command or the image's entrypoint. An
  `rlfleet <component>` container is forked from a zygote that imported the components' code once (zygote.py).
  In the runner's container mode, a pod whose image is built here is `podman run` of it instead (oci.py),
  with the same volumes and environment.
- Restart (restartPolicy Always): back-off 10 s doubling to 300 s while the container keeps failing
  (reset once it ran 10 minutes); CrashLoopBackOff while it waits; restartCount counts restarts.
- Probes (httpGet, HTTP or HTTPS; tcpSocket) from the node to the pod's IP: the startup probe gates the others;
  liveness failing failureThreshold times restarts the container; readiness sets Ready.
- Stop: SIGTERM to the process group, SIGKILL after terminationGracePeriodSeconds.
One container per pod (what the operator and the chart build); init containers and sidecars are refused.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed import Host

from . import netns, oci, zygote
from .container_config import ConfigError, ImageMissing, expand
from .images import process_image

PODEXEC = Path(__file__).with_name("podexec.py")
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
BACKOFF_START_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 10.0, 300.0, 600.0


@dataclass
class Probe:
    spec: dict
    failures: int = 0
    successes: int = 0
    due: float = 0.0
    running: bool = False  # a check is in flight

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))


@dataclass
class Pod:
    namespace: str
    name: str
    uid: str
    owner: tuple[str, str, str]  # (kind, name, uid) of its workload
    revision: str
    template: dict
    labels: dict
    host: Host
    dir: Path
    ordinal: int | None = None
    created: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen | None = None  # the container's first process, or `podman run` in container mode
    container_name: str | None = None  # the podman container in container mode
    started_at: float | None = None  # monotonic, of the running container
    start_time: str | None = None  # RFC 3339, of the running container
    restarts: int = 0
    backoff: float = 0.0
    next_start: float = 0.0
    waiting: str | None = "ContainerCreating"  # the waiting reason while no container runs
    message: str = ""
    last_exit: int | None = None
    startup_done: bool = False
    ready: bool = False
    probes: dict[str, Probe] = field(default_factory=dict)
    terminating_since: float | None = None
    killing_since: float | None = None  # a failed probe stopped the container: SIGKILL after the grace period
    volumes_made: bool = False

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def container(self) -> dict:
        return self.spec["containers"][0]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log(self) -> Path:
        return self.dir / "container.log"

    def volume_dir(self, name: str) -> Path:
        return self.dir / "volumes" / name


def pod_problems(template: dict) -> list[str]:
    spec = template["spec"]
    problems = []
    if len(spec.get("containers") or []) != 1:
        problems.append(f"{len(spec.get('containers') or [])} containers (the box runs exactly one per pod)")
    if spec.get("initContainers"):
        problems.append("init containers (not run by the box)")
    return problems


# ---- volumes and environment ---------------------------------------------------------------------


def _write_keys(directory: Path, data: dict[str, bytes], items: list[dict] | None, mode: int | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for item in items or [{"key": k, "path": k} for k in data]:
        if item["key"] not in data:
            raise ConfigError(f"key {item['key']!r} not found")
        path = directory / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[item["key"]])
        path.chmod(item.get("mode", mode if mode is not None else 0o644))


def secret_data(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def configmap_data(cm: dict) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
    return out | {k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()}


def make_volumes(pod: Pod, cluster) -> None:
    """Lay out the pod's volumes under its directory (once; emptyDirs survive container restarts)."""
    for volume in pod.spec.get("volumes") or []:
        name, target = volume["name"], pod.volume_dir(volume["name"])
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)
        elif "configMap" in volume:
            source = volume["configMap"]
            cm = cluster.get("ConfigMap", pod.namespace, source["name"])
            if cm is None and not source.get("optional"):
                raise ConfigError(f'configmap "{source["name"]}" not found (volume {name})')
            _write_keys(target, configmap_data(cm or {}), source.get("items"), source.get("defaultMode"))
        elif "secret" in volume:
            source = volume["secret"]
            secret = cluster.get("Secret", pod.namespace, source["secretName"])
            if secret is None and not source.get("optional"):
                raise ConfigError(f'secret "{source["secretName"]}" not found (volume {name})')
            _write_keys(target, secret_data(secret or {}), source.get("items"), source.get("defaultMode"))
        elif "hostPath" in volume:
            if not Path(volume["hostPath"]["path"]).exists():
                raise ConfigError(f"hostPath {volume['hostPath']['path']} does not exist (volume {name})")
        else:
            raise ConfigError(f"volume {name}: kind {sorted(set(volume) - {'name'})} is not supported by the box")
    if pod.spec.get("automountServiceAccountToken", True):
        account = pod.spec.get("serviceAccountName") or "default"
        if account != "default" and cluster.get("ServiceAccount", pod.namespace, account) is None:
            raise ConfigError(f'serviceaccount "{account}" not found')
        target = pod.volume_dir("kube-api-access")
        target.mkdir(parents=True, exist_ok=True)
        (target / "token").write_text(cluster.api_server.issue_token(pod.namespace, account))
        (target / "ca.crt").write_bytes(cluster.api_server.ca_path.read_bytes())
        (target / "namespace").write_text(pod.namespace)
    pod.volumes_made = True


def mounts(pod: Pod) -> list[dict]:
    """The container's volume mounts as (host source, target, read-only)."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes") or []}
    out = []
    for m in pod.container.get("volumeMounts") or []:
        volume = volumes[m["name"]]
        source = Path(volume["hostPath"]["path"]) if "hostPath" in volume else pod.volume_dir(m["name"])
        if m.get("subPath"):
            source = source / m["subPath"]
        read_only = bool(m.get("readOnly")) or "configMap" in volume or "secret" in volume
        out.append({"source": str(source), "target": m["mountPath"], "readOnly": read_only})
    if pod.spec.get("automountServiceAccountToken", True):
        out.append({"source": str(pod.volume_dir("kube-api-access")), "target": SA_DIR, "readOnly": True})
    return out


def _field(pod: Pod, path: str) -> str:
    meta = pod.template.get("metadata") or {}
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.uid": pod.uid,
        "status.podIP": pod.host.ip,
        "status.hostIP": pod.host.site.gateway,
        "spec.nodeName": f"node-{pod.host.site.name}",
        "spec.serviceAccountName": pod.spec.get("serviceAccountName") or "default",
    }
    if path in simple:
        return simple[path]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        source = pod.labels if m.group(1) == "labels" else meta.get("annotations") or {}
        return source.get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported by the box")


_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}


def quantity(text) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    if m is None or m.group(2) not in _UNITS:
        raise ConfigError(f"quantity {text!r} not understood")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _resource(pod: Pod, ref: dict) -> str:
    kind, name = ref["resource"].split(".", 1)  # limits.cpu, requests.memory
    resources = pod.container.get("resources") or {}
    value = (resources.get(kind) or {}).get(name)
    if value is None and kind == "limits":  # no limit: the node's allocatable
        value = str(os.cpu_count()) if name == "cpu" else str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if value is None:
        value = "0"
    return str(math.ceil(quantity(value) / quantity(ref.get("divisor", "1"))))  # a kubelet rounds up


def environment(pod: Pod, cluster, image_env: dict[str, str]) -> dict[str, str]:
    """The container's environment: `image_env` (process mode: the image's; a container has its own), then
    the pod's (see the module docstring)."""
    env = dict(image_env)
    for source in pod.container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "secretRef" in source:
            obj = cluster.get("Secret", pod.namespace, source["secretRef"]["name"])
            data = secret_data(obj or {})
        else:
            obj = cluster.get("ConfigMap", pod.namespace, source["configMapRef"]["name"])
            data = configmap_data(obj or {})
        ref = source.get("secretRef") or source.get("configMapRef")
        if obj is None and not ref.get("optional"):
            raise ConfigError(f'{"secret" if "secretRef" in source else "configmap"} "{ref["name"]}" not found')
        env.update({prefix + k: v.decode() for k, v in data.items()})
    for item in pod.container.get("env") or []:
        if "value" in item or "valueFrom" not in item:
            env[item["name"]] = expand(item.get("value", ""), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[item["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[item["name"]] = _resource(pod, source["resourceFieldRef"])
        else:
            kind, ref = (
                ("Secret", source["secretKeyRef"])
                if "secretKeyRef" in source
                else ("ConfigMap", source["configMapKeyRef"])
            )
            obj = cluster.get(kind, pod.namespace, ref["name"])
            data = (secret_data if kind == "Secret" else configmap_data)(obj or {})
            if ref["key"] in data:
                env[item["name"]] = data[ref["key"]].decode()
            elif not ref.get("optional"):
                what = "not found" if obj is None else f"has no key {ref['key']!r}"
                raise ConfigError(f'{kind.lower()} "{ref["name"]}" {what} (env {item["name"]})')
    env["KUBERNETES_SERVICE_HOST"] = cluster.api_server.host.ip
    env["KUBERNETES_SERVICE_PORT"] = str(cluster.api_port)
    env["HOSTNAME"] = pod.name
    return env


# ---- the container -------------------------------------------------------------------------------


def start(pod: Pod, cluster, now: float) -> None:
    """Start the pod's container: volumes once, env now, then a container of its image where the runner
    runs containers and the image is here (oci.py), else podexec in the pod's namespace (process mode)."""
    name = pod.container["image"]
    as_container = cluster.mode == "containers" and oci.is_local(name)
    image = None if as_container else process_image(name)
    if image is None and not as_container:
        raise ImageMissing(f'Failed to pull image "{name}": neither built here nor in the box\'s image table')
    if not pod.volumes_made:
        make_volumes(pod, cluster)
    env = environment(pod, cluster, image.env if image else {})
    log = open(pod.log, "ab")
    log.write(f"---- inabox: container start {pod.restarts} at {time.strftime('%H:%M:%S')}\n".encode())
    log.flush()
    with log:
        if as_container:
            argv = oci.run_argv(pod, cluster.oci_id, env, mounts(pod), cluster.hosts_file(pod))
            (pod.dir / f"container-{pod.restarts}.json").write_text(json.dumps(argv, indent=1))
            pod.proc, pod.container_name = oci.popen(argv, log), oci.container_name(cluster.oci_id, pod, pod.restarts)
        else:
            pod.proc, pod.container_name = _start_process(pod, cluster, image, env, log), None
    pod.started_at, pod.start_time = now, _rfc3339()
    pod.waiting, pod.message, pod.startup_done, pod.ready = None, "", False, False
    pod.probes = {
        kind: Probe(pod.container[kind], due=now + float(pod.container[kind].get("initialDelaySeconds", 0)))
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
        if kind in pod.container
    }
    if "startupProbe" not in pod.probes:
        pod.startup_done = True


def _start_process(pod: Pod, cluster, image, env: dict[str, str], log):
    command = [expand(a, env) for a in pod.container.get("command") or image.entrypoint]
    args = [expand(a, env) for a in pod.container.get("args") or ([] if pod.container.get("command") else image.cmd)]
    layers = pod.dir / "layers" / str(pod.restarts)
    layers.mkdir(parents=True, exist_ok=True)
    spec = {
        "hostname": pod.name,
        "dirs": image.dirs,
        "keep": image.keep,
        "mounts": mounts(pod),
        "layers": str(layers),
        "hosts": str(cluster.hosts_file(pod)),
        "workdir": pod.container.get("workingDir") or image.workdir,
        "env": env,
        "argv": command + args,
    }
    spec_path = pod.dir / f"container-{pod.restarts}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    component = zygote.component_argv(spec["argv"])
    if component is not None and (forked := cluster.fork_pod(pod, component, spec_path, env)) is not None:
        return forked
    argv = ["unshare", "--uts", "--", sys.executable, str(PODEXEC), str(spec_path)]
    return cluster.popen(pod, argv, stdout=log, stderr=log)


def exited(pod: Pod, now: float) -> None:
    """The container ended: count it, and back off before the next start (restartPolicy Always)."""
    pod.last_exit = pod.proc.returncode
    ran = now - (pod.started_at or now)
    pod.backoff = BACKOFF_START_S if ran >= BACKOFF_RESET_S or not pod.backoff else min(2 * pod.backoff, BACKOFF_MAX_S)
    pod.next_start = now + pod.backoff
    pod.restarts += 1
    pod.proc, pod.started_at, pod.ready, pod.startup_done = None, None, False, False
    pod.waiting = "CrashLoopBackOff"
    pod.message = f"back-off {pod.backoff:.0f}s restarting failed container (exit code {pod.last_exit})"


def signal_group(pod: Pod, sig: int) -> None:
    """`sig` to the pod's container: through podman in container mode (to the podman process itself while
    its container is not created yet), to the process group in process mode."""
    if not pod.running:
        return
    if pod.container_name and oci.kill(pod.container_name, sig):
        return
    try:
        os.killpg(pod.proc.pid, sig)
    except ProcessLookupError:
        pass


def environment_of(pod: Pod) -> dict[str, str]:
    """The environment the pod's program runs with: /proc/PID/environ, or for a program forked from a zygote (whose
    /proc shows the zygote's, zygote.py) the environment it was started with."""
    if isinstance(pod.proc, zygote.ForkedPod):
        return json.loads((pod.dir / f"container-{pod.restarts}.json").read_text())["env"]
    variables = open(f"/proc/{main_pid(pod)}/environ", "rb").read().decode().split("\0")
    return dict(kv.split("=", 1) for kv in variables if "=" in kv)


def main_pid(pod: Pod) -> int:
    """The host pid of the program the pod's container runs."""
    return oci.main_pid(pod.container_name) if pod.container_name else pod.proc.pid


def grace_seconds(pod: Pod) -> float:
    return float(pod.spec.get("terminationGracePeriodSeconds", 30))


# ---- probes ----------------------------------------------------------------------------------------


def port_number(pod: Pod, port) -> int:
    """A container port by number or by name."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in pod.container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ConfigError(f"port {port!r} is not a port of container {pod.container['name']}")


def check(pod: Pod, spec: dict) -> bool:
    """One probe of `spec` against the pod's IP, from the node (a socket in the pod's network)."""
    timeout = float(spec.get("timeoutSeconds", 1))
    try:
        if "httpGet" in spec:
            get = spec["httpGet"]
            port, https = port_number(pod, get["port"]), get.get("scheme", "HTTP") == "HTTPS"
            status, _ = netns.http_get(pod.host.netns, pod.host.ip, port, get.get("path", "/"), timeout, https)
            return 200 <= status < 400
        if "tcpSocket" in spec:
            netns.connect(pod.host.netns, pod.host.ip, port_number(pod, spec["tcpSocket"]["port"]), timeout).close()
            return True
    except (OSError, ConfigError, ValueError):
        return False
    raise ConfigError(f"probe {sorted(spec)} is not supported by the box (httpGet and tcpSocket are)")


def record(probe: Probe, ok: bool, now: float) -> str | None:
    """Count one result; 'success' or 'failure' when the probe's threshold is crossed, else None."""
    probe.running, probe.due = False, now + probe.period
    if ok:
        probe.failures, probe.successes = 0, probe.successes + 1
        return "success" if probe.successes >= int(probe.spec.get("successThreshold", 1)) else None
    probe.successes, probe.failures = 0, probe.failures + 1
    return "failure" if probe.failures >= int(probe.spec.get("failureThreshold", 3)) else None


# ---- status ------------------------------------------------------------------------------------------


def _rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status(pod: Pod) -> dict:
    c = pod.container
    if pod.running:
        state = {"running": {"startedAt": pod.start_time}}
    else:
        state = {"waiting": {"reason": pod.waiting or "ContainerCreating", "message": pod.message}}
    last = {"terminated": {"exitCode": pod.last_exit}} if pod.last_exit is not None else {}
    ready = "True" if pod.ready else "False"
    return {
        "phase": "Running" if pod.running else "Pending",
        "podIP": pod.host.ip,
        "podIPs": [{"ip": pod.host.ip}],
        "hostIP": pod.host.site.gateway,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c["image"],
                "ready": pod.ready,
                "started": pod.running and pod.startup_done,
                "restartCount": pod.restarts,
                "state": state,
                "lastState": last,
            }
        ],
    }


def describe(pod: Pod) -> dict:
    """A plain summary for tests and failure reports."""
    keep = ("namespace", "name", "uid", "owner", "revision", "ordinal", "restarts", "waiting", "ready", "last_exit")
    out = {k: getattr(pod, k) for k in keep}
    return out | {"ip": pod.host.ip, "running": pod.running, "terminating": pod.terminating_since is not None}
