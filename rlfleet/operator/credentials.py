"""Credentials follow the data: which pods get which credentials for what they read from S3 or the hub.

    store     spec.store.credentialsSecret (envFrom): the trainer and the origin (they write and serve the
              store; the trainer also fetches an s3:// model and reads the dataset with it); the verifier
              when the run's dataset is on s3:// (it rebuilds every problem from its row)
    dataset   a rollout worker reads the dataset's rows itself when it is on s3://: the pool's
              dataCredentialsSecret, else, for a pool that writes to Redis directly (trusted that far), the
              store's; a pool with ingestUrl gets only its own (its workers are not trusted with the store's)
    hub       spec.model.tokenSecret's `token` as HF_TOKEN, and HF_HOME on the pod's cache volume: the
              trainer alone, which fetches an hf:// model and publishes it as version 0
Never to a worker: the signing key (pods.py signing_env) and any credential for the model, which reaches
workers as policy version 0 through the signed relay tree (rlfleet/models/sources.py). The config refuses
trainer.lora over an s3:// or hf:// model (workers would need the base), so the verifier never fetches
the model either. A dataset is any `dataset.path` in spec.task, however the task nests it.
"""

from __future__ import annotations

from rlfleet.config import InferencePool, RLRun
from rlfleet.operator import names
from rlfleet.wire import env

HUB_TOKEN_KEY = "token"  # the key of spec.model.tokenSecret


def dataset_paths(run: RLRun) -> list[str]:
    """Every `dataset.path` in the run's task spec (a single task's, or each source's of a task that nests them)."""
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            dataset = node.get("dataset")
            if isinstance(dataset, dict) and isinstance(dataset.get("path"), str):
                found.append(dataset["path"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(run.spec.task.model_dump())
    return found


def reads_s3_dataset(run: RLRun) -> bool:
    return any(path.startswith("s3://") for path in dataset_paths(run))


def secrets_from(run: RLRun, component: str, pool: InferencePool | None = None) -> list[str]:
    """The Secrets whose keys become `component`'s environment (envFrom), per the module docstring."""
    store = run.spec.store.credentials_secret
    if component in (names.TRAINER, names.ORIGIN):
        return [store] if store else []
    if not reads_s3_dataset(run):
        return []
    if component == names.VERIFIER:
        return [store] if store else []
    if component == names.ROLLOUT and pool is not None:
        if pool.spec.data_credentials_secret:
            return [pool.spec.data_credentials_secret]
        trusted = not pool.spec.ingest_url and not run.spec.remote
        return [store] if store and trusted else []
    return []


def hub_env(run: RLRun, component: str) -> list[dict]:
    """HF_HOME (the pod's cache volume, so a restarted trainer finds its download; the project's images set the
    same, an image of the user's may not), no progress bars, and HF_TOKEN for the trainer of an hf:// model;
    nothing for any other pod."""
    model = run.spec.model
    if component != names.TRAINER or not model.path.startswith("hf://"):
        return []
    out: list[dict] = [
        {"name": env.HF_HOME, "value": f"{names.CACHE_DIR}/hf"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},  # a pod's log is no terminal
    ]
    if model.token_secret:
        ref = {"secretKeyRef": {"name": model.token_secret, "key": HUB_TOKEN_KEY}}
        out.append({"name": env.HF_TOKEN, "valueFrom": ref})
    return out
