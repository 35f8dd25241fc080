"""The processes of a local run (`rlfleet run`), as typed records; pure: nothing is started here.

A `Process` says what one process is: its component (a record of the registry, rlfleet/wire/components.py),
its instance within that component (a relay replica, a verifier, a worker, a trainer rank), and the
options it is started with as fields (ports, upstream, pool, cache dir...). Everything the launcher
derives from a process (its Redis URLs, its endpoint, its name and log) reads those fields; the
`rlfleet <component>` command line is built from them only when the process is handed to the
supervisor (`Process.argv`), and nothing parses it back.
Names are built by `Process.name`: the component's, then `/instance` when there is one ("relay/t0-0",
"trainer/2": a trainer replica, whose --ranks processes share its log); the log is `logs/<component>[-instance].log`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from rlfleet.config import Bundle, ConfigError, TrainerSpec
from rlfleet.local.supervisor import Component
from rlfleet.wire import env
from rlfleet.wire.components import COMPONENTS, INGEST, ORIGIN, RELAY, ROLLOUT, TRAINER, VERIFIER, ComponentSpec
from rlfleet.wire.ports import free_port
from rlfleet.wire.redis_acl import WORKER_ROLES, RunAcl
from rlfleet.wire.topology import ORIGIN as ORIGIN_NODE
from rlfleet.wire.topology import URL, Node, RelayGraph, bundle_graph

# `rlfleet run` starts one process per replica; more than this on one machine is a mistake, not a run.
MAX_LOCAL_PROCESSES = 64


def _flag(name: str, repeat: bool = False):
    """A field that is the command-line option `name` of its component (repeated once per item)."""
    return {"flag": name, "repeat": repeat}


@dataclass
class Process:
    """One process of the run. The option fields are declared in the order their flags are written."""

    spec: ComponentSpec
    config: Path
    log_dir: Path
    instance: str = ""
    rank: int = 0  # a trainer replica's first rank (rank 0 reads the streams and publishes)
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment
    # The component's options (None / empty: not given).
    port: int | None = field(default=None, metadata=_flag("--port"))
    upstream: str | None = field(default=None, metadata=_flag("--upstream"))
    consumer: str | None = field(default=None, metadata=_flag("--consumer"))
    origin_url: str | None = field(default=None, metadata=_flag("--origin-url"))
    worker_id: str | None = field(default=None, metadata=_flag("--worker-id"))
    pool: str | None = field(default=None, metadata=_flag("--pool"))
    relay_urls: list[str] = field(default_factory=list, metadata=_flag("--relay-url", repeat=True))
    cache_dir: Path | None = field(default=None, metadata=_flag("--cache-dir"))
    api_port: int | None = field(default=None, metadata=_flag("--api-port"))
    keep_versions: int | None = field(default=None, metadata=_flag("--keep-versions"))
    output_dir: Path | None = field(default=None, metadata=_flag("--output-dir"))
    steps: int | None = field(default=None, metadata=_flag("--steps"))
    ranks: int | None = field(default=None, metadata=_flag("--ranks"))  # a trainer replica's rank processes
    metrics_port: int | None = field(default=None, metadata=_flag("--metrics-port"))  # /metrics and /healthz

    @property
    def kind(self) -> str:
        return self.spec.name

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.instance}" if self.instance else self.kind

    @property
    def log(self) -> Path:
        return self.log_dir / (f"{self.kind}-{self.instance}.log" if self.instance else f"{self.kind}.log")

    @property
    def http_ports(self) -> list[int]:
        """The HTTP ports it serves (the registry names which options are ports)."""
        return [port for port in (getattr(self, name) for name in self.spec.ports) if port]

    @property
    def argv(self) -> list[str]:
        """`python -m rlfleet.cli <component> --config FILE` and its options, in field order."""
        argv = [sys.executable, "-m", "rlfleet.cli", self.kind, "--config", str(self.config)]
        for f in fields(self):
            value = getattr(self, f.name)
            if "flag" not in f.metadata or value is None:
                continue
            for item in value if f.metadata["repeat"] else [value]:
                argv += [f.metadata["flag"], str(item)]
        return argv

    def component(self) -> Component:
        """The supervisor's record: the command line is built here, at the last moment."""
        return Component(self.name, self.argv, self.log, env=dict(self.env), done_on_success=self.kind == TRAINER)


