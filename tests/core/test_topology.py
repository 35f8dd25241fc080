"""One relay tree (rlfleet/wire/topology.py) for `rlfleet run` and the operator: the rules, the refusals,
and the same bundles fed to the local launcher's plan and the operator's builders give the same graph."""

from __future__ import annotations

import pytest

from rlfleet.config import parse_bundle
from rlfleet.local.plan import plan
from rlfleet.operator import builders, names
from rlfleet.wire.topology import ORIGIN, Node, TopologyError, relay_graph
from tests.runs import bundle_yaml, relay_tier, rlrun
from tests.runs import pool as inference_pool

NS = "team"
RUN = rlrun(
    "demo", redis={"url": "redis://r:6379"}, store="s3://b/p", shardcast={"requireSignatures": False}
)  # the run every bundle below is of


def tier(name: str, tier_: int = 0, replicas: int = 1, **spec) -> dict:
    return relay_tier(name, "demo", tier_, replicas=replicas, **spec)


def pool(name: str, replicas: int = 2, **spec) -> dict:
    return inference_pool(name, "demo", replicas=replicas, **spec)


def bundle(*docs: dict) -> str:
    """The run, then `docs`, as the YAML a file would hold."""
    return bundle_yaml(RUN, *docs)


BUNDLES = {
    "no relays": bundle(pool("p")),
    "one tier": bundle(tier("t0", replicas=2), pool("p")),
    "two tiers, pool on the top one": bundle(tier("t0"), tier("t1", 1, replicas=3), pool("p", 3)),
    "two tiers at the top, both serve the pool": bundle(
        tier("t0"), tier("t1a", 1), tier("t1b", 1, replicas=2), pool("p")
    ),
    "spec.relay and spec.upstream": bundle(
        tier("core"),
        tier("west", 1),
        tier("east", 1, upstream="core"),
        tier("edge", 2, upstream="core"),
        pool("a", relay="west"),
        pool("b"),
    ),
    "a tier outside the cluster": bundle(
        tier("far", upstreamUrl="http://relay.other.example:8080"), pool("p", relay="far")
    ),
}


def test_rules_in_order_upstream_url_then_upstream_then_tier_below():
    b = parse_bundle(BUNDLES["spec.relay and spec.upstream"])
    graph = relay_graph("demo", b.pools, b.relays)
    assert graph.upstream("core") == ORIGIN
    assert graph.upstream("west") == Node("tier", "core")  # tier 1: the tier-0 tier
    assert graph.upstream("edge") == Node("tier", "core"), "spec.upstream wins over the tier number"
    assert graph.pool_sources("a") == [Node("tier", "west")], "spec.relay wins"
    assert graph.pool_sources("b") == [Node("tier", "edge")], "else every tier at the highest tier"
    far = parse_bundle(BUNDLES["a tier outside the cluster"])
    assert relay_graph("demo", far.pools, far.relays).upstream("far") == Node("url", "http://relay.other.example:8080")


@pytest.mark.parametrize(
    "docs, problem",
    [
        (bundle(tier("t1", 1), pool("p")), "RelayTier t1: spec.tier: no RelayTier of run 'demo' has tier 0"),
        (
            bundle(tier("t0", upstream="nope")),
            "RelayTier t0: spec.upstream: RelayTier 'nope' of run 'demo' does not exist",
        ),
        (
            bundle(tier("t0"), pool("p", relay="tier9")),
            "InferencePool p: spec.relay: RelayTier 'tier9' of run 'demo' does not exist",
        ),
        (bundle(tier("a", upstream="b"), tier("b", upstream="a")), "the tiers a -> b -> a pull from each other"),
    ],
)
def test_references_that_do_not_resolve_are_refused_naming_the_document_and_field(docs, problem, tmp_path):
    b = parse_bundle(docs)
    with pytest.raises(TopologyError, match=problem):
        relay_graph("demo", b.pools, b.relays).check()
    # the local launcher refuses the file before it starts anything, with the same words
    config = tmp_path / "rlrun.yaml"
    config.write_text(docs)
    from rlfleet.config import ConfigError

    with pytest.raises(ConfigError, match=problem):
        plan(b, config, tmp_path)


