"""The pieces every workload the operator builds is made of: the config document a pod reads (and its
hash, which rolls pods when it changes), metadata with the owner, the container, the pod template,
Deployments and Services. Pure functions of the config models, like the builders that use them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import yaml
from pydantic import BaseModel

from rlfleet import env, redis_acl
from rlfleet.config import API_VERSION, InferencePool, RLRun
from rlfleet.operator import names


@dataclass(frozen=True)
class Owner:
    """The parent custom resource of a child (its ownerReference)."""

    kind: str
    name: str
    uid: str

    def reference(self) -> dict:
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# ---- documents and hashes ----------------------------------------------------------------------


def document(obj: BaseModel) -> dict:
    """A config model as the YAML document the components read (cluster-only metadata dropped)."""
    doc = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["metadata"] = {"name": obj.metadata.name}
    return doc


def config_text(run: RLRun, pool: InferencePool | None = None) -> str:
    docs = [document(run)] + ([document(pool)] if pool else [])
    return yaml.safe_dump_all(docs, sort_keys=False)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- shared pod pieces -------------------------------------------------------------------------


def meta(name: str, namespace: str, labels: dict, owner: Owner | None) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner.reference()]
    return meta


def redis_env(run: RLRun, component: str, reads_only: bool = False) -> list[dict]:
    """env.REDIS_URL of a pod: spec.redis.url, the urlSecret's `url`, or with roleUrls its role's
    `url-<role>` (a rollout worker also gets its reader's and tickets' URLs; one behind an ingest only reads)."""
    redis = run.spec.redis
    if not redis.url_secret:
        return [{"name": env.REDIS_URL, "value": redis.url or ""}]

    def from_secret(name: str, key: str) -> dict:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": redis.url_secret, "key": key}}}

    if not redis.role_urls:
        return [from_secret(env.REDIS_URL, names.REDIS_URL_KEY)]
    role = "reader" if reads_only else redis_acl.COMPONENT_ROLES[component]
    out = [from_secret(env.REDIS_URL, names.redis_role_url_key(role))]
    if component == names.ROLLOUT:
        out.append(from_secret(env.REDIS_READ_URL, names.redis_role_url_key(redis_acl.WORKER_ROLES["read"])))
        if not reads_only:
            out.append(from_secret(env.REDIS_TICKETS_URL, names.redis_role_url_key(redis_acl.WORKER_ROLES["tickets"])))
    return out


def pod_env(run: RLRun, component: str, reads_only: bool = False) -> list[dict]:
    return [
        {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *redis_env(run, component, reads_only),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": env.CACHE, "value": f"{names.CACHE_DIR}/models"},
    ]


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


def build_container(
    run: RLRun,
    component: str,
    args: list[str],
    image: str,
    gpus: int = 0,
    store_access: bool = False,
    ports: list[dict] | None = None,
    extra_env: list[dict] | None = None,
    redis_reads_only: bool = False,
) -> dict:
    c = {
        "name": component,
        "image": image,
        "command": ["rlfleet", component],
        "args": ["--config", names.CONFIG_PATH, "--metrics-port", str(names.METRICS_PORT), *args],
        "env": pod_env(run, component, redis_reads_only) + signing_env(run, component) + (extra_env or []),
        "ports": [*(ports or []), {"name": "metrics", "containerPort": names.METRICS_PORT}],
        "volumeMounts": [
            {"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True},
            {"name": "cache", "mountPath": names.CACHE_DIR},
        ],
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


def pod_template(run: RLRun, labels: dict, container: dict, config_map: str, config: str) -> dict:
    volumes = [{"name": "config", "configMap": {"name": config_map}}, {"name": "cache", "emptyDir": {}}]
    if any(m["name"] == "signing" for m in container["volumeMounts"]):
        volumes.append(
            {
                "name": "signing",
                "secret": {
                    "secretName": run.spec.shardcast.signing_key_secret,
                    "items": [{"key": names.SIGNING_KEY, "path": names.SIGNING_KEY}],
                },
            }
        )
    if any(m["name"] == "ingest-tokens" for m in container["volumeMounts"]):
        volumes.append(
            {
                "name": "ingest-tokens",
                "secret": {
                    "secretName": run.spec.ingest.tokens,
                    "items": [{"key": names.INGEST_TOKENS_KEY, "path": names.INGEST_TOKENS_KEY}],
                },
            }
        )
    return {
        "metadata": {"labels": labels, "annotations": {names.CONFIG_HASH_ANNOTATION: config_hash(config)}},
        "spec": {"containers": [container], "volumes": volumes, "enableServiceLinks": False},
    }


def deployment(
    name: str, namespace: str, labels: dict, match: dict, replicas: int, template: dict, owner: Owner | None
) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, namespace, labels, owner),
        "spec": {"replicas": replicas, "selector": {"matchLabels": match}, "template": template},
    }


def service(
    name: str, namespace: str, labels: dict, match: dict, port: int | None, owner: Owner | None, headless: bool = False
) -> dict:
    ports = [{"name": "http", "port": port, "targetPort": port}] if port else []
    ports.append({"name": "metrics", "port": names.METRICS_PORT, "targetPort": names.METRICS_PORT})
    spec = {"selector": match, "ports": ports}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, namespace, labels, owner), "spec": spec}


def image_of(run: RLRun, default_image: str) -> str:
    return run.spec.image or default_image