def plan(bundle: Bundle, config: Path, run_dir: Path, steps: int | None = None) -> list[Process]:
    """Every process of the run, in start order; the trainer's rank 0 last. The relay tree is
    topology.relay_graph's, the operator's too; here a node is 127.0.0.1 ports: a tier's replica i
    pulls from replica i of its upstream tier (modulo its size), as a Service spreads pods there.
    `steps` overrides spec.trainer.steps (each trainer rank's --steps)."""
    spec = bundle.run.spec
    graph = bundle_graph(bundle, str(config))
    place = _Place(config, run_dir / "logs", run_dir / "cache")
    origin = place.process(ORIGIN, port=free_port())
    addresses = _Addresses(
        f"http://127.0.0.1:{origin.port}",
        {t.metadata.name: [f"http://127.0.0.1:{free_port()}" for _ in range(t.spec.replicas)] for t in bundle.relays},
    )
    out = [origin, *_relays(bundle, graph, addresses, place)]
    for i in range(spec.verifier.replicas):
        out.append(
            place.process(
                VERIFIER,
                str(i),
                consumer=f"{VERIFIER}-{i}",
                origin_url=addresses.urls(ORIGIN_NODE)[0],
                cache_dir=place.cache / f"{VERIFIER}-{i}",
                api_port=free_port(),
            )
        )
    if serves_ingest(spec):
        # Outside workers join here (`rlfleet join`, door.py); unless the spec names public relays, the run document
        # announces those this run's own default pool downloads from, whose ports only this plan knows.
        relays = (
            []
            if spec.ingest.admission.relay_urls
            else [u for node in graph.default_sources for u in addresses.urls(node)]
        )
        out.append(place.process(INGEST, port=free_port(), relay_urls=relays))
    out += _workers(bundle, graph, addresses, place)
    out += _trainers(spec.trainer, place, run_dir, steps)
    return out


def components_started(bundle: Bundle) -> list[str]:
    """The components `plan` starts for `bundle`, in its order, found without planning (no port is taken): the
    launcher runs their pre-run checks before the run directory exists. A test holds it to `plan`'s kinds."""
    spec = bundle.run.spec
    workers = sum(p.spec.replicas for p in bundle.pools) if bundle.pools else bundle.pool(None)[1].replicas
    starts = {
        ORIGIN: True,
        RELAY: any(t.spec.replicas for t in bundle.relays),
        VERIFIER: spec.verifier.replicas > 0,
        INGEST: serves_ingest(spec),
        ROLLOUT: workers > 0,
        TRAINER: True,
    }
    return [kind for kind, started in starts.items() if started]


@dataclass(frozen=True)
class _Place:
    """Where a plan's processes read and write: the run's config file, its logs and cache folders."""

    config: Path
    logs: Path
    cache: Path

    def process(self, kind: str, instance: str = "", **options) -> Process:
        spec = COMPONENTS[kind]  # every process serves /metrics on 127.0.0.1 (a Prometheus can scrape the run)
        return Process(
            spec, self.config, self.logs, instance, **options, metrics_port=free_port() if spec.metrics else None
        )


@dataclass(frozen=True)
class _Addresses:
    """The URLs a plan's relay tree nodes serve at: the origin's, each relay tier's replicas' by tier name."""

    origin: str
    replicas: dict[str, list[str]]

    def urls(self, node: Node) -> list[str]:
        if node.kind == URL:
            return [node.name]
        return [self.origin] if node.kind == ORIGIN else self.replicas[node.name]


def _relays(bundle: Bundle, graph: RelayGraph, addresses: _Addresses, place: _Place) -> list[Process]:
    """Every relay replica, tier by tier from the origin down."""
    out = []
    for relay in sorted(bundle.relays, key=lambda r: (r.spec.tier, r.metadata.name)):
        upstream = addresses.urls(graph.upstream(relay.metadata.name))
        for i, url in enumerate(addresses.replicas[relay.metadata.name]):
            name = f"{relay.metadata.name}-{i}"
            out.append(
                place.process(
                    RELAY,
                    name,
                    port=int(url.rsplit(":", 1)[1]),
                    upstream=upstream[i % len(upstream)],
                    cache_dir=place.cache / name,
                    keep_versions=relay.spec.keep_versions or None,
                )
            )
    return out


def _workers(bundle: Bundle, graph: RelayGraph, addresses: _Addresses, place: _Place) -> list[Process]:
    """Every rollout worker, pool by pool; a file without InferencePool documents still gets the default pool
    (its workers take no --pool)."""
    pools: list[tuple[str, int, str | None, list[Node]]] = [
        (p.metadata.name, p.spec.replicas, p.metadata.name, graph.pool_sources(p.metadata.name)) for p in bundle.pools
    ]
    if not pools:
        name, default_pool = bundle.pool(None)
        pools = [(name, default_pool.replicas, None, graph.default_sources)]
    out = []
    for pool_name, replicas, pool, sources in pools:
        relay_urls = [url for node in sources for url in addresses.urls(node)]
        for i in range(replicas):
            worker = f"{pool_name}-{i}"
            out.append(
                place.process(
                    ROLLOUT, worker, worker_id=worker, pool=pool, relay_urls=relay_urls, cache_dir=place.cache / worker
                )
            )
    return out


