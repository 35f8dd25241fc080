"""Pure builders: an RLRun / InferencePool / RelayTier (parsed config models) -> Kubernetes manifests.

Every function here is pure (no API calls, no clock unless passed in) and returns plain dicts that the
operator applies as they are; tests call them directly and validate the output against the
Kubernetes JSON schemas. The processes in the pods are the same `rlfleet <component>` entrypoints
with the same arguments as the local launcher (rlfleet/launcher.py `plan()`), except that ports are
fixed (names.SHARDCAST_PORT, names.METRICS_PORT) and peers are Service DNS names.

    RLRun          -> ConfigMap (the run's YAML), trainer StatefulSet + headless Service,
                      origin Deployment + Service, verifier Deployment
    InferencePool  -> ConfigMap (run + pool YAML), rollout Deployment
    RelayTier      -> relay Deployment + Service (upstream: spec.upstream, tier-1 of the run, or the origin)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import yaml
from pydantic import BaseModel, ValidationError

from rlfleet.config import API_VERSION, KINDS, InferencePool, RelayTier, RLRun, validation_problems
from rlfleet.k8s import names


class SpecError(ValueError):
    """A custom resource that cannot be reconciled; `problems` are `field.path: what is wrong and the fix`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Owner:
    """The parent custom resource of a child (its ownerReference)."""

    kind: str
    name: str
    uid: str

    def reference(self) -> dict:
        return {"apiVersion": API_VERSION, "kind": self.kind, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def parse_resource(body: dict) -> BaseModel:
    """A custom resource body (as the API server returns it) -> its config model, or SpecError."""
    kind = body.get("kind")
    meta = body.get("metadata") or {}
    doc = {"apiVersion": body.get("apiVersion"), "kind": kind, "spec": body.get("spec") or {},
           "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}}
    if kind not in KINDS:
        raise SpecError([f"kind: {kind!r} is not one of {', '.join(KINDS)}"])
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        raise SpecError(validation_problems(exc)) from None


def check_cluster_run(run: RLRun) -> None:
    """What `rlfleet run` fills in by itself but a cluster needs spelled out; raises SpecError."""
    spec, problems = run.spec, []
    if not spec.redis.url and not spec.redis.url_secret:
        problems.append("spec.redis.url: required on a cluster: set a redis:// URL or spec.redis.urlSecret (a Secret with key `url`)")
    if spec.remote:
        pass  # trained elsewhere: pools and relays here never touch the store
    elif not spec.store.uri:
        problems.append("spec.store.uri: required on a cluster: set s3://bucket/prefix (every pod must reach the store)")
    elif spec.store.uri.startswith("file://"):
        problems.append(f"spec.store.uri: {spec.store.uri!r} is a local directory that pods on different nodes cannot share; use s3://bucket/prefix")
    if spec.shardcast.require_signatures and not spec.shardcast.signing_key_secret:
        problems.append("spec.shardcast.signingKeySecret: required on a cluster while requireSignatures is true: create a Secret with "
                        "keys `signing-key` (PEM ed25519) and `public-key`, or set spec.shardcast.requireSignatures: false")
    longest = len(names.trainer(run.metadata.name))
    if longest > names.MAX_STATEFULSET_NAME:
        problems.append(f"metadata.name: at most {names.MAX_STATEFULSET_NAME - len(names.trainer(''))} characters on a cluster "
                        f"(the trainer StatefulSet {names.trainer(run.metadata.name)!r} would exceed {names.MAX_STATEFULSET_NAME})")
    if problems:
        raise SpecError(problems)


# ---- documents and hashes ----------------------------------------------------------------------

def _document(obj: BaseModel) -> dict:
    """A config model as the YAML document the components read (cluster-only metadata dropped)."""
    doc = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["metadata"] = {"name": obj.metadata.name}
    return doc


def config_text(run: RLRun, pool: InferencePool | None = None) -> str:
    docs = [_document(run)] + ([_document(pool)] if pool else [])
    return yaml.safe_dump_all(docs, sort_keys=False)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- shared pod pieces -------------------------------------------------------------------------

def _meta(name: str, namespace: str, labels: dict, owner: Owner | None) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner.reference()]
    return meta


def _env(run: RLRun) -> list[dict]:
    redis = run.spec.redis
    if redis.url_secret:
        redis_env = {"name": names.ENV_REDIS_URL, "valueFrom": {"secretKeyRef": {"name": redis.url_secret, "key": names.REDIS_URL_KEY}}}
    else:
        redis_env = {"name": names.ENV_REDIS_URL, "value": redis.url or ""}
    env = [{"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           redis_env, {"name": "PYTHONUNBUFFERED", "value": "1"},
           {"name": "RLFLEET_CACHE", "value": f"{names.CACHE_DIR}/models"}]
    return env


def _signing_env(run: RLRun, component: str) -> list[dict]:
    """The trainer gets the private key file; every other pod at most the public key (never the Secret's private half)."""
    sc = run.spec.shardcast
    if not sc.signing_key_secret:
        return []
    if component == names.TRAINER:
        return [{"name": names.ENV_SIGNING_KEY_FILE, "value": f"{names.SIGNING_DIR}/{names.SIGNING_KEY}"}]
    if sc.public_key:
        return []  # in the config file
    return [{"name": names.ENV_PUBLIC_KEY, "valueFrom": {"secretKeyRef": {"name": sc.signing_key_secret, "key": names.PUBLIC_KEY}}}]


def _container(run: RLRun, component: str, args: list[str], image: str, gpus: int = 0,
               store_access: bool = False, ports: list[dict] | None = None, extra_env: list[dict] | None = None) -> dict:
    c = {
        "name": component,
        "image": image,
        "command": ["rlfleet", component],
        "args": ["--config", names.CONFIG_PATH, "--metrics-port", str(names.METRICS_PORT), *args],
        "env": _env(run) + _signing_env(run, component) + (extra_env or []),
        "ports": [*(ports or []), {"name": "metrics", "containerPort": names.METRICS_PORT}],
        "volumeMounts": [{"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
                         {"name": "cache", "mountPath": names.CACHE_DIR}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }
    if store_access and run.spec.store.credentials_secret:
        c["envFrom"] = [{"secretRef": {"name": run.spec.store.credentials_secret}}]
    if run.spec.shardcast.signing_key_secret and component == names.TRAINER:
        c["volumeMounts"].append({"name": "signing", "mountPath": names.SIGNING_DIR, "readOnly": True})
    if component == names.INGEST:
        c["volumeMounts"].append({"name": "ingest-tokens", "mountPath": names.INGEST_DIR, "readOnly": True})
    if gpus > 0:
        c["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if ports:
        c["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": ports[0]["name"]}, "periodSeconds": 5}
    return c


def _pod_template(run: RLRun, labels: dict, container: dict, config_map: str, config: str) -> dict:
    volumes = [{"name": "config", "configMap": {"name": config_map}}, {"name": "cache", "emptyDir": {}}]
    if any(m["name"] == "signing" for m in container["volumeMounts"]):
        volumes.append({"name": "signing", "secret": {"secretName": run.spec.shardcast.signing_key_secret,
                                                      "items": [{"key": names.SIGNING_KEY, "path": names.SIGNING_KEY}]}})
    if any(m["name"] == "ingest-tokens" for m in container["volumeMounts"]):
        volumes.append({"name": "ingest-tokens", "secret": {"secretName": run.spec.ingest.tokens,
                                                            "items": [{"key": names.INGEST_TOKENS_KEY, "path": names.INGEST_TOKENS_KEY}]}})
    return {
        "metadata": {"labels": labels, "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash(config)}},
        "spec": {"containers": [container], "volumes": volumes, "enableServiceLinks": False},
    }


def _deployment(name: str, namespace: str, labels: dict, match: dict, replicas: int, template: dict, owner: Owner | None) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, namespace, labels, owner),
            "spec": {"replicas": replicas, "selector": {"matchLabels": match}, "template": template}}


def _service(name: str, namespace: str, labels: dict, match: dict, port: int | None, owner: Owner | None,
             headless: bool = False) -> dict:
    ports = [{"name": "http", "port": port, "targetPort": port}] if port else []
    ports.append({"name": "metrics", "port": names.METRICS_PORT, "targetPort": names.METRICS_PORT})
    spec = {"selector": match, "ports": ports}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, labels, owner), "spec": spec}


def _image(run: RLRun, default_image: str) -> str:
    return run.spec.image or default_image


# ---- RLRun -------------------------------------------------------------------------------------

def build_run_config_map(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    r = run.metadata.name
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(names.run_config(r), namespace, names.labels("RLRun", r, "config", r), owner),
            "data": {names.CONFIG_FILE: config_text(run)}}


def build_trainer_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    r = run.metadata.name
    return _service(names.trainer(r), namespace, names.labels("RLRun", r, names.TRAINER, r),
                    names.selector("RLRun", r, names.TRAINER, r), names.TORCH_MASTER_PORT, owner, headless=True)


def build_trainer_statefulset(run: RLRun, namespace: str, owner: Owner | None = None,
                              default_image: str = names.DEFAULT_IMAGE) -> dict:
    """GRPO trainer; with trainer.replicas > 1 each pod gets torchrun-style MASTER_ADDR/WORLD_SIZE/RANK."""
    r, t = run.metadata.name, run.spec.trainer
    labels = names.labels("RLRun", r, names.TRAINER, r)
    dist = []
    if t.replicas > 1:
        dist = [{"name": "MASTER_ADDR", "value": names.trainer_master_addr(r, namespace)},
                {"name": "MASTER_PORT", "value": str(names.TORCH_MASTER_PORT)},
                {"name": "WORLD_SIZE", "value": str(t.replicas)},
                {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}]
    container = _container(run, names.TRAINER, ["--output-dir", f"{names.CACHE_DIR}/trainer"], _image(run, default_image),
                           gpus=t.gpus, store_access=True, extra_env=dist)
    if t.replicas > 1:
        container["ports"].insert(0, {"name": "torch", "containerPort": names.TORCH_MASTER_PORT})
    template = _pod_template(run, labels, container, names.run_config(r), config_text(run))
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _meta(names.trainer(r), namespace, labels, owner),
            "spec": {"replicas": 0 if run.spec.suspend else t.replicas, "serviceName": names.trainer(r),
                     "podManagementPolicy": "Parallel", "selector": {"matchLabels": names.selector("RLRun", r, names.TRAINER, r)},
                     "template": template}}


