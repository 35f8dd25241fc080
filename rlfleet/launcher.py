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

from rlfleet.config import Bundle, load_bundle
from rlfleet.redis_server import EmbeddedRedis, free_port
from rlfleet.report import read_metrics, write_reports
from rlfleet.streams import RunKeys

STOP_GRACE_S = 20


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment


def plan(bundle: Bundle, config: Path, run_dir: Path) -> list[Component]:
    """Every process of the run, in start order (pure: nothing is started here)."""
    spec = bundle.run.spec
    cli = [sys.executable, "-m", "rlfleet.cli"]
    logs, cache = run_dir / "logs", run_dir / "cache"
    common = ["--config", str(config)]
    origin_url = f"http://127.0.0.1:{free_port()}"
    comps = [Component("origin", [*cli, "origin", *common, "--port", origin_url.rsplit(":", 1)[1]], logs / "origin.log")]
    tiers: dict[int, list[str]] = {}
    for relay in sorted(bundle.relays, key=lambda r: r.spec.tier):
        below = tiers.get(relay.spec.tier - 1, [origin_url])
        for i in range(relay.spec.replicas):
            name, port = f"{relay.metadata.name}-{i}", free_port()
            upstream = below[i % len(below)]
            comps.append(Component(f"relay/{name}", [*cli, "relay", *common, "--port", str(port), "--upstream", upstream,
                                                     "--cache-dir", str(cache / name), "--keep-versions", str(relay.spec.keep_versions)],
                                   logs / f"relay-{name}.log"))
            tiers.setdefault(relay.spec.tier, []).append(f"http://127.0.0.1:{port}")
    relay_urls = tiers[max(tiers)] if tiers else [origin_url]
    for i in range(spec.verifier.replicas):
        comps.append(Component(f"verifier/{i}", [*cli, "verifier", *common, "--consumer", f"verifier-{i}", "--origin-url", origin_url,
                                                 "--cache-dir", str(cache / f"verifier-{i}"), "--api-port", str(free_port())],
                               logs / f"verifier-{i}.log"))
    relay_args = sum((["--relay-url", u] for u in relay_urls), [])
    # Without an InferencePool document the run still gets two CPU workers.
    pools = [(p.metadata.name, p.spec.replicas, ["--pool", p.metadata.name]) for p in bundle.pools] or [("local", 2, [])]
    for pool_name, replicas, pool_args in pools:
        for i in range(replicas):
            worker = f"{pool_name}-{i}"
            comps.append(Component(f"rollout/{worker}", [*cli, "rollout", *common, "--worker-id", worker, *pool_args, *relay_args,
                                                         "--cache-dir", str(cache / worker)], logs / f"rollout-{worker}.log"))
    # trainer.replicas > 1: one process per rank with the torchrun-style environment the operator
    # gives trainer pods; rank 0 ("trainer", last in the list) reads the streams and publishes.
    replicas = spec.trainer.replicas
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(replicas)} if replicas > 1 else {}
    for rank in range(replicas - 1, -1, -1):
        name = "trainer" if rank == 0 else f"trainer/{rank}"
        comps.append(Component(name, [*cli, "trainer", *common, "--output-dir", str(run_dir)],
                               logs / ("trainer.log" if rank == 0 else f"trainer-{rank}.log"),
                               env={**master, "RANK": str(rank)} if replicas > 1 else {}))
    return comps


def run_keys(env: dict, key_dir: Path) -> dict:
    """Set env's RLFLEET_PUBLIC_KEY for every component; return the trainer-only env naming the
    private key (a fresh pair in `key_dir` unless RLFLEET_SIGNING_KEY_FILE was given)."""
    from rlfleet.signing import ENV_PUBLIC_KEY, ENV_SIGNING_KEY_FILE, generate_keypair, load_private_key, public_key_text

    given = env.pop(ENV_SIGNING_KEY_FILE, None)
    if given:
        private, public = Path(given).resolve(), public_key_text(load_private_key(Path(given)))
    else:
        private, public = generate_keypair(key_dir)
    env[ENV_PUBLIC_KEY] = public
    return {ENV_SIGNING_KEY_FILE: str(private)}


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
        new = records[self.seen:]
        if not new:
            return
        self.seen = len(records)
        r = new[-1]
        fields = {"v": r["policy_version"], "reward": f"{r['reward_mean']:.2f}", "acc": r["accepted"],
                  "rej": r["rejected"], "queue": queue_depth, "lag": f"{r['staleness_mean']:.1f}"}
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
    print(f"rlfleet: model {bundle.run.spec.model.path} ready at {model_dir} ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    for pool in bundle.pools:
        if pool.spec.engine == "vllm":  # refused here, not after every other process has started
            try:
                from rlfleet.services.rollout.vllm_engine import check_supported
                check_supported(model_dir)
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
    with EmbeddedRedis(run_path / "redis") as redis_url:
        import redis

        client = redis.Redis.from_url(redis_url)
        env = {**os.environ, "RLFLEET_REDIS_URL": redis_url, "RLFLEET_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1",
               "RLFLEET_LOCAL": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if not bundle.run.spec.store.uri:
            env["RLFLEET_STORE_URI"] = f"file://{run_path / 'store'}"
        signing_env = run_keys(env, run_path / "keys")
        bar = Progress(total, progress and sys.stderr.isatty())
        try:
            for c in comps:
                with open(c.log, "ab") as log:
                    c.proc = subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                              env={**env, **c.env, **(signing_env if c.name == "trainer" else {})})
            trainer = comps[-1]
            while True:
                bar.update(read_metrics(run_path / "metrics.jsonl"), client.xlen(RunKeys(name).rollouts))
                if trainer.proc.poll() == 0:
                    break
                # Other trainer ranks finish their last step before rank 0 has published it.
                failed = next((c for c in comps if c.proc.poll() is not None
                               and not (c.name.startswith("trainer/") and c.proc.returncode == 0)), None)
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
        print(f"rlfleet: component {failed.name} exited with code {failed.proc.returncode}; see {failed.log}", file=sys.stderr)
        return 1
    print(f"rlfleet: done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s, reward "
          f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, accepted {summary['accepted']}, "
          f"rejected {summary['rejected']}; {run_path / 'summary.json'}, {run_path / 'reward.png'}", file=sys.stderr)
    return 0
