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

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import names
from rlfleet.operator.pods import Owner, build_container, config_text, deployment, image_of, meta, pod_template, service
from rlfleet.operator.resources import MissingDependency, SpecError, check_cluster_run, parse_resource
from rlfleet.topology import Node, TopologyError, relay_graph

__all__ = ["MissingDependency", "Owner", "SpecError", "check_cluster_run", "parse_resource"]  # and the build_* below


# ---- RLRun -------------------------------------------------------------------------------------


def build_run_config_map(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    r = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(names.run_config(r), namespace, names.labels("RLRun", r, "config", r), owner),
        "data": {names.CONFIG_FILE: config_text(run)},
    }


def build_trainer_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    r = run.metadata.name
    return service(
        names.trainer(r),
        namespace,
        names.labels("RLRun", r, names.TRAINER, r),
        names.selector("RLRun", r, names.TRAINER, r),
        names.TORCH_MASTER_PORT,
        owner,
        headless=True,
    )


def build_trainer_statefulset(
    run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE
) -> dict:
    """GRPO trainer; with trainer.replicas > 1 each pod gets torchrun-style MASTER_ADDR/WORLD_SIZE/RANK."""
    r, t = run.metadata.name, run.spec.trainer
    labels = names.labels("RLRun", r, names.TRAINER, r)
    dist = []
    if t.replicas > 1:
        dist = [
            {"name": "MASTER_ADDR", "value": names.trainer_master_addr(r, namespace)},
            {"name": "MASTER_PORT", "value": str(names.TORCH_MASTER_PORT)},
            {"name": "WORLD_SIZE", "value": str(t.replicas)},
            {
                "name": "RANK",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
            },
        ]
    main = build_container(
        run,
        names.TRAINER,
        ["--output-dir", f"{names.CACHE_DIR}/trainer"],
        image_of(run, default_image),
        gpus=t.gpus,
        store_access=True,
        extra_env=dist,
    )
    if t.replicas > 1:
        main["ports"].insert(0, {"name": "torch", "containerPort": names.TORCH_MASTER_PORT})
    template = pod_template(run, labels, main, names.run_config(r), config_text(run))
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(names.trainer(r), namespace, labels, owner),
        "spec": {
            "replicas": 0 if run.spec.suspend else t.replicas,
            "serviceName": names.trainer(r),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.selector("RLRun", r, names.TRAINER, r)},
            "template": template,
        },
    }


def _run_server_deployment(
    run: RLRun,
    component: str,
    name: str,
    extra_args: list[str],
    namespace: str,
    owner: Owner | None,
    default_image: str,
    store_access: bool = False,
) -> dict:
    """A one-replica HTTP server of a run (origin, ingest) on the Shardcast port."""
    r = run.metadata.name
    labels = names.labels("RLRun", r, component, r)
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    args = ["--host", "0.0.0.0", "--port", str(names.SHARDCAST_PORT), *extra_args]
    main = build_container(run, component, args, image_of(run, default_image), store_access=store_access, ports=[port])
    return deployment(
        name,
        namespace,
        labels,
        names.selector("RLRun", r, component, r),
        0 if run.spec.suspend else 1,
        pod_template(run, labels, main, names.run_config(r), config_text(run)),
        owner,
    )


def _run_server_service(run: RLRun, component: str, name: str, namespace: str, owner: Owner | None) -> dict:
    r = run.metadata.name
    return service(
        name,
        namespace,
        names.labels("RLRun", r, component, r),
        names.selector("RLRun", r, component, r),
        names.SHARDCAST_PORT,
        owner,
    )


def build_origin_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE
) -> dict:
    """The origin serves the store: the only pod besides the trainer with store credentials."""
    return _run_server_deployment(
        run, names.ORIGIN, names.origin(run.metadata.name), [], namespace, owner, default_image, store_access=True
    )


def build_origin_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_server_service(run, names.ORIGIN, names.origin(run.metadata.name), namespace, owner)


def build_ingest_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE
) -> dict:
    """Only when spec.ingest.tokens names the Secret of worker tokens (mounted into this pod only)."""
    return _run_server_deployment(
        run,
        names.INGEST,
        names.ingest(run.metadata.name),
        ["--tokens-file", f"{names.INGEST_DIR}/{names.INGEST_TOKENS_KEY}"],
        namespace,
        owner,
        default_image,
    )


def build_ingest_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_server_service(run, names.INGEST, names.ingest(run.metadata.name), namespace, owner)


def build_verifier_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE
) -> dict:
    """The verifier reads checkpoints from the trusted origin, never from relays."""
    r = run.metadata.name
    labels = names.labels("RLRun", r, names.VERIFIER, r)
    args = [
        "--consumer",
        f"$({names.ENV_POD_NAME})",
        "--origin-url",
        names.service_url(names.origin(r), namespace),
        "--cache-dir",
        f"{names.CACHE_DIR}/verifier",
    ]
    main = build_container(run, names.VERIFIER, args, image_of(run, default_image))
    return deployment(
        names.verifier(r),
        namespace,
        labels,
        names.selector("RLRun", r, names.VERIFIER, r),
        0 if run.spec.suspend else run.spec.verifier.replicas,
        pod_template(run, labels, main, names.run_config(r), config_text(run)),
        owner,
    )


