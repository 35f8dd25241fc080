"""Every Kubernetes name, label, port and path the operator and the CRDs use; the only place they are spelled.

A child's name is derived from its parent's name and its component, so a re-run of a handler finds
the same object (idempotent apply) and two kinds never produce the same child name.
"""

from __future__ import annotations

from rlfleet.config.base import API_VERSION as API_VERSION
from rlfleet.config.base import GROUP as GROUP
from rlfleet.config.base import VERSION as VERSION
from rlfleet.wire.components import INGEST as INGEST
from rlfleet.wire.components import ORIGIN as ORIGIN
from rlfleet.wire.components import RELAY as RELAY
from rlfleet.wire.components import ROLLOUT as ROLLOUT
from rlfleet.wire.components import TRAINER as TRAINER
from rlfleet.wire.components import VERIFIER as VERIFIER

CATEGORY = "rlfleet"
FIELD_MANAGER = "rlfleet-operator"
DEFAULT_IMAGE = "ghcr.io/rlfleet/rlfleet:0.1.0"
DEFAULT_GPU_IMAGE = "ghcr.io/rlfleet/rlfleet-gpu:0.1.0"


class KindInfo:
    """How one custom kind is spelled in the API (plural, singular, short names)."""

    def __init__(self, kind: str, plural: str, short_names: list[str]):
        self.kind = kind
        self.plural = plural
        self.singular = kind.lower()
        self.short_names = short_names
        self.crd_name = f"{plural}.{GROUP}"


# `ipool`/`rlpool`: the Gateway API Inference Extension also has a kind InferencePool (group
# inference.networking.k8s.io); `kubectl get inferencepools.rlfleet.io` is always unambiguous.
RLRUN = KindInfo("RLRun", "rlruns", ["rlrun", "rlr"])
INFERENCE_POOL = KindInfo("InferencePool", "inferencepools", ["rlpool"])
RELAY_TIER = KindInfo("RelayTier", "relaytiers", ["rltier"])
KINDS = {k.kind: k for k in (RLRUN, INFERENCE_POOL, RELAY_TIER)}

# Ports inside pods.
SHARDCAST_PORT = 8080  # origin and relay HTTP
METRICS_PORT = 9090  # Prometheus /metrics of every component
TORCH_MASTER_PORT = 29500  # trainer rendezvous when the world (replicas x ranks) is over 1

# Paths inside pods.
CONFIG_DIR = "/etc/rlfleet"
CONFIG_FILE = "rlrun.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
CACHE_DIR = "/var/cache/rlfleet"
SIGNING_DIR = "/var/run/rlfleet/signing"
SIGNING_KEY = "signing-key"  # key inside the signing Secret (private; trainer only)
PUBLIC_KEY = "public-key"  # key inside the signing Secret (public; every other pod)
REDIS_URL_KEY = "url"  # key inside the Redis URL Secret (per ACL role: redis_role_url_key)
INGEST_DIR = "/var/run/rlfleet/ingest"
INGEST_TOKENS_KEY = "tokens.yaml"  # key inside the ingest tokens Secret
INGEST_INVITES_DIR = "/var/run/rlfleet/ingest-invites"
INGEST_INVITES_KEY = "invites.yaml"  # key inside the invites Secret (spec.ingest.admission.invites)
WORKER_TOKENS_DIR = "/var/run/rlfleet/worker-tokens"  # a pool's workerTokens Secret: one file per pod name
TLS_DIR = "/var/run/rlfleet/tls"  # a server's kubernetes.io/tls Secret (tls.crt, tls.key): certificates.py
TLS_CA_DIR = "/var/run/rlfleet/tls-ca"  # the run's CA bundle (ca.crt) in its client pods: certificates.py
SHM_DIR = "/dev/shm"  # vLLM workers get a memory-backed /dev/shm (the container runtime's default is 64 MiB)

# The pod's own name, from the downward API (rlfleet's own variables are named in rlfleet/wire/env.py).
ENV_POD_NAME = "POD_NAME"

# Annotations and labels.
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"  # on pod templates: a changed config rolls the pods
RUN_LABEL = f"{GROUP}/run"  # on every child, and on the pools and tiers of a run

# The components (TRAINER, VERIFIER, ...: the `rlfleet <component>` subcommands that run in pods) and the
# API group and version are imported above from where they are spelled: rlfleet/wire/components.py and
# rlfleet/config/base.py.

# A StatefulSet's pods get a `controller-revision-hash` label `<name>-<10 chars>` (at most 63), so
# its name is at most 52 characters.
MAX_STATEFULSET_NAME = 52


def trainer(run: str) -> str:
    """Trainer StatefulSet, its headless Service and its PodDisruptionBudget."""
    return f"{run}-{TRAINER}"


def verifier(run: str) -> str:
    return f"{run}-{VERIFIER}"


def ingest(run: str) -> str:
    """Ingest Deployment and Service (HTTP front of the inbox for outside workers)."""
    return f"{run}-{INGEST}"


def origin(run: str) -> str:
    """Origin Deployment and Service."""
    return f"{run}-{ORIGIN}"


def run_config(run: str) -> str:
    """ConfigMap with the RLRun YAML."""
    return f"{run}-config"


def signing_secret(run: str) -> str:
    """The signing key Secret the operator makes for a run that names none (rundefaults.py)."""
    return f"{run}-signing-key"


def redis_secret(run: str) -> str:
    """The Secret with the chart's Redis URL (password included) the operator makes for a run that names no Redis."""
    return f"{run}-redis-url"


def rollout(pool: str) -> str:
    """Rollout workload of an InferencePool (a Deployment, or a StatefulSet when its workers post to an
    ingest: pod names POOL-rollout-0.. are their worker ids), its headless Service and its
    PodDisruptionBudget."""
    return f"{pool}-{ROLLOUT}"


def pool_config(pool: str) -> str:
    """ConfigMap with the RLRun YAML plus the pool's own document (the workers read `--pool`)."""
    return f"{rollout(pool)}-config"


def relay(tier: str) -> str:
    """Relay Deployment, Service and PodDisruptionBudget of a RelayTier."""
    return f"{tier}-{RELAY}"


def service_url(service: str, namespace: str, port: int = SHARDCAST_PORT, https: bool = False) -> str:
    return f"{'https' if https else 'http'}://{service}.{namespace}.svc:{port}"


def trainer_master_addr(run: str, namespace: str) -> str:
    """DNS name of trainer pod 0 through the headless Service."""
    return f"{trainer(run)}-0.{trainer(run)}.{namespace}.svc"


def labels(kind: str, instance: str, component: str, run: str) -> dict[str, str]:
    """Labels of every child object (and the selector of its pods: the first four keys)."""
    return {
        "app.kubernetes.io/name": "rlfleet",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        RUN_LABEL: run,
        "app.kubernetes.io/part-of": "rlfleet",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        f"{GROUP}/kind": kind.lower(),
    }


def selector(kind: str, instance: str, component: str, run: str) -> dict[str, str]:
    """matchLabels of a workload: immutable on a Deployment/StatefulSet, so only stable keys."""
    full = labels(kind, instance, component, run)
    return {k: full[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")}


def selector_string(match_labels: dict[str, str]) -> str:
    """The `status.selector` string the scale subresource (and HPA) reads."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def redis_role_url_key(role: str) -> str:
    """Key of one Redis ACL role's URL inside the Redis URL Secret (spec.redis.roleUrls)."""
    return f"{REDIS_URL_KEY}-{role}"
