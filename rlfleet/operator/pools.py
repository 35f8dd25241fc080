"""InferencePool -> its ConfigMap (the run and the pool as a worker reads them), the rollout workload, a
headless Service (pod DNS names, /metrics) and a PodDisruptionBudget. Pure.

A pool whose workers post to an ingest (`ingestUrl`) reaches the run only through the ingest and the
relays: its pods get no Redis URL and a config without Redis, store or ingest settings (podconfig.py).
Each worker proves who it is with its own token: the pool is a StatefulSet, so pod names are stable
(POOL-rollout-0..N-1) and serve as worker ids, and each pod reads the file named after itself from the
`workerTokens` Secret (env RLFLEET_WORKER_TOKEN_FILE); the ingest's tokens.yaml maps the same ids to
the same tokens. The Secret is mounted whole (a volume cannot pick a key by pod name): the pods of a
pool share one trust domain, and their tokens tell them apart for reputation and bans. Other pools are
Deployments whose workers XADD to the inbox directly.
"""

from __future__ import annotations

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import kueue, names, podconfig
from rlfleet.operator.certificates import client_trust
from rlfleet.operator.pods import (
    ClusterDefaults,
    ContainerParts,
    Owner,
    build_container,
    deployment,
    disruption_budget,
    meta,
    pod_template,
    scale,
    secret_volume,
    service,
    statefulset,
)
from rlfleet.operator.relays import resolve_pool_relays
from rlfleet.operator.resources import check_cluster_pool
from rlfleet.wire import env


def build_pool_config_map(
    run: RLRun,
    pool: InferencePool,
    namespace: str,
    owner: Owner | None = None,
    defaults: ClusterDefaults = ClusterDefaults(),
) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(names.pool_config(n), namespace, names.labels("InferencePool", n, "config", r), owner),
        "data": {names.CONFIG_FILE: podconfig.pool_config_text(run, pool, defaults.views)},
    }


def _worker_identity(pool: InferencePool) -> tuple[list[dict], list[dict], list[dict]]:
    """(env, volume mounts, volumes) that give each worker of an ingest pool its own token file."""
    if not pool.spec.worker_tokens:
        return [], [], []
    token_file = f"{names.WORKER_TOKENS_DIR}/$({names.ENV_POD_NAME})"
    return (
        [{"name": env.WORKER_TOKEN_FILE, "value": token_file}],
        [{"name": "worker-tokens", "mountPath": names.WORKER_TOKENS_DIR, "readOnly": True}],
        [secret_volume("worker-tokens", pool.spec.worker_tokens)],
    )


def build_rollout_workload(
    run: RLRun,
    pool: InferencePool,
    relay_urls: list[str],
    namespace: str,
    owner: Owner | None = None,
    defaults: ClusterDefaults = ClusterDefaults(),
    active: bool = True,
) -> dict:
    n, r, spec = pool.metadata.name, run.metadata.name, pool.spec
    labels = names.labels("InferencePool", n, names.ROLLOUT, r)
    args = ["--worker-id", f"$({names.ENV_POD_NAME})", "--pool", n]
    args += [*sum((["--relay-url", u] for u in relay_urls), []), "--cache-dir", f"{names.CACHE_DIR}/rollout"]
    token_env, mounts, volumes = _worker_identity(pool)
    ca_env, ca_mounts, ca_volumes = client_trust(run)  # an https:// ingest or relay: verified with the run's CA
    mounts, volumes = mounts + ca_mounts, volumes + ca_volumes
    if spec.engine == "vllm":
        mounts.append({"name": "dshm", "mountPath": names.SHM_DIR})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}})
    main = build_container(
        run,
        defaults,
        ContainerParts(
            names.ROLLOUT,
            args,
            defaults.image_for(run, spec.gpus, spec.image),
            spec.resources,
            gpus=spec.gpus,
            gpu_resource=spec.gpu_resource,
            pool=pool,
            extra_env=token_env + ca_env,
            mounts=mounts,
            redis=not spec.ingest_url,
        ),
    )
    config = podconfig.pool_config_text(run, pool, defaults.views)
    template = pod_template(
        labels,
        main,
        names.pool_config(n),
        podconfig.config_hash(config),
        defaults,
        volumes=volumes,
        override=spec.pod_template,
    )
    match = names.selector("InferencePool", n, names.ROLLOUT, r)
    replicas = scale(run, spec.replicas, active)
    if spec.ingest_url:
        return statefulset(names.rollout(n), namespace, labels, match, replicas, template, owner, names.rollout(n))
    return deployment(names.rollout(n), namespace, labels, match, replicas, template, owner)


def build_rollout_service(run: RLRun, pool: InferencePool, namespace: str, owner: Owner | None = None) -> dict:
    """Headless: the StatefulSet's pod DNS names, and the workers' /metrics for a ServiceMonitor."""
    n, r = pool.metadata.name, run.metadata.name
    return service(
        names.rollout(n),
        namespace,
        names.labels("InferencePool", n, names.ROLLOUT, r),
        names.selector("InferencePool", n, names.ROLLOUT, r),
        owner,
        [("metrics", names.METRICS_PORT)],
        headless=True,
    )


def build_rollout_budget(run: RLRun, pool: InferencePool, namespace: str, owner: Owner | None = None) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    return disruption_budget(
        names.rollout(n),
        namespace,
        names.labels("InferencePool", n, names.ROLLOUT, r),
        names.selector("InferencePool", n, names.ROLLOUT, r),
        pool.spec.max_unavailable,
        owner,
    )


def build_pool_children(
    run: RLRun,
    pool: InferencePool,
    tiers: list[RelayTier],
    namespace: str,
    owner: Owner | None = None,
    defaults: ClusterDefaults = ClusterDefaults(),
    active: bool = True,
) -> list[dict]:
    check_cluster_pool(run, pool)
    relays = resolve_pool_relays(run, pool, tiers, namespace)
    children = [
        build_pool_config_map(run, pool, namespace, owner, defaults),
        build_rollout_workload(run, pool, relays, namespace, owner, defaults, active),
        build_rollout_service(run, pool, namespace, owner),
        build_rollout_budget(run, pool, namespace, owner),
    ]
    queue = kueue.queue_of(pool.metadata.labels, run.metadata.labels)
    return kueue.grouped(children, queue, names.rollout(pool.metadata.name), pool.spec.replicas)