def build_run_children(
    run: RLRun, namespace: str, owner: Owner | None = None, default_image: str = names.DEFAULT_IMAGE
) -> list[dict]:
    """Every child of an RLRun, in apply order (config first, so pods find it)."""
    check_cluster_run(run)
    if run.spec.remote:  # trained in another cluster: only the config its pools and relays read
        return [build_run_config_map(run, namespace, owner)]
    return [
        build_run_config_map(run, namespace, owner),
        build_origin_service(run, namespace, owner),
        build_origin_deployment(run, namespace, owner, default_image),
        build_trainer_service(run, namespace, owner),
        build_trainer_statefulset(run, namespace, owner, default_image),
        build_verifier_deployment(run, namespace, owner, default_image),
        *(
            [build_ingest_service(run, namespace, owner), build_ingest_deployment(run, namespace, owner, default_image)]
            if run.spec.ingest.tokens
            else []
        ),
    ]


# ---- relay tree --------------------------------------------------------------------------------


def node_url(node: Node, run: str, namespace: str) -> str:
    """A node of the relay tree (topology.py) as the Service URL pods reach it by."""
    if node.kind == "url":
        return node.name
    return names.service_url(names.origin(run) if node.kind == "origin" else names.relay(node.name), namespace)


def resolve_upstream(run: RLRun, tier: RelayTier, tiers: list[RelayTier], namespace: str) -> str:
    """Upstream URL of a tier (topology.relay_graph's rules); MissingDependency while a tier it names is absent."""
    try:
        return node_url(
            relay_graph(run.metadata.name, [], [*tiers, tier]).upstream(tier.metadata.name),
            run.metadata.name,
            namespace,
        )
    except TopologyError as exc:
        raise MissingDependency(exc.problems) from None


def resolve_pool_relays(run: RLRun, pool: InferencePool, tiers: list[RelayTier], namespace: str) -> list[str]:
    """Relay URLs of a pool (topology.relay_graph's rules); MissingDependency while the tier it names is absent."""
    try:
        nodes = relay_graph(run.metadata.name, [pool], tiers).pool_sources(pool.metadata.name)
    except TopologyError as exc:
        raise MissingDependency(exc.problems) from None
    return [node_url(n, run.metadata.name, namespace) for n in nodes]


def build_relay_deployment(
    run: RLRun,
    tier: RelayTier,
    upstream_url: str,
    namespace: str,
    owner: Owner | None = None,
    default_image: str = names.DEFAULT_IMAGE,
) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    labels = names.labels("RelayTier", n, names.RELAY, r)
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    args = [
        "--host",
        "0.0.0.0",
        "--port",
        str(names.SHARDCAST_PORT),
        "--upstream",
        upstream_url,
        "--cache-dir",
        f"{names.CACHE_DIR}/relay",
    ]
    if tier.spec.keep_versions:
        args += ["--keep-versions", str(tier.spec.keep_versions)]
    main = build_container(run, names.RELAY, args, image_of(run, default_image), ports=[port])
    return deployment(
        names.relay(n),
        namespace,
        labels,
        names.selector("RelayTier", n, names.RELAY, r),
        0 if run.spec.suspend else tier.spec.replicas,
        pod_template(run, labels, main, names.run_config(r), config_text(run)),
        owner,
    )


def build_relay_service(run: RLRun, tier: RelayTier, namespace: str, owner: Owner | None = None) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    return service(
        names.relay(n),
        namespace,
        names.labels("RelayTier", n, names.RELAY, r),
        names.selector("RelayTier", n, names.RELAY, r),
        names.SHARDCAST_PORT,
        owner,
    )


def build_relay_children(
    run: RLRun,
    tier: RelayTier,
    tiers: list[RelayTier],
    namespace: str,
    owner: Owner | None = None,
    default_image: str = names.DEFAULT_IMAGE,
) -> list[dict]:
    upstream = resolve_upstream(run, tier, tiers, namespace)
    return [
        build_relay_service(run, tier, namespace, owner),
        build_relay_deployment(run, tier, upstream, namespace, owner, default_image),
    ]


# ---- InferencePool -----------------------------------------------------------------------------


def build_pool_config_map(run: RLRun, pool: InferencePool, namespace: str, owner: Owner | None = None) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(names.pool_config(n), namespace, names.labels("InferencePool", n, "config", r), owner),
        "data": {names.CONFIG_FILE: config_text(run, pool)},
    }


def build_rollout_deployment(
    run: RLRun,
    pool: InferencePool,
    relay_urls: list[str],
    namespace: str,
    owner: Owner | None = None,
    default_image: str = names.DEFAULT_IMAGE,
) -> dict:
    n, r = pool.metadata.name, run.metadata.name
    labels = names.labels("InferencePool", n, names.ROLLOUT, r)
    args = [
        "--worker-id",
        f"$({names.ENV_POD_NAME})",
        "--pool",
        n,
        *sum((["--relay-url", u] for u in relay_urls), []),
        "--cache-dir",
        f"{names.CACHE_DIR}/rollout",
    ]
    main = build_container(
        run,
        names.ROLLOUT,
        args,
        pool.spec.image or image_of(run, default_image),
        gpus=pool.spec.gpus,
        redis_reads_only=bool(pool.spec.ingest_url),  # it submits through the ingest
    )
    return deployment(
        names.rollout(n),
        namespace,
        labels,
        names.selector("InferencePool", n, names.ROLLOUT, r),
        0 if run.spec.suspend else pool.spec.replicas,
        pod_template(run, labels, main, names.pool_config(n), config_text(run, pool)),
        owner,
    )


def build_pool_children(
    run: RLRun,
    pool: InferencePool,
    tiers: list[RelayTier],
    namespace: str,
    owner: Owner | None = None,
    default_image: str = names.DEFAULT_IMAGE,
) -> list[dict]:
    relays = resolve_pool_relays(run, pool, tiers, namespace)
    return [
        build_pool_config_map(run, pool, namespace, owner),
        build_rollout_deployment(run, pool, relays, namespace, owner, default_image),
    ]