def _run_server_deployment(run: RLRun, component: str, name: str, extra_args: list[str], namespace: str,
                           owner: Owner | None, default_image: str, store_access: bool = False) -> dict:
    """A one-replica HTTP server of a run (origin, ingest) on the Shardcast port."""
    r = run.metadata.name
    labels = names.labels("RLRun", r, component, r)
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    args = ["--host", "0.0.0.0", "--port", str(names.SHARDCAST_PORT), *extra_args]
    container = _container(run, component, args, _image(run, default_image), store_access=store_access, ports=[port])
    return _deployment(name, namespace, labels, names.selector("RLRun", r, component, r), 0 if run.spec.suspend else 1,
                       _pod_template(run, labels, container, names.run_config(r), config_text(run)), owner)


def _run_server_service(run: RLRun, component: str, name: str, namespace: str, owner: Owner | None) -> dict:
    r = run.metadata.name
    return _service(name, namespace, names.labels("RLRun", r, component, r), names.selector("RLRun", r, component, r),
                    names.SHARDCAST_PORT, owner)


def build_origin_deployment(run: RLRun, namespace: str, owner: Owner | None = None,
                            default_image: str = names.DEFAULT_IMAGE) -> dict:
    """The origin serves the store: the only pod besides the trainer with store credentials."""
    return _run_server_deployment(run, names.ORIGIN, names.origin(run.metadata.name), [], namespace, owner,
                                  default_image, store_access=True)