def test_one_bad_tier_does_not_block_the_others():
    b = parse_bundle(bundle(tier("t0"), tier("bad", upstream="nope"), pool("p", relay="t0")))
    graph = relay_graph("demo", b.pools, b.relays)
    assert graph.upstream("t0") == ORIGIN and graph.pool_sources("p") == [Node("tier", "t0")]
    with pytest.raises(TopologyError):
        graph.upstream("bad")


def _local_graph(bundle, tmp_path) -> tuple[dict, dict]:
    """{tier: upstream node}, {pool: source nodes} read back from the launcher's processes."""
    config = tmp_path / "rlrun.yaml"
    comps = plan(bundle, config, tmp_path)
    origin_url = f"http://127.0.0.1:{next(c for c in comps if c.name == 'origin').port}"
    node_of = {origin_url: ORIGIN}
    for c in comps:
        if c.name.startswith("relay/"):
            tier_name = c.name.split("/", 1)[1].rsplit("-", 1)[0]
            node_of[f"http://127.0.0.1:{c.port}"] = Node("tier", tier_name)

    def node(url: str) -> Node:
        return node_of.get(url, Node("url", url))

    upstreams, sources = {}, {}
    for c in comps:
        if c.name.startswith("relay/"):
            tier_name = c.name.split("/", 1)[1].rsplit("-", 1)[0]
            upstreams.setdefault(tier_name, set()).add(node(c.upstream))
        if c.name.startswith("rollout/"):
            sources[c.pool] = {node(u) for u in c.relay_urls}
    return upstreams, sources


def _cluster_graph(bundle) -> tuple[dict, dict]:
    """The same read back from the Deployments the operator's builders make."""

    def node(url: str) -> Node:
        if url == names.service_url(names.origin("demo"), NS):
            return ORIGIN
        tier_name = next(
            (t.metadata.name for t in bundle.relays if url == names.service_url(names.relay(t.metadata.name), NS)), None
        )
        return Node("tier", tier_name) if tier_name else Node("url", url)

    def args(children) -> list[str]:
        return next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
            "args"
        ]

    upstreams, sources = {}, {}
    for t in bundle.relays:
        a = args(builders.build_relay_children(bundle.run, t, bundle.relays, NS))
        upstreams[t.metadata.name] = {node(a[a.index("--upstream") + 1])}
    for p in bundle.pools:
        a = args(builders.build_pool_children(bundle.run, p, bundle.relays, NS))
        sources[p.metadata.name] = {node(a[i + 1]) for i, x in enumerate(a) if x == "--relay-url"}
    return upstreams, sources


@pytest.mark.parametrize("case", list(BUNDLES))
def test_local_and_cluster_relay_graphs_agree(case, tmp_path):
    bundle = parse_bundle(BUNDLES[case])
    local, cluster = _local_graph(bundle, tmp_path), _cluster_graph(bundle)
    assert local == cluster
    graph = relay_graph("demo", bundle.pools, bundle.relays)  # and both are the function's
    assert cluster == (
        {t: {graph.upstream(t)} for t in graph.upstreams},
        {p: set(graph.pool_sources(p)) for p in graph.sources},
    )


def test_local_tier_replicas_spread_over_the_replicas_of_the_tier_below(tmp_path):
    bundle = parse_bundle(BUNDLES["two tiers, pool on the top one"])
    comps = plan(bundle, tmp_path / "rlrun.yaml", tmp_path)
    t0_url = next(f"http://127.0.0.1:{c.port}" for c in comps if c.name == "relay/t0-0")
    t1 = [c for c in comps if c.name.startswith("relay/t1-")]
    assert len(t1) == 3 and all(c.upstream == t0_url for c in t1)
    workers = [c for c in comps if c.name.startswith("rollout/p-")]
    assert len(workers) == 3 and all(len(c.relay_urls) == 3 for c in workers)
