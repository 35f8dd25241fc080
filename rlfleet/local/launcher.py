"""`rlfleet run FILE`: the whole system on one machine, one OS process per component.

It builds the builtin model if needed (so components never race to build it), then starts an
embedded redis-server (append-only file, rlfleet/local/redis_server.py), the Shardcast origin, each
RelayTier's relays (the tree of rlfleet/wire/topology.py), the verifier replicas, the ingest when outside
workers may submit (spec.ingest.admission open or invite, or a tokensFile: its run document announces this
run's own relays, and the run prints the URL `rlfleet join` takes), each InferencePool's workers and the
trainer (one process per replica, each starting its ranksPerReplica ranks, with the torchrun-style environment
of the trainer pods), with the same `rlfleet <component>` entrypoints the containers use.
The processes are planned as typed records (rlfleet/local/plan.py), handed to the supervisor as
command lines only when they start; a `LocalRun` holds one launch's state.
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
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.config import Bundle, ConfigError, load_bundle
from rlfleet.local.forking import Preload
from rlfleet.local.plan import Process, check_local_size, components_started, endpoints, join_url, plan, redis_env
from rlfleet.local.progress import BuildProgress, Progress, startup_status
from rlfleet.local.prometheus import LocalPrometheus, write_targets
from rlfleet.local.prometheus import start as start_prometheus
from rlfleet.local.redis_server import redis_server_argv, wait_until_ready, write_acl_file
from rlfleet.local.run_report import write_html_report
from rlfleet.local.supervisor import RECORD, Component, Supervisor
from rlfleet.wire import env
from rlfleet.wire.components import COMPONENTS, TRAINER
from rlfleet.wire.ports import free_port
from rlfleet.wire.redis_acl import ADMIN, RunAcl
from rlfleet.wire.run_summary import read_metrics, reward_trend, write_reports
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.topology import bundle_graph


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


def take_tracker_credentials(environ: dict) -> dict[str, str]:
    """Remove the experiment trackers' credentials from `environ` (every process's) and return them, for the
    trainer's rank 0 alone, as on a cluster."""
    return {name: environ.pop(name) for name in env.TRACKER_CREDENTIALS if name in environ}