def build_origin_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_server_service(run, names.ORIGIN, names.origin(run.metadata.name), namespace, owner)


def build_ingest_deployment(run: RLRun, namespace: str, owner: Owner | None = None,
                            default_image: str = names.DEFAULT_IMAGE) -> dict:
    """Only when spec.ingest.tokens names the Secret of worker tokens (mounted into this pod only)."""
    return _run_server_deployment(run, names.INGEST, names.ingest(run.metadata.name),
                                  ["--tokens-file", f"{names.INGEST_DIR}/{names.INGEST_TOKENS_KEY}"],
                                  namespace, owner, default_image)


def build_ingest_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_server_service(run, names.INGEST, names.ingest(run.metadata.name), namespace, owner)


def build_verifier_deployment(run: RLRun, namespace: str, owner: Owner | None = None,
                              default_image: str = names.DEFAULT_IMAGE) -> dict:
    """The verifier reads checkpoints from the trusted origin, never from relays."""
    r = run.metadata.name
    labels = names.labels("RLRun", r, names.VERIFIER, r)
    args = ["--consumer", f"$({names.ENV_POD_NAME})", "--origin-url", names.service_url(names.origin(r), namespace),
            "--cache-dir", f"{names.CACHE_DIR}/verifier"]
    container = _container(run, names.VERIFIER, args, _image(run, default_image))
    return _deployment(names.verifier(r), namespace, labels, names.selector("RLRun", r, names.VERIFIER, r),
                       0 if run.spec.suspend else run.spec.verifier.replicas,
                       _pod_template(run, labels, container, names.run_config(r), config_text(run)), owner)


