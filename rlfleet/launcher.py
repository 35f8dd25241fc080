"""`rlfleet run FILE`: the whole system on one machine, one OS process per component.

It starts an embedded redis-server, builds the builtin model if needed (so components never race
to build it), then the Shardcast origin, each RelayTier's relays (tier 0 from the origin, tier k
from tier k-1), the verifier replicas, each InferencePool's workers and the trainer (one process per
rank when trainer.replicas > 1, with the torchrun-style environment of the trainer pods), with the
same `rlfleet <component>` entrypoints the containers use. It shows progress from the trainer's
metrics.jsonl, ends when the trainer finishes its steps, and stops everything on Ctrl-C. If any
component dies, every other one is stopped and the run exits non-zero naming the component and
its log file.
Manifests are signed: a run key pair is generated in RUN_DIR/keys (unless RLFLEET_SIGNING_KEY_FILE
is set); only the trainer gets the private key file, every component gets the public key
(env RLFLEET_PUBLIC_KEY).
Redis has one ACL user per role with a fresh password (rlfleet/redis_acl.py; the default user is
off): each component gets its role's URL (a worker can add to the inbox and read the policy stream,
nothing more), the launcher itself the run's admin user.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet import env
from rlfleet.config import Bundle, load_bundle
from rlfleet.redis_acl import ADMIN, COMPONENT_ROLES, WORKER_ROLES, RunAcl, user_name
from rlfleet.redis_server import EmbeddedRedis, free_port
from rlfleet.report import read_metrics, write_reports
from rlfleet.streams import RunKeys
from rlfleet.topology import ORIGIN, Node, bundle_graph

STOP_GRACE_S = 20


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment
    role: str = ""  # its Redis ACL role (rlfleet/redis_acl.py); "" = the one of its `rlfleet` subcommand

    @property
    def redis_role(self) -> str:
        return self.role or COMPONENT_ROLES[self.argv[3]]  # argv: python -m rlfleet.cli <subcommand>

    def redis_env(self, acl: RunAcl, base_url: str) -> dict[str, str]:
        """The Redis URLs of its role(s): a rollout worker reads and takes tickets as other users."""
        out = {env.REDIS_URL: acl.url(base_url, self.redis_role)}
        if self.argv[3] == "rollout":
            out[env.REDIS_READ_URL] = acl.url(base_url, WORKER_ROLES["read"])
            if self.redis_role == WORKER_ROLES["write"]:  # a pool behind an ingest takes tickets there
                out[env.REDIS_TICKETS_URL] = acl.url(base_url, WORKER_ROLES["tickets"])
        return out


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
    # A pool that submits through an ingest only reads Redis (policy stream, inbox length).
    pools = [
        (
            p.metadata.name,
            p.spec.replicas,
            ["--pool", p.metadata.name],
            graph.pool_sources(p.metadata.name),
            "reader" if p.spec.ingest_url else "worker",
        )
        for p in bundle.pools
    ]
    if not pools:
        name, default_pool = bundle.pool(None)
        pools = [(name, default_pool.replicas, [], graph.default_sources, "worker")]
    for pool_name, replicas, pool_args, sources, role in pools:
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
                    role=role,
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
            )
        )
    return comps


def run_keys(environ: dict, key_dir: Path) -> dict:
    """Set environ's RLFLEET_PUBLIC_KEY for every component; return the trainer-only env naming the
    private key (a fresh pair in `key_dir` unless RLFLEET_SIGNING_KEY_FILE was given)."""
    from rlfleet.signing import generate_keypair, load_private_key, public_key_text

    given = environ.pop(env.SIGNING_KEY_FILE, None)
    if given:
        private, public = Path(given).resolve(), public_key_text(load_private_key(Path(given)))
    else:
        private, public = generate_keypair(key_dir)
    environ[env.PUBLIC_KEY] = public
    return {env.SIGNING_KEY_FILE: str(private)}


def stop_all(comps: list[Component]) -> None:
    """SIGTERM every running component, then SIGKILL what is left after the grace period."""
    running = [c for c in comps if c.proc and c.proc.poll() is None]
    for c in running:
        c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for c in running:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


class Progress:
    """A tqdm bar over trainer steps (or one line per step without a terminal)."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr) if enabled else None
        self.seen = 0

    def update(self, records: list[dict], queue_depth: int) -> None:
        new = records[self.seen :]
        if not new:
            return
        self.seen = len(records)
        r = new[-1]
        fields = {
            "v": r["policy_version"],
            "reward": f"{r['reward_mean']:.2f}",
            "acc": r["accepted"],
            "rej": r["rejected"],
            "queue": queue_depth,
            "lag": f"{r['staleness_mean']:.1f}",
        }
        if self.bar:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(len(new))
        else:
            print(f"step {r['step']} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


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
    from rlfleet.models.builtin import resolve_model_path

    t0 = time.monotonic()
    model_dir = resolve_model_path(bundle.run.spec.model, bundle.run.spec.task, seed=bundle.run.spec.trainer.seed)
    print(
        f"rlfleet: model {bundle.run.spec.model.path} ready at {model_dir} ({time.monotonic() - t0:.0f}s)",
        file=sys.stderr,
    )
    from rlfleet.services.rollout.engines import check_supported

    for pool in bundle.pools:  # refused here, not after every other process has started
        try:
            check_supported(pool.spec.engine, model_dir)
        except (ImportError, ValueError) as exc:
            raise SystemExit(f"rlfleet run: InferencePool {pool.metadata.name}: {exc}") from None

    # SIGTERM (a supervisor, `kill`) stops the run the same way Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    comps = plan(bundle, config, run_path)
    if steps:
        for c in comps:
            if c.name.startswith("trainer"):
                c.argv += ["--steps", str(steps)]
    started = time.monotonic()
    failed: Component | None = None
    interrupted = False
    acl = RunAcl.generate(name)
    server = EmbeddedRedis(run_path / "redis", acl=acl.acl_file(), auth=(user_name(ADMIN, name), acl.passwords[ADMIN]))
    with server as redis_url:
        import redis

        client = redis.Redis.from_url(redis_url)
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
        signing_env = run_keys(environ, run_path / "keys")
        bar = Progress(total, progress and sys.stderr.isatty())
        try:
            for c in comps:
                with open(c.log, "ab") as log:
                    c.proc = subprocess.Popen(
                        c.argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env={
                            **environ,
                            **c.redis_env(acl, server.base_url),
                            **c.env,
                            **(signing_env if c.name == "trainer" else {}),
                        },
                    )
            trainer = comps[-1]
            while True:
                bar.update(read_metrics(run_path / "metrics.jsonl"), client.xlen(RunKeys(name).rollouts))
                if trainer.proc.poll() == 0:
                    break
                # Other trainer ranks finish their last step before rank 0 has published it.
                failed = next(
                    (
                        c
                        for c in comps
                        if c.proc.poll() is not None and not (c.name.startswith("trainer/") and c.proc.returncode == 0)
                    ),
                    None,
                )
                if failed:
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
            stop_all(comps)
            client.close()
    summary = write_reports(run_path, time.monotonic() - started, f"rlfleet run {name}")
    if interrupted:
        print(f"rlfleet: interrupted; every component stopped. Logs in {run_path / 'logs'}", file=sys.stderr)
        return 130
    if failed:
        print(
            f"rlfleet: component {failed.name} exited with code {failed.proc.returncode}; see {failed.log}",
            file=sys.stderr,
        )
        return 1
    print(
        f"rlfleet: done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, reward "
        f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, accepted {summary['accepted']}, "
        f"rejected {summary['rejected']}; {run_path / 'summary.json'}, {run_path / 'reward.png'}",
        file=sys.stderr,
    )
    return 0