def run_local(
    file: str, run_dir: str | None = None, steps: int | None = None, progress: bool = True, prometheus: bool = False
) -> int:
    bundle = load_bundle(file)
    bundle_graph(bundle, file)  # a relay tree that cannot be built fails before anything starts
    prerun_checks(bundle, file)  # so do a tracker not installed, a missing eval.dataset or invites file
    name = bundle.run.metadata.name
    run_path = Path(run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run_path / "logs").mkdir(parents=True, exist_ok=True)
    config = run_path / "rlrun.yaml"
    shutil.copyfile(file, config)

    print(f"rlfleet: run {name} in {run_path}", file=sys.stderr)
    # Until components run (LocalRun.supervise takes over), SIGTERM interrupts like Ctrl-C: nothing to stop yet.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    check_task(bundle.run.spec)
    from rlfleet.models.sources import resolve_model_path

    t0 = time.monotonic()
    build = BuildProgress(bundle.run.spec.model.path, progress and sys.stderr.isatty())
    try:
        spec = bundle.run.spec
        model_dir = resolve_model_path(
            spec.model,
            spec.task,
            seed=spec.trainer.seed,
            progress=build,
            store_endpoint=spec.store.endpoint_url,
            caller="launcher",
        )
    finally:
        build.close()
    # From here on a signal is counted, never raised (Interrupts): the imports and the start-up ahead
    # must not be cut in the middle, and every path below stops what it started. Counted from before the line
    # that says the model is ready: a Ctrl-C just after it, raised as KeyboardInterrupt, could land in a
    # finalizer the garbage collector runs and be dropped, and the run would go on.
    interrupts = Interrupts()
    previous = {sig: signal.signal(sig, interrupts) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(
            f"rlfleet: model {bundle.run.spec.model.path} ready at {model_dir} ({time.monotonic() - t0:.0f}s)",
            file=sys.stderr,
        )
        run = LocalRun(
            bundle, file, config, run_path, steps, progress, with_prometheus=prometheus, interrupts=interrupts
        )
        return run.start(model_dir)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def prerun_checks(bundle: Bundle, source: str) -> None:
    """Run the pre-run check of every component the run starts (its registry record's `prerun`,
    rlfleet/wire/components.py), in start order; one ConfigError naming `source` lists all their problems.
    The launcher knows the checks by the registry alone: it imports no service."""
    problems = []
    for kind in components_started(bundle):
        check = COMPONENTS[kind].prerun_check()
        if check is not None:
            problems += check(bundle)
    if problems:
        raise ConfigError(source, problems)


def check_task(spec) -> None:
    """Make the run's task once here (its data sets read, a user environment imported and built), so a bad task
    stops the run before a model is built or any process starts."""
    from rlfleet.tasks import make_run_task

    try:
        task = make_run_task(spec)
    except ValueError as exc:
        raise SystemExit(f"rlfleet run: {exc}") from None
    del task  # a user environment's process ends with it


@dataclass
class LocalRun:
    """One launch of a run on this machine: its config, its directory, and once started its processes,
    their supervisor and the signals it received."""

    bundle: Bundle
    source: str  # the file the user gave (named in errors)
    config: Path  # its copy in the run directory, which the components read
    path: Path  # the run directory
    steps: int | None = None  # overrides spec.trainer.steps
    progress: bool = True
    with_prometheus: bool = False  # --prometheus: start one beside the run (rlfleet/local/prometheus.py)
    prometheus: LocalPrometheus | None = None
    interrupts: Interrupts = field(default_factory=lambda: Interrupts())
    processes: list[Process] = field(default_factory=list)

    @property
    def total_steps(self) -> int:
        return self.steps or self.bundle.run.spec.trainer.steps

    def start(self, model_dir: Path) -> int:
        """Check the engines, plan the processes, set up their environment and keys, then supervise them."""
        from rlfleet.engines import check_supported  # imports neither torch nor vLLM

        for pool in self.bundle.pools:  # refused here, not after every other process has started
            try:
                check_supported(pool.spec.engine, model_dir, pool.spec.vllm)
            except (ImportError, ValueError) as exc:
                raise SystemExit(f"rlfleet run: InferencePool {pool.metadata.name}: {exc}") from None

        from rlfleet.tasks.chat import ChatTemplateMissing, check_chat_templates, has_chat_template

        spec = self.bundle.run.spec
        try:
            check_chat_templates(spec.task, has_chat_template(model_dir), spec.model.path)
        except ChatTemplateMissing as exc:
            raise SystemExit(f"rlfleet run: {exc}") from None
        self.processes = plan(self.bundle, self.config, self.path, self.steps)
        check_local_size(self.processes, self.source)
        redis_port = free_port()
        base_url = f"redis://127.0.0.1:{redis_port}/0"
        acl = RunAcl.generate(self.bundle.run.metadata.name)
        redis_url = acl.url(base_url, ADMIN)
        acl_file = write_acl_file(self.path / "redis" / "users.acl", acl.acl_file())
        redis_comp = Component(
            "redis",
            redis_server_argv(self.path / "redis", redis_port, persistent=True, acl_file=acl_file),
            self.path / "logs" / "redis.log",
            stop_last=True,
        )
        environ = self.environment(redis_url)
        trainer_env = run_keys(environ, self.path / "keys")
        trainer_env.update(take_tracker_credentials(environ))
        for p in self.processes:
            p.env.update(redis_env(p, self.bundle, acl, base_url))
            if p.kind == TRAINER and p.rank == 0:
                p.env.update(trainer_env)
        (self.path / "redis").mkdir(exist_ok=True)
        join = join_url(self.processes, self.bundle)
        text = json.dumps(endpoints(redis_url, self.processes, join), indent=2) + "\n"
        (self.path / "endpoints.json").write_text(text)
        if join:
            code = " --code CODE" if spec.ingest.admission.mode == "invite" else ""
            print(f"rlfleet: outside workers join with: rlfleet join {join}{code}", file=sys.stderr)
        targets = write_targets(self.path, self.bundle.run.metadata.name, self.processes)
        if self.with_prometheus:
            try:
                self.prometheus = start_prometheus(self.path, targets)
                print(f"rlfleet: Prometheus at {self.prometheus.url} scrapes every component", file=sys.stderr)
            except RuntimeError as exc:
                print(f"rlfleet: --prometheus: {exc}; the run goes on without it", file=sys.stderr)
        comps = [p.component() for p in self.processes]
        preload = Preload(p.kind for p in self.processes)
        supervisor = Supervisor([redis_comp, *comps], environ, preload=preload, record=self.path / RECORD)
        started = Started(supervisor, redis=redis_comp, trainer=comps[-1])
        if self.interrupts.requested:
            print("rlfleet: interrupted before the run started", file=sys.stderr)
            return 130
        return self.supervise(started)

    def environment(self, redis_url: str) -> dict[str, str]:
        """The environment every process gets (a process's own `env` is added to it)."""
        environ = {
            **os.environ,
            env.REDIS_URL: redis_url,
            env.TORCH_THREADS: "1",
            "OMP_NUM_THREADS": "1",
            env.LOCAL: "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            # An hf:// model was downloaded by the launcher before anything started (run_local): the trainer reads
            # that cache, and no component contacts the hub (workers never resolve an hf:// model at all).
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        if not self.bundle.run.spec.store.uri:
            environ[env.STORE_URI] = f"file://{self.path / 'store'}"
        return environ

    def supervise(self, run: Started) -> int:
        """Run until the trainer finishes, a component crash-loops or the user interrupts; then stop
        everything and write the reports."""
        started = time.monotonic()
        try:
            failed = self.run_components(run)
        finally:
            run.supervisor.stop_all(force=lambda: self.interrupts.count >= 2)
            if self.prometheus:
                self.prometheus.stop()
        name = self.bundle.run.metadata.name
        summary = write_reports(self.path, time.monotonic() - started, f"rlfleet run {name}")
        page = write_html_report(self.path)
        if self.interrupts.requested:
            print(f"rlfleet: interrupted; every component stopped. Logs in {self.path / 'logs'}", file=sys.stderr)
            return 130
        if failed is run.redis and not failed.failures:
            print(f"rlfleet: redis-server did not start; see {run.redis.log}", file=sys.stderr)
            return 1
        if failed:
            code = failed.proc.returncode if failed.proc else None
            print(
                f"rlfleet: component {failed.name} keeps failing (exit code {code}, "
                f"{failed.failures} times in a row); see {failed.log}",
                file=sys.stderr,
            )
            return 1
        print(
            f"rlfleet: done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, {reward_trend(summary)}, "
            f"accepted {summary['accepted']}, rejected {summary['rejected']}; {self.path / 'summary.json'}, "
            f"{self.path / 'reward.png'}; the report: {page}",
            file=sys.stderr,
        )
        return 0

    def run_components(self, run: Started) -> Component | None:
        """Start Redis, then every component; supervise until the trainer is done or a signal came.
        Returns the component that failed the run, if one did."""
        import redis

        supervisor, interrupts = run.supervisor, self.interrupts
        proc = supervisor.start(run.redis)
        url = supervisor.environ[env.REDIS_URL]
        if supervisor.preload is not None:
            supervisor.preload.load(supervisor.environ)  # while Redis starts: the components are forked from here
        try:
            wait_until_ready(url, proc, run.redis.log, cancelled=lambda: interrupts.requested)
        except RuntimeError:
            return run.redis
        for comp in supervisor.comps[1:]:
            if interrupts.requested:
                return None
            supervisor.start(comp)
        bar = Progress(self.total_steps, self.progress and sys.stderr.isatty())
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        keys = RunKeys(self.bundle.run.metadata.name)
        try:
            while not interrupts.requested:
                records = read_metrics(self.path / "metrics.jsonl")
                depth: int | str
                try:
                    depth = client.xlen(keys.rollouts)
                    if not records:
                        bar.waiting(startup_status(client, keys, self.bundle.run.spec.trainer.batch_size))
                except redis.RedisError:
                    depth = "?"  # Redis is restarting; its append-only file brings the queue back
                bar.update(records, depth)
                if run.trainer.finished:
                    self.snapshot_reputation(client, keys)
                    return None
                failed = supervisor.poll()
                if failed:
                    return failed
                time.sleep(0.5)
            self.snapshot_reputation(client, keys)  # interrupted: the components and Redis still run
            return None
        finally:
            bar.close()
            client.close()

    def snapshot_reputation(self, client, keys: RunKeys) -> None:
        """RUN_DIR/workers.json: every worker's verdict counters and ban record (the verifier's /workers), read
        from Redis before it stops (the trainer done or the run interrupted), for `rlfleet report`."""
        import redis

        from rlfleet.fleet.reputation import worker_stats

        try:
            stats = worker_stats(client, keys)
        except redis.RedisError as exc:
            print(f"rlfleet: workers.json not written: {exc}", file=sys.stderr)
            return
        (self.path / "workers.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Started:
    """A run's processes once planned: their supervisor, and the two the run watches by name."""

    supervisor: Supervisor
    redis: Component  # started first, stopped last
    trainer: Component  # rank 0; its exit ends the run


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