def _trainers(t: TrainerSpec, place: _Place, run_dir: Path, steps: int | None) -> list[Process]:
    """One process per trainer replica, each a group of `ranks` rank processes (--ranks N: it starts them,
    rlfleet/services/trainer/ranks.py), with the torchrun-style environment the operator gives trainer pods:
    GROUP_RANK is the replica, RANK = GROUP_RANK x ranks + LOCAL_RANK. Replica 0 (no instance, named like the
    component; last in the list) holds rank 0, which reads the streams and publishes."""
    master = (
        {env.MASTER_ADDR: "127.0.0.1", env.MASTER_PORT: str(free_port()), env.WORLD_SIZE: str(t.world)}
        if t.world > 1
        else {}
    )
    return [
        place.process(
            TRAINER,
            str(replica) if replica else "",
            rank=replica * t.ranks,
            env={**master, env.GROUP_RANK: str(replica)} if t.world > 1 else {},
            output_dir=run_dir,
            steps=steps,
            ranks=t.ranks if t.ranks > 1 else None,
        )
        for replica in range(t.replicas - 1, -1, -1)
    ]


def serves_ingest(spec) -> bool:
    """A local run starts an ingest when outside workers may submit: it admits joins (spec.ingest.admission.mode
    open or invite) or names worker tokens (spec.ingest.tokensFile)."""
    return spec.ingest.admission.mode != "tokens" or bool(spec.ingest.tokens_file)


def join_url(processes: list[Process], bundle: Bundle) -> str | None:
    """The run document's URL, which `rlfleet join` takes, when the run has an ingest that admits joins."""
    ingest = next((p for p in processes if p.kind == INGEST), None)
    if ingest is None or bundle.run.spec.ingest.admission.mode == "tokens":
        return None
    return f"http://127.0.0.1:{ingest.port}/v1/{bundle.run.metadata.name}"


def redis_env(p: Process, bundle: Bundle, acl: RunAcl, base_url: str) -> dict[str, str]:
    """The Redis URLs of a process: its component's role's; a worker's reader and tickets users besides;
    none for a worker of a pool that submits through an ingest (it never touches Redis)."""
    if p.kind != ROLLOUT:
        return {env.REDIS_URL: acl.url(base_url, p.spec.role)}
    if bundle.pool(p.pool)[1].ingest_url:
        return {env.REDIS_URL: ""}
    return {
        env.REDIS_URL: acl.url(base_url, WORKER_ROLES["write"]),
        env.REDIS_READ_URL: acl.url(base_url, WORKER_ROLES["read"]),
        env.REDIS_TICKETS_URL: acl.url(base_url, WORKER_ROLES["tickets"]),
    }


def endpoints(redis_url: str, processes: list[Process], join: str | None = None) -> dict:
    """endpoints.json: where the run's services listen (Redis, each process's HTTP port, and each process's
    Prometheus /metrics, by process name), and `join`, the URL outside workers join with, when there is one."""
    http = {p.name: f"http://127.0.0.1:{port}" for p in processes for port in p.http_ports}
    metrics = {p.name: f"http://127.0.0.1:{p.metrics_port}/metrics" for p in processes if p.metrics_port}
    return {"redis": redis_url, "http": http, "metrics": metrics, **({"join": join} if join else {})}


def check_local_size(processes: list[Process], source: str) -> None:
    """Refuse a run this machine should not start: too many processes, or neither a worker nor an ingest to feed
    the trainer."""
    problems = []
    count = sum(p.ranks or 1 for p in processes)  # a trainer replica is its ranks
    if count > MAX_LOCAL_PROCESSES:
        problems.append(
            f"replicas: the run would start {count} processes on this machine (at most "
            f"{MAX_LOCAL_PROCESSES}); lower the InferencePool/RelayTier/verifier/trainer replicas or "
            "trainer.ranksPerReplica, or run it on a cluster"
        )
    if not any(p.kind in (ROLLOUT, INGEST) for p in processes):  # an ingest: outside workers feed it
        problems.append(
            "InferencePool spec.replicas: every pool has 0 workers, so no group would ever reach the trainer; "
            "give a pool at least 1 replica, or admit outside workers (spec.ingest.admission.mode open or invite)"
        )
    if problems:
        raise ConfigError(source, problems)
