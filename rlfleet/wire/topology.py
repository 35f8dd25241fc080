"""The relay tree of a run: which node each RelayTier pulls from and which nodes each InferencePool
downloads from. One pure function answers it for `rlfleet run` and for the operator alike; each maps
the nodes to addresses of its own (127.0.0.1 ports locally, Service URLs on a cluster).

Nodes are the origin, the run's RelayTiers, and URLs outside the cluster. Rules, first match wins:
  tier  spec.upstreamUrl -> that URL; spec.upstream -> that RelayTier; tier 0 -> the origin;
        tier k -> the RelayTier of tier k-1 of the same run (the first by name when there are several)
  pool  spec.relay -> that RelayTier; else every RelayTier at the run's highest tier; else the origin
Invariants: every tier reaches the origin or a URL through its upstreams (no cycle, no missing
tier), and only tiers and pools of the same run take part. A reference that cannot be resolved is
a problem of the document that makes it, so one bad tier does not block the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.config import Bundle, ConfigError, InferencePool, RelayTier
from rlfleet.wire import components

TIER, URL = "tier", "url"  # the kinds of node besides the origin (components.ORIGIN)


@dataclass(frozen=True)
class Node:
    """A checkpoint source: the origin, a RelayTier (by name), or a URL outside the cluster."""

    kind: str  # components.ORIGIN, TIER or URL
    name: str = ""  # the tier's name or the URL


ORIGIN = Node(components.ORIGIN)


class TopologyError(ValueError):
    """References that do not resolve; `problems` are `Kind name: spec.field: what is wrong and the fix`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass
class RelayGraph:
    upstreams: dict[str, Node] = field(default_factory=dict)  # tier name -> where it pulls from
    sources: dict[str, list[Node]] = field(default_factory=dict)  # pool name -> where its workers download
    default_sources: list[Node] = field(default_factory=lambda: [ORIGIN])  # a pool without spec.relay (or document)
    problems: dict[str, list[str]] = field(default_factory=dict)  # "Kind name" -> unresolved references

    def upstream(self, tier: str) -> Node:
        """Where tier `tier` pulls from; TopologyError naming that tier's problem."""
        self._check(f"RelayTier {tier}")
        return self.upstreams[tier]

    def pool_sources(self, pool: str) -> list[Node]:
        """Where pool `pool`'s workers download from; TopologyError naming that pool's problem."""
        self._check(f"InferencePool {pool}")
        return self.sources[pool]

    def check(self) -> None:
        """TopologyError listing every problem of the run's tree."""
        if self.problems:
            raise TopologyError([p for ps in self.problems.values() for p in ps])

    def _check(self, who: str) -> None:
        if who in self.problems:
            raise TopologyError(self.problems[who])


def relay_graph(run: str, pools: list[InferencePool], tiers: list[RelayTier]) -> RelayGraph:
    """The relay tree of run `run` from its pools and tiers (documents of other runs are ignored)."""
    graph = RelayGraph()
    mine = {t.metadata.name: t for t in tiers if t.spec.run == run}

    def problem(who: str, text: str) -> None:
        graph.problems.setdefault(who, []).append(f"{who}: {text}")

    for name, tier in sorted(mine.items()):
        spec, who = tier.spec, f"RelayTier {name}"
        if spec.upstream_url:
            graph.upstreams[name] = Node(URL, spec.upstream_url.rstrip("/"))
        elif spec.upstream:
            if spec.upstream not in mine:
                problem(
                    who,
                    f"spec.upstream: RelayTier {spec.upstream!r} of run {run!r} does not exist; create it or drop "
                    f"spec.upstream",
                )
            graph.upstreams[name] = Node(TIER, spec.upstream)
        elif spec.tier == 0:
            graph.upstreams[name] = ORIGIN
        else:
            below = sorted(n for n, t in mine.items() if t.spec.tier == spec.tier - 1)
            if not below:
                problem(
                    who,
                    f"spec.tier: no RelayTier of run {run!r} has tier {spec.tier - 1}; add one, or set spec.upstream",
                )
                graph.upstreams[name] = ORIGIN
            else:
                graph.upstreams[name] = Node(TIER, below[0])
    for name in sorted(mine):
        seen = [name]
        node = graph.upstreams[name]
        while node.kind == TIER and node.name in graph.upstreams:
            if node.name in seen:
                problem(
                    f"RelayTier {name}",
                    f"spec.upstream: the tiers {' -> '.join([*seen, node.name])} pull from each other; "
                    "one of them must pull from the origin or a lower tier",
                )
                break
            seen.append(node.name)
            node = graph.upstreams[node.name]

    top = max((t.spec.tier for t in mine.values()), default=None)
    graph.default_sources = [Node(TIER, n) for n in sorted(mine) if mine[n].spec.tier == top] or [ORIGIN]
    for pool in pools:
        if pool.spec.run != run:
            continue
        name, relay = pool.metadata.name, pool.spec.relay
        if relay:
            if relay not in mine:
                problem(
                    f"InferencePool {name}",
                    f"spec.relay: RelayTier {relay!r} of run {run!r} does not exist; create it or drop spec.relay",
                )
            graph.sources[name] = [Node(TIER, relay)]
        else:
            graph.sources[name] = graph.default_sources
    return graph


def bundle_graph(bundle: Bundle, source: str = "<config>") -> RelayGraph:
    """The relay tree of a config file's documents; ConfigError listing every unresolved reference."""
    graph = relay_graph(bundle.run.metadata.name, bundle.pools, bundle.relays)
    try:
        graph.check()
    except TopologyError as exc:
        raise ConfigError(source, exc.problems) from None
    return graph
