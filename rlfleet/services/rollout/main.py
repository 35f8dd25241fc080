"""`rlfleet rollout`: a worker of an InferencePool.

Loop: draw a task id and seed (or, when the run assigns work, take a ticket that fixes them:
rlfleet/wire/assignment.py), sample G completions with the current policy version, build TOPLOC proofs of
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
import requests
from prometheus_client import Counter, Gauge

from rlfleet.models.builtin import local_model_path
from rlfleet.models.policy import configure_torch_threads
from rlfleet.models.sampling import completion_text
from rlfleet.services.ingest.client import post_group, request_ticket, rollouts_url, tickets_url
from rlfleet.services.rollout.engines import Engine, make_engine
from rlfleet.services.rollout.health import engine_liveness
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings, wait_for_version
from rlfleet.services.toploc.proof import build_proofs_many
from rlfleet.tasks import make_run_task
from rlfleet.versions.checkpoint import prune_cache
from rlfleet.versions.signing import run_public_key
from rlfleet.wire import components, env
from rlfleet.wire.assignment import assigned_work, issue_ticket
from rlfleet.wire.runtime import ComponentOptions, Context, component_context, connect_redis, latest_announced_version
from rlfleet.wire.streams import MESSAGE_FIELD, RolloutGroup, Sample, SamplingParams, decode_json, stream_reply

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

    def __init__(
        self, ctx: Context, relay_urls: list[str], cache_dir: Path, keep: int, reader: redis.Redis | None = None
    ):
        super().__init__(daemon=True, name="version-follower")
        self.ctx, self.relay_urls, self.cache_dir, self.keep = ctx, relay_urls, cache_dir, keep
        self.reader = reader  # reads the policy stream (a worker's read-only Redis user); None: the relays' long-poll
        self.use_redis = reader is not None
        # manifests must verify with the run's key; the relays' measurements are kept across versions
        self.fetch = FetchSettings.over(
            relay_urls, ctx.run_name, public_key=run_public_key(ctx.bundle.run.spec.shardcast), stop=ctx.stop
        )
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
        if self.reader is None:  # use_redis
            while not self.ctx.stop.is_set():
                yield wait_for_version(self.relay_urls, self.ctx.run_name, self.announced, 60, stop=self.ctx.stop)
            return
        last_id: bytes | str = "0-0"
        while not self.ctx.stop.is_set():
            resp = stream_reply(self.reader.xread({self.ctx.keys.policy: last_id}, block=500))
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
            # whole, or rebuilt from the version held here and a delta
            path = fetch_policy(self.fetch, newest, self.cache_dir)
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
        prune_cache(self.cache_dir, min(newest - self.keep + 1, self.taken))


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
        self.tickets_url = tickets_url(pool.ingest_url, ctx.run_name) if pool.ingest_url else None
        self.worker_id = options.worker_id
        self.token = worker_token(pool_name, self.worker_id) if self.ingest_url else ""
        if not self.ingest_url and ctx.redis is None:
            raise SystemExit(
                f"rlfleet rollout: pool {pool_name} writes to the run's Redis: set spec.redis.url, --redis-url or "
                f"{env.REDIS_URL} (or give the pool spec.ingestUrl)"
            )
        self.session = requests.Session()  # the ingest's connections (no socket opens until one is used)
        self.task = make_run_task(self.spec)
        seed = int.from_bytes(hashlib.sha256(f"{self.spec.task.seed}:{self.worker_id}".encode()).digest()[:8], "little")
        self.rng = np.random.default_rng(seed)
        # Redis users per job (rlfleet/wire/redis_acl.py): ctx.redis only adds to the inbox; reads and tickets
        # go through their own users when the launcher or the operator gives them (else ctx.redis).
        self.reader = self.tickets = None
        if not self.ingest_url:
            read_url, tickets_url_ = env.get(env.REDIS_READ_URL), env.get(env.REDIS_TICKETS_URL)
            self.reader = connect_redis(read_url) if read_url else ctx.redis
            self.tickets = connect_redis(tickets_url_) if tickets_url_ else ctx.redis
        self.follower = VersionFollower(
            ctx, options.relay_urls, options.cache_dir, self.spec.shardcast.keep_versions, reader=self.reader
        )
        self.engine: Engine | None = None  # made by start() (see `loaded`)
        self.liveness = engine_liveness(ctx, lambda: self.engine)  # /healthz: generations and swaps hold working()

    def wait_first_version(self) -> bool:
        """Start the engine and load the first announced version. The engine starts from the run's base
        model when this machine has it (a shipped or cached builtin, a local directory), while the
        first version is being published and downloaded (vLLM takes most of a minute to start on a
        few CPU cores); it generates nothing before that version's weights are loaded in."""
        self.follower.start()
        spec = self.spec
        base = local_model_path(spec.model, spec.task, spec.trainer.seed)
        if base is not None:
            self.engine = make_engine(self.engine_kind, base, -1, spec.model.dtype)
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            ready = self.follower.take(-1)
            if ready:
                version, path, _ = ready
                if self.engine is None:
                    self.engine = make_engine(self.engine_kind, path, version, spec.model.dtype)
                else:
                    try:
                        self.engine.load_weights(path, version)
                    except ValueError:  # the local base model is another architecture: start from this version
                        self.engine.close()
                        self.engine = make_engine(self.engine_kind, path, version, spec.model.dtype)
                VERSION.set(version)
                self.liveness.ready()
                return True
            time.sleep(0.05)
        return False

    def _raise_follower_error(self) -> None:
        if self.follower.error is not None:
            raise RuntimeError(f"downloading policy versions failed: {self.follower.error}") from self.follower.error

    @property
    def loaded(self) -> Engine:  # the engine, for what runs once start() has made it (generation, swaps, pausing)
        assert self.engine is not None, "the rollout engine is not made yet (start() makes it)"
        return self.engine

    def maybe_swap(self) -> None:
        ready = self.follower.take(self.loaded.version)
        if ready:
            version, path, announced_at = ready
            t0 = time.monotonic()
            with self.liveness.working():
                self.loaded.load_weights(path, version)
            LOAD_SECONDS.set(time.monotonic() - t0)
            SWAP_SECONDS.set(time.monotonic() - announced_at)
            VERSION.set(version)
            log.info("now generating with version %d", version)

    def paused(self) -> str | None:
        """Why generation should wait now, or None (an ingest worker's backlog is the ingest's to refuse).

        - `version_lag`: the engine is more than maxAsyncLevel versions behind the newest announced one;
        - `batch_full`: the trainer already holds the batch of the last step that could train this
          version (its demand's `oldest`), so a group sampled now would arrive stale; at maxAsyncLevel 0
          that is every moment between a batch filling and the next version loading;
        - `enough_queued`: the groups queued for the trainer and not yet taken by it (the inbox and the
          verified stream, less the entries it holds) cover its current step's `need` and, when this
          version will still be trained one step later (newer than `oldest`), one batch more: what
          keeps the trainer fed while it trains; anything deeper would only wait and go stale;
        - `backlog`: the inbox holds more than the pool's maxPending."""
        if self.ingest_url:
            newest: int | None = self.follower.announced
        else:
            assert self.reader is not None  # a worker without an ingest reads Redis
            newest = latest_announced_version(self.reader, self.ctx.keys)
        lag = (newest or 0) - self.loaded.version
        LAG.set(lag)
        if lag > self.spec.trainer.max_async_level:
            return "version_lag"
        if self.ingest_url:
            return None
        keys = self.ctx.keys
        assert self.reader is not None  # a worker without an ingest reads Redis
        with self.reader.pipeline(transaction=False) as pipe:  # one round trip, every 20 ms while paused
            pipe.hmget(keys.demand, ["oldest", "need", "held"])
            pipe.xlen(keys.rollouts)
            pipe.xlen(keys.verified)
            (oldest, need, held), queued, verified = pipe.execute()
        if oldest is not None and self.loaded.version < int(oldest):
            return "batch_full"
        if need is not None:
            ahead = queued + verified - int(held or 0)
            later = self.loaded.version > int(oldest)  # still trainable once the trainer's step advances
            if ahead >= int(need) + later * self.spec.trainer.batch_size:
                return "enough_queued"
        if queued > self.max_pending:
            return "backlog"
        return None

    def next_work(self) -> tuple[str, int, int | None] | None:
        """(task id, group seed, ticket) of the next group: drawn here, or assigned by the run
        (spec.sampling.assignment: run; a ticket from Redis or the ingest). None if stopped meanwhile."""
        if self.spec.sampling.assignment == "worker":
            return self.task.sample_id(self.rng), int(self.rng.integers(0, 2**31)), None
        if self.ingest_url:
            assert self.tickets_url is not None  # made with ingest_url
            ticket = request_ticket(self.session, self.tickets_url, self.token, self.ctx.stop)
            if ticket is None:
                return None
        else:
            assert self.tickets is not None  # a worker without an ingest takes tickets from Redis
            ticket = issue_ticket(self.tickets, self.ctx.keys, self.worker_id)
        task_id, seed = assigned_work(self.task, self.spec.task.seed, self.worker_id, ticket)
        return task_id, seed, ticket

    def make_group(
        self, task_id: str | None = None, seed: int | None = None, ticket: int | None = None
    ) -> RolloutGroup:
        """One group: of `task_id` with group seed `seed` (next_work's), or a drawn task and seed when not given."""
        if task_id is None or seed is None:
            task_id, seed = self.task.sample_id(self.rng), int(self.rng.integers(0, 2**31))
        s, toploc = self.spec.sampling, self.spec.verifier.toploc
        problem = self.task.problem(task_id)
        prompt_ids = self.loaded.tokenizer(problem.prompt)["input_ids"]
        params = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, seed=seed
        )
        IN_FLIGHT.set(s.group_size)
        try:
            with self.liveness.working():
                gens = self.loaded.generate(prompt_ids, params, s.group_size)
        finally:
            IN_FLIGHT.set(0)
        samples = []
        group_proofs = build_proofs_many(  # the whole group's chunks in one vectorised pass
            [gen.hidden for gen in gens],
            prompt_len=len(prompt_ids),
            decode_batching_size=toploc.decode_batching_size,
            topk=toploc.topk,
        )
        for gen, proofs in zip(gens, group_proofs):
            text = completion_text(self.loaded.tokenizer, gen.completion_ids, self.loaded.stop_ids)
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
            engine=self.loaded.name,
            ticket=ticket,
        )

    def run(self) -> None:
        if not self.wait_first_version():
            return
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            self.maybe_swap()
            reason = self.paused()
            if reason:
                PAUSED.labels(reason).inc(0.02)
                time.sleep(0.02)
                continue
            work = self.next_work()
            if work is None:
                return  # stopped while the ingest held the ticket back
            group = self.make_group(*work)
            if self.ingest_url:
                if (
                    post_group(
                        self.session,
                        self.ingest_url,
                        self.token,
                        group.encode()[MESSAGE_FIELD],
                        self.ctx.stop,
                        on_wait=PAUSED.labels(components.INGEST).inc,
                    )
                    is None
                ):
                    return  # stopped while the ingest held it back
            else:
                # Never trimmed (no MAXLEN): the inbox holds only unverified groups; maxPending bounds it.
                self.ctx.client.xadd(self.ctx.keys.rollouts, group.encode())  # type: ignore[arg-type]  # invariant Dict
            GROUPS.inc()


def main(options: RolloutOptions) -> int:
    if not options.relay_urls:
        raise SystemExit("rlfleet rollout: at least one --relay-url is required")
    ctx = component_context(options, components.ROLLOUT, redis_optional=True, health_check=True)  # ingest: no Redis
    configure_torch_threads()
    worker = Worker(ctx, options)
    try:
        worker.run()
    finally:
        if worker.engine is not None:
            worker.engine.close()
    return 0
