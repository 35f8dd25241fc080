"""`rlfleet rollout`: a worker of an InferencePool.

Loop: draw a task id, sample G completions with the current policy version, build TOPLOC proofs of
their final hidden states, XADD the group to the inbox. A background thread follows the `policy`
stream and downloads each announced version through the relays (checking every file's sha256; a delta
version is rebuilt from the one held here, shardcast/assemble.py)
while generation goes on with the old weights; the main loop swaps weights between groups, so a
group is always produced by exactly one version, which it records.

A worker of a pool with `ingestUrl` (untrusted, possibly in another cluster) never touches Redis: it
POSTs each group to the run's ingest with its own token (env RLFLEET_WORKER_TOKEN, or the file named
by RLFLEET_WORKER_TOKEN_FILE; rlfleet/services/ingest/) and learns of new versions by long-polling
its relays' `latest?after=N` instead of reading the policy stream.

Backpressure: the worker pauses while the inbox holds more than `maxPending` groups (the verifier
deletes what it has handled, so XLEN is the backlog; an ingest worker leaves this to the ingest) or
while its weights lag the newest announced version by more than `maxAsyncLevel`; it resumes by
itself. An ingest answering 429 or 503 makes the worker wait (Retry-After) and resend the same group;
a group is never dropped.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests
from prometheus_client import Counter, Gauge

from rlfleet import env
from rlfleet.checkpoint import parse_version_dir
from rlfleet.policy import configure_torch_threads
from rlfleet.runtime import ComponentOptions, Context, component_context, latest_announced_version
from rlfleet.services.ingest.client import post_group, rollouts_url
from rlfleet.services.rollout.engines import Engine, make_engine
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import Sources, wait_for_version
from rlfleet.services.toploc.proof import build_proofs
from rlfleet.signing import run_public_key
from rlfleet.streams import MESSAGE_FIELD, RolloutGroup, Sample, SamplingParams, decode_json
from rlfleet.tasks import make_run_task

log = logging.getLogger("rlfleet.rollout")

GROUPS = Counter("rlfleet_rollout_groups_total", "Groups sent to the inbox")
TOKENS = Counter("rlfleet_rollout_tokens_total", "Completion tokens generated")
VERSION = Gauge("rlfleet_rollout_policy_version", "Policy version of the loaded weights")
LAG = Gauge("rlfleet_rollout_version_lag", "Newest announced version minus loaded version")
PAUSED = Counter("rlfleet_rollout_paused_seconds_total", "Seconds paused by backpressure", ["reason"])
IN_FLIGHT = Gauge("rlfleet_rollout_requests_in_flight", "Completions the engine is generating now")
DOWNLOAD_SECONDS = Gauge(
    "rlfleet_rollout_weight_download_seconds", "Download (relays, hashes, signature) of the newest version"
)
LOAD_SECONDS = Gauge("rlfleet_rollout_weight_load_seconds", "In-place load of the last swapped version into the engine")
SWAP_SECONDS = Gauge(
    "rlfleet_rollout_weight_swap_seconds", "Last swap from seeing the version announced to generating with it"
)


class VersionFollower(threading.Thread):
    """Follows the policy stream and downloads each new version; `ready` holds the newest local one."""

    def __init__(self, ctx: Context, relay_urls: list[str], cache_dir: Path, keep: int, use_redis: bool = True):
        super().__init__(daemon=True, name="version-follower")
        self.ctx, self.relay_urls, self.cache_dir, self.keep = ctx, relay_urls, cache_dir, keep
        self.use_redis = use_redis  # False: announcements come from the relays' long-poll
        self.public_key = run_public_key(ctx.bundle.run.spec.shardcast)  # manifests must verify with it
        self.sources = Sources(relay_urls) if relay_urls else None  # relay measurements kept across versions
        self.announced = -1
        self.ready: tuple[int, Path, float] | None = None  # (version, directory, monotonic time it was announced)
        self.taken = -1  # the newest version handed to the engine: in use or being loaded, never pruned
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # surfaced to the main loop, which exits non-zero
            self.error = exc

    def _announcements(self):
        """The newest announced version each time there is news (None: nothing new yet)."""
        if not self.use_redis:
            while not self.ctx.stop.is_set():
                yield wait_for_version(self.relay_urls, self.ctx.run_name, self.announced, 60, stop=self.ctx.stop)
            return
        last_id = "0-0"
        while not self.ctx.stop.is_set():
            resp = self.ctx.redis.xread({self.ctx.keys.policy: last_id}, block=500)
            newest = None
            for _, entries in resp or []:
                for msg_id, fields in entries:
                    last_id = msg_id
                    newest = max(newest or -1, int(decode_json(fields)["version"]))
            yield newest

    def _follow(self) -> None:
        for newest in self._announcements():
            if newest is None or newest <= self.announced:
                continue
            self.announced, announced_at = newest, time.monotonic()
            path = fetch_policy(  # whole, or rebuilt from the version held here and a delta
                self.relay_urls,
                self.ctx.run_name,
                newest,
                self.cache_dir,
                stop=self.ctx.stop,
                public_key=self.public_key,
                sources=self.sources,
            )
            DOWNLOAD_SECONDS.set(time.monotonic() - announced_at)
            with self._lock:
                self.ready = (newest, path, announced_at)
                self._prune(newest)

    def take(self, newer_than: int) -> tuple[int, Path, float] | None:
        with self._lock:
            if self.ready and self.ready[0] > newer_than:
                self.taken = self.ready[0]
                return self.ready
        return None

    def _prune(self, newest: int) -> None:
        """Drop versions older than the newest `keep`, but never the one the engine took (it may still
        be loading it while newer versions arrive). Called with the lock held."""
        for child in self.cache_dir.iterdir():
            version = parse_version_dir(child.name)
            if version is not None and version <= newest - self.keep and version < self.taken:
                shutil.rmtree(child, ignore_errors=True)


@dataclass(frozen=True, kw_only=True)
class RolloutOptions(ComponentOptions):
    worker_id: str
    cache_dir: Path  # where downloaded policy versions are kept
    relay_urls: list[str] = field(default_factory=list)  # relay (or origin) base URLs
    pool: str | None = None  # InferencePool name; None: the file's only pool, or the defaults without one


def worker_token(pool: str, worker_id: str) -> str:
    """This worker's ingest token: env RLFLEET_WORKER_TOKEN, else the file RLFLEET_WORKER_TOKEN_FILE names."""
    token = env.get(env.WORKER_TOKEN)
    path = env.get(env.WORKER_TOKEN_FILE)
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise SystemExit(
                f"rlfleet rollout: no token for worker {worker_id} of pool {pool}: cannot read {path} "
                f"({exc.strerror}); its workerTokens Secret needs a key named {worker_id}"
            ) from None
    if not token:
        raise SystemExit(
            f"rlfleet rollout: pool {pool} has spec.ingestUrl; set env {env.WORKER_TOKEN} (or {env.WORKER_TOKEN_FILE}) "
            f"to worker {worker_id}'s token"
        )
    return token


