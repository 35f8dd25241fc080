"""The pieces every workload the operator builds is made of: owner references and metadata, the main
container (entrypoint, environment, resources, probes, security), the pod template (volumes, pull
secrets, the config hash, the component's podTemplate override), Deployments, StatefulSets, Services
and PodDisruptionBudgets. Pure functions of the config models and the operator's ClusterDefaults.

Probes: HTTP servers (origin, relay, ingest) are probed on /healthz of their port. Rollout workers and
the verifier are probed on /healthz of their metrics port, which says whether their model is alive
(rlfleet/wire/health.py): 503 while starting (the engine loading, the first version coming in), and
when a forward step or the idle probe (one generated token, a short prefill) misses its deadline, so a
wedged engine fails liveness (3 x 20 s) and the kubelet restarts it. The startupProbe gives their
starts room (a vLLM worker loading a model: up to 15 minutes; the verifier 5) before liveness counts;
readiness on the same answer keeps a roll-out from counting a worker before its model serves. The
trainer is probed on /metrics, which its process serves from its first second: liveness means "the
process answers", never "the model is loaded".
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass, field

from rlfleet.config import API_VERSION, InferencePool, RLRun
from rlfleet.config.tracking import WANDB_API_KEY_KEY
from rlfleet.config.workload import ResourcesSpec
from rlfleet.operator import credentials, names, security
from rlfleet.operator.overrides import merge_pod_template
from rlfleet.wire import env, redis_acl
from rlfleet.wire.views import VIEWS, View


@dataclass(frozen=True)
class ClusterDefaults:
    """What the operator fills in that a spec does not say (the Helm chart sets these on the operator)."""

    image: str = names.DEFAULT_IMAGE  # every component that names no image
    gpu_image: str = names.DEFAULT_GPU_IMAGE  # components that ask for GPUs and name no image
    pull_policy: str | None = None  # imagePullPolicy of every container (None: the cluster's default)
    pull_secrets: tuple[str, ...] = ()  # imagePullSecrets of every pod
    # securityContext of every run pod and of its container (security.py; the chart's runPods values)
    pod_security: Mapping = field(default_factory=lambda: security.POD_SECURITY_CONTEXT)
    container_security: Mapping = field(default_factory=lambda: security.CONTAINER_SECURITY_CONTEXT)
    # What each component reads (rlfleet/wire/views.py): the configs and config hashes are cut by it.
    views: Mapping[str, View] = field(default_factory=lambda: VIEWS)

    def image_for(self, run: RLRun, gpus: int, own_image: str | None = None) -> str:
        """A pool's own image, else the run's, else the GPU image when the pod asks for GPUs, else the CPU one."""
        return own_image or run.spec.image or (self.gpu_image if gpus > 0 else self.image)


@dataclass(frozen=True)
class Owner:
    """The parent custom resource of a child (its ownerReference)."""

    kind: str
    name: str
    uid: str

    def reference(self, controller: bool = True) -> dict:
        """A controller reference (children: deleted with their parent, blocking its deletion until they
        go), or a plain one (a run's pools and tiers: deleted with it, nothing blocked)."""
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": controller,
            "blockOwnerDeletion": controller,
        }


def meta(name: str, namespace: str, labels: dict, owner: Owner | None) -> dict:
    out = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        out["ownerReferences"] = [owner.reference()]
    return out


# ---- environment -------------------------------------------------------------------------------


