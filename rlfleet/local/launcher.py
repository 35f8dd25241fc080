"""`rlfleet run FILE`: the whole system on one machine, one OS process per component.

It builds the builtin model if needed (so components never race to build it), then starts an
embedded redis-server (append-only file, rlfleet/local/redis_server.py), the Shardcast origin, each
RelayTier's relays (the tree of rlfleet/wire/topology.py), the verifier replicas, each InferencePool's
workers and the trainer (one process per rank when trainer.replicas > 1, with the torchrun-style
environment of the trainer pods), with the same `rlfleet <component>` entrypoints the containers use.
Components run under a restart policy with back-off, as pods would (rlfleet/local/supervisor.py): a
crash costs seconds, not the run; a component that crash-loops stops the run, named with its log.
The run ends when the trainer finishes its steps; Ctrl-C (or SIGTERM) stops everything, a second
Ctrl-C kills what is still stopping; `summary.json` is written either way. A run directory holds
everything a run needs to resume: relaunching with the same `--run-dir` reloads the queue from
Redis's append-only file and the trainer's state from the store, and reuses the run's keys.
Manifests are signed: a run key pair is kept in RUN_DIR/keys (unless RLFLEET_SIGNING_KEY_FILE
is set); only the trainer gets the private key file, every component gets the public key
(env RLFLEET_PUBLIC_KEY).
Redis has one ACL user per role with fresh passwords on each launch (rlfleet/wire/redis_acl.py; the
default user is off, the aclfile RUN_DIR/redis/users.acl is the owner's only): each component gets
its role's URLs (`redis_env`: a worker can add to the inbox and read the policy stream, nothing
more), the launcher and endpoints.json the run's admin user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from rlfleet.config import Bundle, ConfigError, load_bundle
from rlfleet.local.progress import BuildProgress, Progress, startup_status
from rlfleet.local.redis_server import free_port, redis_server_argv, wait_until_ready, write_acl_file
from rlfleet.local.report import read_metrics, reward_trend, write_reports
from rlfleet.local.supervisor import Component, Supervisor
from rlfleet.wire import env
from rlfleet.wire.redis_acl import ADMIN, COMPONENT_ROLES, WORKER_ROLES, RunAcl
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.topology import ORIGIN, Node, bundle_graph

# `rlfleet run` starts one process per replica; more than this on one machine is a mistake, not a run.
MAX_LOCAL_PROCESSES = 64


def plan(bundle: Bundle, config: Path, run_dir: Path) -> list[Component]:
    """Every process of the run, in start order (pure: nothing is started here). The relay tree is
    topology.relay_graph's, the operator's too; here a node is 127.0.0.1 ports: a tier's replica i
    pulls from replica i of its upstream tier (modulo its size), as a Service spreads pods there."""
    spec = bundle.run.spec
    graph = bundle_graph(bundle, str(config))
    cli = [sys.executable, "-m", "rlfleet.cli"]
    logs, cache = run_dir / "logs", run_dir / "cache"
    common = ["--config", str(config)]
    origin_port = free_port()
    replica_urls = {
        t.metadata.name: [f"http://127.0.0.1:{free_port()}" for _ in range(t.spec.replicas)] for t in bundle.relays
    }

    def urls(node: Node) -> list[str]:
        return {
            "origin": lambda: [f"http://127.0.0.1:{origin_port}"],
            "url": lambda: [node.name],
            "tier": lambda: replica_urls[node.name],
        }[node.kind]()

    comps = [Component("origin", [*cli, "origin", *common, "--port", str(origin_port)], logs / "origin.log")]
    for relay in sorted(bundle.relays, key=lambda r: (r.spec.tier, r.metadata.name)):
        upstream = urls(graph.upstream(relay.metadata.name))
        keep = ["--keep-versions", str(relay.spec.keep_versions)] if relay.spec.keep_versions else []
        for i, url in enumerate(replica_urls[relay.metadata.name]):
            name = f"{relay.metadata.name}-{i}"
            comps.append(
                Component(
                    f"relay/{name}",
                    [
                        *cli,
                        "relay",
                        *common,
                        "--port",
                        url.rsplit(":", 1)[1],
                        "--upstream",
                        upstream[i % len(upstream)],
                        "--cache-dir",
                        str(cache / name),
                        *keep,
                    ],
                    logs / f"relay-{name}.log",
                )
            )
    for i in range(spec.verifier.replicas):
        comps.append(
            Component(
                f"verifier/{i}",
                [
                    *cli,
                    "verifier",
                    *common,
                    "--consumer",
                    f"verifier-{i}",
                    "--origin-url",
                    urls(ORIGIN)[0],
                    "--cache-dir",
                    str(cache / f"verifier-{i}"),
                    "--api-port",
                    str(free_port()),
                ],
                logs / f"verifier-{i}.log",
            )
        )
    # A file without InferencePool documents still gets the default pool (its workers take no --pool).
    pools = [
        (p.metadata.name, p.spec.replicas, ["--pool", p.metadata.name], graph.pool_sources(p.metadata.name))
        for p in bundle.pools
    ]
    if not pools:
        name, default_pool = bundle.pool(None)
        pools = [(name, default_pool.replicas, [], graph.default_sources)]
    for pool_name, replicas, pool_args, sources in pools:
        relay_args = [arg for node in sources for url in urls(node) for arg in ("--relay-url", url)]
        for i in range(replicas):
            worker = f"{pool_name}-{i}"
            comps.append(
                Component(
                    f"rollout/{worker}",
                    [
                        *cli,
                        "rollout",
                        *common,
                        "--worker-id",
                        worker,
                        *pool_args,
                        *relay_args,
                        "--cache-dir",
                        str(cache / worker),
                    ],
                    logs / f"rollout-{worker}.log",
                )
            )
    # trainer.replicas > 1: one process per rank with the torchrun-style environment the operator
    # gives trainer pods; rank 0 ("trainer", last in the list) reads the streams and publishes.
    replicas = spec.trainer.replicas
    master = (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(replicas)}
        if replicas > 1
        else {}
    )
    for rank in range(replicas - 1, -1, -1):
        name = "trainer" if rank == 0 else f"trainer/{rank}"
        comps.append(
            Component(
                name,
                [*cli, "trainer", *common, "--output-dir", str(run_dir)],
                logs / ("trainer.log" if rank == 0 else f"trainer-{rank}.log"),
                env={**master, "RANK": str(rank)} if replicas > 1 else {},
                done_on_success=True,
            )
        )
    return comps


def redis_env(c: Component, bundle: Bundle, acl: RunAcl, base_url: str) -> dict[str, str]:
    """The Redis URLs of a component: its role's; a worker's reader and tickets users besides; none for a
    worker of a pool that submits through an ingest (it never touches Redis)."""
    command = c.argv[3]  # argv: python -m rlfleet.cli <subcommand> ...
    if command != "rollout":
        return {env.REDIS_URL: acl.url(base_url, COMPONENT_ROLES[command])}
    pool = c.argv[c.argv.index("--pool") + 1] if "--pool" in c.argv else None
    if bundle.pool(pool)[1].ingest_url:
        return {env.REDIS_URL: ""}
    return {
        env.REDIS_URL: acl.url(base_url, WORKER_ROLES["write"]),
        env.REDIS_READ_URL: acl.url(base_url, WORKER_ROLES["read"]),
        env.REDIS_TICKETS_URL: acl.url(base_url, WORKER_ROLES["tickets"]),
    }


def run_keys(environ: dict, key_dir: Path) -> dict:
    """Set environ's RLFLEET_PUBLIC_KEY for every component; return the trainer-only env naming the
    private key: RLFLEET_SIGNING_KEY_FILE if given, else the pair in `key_dir` (made on the run's
    first launch, reused when it resumes, so the versions it already signed still verify)."""
    from rlfleet.versions.signing import PRIVATE_KEY_FILE, generate_keypair, load_private_key, public_key_text

    given = environ.pop(env.SIGNING_KEY_FILE, None) or (
        key_dir / PRIVATE_KEY_FILE if (key_dir / PRIVATE_KEY_FILE).exists() else None
    )
    if given:
        private, public = Path(given).resolve(), public_key_text(load_private_key(Path(given)))
    else:
        private, public = generate_keypair(key_dir)
    environ[env.PUBLIC_KEY] = public
    return {env.SIGNING_KEY_FILE: str(private)}


def run_local(file: str, run_dir: str | None = None, steps: int | None = None, progress: bool = True) -> int:
    bundle = load_bundle(file)
    bundle_graph(bundle, file)  # a relay tree that cannot be built fails before anything starts
    name = bundle.run.metadata.name
    run_path = Path(run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run_path / "logs").mkdir(parents=True, exist_ok=True)
    config = run_path / "rlrun.yaml"
    shutil.copyfile(file, config)
    total = steps or bundle.run.spec.trainer.steps

    print(f"rlfleet: run {name} in {run_path}", file=sys.stderr)
    # Until components run (supervise() takes over), SIGTERM interrupts like Ctrl-C: nothing to stop yet.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from rlfleet.models.builtin import resolve_model_path

    t0 = time.monotonic()
    build = BuildProgress(bundle.run.spec.model.path, progress and sys.stderr.isatty())
    try:
        model_dir = resolve_model_path(
            bundle.run.spec.model, bundle.run.spec.task, seed=bundle.run.spec.trainer.seed, progress=build
        )
    finally:
        build.close()
    print(
        f"rlfleet: model {bundle.run.spec.model.path} ready at {model_dir} ({time.monotonic() - t0:.0f}s)",
        file=sys.stderr,
    )
    # From here on a signal is counted, never raised (Interrupts): the imports and the start-up ahead
    # must not be cut in the middle, and every path below stops what it started.
    interrupts = Interrupts()
    previous = {sig: signal.signal(sig, interrupts) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return start_and_supervise(bundle, file, config, run_path, model_dir, steps, total, progress, interrupts)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_and_supervise(bundle: Bundle, file: str, config: Path, run_path: Path, model_dir: Path, steps: int | None,
                        total: int, progress: bool, interrupts: Interrupts) -> int:  # fmt: skip
    """Check the engines, plan the processes, set up their environment and keys, then supervise them."""
    from rlfleet.services.rollout.engines import check_supported  # imports neither torch nor vLLM

    for pool in bundle.pools:  # refused here, not after every other process has started
        try:
            check_supported(pool.spec.engine, model_dir)
        except (ImportError, ValueError) as exc:
            raise SystemExit(f"rlfleet run: InferencePool {pool.metadata.name}: {exc}") from None

    comps = plan(bundle, config, run_path)
    check_local_size(bundle, comps, file)
    if steps:
        for c in comps:
            if c.name.startswith("trainer"):
                c.argv += ["--steps", str(steps)]
    redis_port = free_port()
    base_url = f"redis://127.0.0.1:{redis_port}/0"
    acl = RunAcl.generate(bundle.run.metadata.name)
    redis_url = acl.url(base_url, ADMIN)
    acl_file = write_acl_file(run_path / "redis" / "users.acl", acl.acl_file())
    redis_comp = Component(
        "redis",
        redis_server_argv(run_path / "redis", redis_port, persistent=True, acl_file=acl_file),
        run_path / "logs" / "redis.log",
        stop_last=True,
    )
    environ = {
        **os.environ,
        env.REDIS_URL: redis_url,
        env.TORCH_THREADS: "1",
        "OMP_NUM_THREADS": "1",
        env.LOCAL: "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if not bundle.run.spec.store.uri:
        environ[env.STORE_URI] = f"file://{run_path / 'store'}"
    trainer_env = run_keys(environ, run_path / "keys")
    for c in comps:
        c.env.update(redis_env(c, bundle, acl, base_url))
        if c.name == "trainer":
            c.env.update(trainer_env)
    (run_path / "redis").mkdir(exist_ok=True)
    write_endpoints(run_path / "endpoints.json", redis_url, comps)
    supervisor = Supervisor([redis_comp, *comps], environ)
    if interrupts.requested:
        print("rlfleet: interrupted before the run started", file=sys.stderr)
        return 130
    return supervise(supervisor, redis_comp, comps[-1], run_path, bundle, total, progress, interrupts)


def write_endpoints(path: Path, redis_url: str, comps: list[Component]) -> None:
    """Where the run's services listen (Redis, and each component's HTTP port), for tools and people."""
    http = {}
    for c in comps:
        for flag in ("--port", "--api-port"):
            if flag in c.argv:
                http[c.name] = f"http://127.0.0.1:{c.argv[c.argv.index(flag) + 1]}"
    path.write_text(json.dumps({"redis": redis_url, "http": http}, indent=2) + "\n")


def check_local_size(bundle: Bundle, comps: list[Component], source: str) -> None:
    """Refuse a run this machine should not start: too many processes, or no worker to feed the trainer."""
    problems = []
    if len(comps) > MAX_LOCAL_PROCESSES:
        problems.append(f"replicas: the run would start {len(comps)} processes on this machine (at most "
                        f"{MAX_LOCAL_PROCESSES}); lower the InferencePool/RelayTier/verifier/trainer replicas, or "
                        "run it on a cluster")  # fmt: skip
    if not any(c.name.startswith("rollout/") for c in comps):
        problems.append("InferencePool spec.replicas: every pool has 0 workers, so no group would ever reach the "
                        "trainer; give a pool at least 1 replica")  # fmt: skip
    if problems:
        raise ConfigError(source, problems)


def supervise(supervisor: Supervisor, redis_comp: Component, trainer: Component, run_path: Path, bundle: Bundle,
              total: int, progress: bool, interrupts: Interrupts) -> int:  # fmt: skip
    """Run until the trainer finishes, a component crash-loops or the user interrupts; then stop
    everything and write the reports."""
    started = time.monotonic()
    try:
        failed = run_components(supervisor, redis_comp, trainer, run_path, bundle, total, progress, interrupts)
    finally:
        supervisor.stop_all(force=lambda: interrupts.count >= 2)
    summary = write_reports(run_path, time.monotonic() - started, f"rlfleet run {bundle.run.metadata.name}")
    if interrupts.requested:
        print(f"rlfleet: interrupted; every component stopped. Logs in {run_path / 'logs'}", file=sys.stderr)
        return 130
    if failed is redis_comp and not failed.failures:
        print(f"rlfleet: redis-server did not start; see {redis_comp.log}", file=sys.stderr)
        return 1
    if failed:
        print(f"rlfleet: component {failed.name} keeps failing (exit code {failed.proc and failed.proc.returncode}, "
              f"{failed.failures} times in a row); see {failed.log}", file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"rlfleet: done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, {reward_trend(summary)}, "
        f"accepted {summary['accepted']}, rejected {summary['rejected']}; {run_path / 'summary.json'}, "
        f"{run_path / 'reward.png'}",
        file=sys.stderr,
    )
    return 0


def run_components(supervisor: Supervisor, redis_comp: Component, trainer: Component, run_path: Path, bundle: Bundle,
                   total: int, progress: bool, interrupts: Interrupts) -> Component | None:  # fmt: skip
    """Start Redis, then every component; supervise until the trainer is done or a signal came.
    Returns the component that failed the run, if one did."""
    import redis

    supervisor.start(redis_comp)
    url = supervisor.environ[env.REDIS_URL]
    assert redis_comp.proc is not None  # start() made it
    try:
        wait_until_ready(url, redis_comp.proc, redis_comp.log, cancelled=lambda: interrupts.requested)
    except RuntimeError:
        return redis_comp
    for comp in supervisor.comps[1:]:
        if interrupts.requested:
            return None
        supervisor.start(comp)
    bar = Progress(total, progress and sys.stderr.isatty())
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    keys = RunKeys(bundle.run.metadata.name)
    try:
        while not interrupts.requested:
            records = read_metrics(run_path / "metrics.jsonl")
            try:
                depth: int | str = client.xlen(keys.rollouts)
                if not records:
                    bar.waiting(startup_status(client, keys, bundle.run.spec.trainer.batch_size))
            except redis.RedisError:
                depth = "?"  # Redis is restarting; its append-only file brings the queue back
            bar.update(records, depth)
            if trainer.finished:
                return None
            failed = supervisor.poll()
            if failed:
                return failed
            time.sleep(0.5)
        return None
    finally:
        bar.close()
        client.close()


class Interrupts:
    """The launcher's SIGINT/SIGTERM handler while components run. A signal is only counted, never
    raised: a KeyboardInterrupt can be swallowed (raised inside a finalizer, it is printed and
    dropped) or land between starting a process and recording it; the loops check `requested`
    every half second instead. The first signal stops the run, a second one makes the stop kill
    what is left at once."""

    def __init__(self):
        self.count = 0

    @property
    def requested(self) -> bool:
        return self.count >= 1

    def __call__(self, signum, frame) -> None:
        self.count += 1