def build_run_children(run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE) -> list[dict]:
    """Every child of an RLRun, in apply order (config first, so pods find it)."""
    check_cluster_run(run)
    if run.spec.remote:  # trained in another cluster: only the config its pools and relays read
        return [build_run_config_map(run, namespace, owner)]
    return [build_run_config_map(run, namespace, owner),
            build_origin_service(run, namespace, owner), build_origin_deployment(run, namespace, owner, default_image),
            build_trainer_service(run, namespace, owner), build_trainer_statefulset(run, namespace, owner, default_image),
            build_verifier_deployment(run, namespace, owner, default_image),
            *([build_ingest_service(run, namespace, owner), build_ingest_deployment(run, namespace, owner, default_image)]
              if run.spec.ingest.tokens else [])]


# ---- relay tree --------------------------------------------------------------------------------

def resolve_upstream(tier: RelayTier, tiers: list[RelayTier], namespace: str) -> str:
    """Upstream URL of a tier: spec.upstreamUrl, spec.upstream's Service, else tier-1 of the same run, else the origin."""
    spec = tier.spec
    if spec.upstream_url:
        return spec.upstream_url.rstrip("/")
    if spec.upstream:
        if not any(t.metadata.name == spec.upstream for t in tiers):
            raise SpecError([f"spec.upstream: RelayTier {spec.upstream!r} does not exist in namespace {namespace!r}"])
        return names.service_url(names.relay(spec.upstream), namespace)
    if spec.tier == 0:
        return names.service_url(names.origin(spec.run), namespace)
    below = sorted(t.metadata.name for t in tiers if t.spec.run == spec.run and t.spec.tier == spec.tier - 1)
    if not below:
        raise SpecError([f"spec.tier: no RelayTier of run {spec.run!r} has tier {spec.tier - 1}; add one or set spec.upstream"])
    return names.service_url(names.relay(below[0]), namespace)


def resolve_pool_relays(pool: InferencePool, tiers: list[RelayTier], namespace: str) -> list[str]:
    """Relay URLs of a pool: spec.relay, else every tier at the run's highest tier, else the origin."""
    if pool.spec.relay:
        if not any(t.metadata.name == pool.spec.relay for t in tiers):
            raise SpecError([f"spec.relay: RelayTier {pool.spec.relay!r} does not exist in namespace {namespace!r}"])
        return [names.service_url(names.relay(pool.spec.relay), namespace)]
    mine = [t for t in tiers if t.spec.run == pool.spec.run]
    if not mine:
        return [names.service_url(names.origin(pool.spec.run), namespace)]
    top = max(t.spec.tier for t in mine)
    return [names.service_url(names.relay(t.metadata.name), namespace) for t in sorted(mine, key=lambda t: t.metadata.name) if t.spec.tier == top]