class Worker:
    def __init__(self, ctx: Context, options: RolloutOptions):
        self.ctx = ctx
        self.spec = ctx.bundle.run.spec
        pool_name, pool = ctx.bundle.pool(options.pool, str(options.config))
        self.engine_kind = pool.engine
        self.max_pending = pool.max_pending
        self.ingest_url = rollouts_url(pool.ingest_url, ctx.run_name) if pool.ingest_url else None
        self.worker_id = options.worker_id
        self.token = worker_token(pool_name, self.worker_id) if self.ingest_url else ""
        if not self.ingest_url and ctx.redis is None:
            raise SystemExit(
                f"rlfleet rollout: pool {pool_name} writes to the run's Redis: set spec.redis.url, --redis-url or "
                f"{env.REDIS_URL} (or give the pool spec.ingestUrl)"
            )
        self.session = requests.Session() if self.ingest_url else None
        self.task = make_run_task(self.spec)
        seed = int.from_bytes(hashlib.sha256(f"{self.spec.task.seed}:{self.worker_id}".encode()).digest()[:8], "little")
        self.rng = np.random.default_rng(seed)
        self.follower = VersionFollower(
            ctx, options.relay_urls, options.cache_dir, self.spec.shardcast.keep_versions, use_redis=not self.ingest_url
        )
        self.engine: Engine | None = None

    def wait_first_version(self) -> bool:
        self.follower.start()
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            ready = self.follower.take(-1)
            if ready:
                version, path, _ = ready
                self.engine = make_engine(self.engine_kind, path, version, self.spec.model.dtype)
                VERSION.set(version)
                return True
            time.sleep(0.05)
        return False

    def _raise_follower_error(self) -> None:
        if self.follower.error is not None:
            raise RuntimeError(f"downloading policy versions failed: {self.follower.error}") from self.follower.error

    def maybe_swap(self) -> None:
        ready = self.follower.take(self.engine.version)
        if ready:
            version, path, announced_at = ready
            t0 = time.monotonic()
            self.engine.load_weights(path, version)
            LOAD_SECONDS.set(time.monotonic() - t0)
            SWAP_SECONDS.set(time.monotonic() - announced_at)
            VERSION.set(version)
            log.info("now generating with version %d", version)

    def paused(self) -> str | None:
        """Why generation should wait now, or None (an ingest worker's backlog is the ingest's to refuse)."""
        if self.ingest_url:
            newest = self.follower.announced
        else:
            newest = latest_announced_version(self.ctx.redis, self.ctx.keys)
        lag = (newest or 0) - self.engine.version
        LAG.set(lag)
        if lag > self.spec.trainer.max_async_level:
            return "version_lag"
        if not self.ingest_url and self.ctx.redis.xlen(self.ctx.keys.rollouts) > self.max_pending:
            return "backlog"
        return None

    def make_group(self) -> RolloutGroup:
        s, toploc = self.spec.sampling, self.spec.verifier.toploc
        problem = self.task.problem(self.task.sample_id(self.rng))
        prompt_ids = self.engine.tokenizer(problem.prompt)["input_ids"]
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            seed=int(self.rng.integers(0, 2**31)),
        )
        IN_FLIGHT.set(s.group_size)
        try:
            gens = self.engine.generate(prompt_ids, params, s.group_size)
        finally:
            IN_FLIGHT.set(0)
        samples = []
        for gen in gens:
            proofs = build_proofs(
                gen.hidden,
                prompt_len=len(prompt_ids),
                decode_batching_size=toploc.decode_batching_size,
                topk=toploc.topk,
            )
            text = self.engine.tokenizer.decode(gen.completion_ids, skip_special_tokens=True)
            samples.append(
                Sample(
                    completion_ids=gen.completion_ids,
                    logprobs=gen.logprobs,
                    proofs=proofs,
                    reward=self.task.score(problem, text, len(gen.completion_ids)),
                    finish_reason=gen.finish_reason,
                )
            )
            TOKENS.inc(len(gen.completion_ids))
        # The version that produced the tokens (engine.py's invariant), not one swapped in since.
        return RolloutGroup(
            task_id=problem.task_id,
            worker_id=self.worker_id,
            policy_version=gens[0].version,
            prompt_ids=prompt_ids,
            sampling=params,
            samples=samples,
        )

    def run(self) -> None:
        if not self.wait_first_version():
            return
        maxlen = self.spec.redis.stream_max_len
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            self.maybe_swap()
            reason = self.paused()
            if reason:
                PAUSED.labels(reason).inc(0.02)
                time.sleep(0.02)
                continue
            group = self.make_group()
            if self.ingest_url:
                if (
                    post_group(
                        self.session,
                        self.ingest_url,
                        self.token,
                        group.encode()[MESSAGE_FIELD],
                        self.ctx.stop,
                        on_wait=PAUSED.labels("ingest").inc,
                    )
                    is None
                ):
                    return  # stopped while the ingest held it back
            else:
                self.ctx.redis.xadd(self.ctx.keys.rollouts, group.encode(), maxlen=maxlen, approximate=True)
            GROUPS.inc()


def main(options: RolloutOptions) -> int:
    if not options.relay_urls:
        raise SystemExit("rlfleet rollout: at least one --relay-url is required")
    ctx = component_context(options, "rollout", redis_optional=True)  # an ingest pool's workers run without it
    configure_torch_threads()
    worker = Worker(ctx, options)
    try:
        worker.run()
    finally:
        if worker.engine is not None:
            worker.engine.close()
    return 0
