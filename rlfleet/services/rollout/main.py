"""`rlfleet rollout`: a worker of an InferencePool.

Loop, one batch of groups at a time: swap to the newest downloaded version if there is one; ask how
many groups the trainer can still take (`room`: backpressure below); take up to K = min(maxGroupsInFlight,
room) pieces of work, each a task id and seed drawn here (or, when the run assigns work, a ticket that
fixes them: rlfleet/fleet/assignment.py); sample all K groups of G completions in ONE engine call
(`generate_groups`: the engine batches K*G sequences, rlfleet/engines/base.py); build
the TOPLOC proofs of their final hidden states; send each group in order (XADD to the inbox, or POST
to the ingest). maxGroupsInFlight unset: the engine's `default_groups_in_flight`.
Versions: a background thread (follower.py) downloads each announced version while generation goes
on with the old weights; weights are swapped only between batches, so a swap waits for the groups in
flight, and every group of a batch is produced by exactly the one version the engine call ran on,
which it records.

A worker of a pool with `ingestUrl` (untrusted, possibly in another cluster) never touches Redis: it
POSTs each group to the run's ingest with its own token (env RLFLEET_WORKER_TOKEN, or the file named
by RLFLEET_WORKER_TOKEN_FILE; rlfleet/services/ingest/) and learns of new versions by long-polling
its relays' `latest?after=N` instead of reading the policy stream.

A worker with Redis sends no group the trainer would drop for its content (repeats.py: repeats of trained work
and, under skipZeroAdvantageGroups, groups of equal rewards), and builds no proofs for one.

Backpressure, checked before each batch (`room`, backpressure.py): the worker pauses while the trainer's demand is
covered (counting what the pool's other workers are sampling now), its weights lag too far, or the inbox is full,
and a batch takes at most the room left. An ingest answering 429 or 503 makes the worker wait (Retry-After) and
resend the same group; a group is never dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from prometheus_client import Counter, Gauge

from rlfleet.config import worker_dtype
from rlfleet.engines import Engine, Generation, make_engine
from rlfleet.engines.base import GroupRequest
from rlfleet.engines.episodes import generate_episodes
from rlfleet.models.policy import configure_torch_threads
from rlfleet.models.sources import local_model_path, resolve_model_path
from rlfleet.proofs.toploc import build_proofs_many
from rlfleet.services.ingest.client import post_group, rollouts_url, tickets_url
from rlfleet.services.rollout.backpressure import Backpressure
from rlfleet.services.rollout.follower import VersionFollower
from rlfleet.services.rollout.health import engine_liveness
from rlfleet.services.rollout.repeats import holds_flat, worth_sending
from rlfleet.services.rollout.timing import LAPS
from rlfleet.services.rollout.work import IngestLink, Work, WorkSource
from rlfleet.tasks import make_run_task
from rlfleet.tasks.chat import check_chat_templates, encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.tasks.turns import drawn_tokens, episode_text
from rlfleet.versions.adapter import is_adapter_dir
from rlfleet.versions.checkpoint import weight_bytes
from rlfleet.wire import components, env
from rlfleet.wire.runtime import ComponentOptions, Context, component_context, connect_redis
from rlfleet.wire.streams import MESSAGE_FIELD, RolloutGroup, Sample, SamplingParams

log = logging.getLogger("rlfleet.rollout")

GROUPS = Counter("rlfleet_rollout_groups_total", "Groups sent to the inbox")
TOKENS = Counter("rlfleet_rollout_tokens_total", "Completion tokens generated")
VERSION = Gauge("rlfleet_rollout_policy_version", "Policy version of the loaded weights")
PAUSED = Counter("rlfleet_rollout_paused_seconds_total", "Seconds paused by backpressure", ["reason"])
# Every reason (Worker.room's, and the ingest's holding back) is exported at 0 from the start: the series
# exist before the first pause, and a dashboard shows "never paused" rather than no data.
for _reason in ("version_lag", "batch_full", "enough_queued", "backlog", components.INGEST):
    PAUSED.labels(_reason)
IN_FLIGHT = Gauge("rlfleet_rollout_requests_in_flight", "Completions the engine is generating now")
GROUPS_IN_FLIGHT = Gauge("rlfleet_rollout_groups_in_flight", "Groups the engine is generating now (one batch)")
LOAD_SECONDS = Gauge("rlfleet_rollout_weight_load_seconds", "In-place load of the last swapped version into the engine")
SWAP_SECONDS = Gauge(
    "rlfleet_rollout_weight_swap_seconds", "Last swap from seeing the version announced to generating with it"
)


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
    """One worker's loop (the module docstring): its engine, the versions it follows, what it draws (`draws`) and
    when it pauses (`backpressure`)."""

    def __init__(self, ctx: Context, options: RolloutOptions):
        self.ctx = ctx
        self.spec = ctx.bundle.run.spec
        pool_name, pool = ctx.bundle.pool(options.pool, str(options.config))
        self.engine_kind, self.vllm = pool.engine, pool.vllm  # make_engine's kind and vLLM settings
        self.dtype = pool.dtype or worker_dtype(self.spec)  # the run admits no other (config._pool_problems)
        self.max_in_flight = pool.max_groups_in_flight  # None: the engine's default_groups_in_flight
        self.worker_id = options.worker_id
        self.ingest: IngestLink | None = None
        if pool.ingest_url:
            self.ingest = IngestLink(
                requests.Session(),
                rollouts_url(pool.ingest_url, ctx.run_name),
                tickets_url(pool.ingest_url, ctx.run_name),
                worker_token(pool_name, self.worker_id),
            )
        elif ctx.redis is None:
            raise SystemExit(
                f"rlfleet rollout: pool {pool_name} writes to the run's Redis: set spec.redis.url, --redis-url or "
                f"{env.REDIS_URL} (or give the pool spec.ingestUrl)"
            )
        self.task = make_run_task(self.spec)
        # Redis users per job (rlfleet/wire/redis_acl.py): ctx.redis only adds to the inbox; reads and tickets
        # go through their own users when the launcher or the operator gives them (else ctx.redis).
        self.reader = tickets = None
        if not self.ingest:
            read_url, tickets_url_ = env.get(env.REDIS_READ_URL), env.get(env.REDIS_TICKETS_URL)
            self.reader = connect_redis(read_url) if read_url else ctx.redis
            tickets = connect_redis(tickets_url_) if tickets_url_ else ctx.redis
        self.draws = WorkSource(ctx, self.task, self.worker_id, self.ingest, tickets, self.reader)
        self.hold_flat = holds_flat(self.spec)
        self.follower = VersionFollower(
            ctx, options.relay_urls, options.cache_dir, self.spec.shardcast.keep_versions, reader=self.reader
        )
        self.backpressure = Backpressure(ctx, self.worker_id, self.reader, self.follower, pool.max_pending)
        self.engine: Engine | None = None  # made by start() (see `loaded`)
        self.liveness = engine_liveness(ctx, lambda: self.engine)  # /healthz: generations and swaps hold working()
        self.largest_weights = 0  # bytes of the largest whole weights loaded here (`swap_bytes`)

    def wait_first_version(self) -> bool:
        """Start the engine and load the first announced version. The engine starts from the run's base
        model when this machine has it (a shipped or cached builtin, a local directory, the cached
        conversion of a local GGUF file), while the first version is being published and downloaded (vLLM
        takes most of a minute to start on a few CPU cores); it generates nothing before that version's
        weights are loaded in. A model on s3:// or hf:// is never fetched here, nor a GGUF converted: the
        engine starts from version 0 as the relays serve it."""
        self.follower.start()
        spec = self.spec
        base = local_model_path(spec.model, spec.task, spec.trainer.seed)
        if base is not None:
            self.engine = make_engine(self.engine_kind, base, -1, self.dtype, self.vllm)
            self.largest_weights = weight_bytes(base)
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            ready = self.follower.take(-1)
            if ready:
                version, path, _ = ready
                if self.engine is None and is_adapter_dir(path):  # an adapter (LoRA) applies to the run's base
                    # a builtin or a local directory: the config refuses lora over s3:// or hf:// (workers never fetch)
                    base = resolve_model_path(spec.model, spec.task, spec.trainer.seed, caller=components.ROLLOUT)
                    self.engine = make_engine(self.engine_kind, base, -1, self.dtype, self.vllm)
                    self.largest_weights = weight_bytes(base)
                with LAPS.part("load"):
                    self._load_first(version, path)
                VERSION.set(version)
                # a run asking for a chat template the model lacks: refused here, before any group
                check_chat_templates(spec.task, bool(getattr(self.loaded.tokenizer, "chat_template", None)), str(path))
                self.liveness.ready()
                return True
            time.sleep(0.05)
        return False

    def _load_first(self, version: int, path: Path) -> None:
        """Load the first version: into the engine started from the base model, else into a new engine."""
        if self.engine is None:
            self.engine = make_engine(self.engine_kind, path, version, self.dtype, self.vllm)
            return
        try:
            self.engine.load_weights(path, version)
        except ValueError:  # the local base model is another architecture: start from this version
            if is_adapter_dir(path):
                raise  # an adapter needs the base it was made over (its message names it)
            self.engine.close()
            self.engine = make_engine(self.engine_kind, path, version, self.dtype, self.vllm)

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
            with self.liveness.swapping(self.swap_bytes(path)), LAPS.part("load"):
                self.loaded.load_weights(path, version)
            LOAD_SECONDS.set(time.monotonic() - t0)
            swap = time.monotonic() - announced_at
            SWAP_SECONDS.set(swap)
            VERSION.set(version)
            # `rlfleet report` reads these lines for its broadcast times (rlfleet/local/run_report.py).
            log.info("%.3fs after its announcement, now generating with version %d", swap, version)

    def swap_bytes(self, path: Path) -> int:
        """The bytes a swap to the version in `path` loads, for its liveness budget (rlfleet/wire/health.py): its
        weights, or for an adapter (merged into the base by the engine) the largest whole weights loaded here."""
        self.largest_weights = max(self.largest_weights, weight_bytes(path))
        return self.largest_weights

    @property
    def in_flight(self) -> int:
        """K: the most groups one batch takes (the pool's maxGroupsInFlight, else the engine's default)."""
        return self.max_in_flight or self.loaded.default_groups_in_flight

    def room(self) -> tuple[str | None, int]:
        """(why generation should wait now, or None; how many groups the next batch may take): backpressure.py."""
        return self.backpressure.room(self.loaded.version, self.in_flight)

    def paused(self) -> str | None:
        """Why generation should wait now, or None (`room`'s reason)."""
        return self.room()[0]

    def take_work(self, room: int) -> list[Work] | None:
        """Up to `room` pieces of work (task id, group seed, ticket), drawn past retired prompts (work.py)."""
        return self.draws.take_work(room, self.loaded.tokenizer)

    def make_groups(self, work: list[Work]) -> list[RolloutGroup]:
        """The groups of `work` (work.py's Work: task id, group seed, ticket) to send, sampled in ONE engine
        call, so every group records the one version that produced all of them; what the trainer would drop for
        its content is held back (repeats.py) before any proof is built."""
        s, toploc = self.spec.sampling, self.spec.verifier.toploc
        problems, kept = [], []
        for piece in work:
            try:
                problems.append(self.task.problem(piece.task_id))
                kept.append(piece)
            except EnvironmentFailure as exc:  # a user environment's fault: the group is skipped, the worker goes on
                log.warning("task %s: the environment failed to make the problem: %s", piece.task_id, exc)
        work = kept
        if not work:
            return []
        prompts = [encode_prompt(self.loaded.tokenizer, p) for p in problems]
        params = [SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=w.seed) for w in work]
        IN_FLIGHT.set(s.group_size * len(work))
        GROUPS_IN_FLIGHT.set(len(work))
        requests = [GroupRequest(p, q, s.group_size) for p, q in zip(prompts, params)]
        try:
            with self.liveness.working(), LAPS.part("generate"):
                generated = self.generate(requests, problems)
        finally:
            IN_FLIGHT.set(0)
            GROUPS_IN_FLIGHT.set(0)
        done = [k for k, gens in enumerate(generated) if gens is not None]  # a failed environment drops its group
        work, problems = [work[k] for k in done], [problems[k] for k in done]
        prompts, params = [prompts[k] for k in done], [params[k] for k in done]
        batch = [gens for gens in generated if gens is not None]
        if not batch:
            return []
        versions = {gen.version for gens in batch for gen in gens}
        if len(versions) != 1:  # the engine seam's invariant; a group claiming one version must hold only its tokens
            raise RuntimeError(f"one engine call produced versions {sorted(versions)}: the engine broke its contract")
        drafts: list[tuple[RolloutGroup, list]] = []  # each group (its proofs not built yet) and its generations
        for piece, problem, prompt_ids, q, gens in zip(work, problems, prompts, params, batch):
            group = self.draft(piece, problem, prompt_ids, q, gens)
            if group is not None:
                drafts.append((group, gens))
        # Groups the trainer would drop for their content are held back before their proofs are built: a group's
        # digest is its prompt, sampling and completions, never its proofs, and its rewards are computed above.
        fresh = {id(g) for g in worth_sending(self.reader, self.ctx, [g for g, _ in drafts], self.hold_flat)}
        drafts = [(g, gens) for g, gens in drafts if id(g) in fresh]
        proofs: list[list[bytes]] = []
        if drafts:
            with LAPS.part("proofs"):
                proofs = build_proofs_many(  # every sample to send in one vectorised pass
                    [gen.hidden for _, gens in drafts for gen in gens],
                    prompt_len=[len(g.prompt_ids) for g, gens in drafts for _ in gens],
                    decode_batching_size=toploc.decode_batching_size,
                    topk=toploc.topk,
                )
        at = 0
        for group, _ in drafts:
            for sample in group.samples:
                sample.proofs, at = proofs[at], at + 1
        return [g for g, _ in drafts]

    def draft(self, piece: Work, problem, prompt_ids: list[int], q: SamplingParams, gens: list[Generation]):
        """The group of `piece` from its generations, with the rewards its worker claims and no proofs yet; None when
        the environment fails to score it (the group is dropped, the worker goes on)."""
        tokenizer, stop_ids = self.loaded.tokenizer, self.loaded.stop_ids
        try:
            with LAPS.part("reward"):
                texts = [episode_text(self.task, problem, tokenizer, g.completion_ids, g.spans, stop_ids) for g in gens]
                drawn = [drawn_tokens(g.spans, len(g.completion_ids)) for g in gens]
                rewards = self.task.scores(problem, texts, drawn)
        except EnvironmentFailure as exc:
            log.warning("task %s: the environment failed to score the group, which is dropped: %s",
                        problem.task_id, exc)  # fmt: skip
            return None
        samples = []
        for gen, reward in zip(gens, rewards):
            samples.append(Sample(gen.completion_ids, gen.logprobs, [], reward, gen.finish_reason, gen.spans))
            TOKENS.inc(len(gen.completion_ids))
        return RolloutGroup(
            task_id=problem.task_id,
            worker_id=self.worker_id,
            policy_version=gens[0].version,  # the version that produced the tokens, not one swapped in since
            prompt_ids=prompt_ids,
            sampling=q,
            samples=samples,
            engine=self.loaded.name,
            ticket=piece.ticket,
            ticket_draw=piece.draw,
        )

    def generate(self, requests: list[GroupRequest], problems: list) -> list[list[Generation] | None]:
        """Each request's generations: one engine call, or of a task that takes turns, its episodes turn by turn
        (rlfleet/engines/episodes.py; None for a group whose environment failed a turn, which is dropped)."""
        s = self.spec.sampling
        if not (self.task.multi_turn and s.max_turns > 1):
            return list(self.loaded.generate_groups(requests))
        episodes, failures = generate_episodes(self.loaded, self.task, requests, problems, s)
        for k, exc in failures.items():
            log.warning("task %s: the environment failed to answer a turn; the group is dropped: %s",
                        problems[k].task_id, exc)  # fmt: skip
        return episodes

    def send(self, group: RolloutGroup) -> bool:
        """XADD `group` to the inbox or POST it to the ingest; False if stopped while the ingest held it back."""
        with LAPS.part("send"):
            return self._send(group)

    def _send(self, group: RolloutGroup) -> bool:
        if self.ingest:
            fields = group.encode()[MESSAGE_FIELD]
            on_wait = PAUSED.labels(components.INGEST).inc
            ingest, stop = self.ingest, self.ctx.stop
            if post_group(ingest.session, ingest.rollouts_url, ingest.token, fields, stop, on_wait=on_wait) is None:
                return False
        else:
            # Never trimmed (no MAXLEN): the inbox holds only unverified groups; maxPending bounds it.
            self.ctx.client.xadd(self.ctx.keys.rollouts, group.encode())  # type: ignore[arg-type]  # invariant Dict
        GROUPS.inc()
        return True

    def run(self) -> None:
        if not self.wait_first_version():
            return
        while not self.ctx.stop.is_set():
            self._raise_follower_error()
            self.maybe_swap()  # only here, between batches: a swap waits for the groups in flight
            reason, room = self.room()
            if reason:
                PAUSED.labels(reason).inc(0.02)
                time.sleep(0.02)
                continue
            work = self.take_work(room)
            if work is None:
                return  # stopped while the ingest held a ticket back
            sent = 0
            self.backpressure.begin_batch(len(work))
            try:
                for group in self.make_groups(work):
                    if not self.send(group):
                        return  # stopped while the ingest held it back
                    sent += 1
            finally:
                self.backpressure.end_batch(len(work), sent)


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