def build_relay_deployment(run: RLRun, tier: RelayTier, upstream_url: str, namespace: str, owner: Owner | None = None,
                           default_image: str = names.DEFAULT_IMAGE) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    labels = names.labels("RelayTier", n, names.RELAY, r)
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    args = ["--host", "0.0.0.0", "--port", str(names.SHARDCAST_PORT), "--upstream", upstream_url,
            "--cache-dir", f"{names.CACHE_DIR}/relay", "--keep-versions", str(tier.spec.keep_versions)]
    container = _container(run, names.RELAY, args, _image(run, default_image), ports=[port])
    return _deployment(names.relay(n), namespace, labels, names.selector("RelayTier", n, names.RELAY, r),
                       0 if run.spec.suspend else tier.spec.replicas,
                       _pod_template(run, labels, container, names.run_config(r), config_text(run)), owner)


def build_relay_service(run: RLRun, tier: RelayTier, namespace: str, owner: Owner | None = None) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    return _service(names.relay(n), namespace, names.labels("RelayTier", n, names.RELAY, r),
                    names.selector("RelayTier", n, names.RELAY, r), names.SHARDCAST_PORT, owner)


def build_relay_children(run: RLRun, tier: RelayTier, tiers: list[RelayTier], namespace: str, owner: Owner | None = None,
                         default_image: str = names.DEFAULT_IMAGE) -> list[dict]:
    upstream = resolve_upstream(tier, tiers, namespace)
    return [build_relay_service(run, tier, namespace, owner),
            build_relay_deployment(run, tier, upstream, namespace, owner, default_image)]


# ---- InferencePool -----------------------------------------------------------------------------

def build_pool_config_map(run: RLRun, pool: InferencePool, namespace: str, owner: Owner | None = None) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(names.pool_config(n), namespace, names.labels("InferencePool", n, "config", r), owner),
            "data": {names.CONFIG_FILE: config_text(run, pool)}}


def build_rollout_deployment(run: RLRun, pool: InferencePool, relay_urls: list[str], namespace: str,
                             owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    labels = names.labels("InferencePool", n, names.ROLLOUT, r)
    args = ["--worker-id", f"$({names.ENV_POD_NAME})", "--pool", n, *sum((["--relay-url", u] for u in relay_urls), []),
            "--cache-dir", f"{names.CACHE_DIR}/rollout"]
    container = _container(run, names.ROLLOUT, args, pool.spec.image or _image(run, default_image), gpus=pool.spec.gpus)
    return _deployment(names.rollout(n), namespace, labels, names.selector("InferencePool", n, names.ROLLOUT, r),
                       0 if run.spec.suspend else pool.spec.replicas,
                       _pod_template(run, labels, container, names.pool_config(n), config_text(run, pool)), owner)


def build_pool_children(run: RLRun, pool: InferencePool, tiers: list[RelayTier], namespace: str, owner: Owner | None = None,
                        default_image: str = names.DEFAULT_IMAGE) -> list[dict]:
    relays = resolve_pool_relays(pool, tiers, namespace)
    return [build_pool_config_map(run, pool, namespace, owner),
            build_rollout_deployment(run, pool, relays, namespace, owner, default_image)]


# ---- status ------------------------------------------------------------------------------------

def build_condition(type_: str, ok: bool, reason: str, message: str, generation: int | None, now: str,
                    previous: list[dict] | None = None) -> dict:
    """A condition; lastTransitionTime moves only when its status changes."""
    status = "True" if ok else "False"
    old = next((c for c in previous or [] if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(previous: list[dict] | None, *new: dict) -> list[dict]:
    """Replace conditions of the same type, keep the others (status.conditions is a map keyed by type)."""
    types = {c["type"] for c in new}
    return [c for c in previous or [] if c.get("type") not in types] + list(new)


def workload_selector(child: dict) -> str:
    return names.selector_string(child["spec"]["selector"]["matchLabels"])