def pod_env(run: RLRun, redis: bool = True, component: str | None = None) -> list[dict]:
    """What every pod gets; `redis=False` for pods that must never reach the run's Redis. With
    spec.redis.roleUrls, `component`'s Redis ACL role's URLs (redis_role_env)."""
    out: list[dict] = [
        {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": env.CACHE, "value": f"{names.CACHE_DIR}/models"},
    ]
    spec = run.spec.redis
    if not redis or run.spec.remote:
        return out
    if spec.url_secret and spec.role_urls and component:
        return out[:1] + redis_role_env(spec.url_secret, component) + out[1:]
    value: dict
    if spec.url_secret:
        value = {"valueFrom": {"secretKeyRef": {"name": spec.url_secret, "key": names.REDIS_URL_KEY}}}
    else:
        value = {"value": spec.url or ""}
    return out[:1] + [{"name": env.REDIS_URL, **value}] + out[1:]


def redis_role_env(secret: str, component: str) -> list[dict]:
    """The urlSecret's `url-<role>` of the component's Redis ACL role (rlfleet/wire/redis_acl.py); a rollout
    worker also reads and takes tickets as their own users."""

    def from_secret(name: str, role: str) -> dict:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": names.redis_role_url_key(role)}}}

    out = [from_secret(env.REDIS_URL, redis_acl.COMPONENT_ROLES[component])]
    if component == names.ROLLOUT:
        out += [
            from_secret(env.REDIS_READ_URL, redis_acl.WORKER_ROLES["read"]),
            from_secret(env.REDIS_TICKETS_URL, redis_acl.WORKER_ROLES["tickets"]),
        ]
    return out


def signing_env(run: RLRun, component: str) -> list[dict]:
    """The trainer gets the private key file; every other pod at most the public key (never the Secret's
    private half)."""
    sc = run.spec.shardcast
    if not sc.signing_key_secret:
        return []
    if component == names.TRAINER:
        return [{"name": env.SIGNING_KEY_FILE, "value": f"{names.SIGNING_DIR}/{names.SIGNING_KEY}"}]
    if sc.public_key:
        return []  # in the config file
    return [
        {
            "name": env.PUBLIC_KEY,
            "valueFrom": {"secretKeyRef": {"name": sc.signing_key_secret, "key": names.PUBLIC_KEY}},
        }
    ]


def tracking_env(run: RLRun, component: str) -> list[dict]:
    """The trainer alone logs to the run's trackers (spec.tracking), so it alone gets W&B's API key."""
    wandb = run.spec.tracking.wandb
    if component != names.TRAINER or not wandb or not wandb.api_key_secret:
        return []
    key = {"secretKeyRef": {"name": wandb.api_key_secret, "key": WANDB_API_KEY_KEY}}
    return [{"name": env.WANDB_API_KEY, "valueFrom": key}]


def torch_env(component: str) -> list[dict]:
    """Torch's intra-op threads = the CPUs the container requests (rounded up), for the components that
    run torch: left alone, torch takes every core of the node, and pods sharing a node oversubscribe it."""
    if component not in (names.TRAINER, names.VERIFIER, names.ROLLOUT):
        return []
    field = {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}
    return [{"name": env.TORCH_THREADS, "valueFrom": field}]


# ---- the main container ------------------------------------------------------------------------


# Components whose metrics port answers /healthz with their model's liveness (module docstring).
ENGINE_HEALTH = (names.ROLLOUT, names.VERIFIER)


def _probes(component: str, http_port: str | None, https: bool = False) -> dict:
    if http_port:
        port, path = http_port, "/healthz"
    else:
        port, path = "metrics", "/healthz" if component in ENGINE_HEALTH else "/metrics"
    get = {"httpGet": {"path": path, "port": port, **({"scheme": "HTTPS"} if https else {})}, "timeoutSeconds": 5}
    startup_failures = 90 if component == names.ROLLOUT else 30  # x 10 s
    return {
        "startupProbe": {**get, "periodSeconds": 10, "failureThreshold": startup_failures},
        "livenessProbe": {**get, "periodSeconds": 20, "failureThreshold": 3},
        "readinessProbe": {**get, "periodSeconds": 5 if http_port else 10, "failureThreshold": 3},
    }


def resource_requirements(resources: ResourcesSpec, gpus: int = 0, gpu_resource: str = "nvidia.com/gpu") -> dict:
    out: dict[str, dict] = {
        k: dict(v) for k, v in (("requests", resources.requests), ("limits", resources.limits)) if v
    }
    if gpus > 0:  # an extended resource: its request, when given, must equal its limit
        out.setdefault("limits", {})[gpu_resource] = gpus
    return out


@dataclass(frozen=True)
class ContainerParts:
    """What one component's container has of its own (build_container adds what every container has): its
    `rlfleet <component>` arguments after --config and --metrics-port, image, resources and GPUs, the pool a
    worker serves (its secrets), its ports (the first is the one probed), env, mounts, whether it reaches Redis,
    and `https`: its first port serves only HTTPS (certificates.py), so the probes on it ask with scheme HTTPS."""

    component: str
    args: list[str]
    image: str
    resources: ResourcesSpec
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    pool: InferencePool | None = None
    ports: list[dict] = field(default_factory=list)
    extra_env: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    redis: bool = True
    https: bool = False


def build_container(run: RLRun, defaults: ClusterDefaults, parts: ContainerParts) -> dict:
    """The `rlfleet <component>` container of `parts` with the launcher's arguments, on the fixed pod ports."""
    component, ports = parts.component, parts.ports
    c = {
        "name": component,
        "image": parts.image,
        "command": ["rlfleet", component],
        "args": ["--config", names.CONFIG_PATH, "--metrics-port", str(names.METRICS_PORT), *parts.args],
        "env": pod_env(run, parts.redis, component)
        + torch_env(component)
        + signing_env(run, component)
        + tracking_env(run, component)
        + credentials.hub_env(run, component)
        + security.writable_env()
        + parts.extra_env,
        "ports": [*ports, {"name": "metrics", "containerPort": names.METRICS_PORT}],
        "resources": resource_requirements(parts.resources, parts.gpus, parts.gpu_resource),
        "volumeMounts": [
            {"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
            {"name": "cache", "mountPath": names.CACHE_DIR},
            security.TMP_MOUNT,
            *parts.mounts,
        ],
        "securityContext": deepcopy(dict(defaults.container_security)),
        **_probes(component, ports[0]["name"] if ports else None, parts.https),
    }
    if defaults.pull_policy:
        c["imagePullPolicy"] = defaults.pull_policy
    secrets = credentials.secrets_from(run, component, parts.pool)  # the store's and the data's (credentials.py)
    mlflow = run.spec.tracking.mlflow
    if component == names.TRAINER and mlflow and mlflow.credentials_secret:  # MLflow's credentials: the trainer's only
        secrets = [*secrets, mlflow.credentials_secret]
    if secrets:
        c["envFrom"] = [{"secretRef": {"name": s}} for s in secrets]
    return c


# ---- pods and workloads ------------------------------------------------------------------------


def scale(run: RLRun, replicas: int, active: bool = True) -> int:
    """Pods a workload of `run` runs: `replicas` while the run is active (neither finished nor failed) and
    not suspended, else 0."""
    return replicas if active and not run.spec.suspend else 0


def secret_volume(name: str, secret: str, keys: list[str] | None = None) -> dict:
    """A Secret as files; `keys`: only those (each as a file of its name)."""
    source: dict = {"secretName": secret}
    if keys:
        source["items"] = [{"key": k, "path": k} for k in keys]
    return {"name": name, "secret": source}


def pod_template(
    labels: dict,
    container: dict,
    config_map: str,
    config_hash: str,
    defaults: ClusterDefaults,
    *,
    volumes: list[dict] | None = None,
    override: dict | None = None,
) -> dict:
    """The pod: the container, its config, cache and /tmp volumes (and `volumes`), pull secrets, the config
    hash (a changed config rolls the pods), no service account token, the cluster's pod security context
    (security.py), then the component's podTemplate override merged in (overrides.py)."""
    spec = {
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_map}},
            {"name": "cache", "emptyDir": {}},
            security.TMP_VOLUME,
            *(volumes or []),
        ],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # no run component calls the API (security.py)
        "securityContext": deepcopy(dict(defaults.pod_security)),
    }
    if defaults.pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in defaults.pull_secrets]
    built = {"metadata": {"labels": labels, "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash}}, "spec": spec}
    return merge_pod_template(built, override) if override else built


def deployment(
    name: str, namespace: str, labels: dict, match: dict, replicas: int, template: dict, owner: Owner | None
) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, namespace, labels, owner),
        "spec": {"replicas": replicas, "selector": {"matchLabels": match}, "template": template},
    }


def statefulset(
    name: str,
    namespace: str,
    labels: dict,
    match: dict,
    replicas: int,
    template: dict,
    owner: Owner | None,
    service_name: str,
) -> dict:
    """Pods with stable names NAME-0..N-1 (and DNS through the headless Service), started in parallel."""
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "serviceName": service_name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": match},
            "template": template,
        },
    }


def service(
    name: str,
    namespace: str,
    labels: dict,
    match: dict,
    owner: Owner | None,
    ports: list[tuple[str, int]],
    headless: bool = False,
) -> dict:
    """A Service over the pods `match` selects; `ports` are (name, port) pairs, each to the same container port."""
    spec: dict = {"selector": match, "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, namespace, labels, owner), "spec": spec}


def disruption_budget(
    name: str, namespace: str, labels: dict, match: dict, max_unavailable: int | str, owner: Owner | None
) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(name, namespace, labels, owner),
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": match}},
    }
