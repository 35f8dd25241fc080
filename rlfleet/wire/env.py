"""Every environment variable rlfleet reads or sets, named once.

Processes read them when they start (in `main`, `component_context`, the operator's start-up),
never at import, so a test or a launcher can set them before it starts a component in-process.
Run configuration lives in the config models (rlfleet/config/); these are per-process settings
that a pod, the local launcher or an operator image supplies.
"""

from __future__ import annotations

import os

# Set by the local launcher and by the operator's pod specs; read by every component.
REDIS_URL = "RLFLEET_REDIS_URL"  # overrides spec.redis.url
REDIS_READ_URL = "RLFLEET_REDIS_READ_URL"  # a rollout worker's reads (policy, inbox length); default REDIS_URL
REDIS_TICKETS_URL = "RLFLEET_REDIS_TICKETS_URL"  # a rollout worker's work tickets; default REDIS_URL
STORE_URI = "RLFLEET_STORE_URI"  # overrides spec.store.uri (the launcher's RUN_DIR/store)
PUBLIC_KEY = "RLFLEET_PUBLIC_KEY"  # manifest verification key, overrides spec.shardcast.publicKey
SIGNING_KEY_FILE = "RLFLEET_SIGNING_KEY_FILE"  # the trainer's private signing key (PEM file)
WORKER_TOKEN = "RLFLEET_WORKER_TOKEN"  # a remote worker's ingest token
WORKER_TOKEN_FILE = "RLFLEET_WORKER_TOKEN_FILE"  # ... or the file holding it (a pod's key of the pool's Secret)
TLS_CA_FILE = "RLFLEET_TLS_CA_FILE"  # PEM CA bundle https:// servers are verified with (wire/tls.py)
TORCH_THREADS = "RLFLEET_TORCH_THREADS"  # intra-op threads of torch (the launcher sets 1; pods: their CPU request)
LOCAL = "RLFLEET_LOCAL"  # set by `rlfleet run`: bind /metrics to 127.0.0.1 only
LOG_LEVEL = "RLFLEET_LOG_LEVEL"
CACHE = "RLFLEET_CACHE"  # builtin model cache (default ~/.cache/rlfleet)
VLLM_KV_CACHE_BYTES = "RLFLEET_VLLM_KV_CACHE_BYTES"  # vLLM's KV cache on CPU
# The hub's own variables (huggingface_hub), read when an hf:// model is resolved (rlfleet/models/sources.py)
HF_ENDPOINT = "HF_ENDPOINT"  # the hub's URL (default https://huggingface.co)
HF_HOME = "HF_HOME"  # its cache is HF_HOME/hub (default ~/.cache/huggingface)
HF_HUB_CACHE = "HF_HUB_CACHE"  # ... or this directory
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"  # 1: only the cache is read
HF_TOKEN = "HF_TOKEN"  # a private or gated repository's token (on a cluster from spec.model.tokenSecret)
DEVICE = "RLFLEET_DEVICE"  # cpu, cuda, cuda:N or auto (unset): where the process computes (rlfleet/models/device.py)
# torchrun's names, set on trainer ranks (rlfleet/services/trainer/ranks.py starts a replica's ranks).
LOCAL_RANK = "LOCAL_RANK"  # a trainer rank's index in its replica = its GPU index in its pod (default 0)
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"  # ranks per replica
GROUP_RANK = "GROUP_RANK"  # the replica's index (a trainer pod's ordinal); RANK = GROUP_RANK x ranks + LOCAL_RANK
RANK = "RANK"  # the rank in the whole world (default 0)
WORLD_SIZE = "WORLD_SIZE"  # replicas x ranks per replica (default 1)
MASTER_ADDR = "MASTER_ADDR"  # where rank 0 listens for the process group's rendezvous
MASTER_PORT = "MASTER_PORT"
# Experiment trackers' credentials (spec.tracking): only the trainer gets them (`rlfleet run` takes them out of the
# other processes' environment; the operator puts its Secrets in the trainer pod only).
WANDB_API_KEY = "WANDB_API_KEY"
TRACKER_CREDENTIALS = (WANDB_API_KEY, "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# Engine liveness on /healthz (rlfleet/wire/health.py): a rollout worker's engine, the verifier's prefill model.
HEALTH_DEADLINE_S = "RLFLEET_HEALTH_DEADLINE_S"  # a forward step (busy) or an idle probe must complete within it
HEALTH_PROBE_INTERVAL_S = "RLFLEET_HEALTH_PROBE_INTERVAL_S"  # idle: a tiny forward once this long without one
# a weight swap may take deadline + its version's bytes at this rate (bytes per second) before it counts as a hang
HEALTH_SWAP_MIN_RATE = "RLFLEET_HEALTH_SWAP_MIN_RATE"
# Read by `rlfleet operator` (set by the Helm chart).
IMAGE = "RLFLEET_IMAGE"  # default image of every component
GPU_IMAGE = "RLFLEET_GPU_IMAGE"  # default image of the components that ask for GPUs
IMAGE_PULL_POLICY = "RLFLEET_IMAGE_PULL_POLICY"  # imagePullPolicy of every container (Always, IfNotPresent, Never)
IMAGE_PULL_SECRETS = "RLFLEET_IMAGE_PULL_SECRETS"  # comma-separated Secret names: imagePullSecrets of every pod
RESYNC_INTERVAL = "RLFLEET_RESYNC_INTERVAL"  # seconds between re-applies and status reads
POD_SECURITY_CONTEXT = "RLFLEET_POD_SECURITY_CONTEXT"  # JSON: securityContext of every run pod
CONTAINER_SECURITY_CONTEXT = "RLFLEET_CONTAINER_SECURITY_CONTEXT"  # JSON: securityContext of their containers
API_TIMEOUT = "RLFLEET_API_TIMEOUT"  # seconds: the bound on each Kubernetes API request (connect: at most 10 of them)
# What the operator fills into an RLRun that leaves it out (rlfleet/operator/rundefaults.py; the chart sets them):
DEFAULT_REDIS_URL = "RLFLEET_DEFAULT_REDIS_URL"  # redis:// URL of the chart's Redis, without the password
DEFAULT_REDIS_PASSWORD = "RLFLEET_DEFAULT_REDIS_PASSWORD"  # its password (from the chart's Secret)
DEFAULT_STORE = "RLFLEET_DEFAULT_STORE"  # JSON of a spec.store (uri, endpointUrl, credentialsSecret)

DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_VLLM_KV_CACHE_BYTES = 512 << 20
DEFAULT_RESYNC_INTERVAL_S = 15.0
DEFAULT_API_TIMEOUT_S = 30.0


def get(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    return os.environ.get(name) or None


def get_int(name: str, default: int) -> int:
    """An integer variable; a value that is not one is an error naming the variable."""
    return int(_number(name, default, int))


def get_float(name: str, default: float) -> float:
    """A number variable; a value that is not one is an error naming the variable."""
    return float(_number(name, default, float))


def _number(name: str, default, kind):
    text = get(name)
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise SystemExit(
            f"environment variable {name}={text!r} is not a {kind.__name__}; unset it or fix the value"
        ) from None
