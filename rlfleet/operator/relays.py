"""RelayTier -> relay Deployment + Service + PodDisruptionBudget, and the relay tree as Service URLs
(topology.relay_graph decides who pulls from whom; this maps its nodes to addresses). Pure."""

from __future__ import annotations

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import kueue, names, podconfig
from rlfleet.operator.certificates import client_trust, server_tls
from rlfleet.operator.pods import (
    ClusterDefaults,
    ContainerParts,
    Owner,
    build_container,
    deployment,
    disruption_budget,
    pod_template,
    scale,
    service,
)
from rlfleet.operator.resources import MissingDependency
from rlfleet.wire.topology import ORIGIN, URL, Node, TopologyError, relay_graph


def node_url(node: Node, run: str, namespace: str, https_tiers: frozenset[str] = frozenset()) -> str:
    """A node of the relay tree (topology.py) as the Service URL pods reach it by: https:// for a tier that
    serves TLS (`https_tiers`: the names of the tiers with tls.secretName)."""
    if node.kind == URL:
        return node.name
    if node == ORIGIN:
        return names.service_url(names.origin(run), namespace)
    return names.service_url(names.relay(node.name), namespace, https=node.name in https_tiers)


def https_tiers(tiers: list[RelayTier]) -> frozenset[str]:
    return frozenset(t.metadata.name for t in tiers if t.spec.tls.secret_name)


def resolve_upstream(run: RLRun, tier: RelayTier, tiers: list[RelayTier], namespace: str) -> str:
    """Upstream URL of a tier (topology.relay_graph's rules); MissingDependency while a tier it names is absent."""
    try:
        return node_url(
            relay_graph(run.metadata.name, [], [*tiers, tier]).upstream(tier.metadata.name),
            run.metadata.name,
            namespace,
            https_tiers([*tiers, tier]),
        )
    except TopologyError as exc:
        raise MissingDependency(exc.problems) from None


def resolve_pool_relays(run: RLRun, pool: InferencePool, tiers: list[RelayTier], namespace: str) -> list[str]:
    """Relay URLs of a pool (topology.relay_graph's rules); MissingDependency while the tier it names is absent."""
    try:
        nodes = relay_graph(run.metadata.name, [pool], tiers).pool_sources(pool.metadata.name)
    except TopologyError as exc:
        raise MissingDependency(exc.problems) from None
    return [node_url(n, run.metadata.name, namespace, https_tiers(tiers)) for n in nodes]


def build_relay_deployment(
    run: RLRun,
    tier: RelayTier,
    upstream_url: str,
    namespace: str,
    owner: Owner | None = None,
    defaults: ClusterDefaults = ClusterDefaults(),
    active: bool = True,
) -> dict:
    """A tier's relays: with tls.secretName they serve HTTPS from it, and with the run's spec.tls CA bundle they
    verify an https:// upstream with it (certificates.py)."""
    n, r = tier.metadata.name, run.metadata.name
    labels = names.labels("RelayTier", n, names.RELAY, r)
    args = ["--host", "0.0.0.0", "--port", str(names.SHARDCAST_PORT), "--upstream", upstream_url]
    args += ["--cache-dir", f"{names.CACHE_DIR}/relay"]
    if tier.spec.keep_versions:
        args += ["--keep-versions", str(tier.spec.keep_versions)]
    tls_args, tls_mounts, tls_volumes = server_tls(tier.spec.tls)
    ca_env, ca_mounts, ca_volumes = client_trust(run)
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    main = build_container(
        run,
        defaults,
        ContainerParts(
            names.RELAY,
            args + tls_args,
            defaults.image_for(run, 0),
            tier.spec.resources,
            ports=[port],
            extra_env=ca_env,
            mounts=tls_mounts + ca_mounts,
            https=bool(tls_args),
        ),
    )
    template = pod_template(
        labels,
        main,
        names.run_config(r),
        podconfig.run_reader_hash(run, names.RELAY, defaults.views),
        defaults,
        volumes=tls_volumes + ca_volumes,
        override=tier.spec.pod_template,
    )
    match = names.selector("RelayTier", n, names.RELAY, r)
    return deployment(names.relay(n), namespace, labels, match, scale(run, tier.spec.replicas, active), template, owner)


def build_relay_service(run: RLRun, tier: RelayTier, namespace: str, owner: Owner | None = None) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    return service(
        names.relay(n),
        namespace,
        names.labels("RelayTier", n, names.RELAY, r),
        names.selector("RelayTier", n, names.RELAY, r),
        owner,
        [("http", names.SHARDCAST_PORT), ("metrics", names.METRICS_PORT)],
    )


def build_relay_budget(run: RLRun, tier: RelayTier, namespace: str, owner: Owner | None = None) -> dict:
    n, r = tier.metadata.name, run.metadata.name
    return disruption_budget(
        names.relay(n),
        namespace,
        names.labels("RelayTier", n, names.RELAY, r),
        names.selector("RelayTier", n, names.RELAY, r),
        tier.spec.max_unavailable,
        owner,
    )


def build_relay_children(
    run: RLRun,
    tier: RelayTier,
    tiers: list[RelayTier],
    namespace: str,
    owner: Owner | None = None,
    defaults: ClusterDefaults = ClusterDefaults(),
    active: bool = True,
) -> list[dict]:
    upstream = resolve_upstream(run, tier, tiers, namespace)
    children = [
        build_relay_service(run, tier, namespace, owner),
        build_relay_deployment(run, tier, upstream, namespace, owner, defaults, active),
        build_relay_budget(run, tier, namespace, owner),
    ]
    queue = kueue.queue_of(tier.metadata.labels, run.metadata.labels)
    return kueue.grouped(children, queue, names.relay(tier.metadata.name), tier.spec.replicas)
