"""The gate's checks on one rollout group, in order; the first failure is a `Rejection` whose
reason names the check (the reasons are spelled once, `RejectionReason` in rlfleet/config/verifier.py).

  1. envelope   size (message bytes, G samples, 1..maxTokens tokens), schema_version, malformed
                (undecodable, token ids outside the vocabulary), sampling_params (not the run's, or
                an engine `spec.verifier.engines` does not admit), unknown_version (never published),
                stale_version (older than maxAsyncLevel), banned (worker banned), replay (the same
                work, by content digest, already submitted in another entry; guards.py), assignment (a run
                that assigns work: the ticket was not issued to this worker, does not fix this task
                and seed, or was used), completion_end (tokens after a stop token, or no stop token
                short of the budget; ending.py);
  2. prompt     prompt_mismatch: the prompt rebuilt from the task id by the trusted task source
                differs token by token (or the task id is not the source's); then, of a multi-turn
                sample (rlfleet/tasks/turns.py), transcript: an environment span that is not exactly
                the environment's answer to the model turns before it, or an episode that does not
                end where the rules end it (the environment is asked again, on every group);
  3. TOPLOC     toploc: proofs of the wrong count or length (always checked), or a chunk whose
                recomputed top-k is too far from the proof (one prefill of prompt + completion with
                the claimed version);
  4. sampling   logprob_mismatch: a claimed token logprob differs from the recomputed one by more
                than the logprob tolerance; seed_replay: every group, whatever engine it claims (both
                draw by rlfleet/models/sampling.py), is re-drawn from its seeds and scored (replay.py):
                rejected when the share of tokens its seeds do not draw exceeds the calibrated share
                (0 on CPU); where that share is above 0 (GPU rows), impossible_token: a token that
                top-k / top-p would have excluded, beyond the tolerances;
  5. reward     recomputed by the trusted verifier on the tokens before the stop token; the claimed
                one is ignored but counted when wrong.
Of a multi-turn sample, checks 3 covers every transcript position (the environment's tokens' hidden states
included) and 4 the model's positions only: the environment's tokens were inserted, not drawn, and the
model's k-th token draws with its stream's k-th uniform.
Thresholds and tolerances follow the group's engine, the run's workerDevice and dtype unless the
run sets them (calibration.py); the claimed engine only picks tolerances, it never skips a check.
Checks 3 and 4 (the prefill) run on the spot-checked fraction of groups; 1, 2, 5
on every group. A spot-checked group leaves with the recomputed logprobs (`Outcome.logprobs`), which
the trainer then trains on instead of the worker's. Out-of-band verification (`msg_id=None`) skips
only the one-time guards (replay, ticket) and writes nothing.

Devices: the prefill runs where the verifier's model is (its process's device, rlfleet/models/device.py:
a GPU when the verifier has one, in spec.model.dtype) and checks 3 and 4 compute there too: the claimed
logprobs, the tokens and the seeds' uniforms are moved to the model's device, and only the verdict's
numbers (counts, maxima, the top-k of each proof chunk, the recomputed logprobs as lists) come back to
the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import get_args

import redis
import torch

from rlfleet.config import RejectionReason, RLRunSpec, worker_dtype
from rlfleet.fleet.assignment import assigned_work, ticket_problem
from rlfleet.fleet.prompt_filter import RetiredPrompts, prompt_key
from rlfleet.fleet.window import AsyncWindow
from rlfleet.models.policy import Scored, score
from rlfleet.models.sampling import completion_budget, context_length, stop_token_ids
from rlfleet.proofs.toploc import ProofFormatError, chunk_rows, verify_proofs_many
from rlfleet.services.toploc.calibration import Calibration, calibration
from rlfleet.services.toploc.ending import ending_problem
from rlfleet.services.toploc.guards import ticket_replay, work_replay
from rlfleet.services.toploc.metrics import LAPS
from rlfleet.services.toploc.replay import GroupReplay, ReplayScore, logits_chunk_rows, possible_tokens
from rlfleet.tasks import Problem, make_run_task
from rlfleet.tasks.chat import encode_prompt
from rlfleet.tasks.python_env import EnvironmentFailure
from rlfleet.tasks.turns import TurnLimits, check_transcript, drawn_tokens, episode_text, model_positions
from rlfleet.wire.runtime import announced_version, latest_announced_version
from rlfleet.wire.streams import (
    ID_MAX_CHARS,
    MESSAGE_FIELD,
    SCHEMA_VERSION,
    MessageError,
    RolloutGroup,
    RunKeys,
    text_field,
)

REASONS: tuple[str, ...] = get_args(RejectionReason)


class Rejection(Exception):
    def __init__(self, reason: str, detail: str, worker_id: str | None = None):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.worker_id = reason, detail, worker_id


@dataclass
class Outcome:
    rewards: list[float]  # (G,) trusted rewards
    reward_mismatches: int  # samples whose claimed reward differed
    prefill_checked: bool  # checks 3 and 4 ran (spot-checking)
    tokens: int  # completion tokens in the group
    logprobs: list[list[float]] | None = None  # (G, T_i) recomputed token logprobs, when the prefill ran
    replay: ReplayScore | None = None  # the seed replay's score, when the prefill ran


@LAPS.part("decode")
def decode_group(fields: dict, max_bytes: int) -> RolloutGroup:
    """Decode an inbox entry or raise Rejection (size, schema_version or malformed)."""
    size = sum(len(k) + len(v) for k, v in fields.items())
    if size > max_bytes:
        raise Rejection("size", f"message is {size} bytes, more than maxMessageBytes {max_bytes}")
    try:
        return RolloutGroup.decode(fields)
    except MessageError as exc:
        body = _peek(fields)
        try:
            worker = text_field(body, "worker_id", ID_MAX_CHARS)  # counted against it when it is a valid id
        except (KeyError, MessageError):
            worker = None
        if body and body.get("schema") != SCHEMA_VERSION:
            raise Rejection("schema_version", str(exc), worker) from None
        raise Rejection("malformed", str(exc), worker) from None


def _peek(fields: dict) -> dict:
    """The JSON body of an undecodable entry when it is at least a JSON object, else {}."""
    raw = fields.get(MESSAGE_FIELD) or fields.get(MESSAGE_FIELD.decode())
    try:
        body = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}


class Checker:
    """Runs the checks against one run's spec; `policy(version)` returns (model, tokenizer). `describe(version)`,
    when given, returns a (model, tokenizer) with that version's config and tokenizer for the checks that read
    no weight (a deferred check: the prefill comes later, batch.py); without it they use `policy`."""

    def __init__(
        self,
        spec: RLRunSpec,
        client: redis.Redis,
        keys: RunKeys,
        policy: Callable[[int], tuple],
        describe: Callable[[int], tuple] | None = None,
    ):
        self.spec, self.redis, self.keys, self.policy = spec, client, keys, policy
        self.describe = describe or policy
        self.task = make_run_task(spec)
        self.window = AsyncWindow.of(spec)
        online_filter = spec.sampling.online_filter
        # A ticket's draws past the first are the online filter's redraws (rlfleet/fleet/assignment.py).
        self.ticket_draws = online_filter.max_redraws if online_filter else 1
        self.retired = RetiredPrompts(client, keys) if online_filter else None

    def calibration(self, group: RolloutGroup) -> Calibration:
        """Thresholds for `group`: its engine's (admitted by envelope) at the run's declared worker dtype, unless the
        run sets them."""
        return calibration(self.spec.verifier, group.engine, worker_dtype(self.spec))

    def running_share_limit(self, group: RolloutGroup) -> float:
        """The running replay mismatch share past which `group`'s worker is banned (0 = never)."""
        return self.calibration(group).max_running_share

    @LAPS.part("checks")  # the policy's fetch and load, and a prefill, inside it are counted as their own parts
    def check(self, group: RolloutGroup, msg_id: bytes | None, prefill: bool = True, deferred: bool = False) -> Outcome:
        """Every check in order; the trusted outcome, or Rejection. `msg_id=None`: out of band. `deferred`: the
        caller runs the prefill checks of a `prefill` group itself (batch.py), the others run here."""
        try:
            newest = self.envelope(group, msg_id)
            self.once(group, msg_id, prefill, newest)
            try:
                problem = self.task.problem(group.task_id)
            except KeyError as exc:
                raise Rejection("prompt_mismatch", str(exc)) from None
            except EnvironmentFailure as exc:
                raise Rejection("environment", f"task {group.task_id}: {exc}") from None
            needs_weights = prefill and not deferred
            model, tokenizer = (self.policy if needs_weights else self.describe)(group.policy_version)
            if encode_prompt(tokenizer, problem) != group.prompt_ids:  # chat template included (tasks/chat.py)
                raise Rejection("prompt_mismatch", f"prompt tokens differ from those of task {group.task_id}")
            if group.ticket_draw and self.spec.sampling.assignment == "run":
                self.earlier_draws_retired(group, tokenizer)
            vocab = model.config.vocab_size
            if any(not 0 <= t < vocab for s in group.samples for t in s.completion_ids):
                raise Rejection("malformed", f"a completion token id is outside the vocabulary [0, {vocab})")
            stop_ids = stop_token_ids(model, tokenizer)
            sp = self.spec.sampling
            problem_end = ending_problem(group, stop_ids, context_length(model), sp.max_turns, sp.max_tokens_per_turn)
            if problem_end:
                raise Rejection("completion_end", problem_end)
            self.proof_shapes(group, model.config.hidden_size)
            self.transcripts(group, problem, tokenizer, stop_ids, context_length(model))
            logprobs, replay = None, None
            if prefill and not deferred:
                logprobs, replay = self.prefill_checks(group, model, tokenizer)
            try:
                texts = [episode_text(self.task, problem, tokenizer, s.completion_ids, s.spans, stop_ids)
                         for s in group.samples]  # fmt: skip
                rewards = self.task.scores(problem, texts, [drawn_tokens(s.spans, len(s.completion_ids))
                                                            for s in group.samples])  # fmt: skip
            except EnvironmentFailure as exc:
                raise Rejection("environment", f"task {group.task_id}: {exc}") from None
            mismatches = sum(r != s.reward for r, s in zip(rewards, group.samples))
        except Rejection as exc:
            exc.worker_id = group.worker_id
            raise
        tokens = sum(len(s.completion_ids) for s in group.samples)
        return Outcome(rewards, mismatches, prefill and not deferred, tokens, logprobs, replay)

    def envelope(self, group: RolloutGroup, msg_id: bytes | None) -> int:
        """The checks of what the group claims (size, sampling, engine, version, worker, ticket); the newest
        announced version, read with the worker's ban in one round trip."""
        s = self.spec.sampling
        if len(group.samples) != s.group_size:
            raise Rejection("size", f"{len(group.samples)} samples, the run uses groupSize {s.group_size}")
        if not group.prompt_ids:
            raise Rejection("size", "empty prompt")
        for i, sample in enumerate(group.samples):
            if not 1 <= len(sample.completion_ids) <= s.max_tokens:
                raise Rejection(
                    "size", f"samples[{i}] has {len(sample.completion_ids)} tokens (1..{s.max_tokens} allowed)"
                )
        claimed = group.sampling
        if (claimed.temperature, claimed.top_p, claimed.top_k, claimed.max_tokens) != (
            s.temperature,
            s.top_p,
            s.top_k,
            s.max_tokens,
        ):
            raise Rejection("sampling_params", f"{claimed} differs from the run's sampling spec")
        if group.engine not in self.spec.verifier.engines:
            raise Rejection(
                "sampling_params",
                f"engine {group.engine!r} is not admitted by spec.verifier.engines {self.spec.verifier.engines} "
                f"(add it there if a pool of this run uses it)",
            )
        with self.redis.pipeline(transaction=False) as pipe:  # one round trip for both
            pipe.xrevrange(self.keys.policy, count=1)
            pipe.hexists(self.keys.banned, group.worker_id)
            announced, banned = pipe.execute()
        newest = announced_version(announced)
        if newest is None or not 0 <= group.policy_version <= newest:
            raise Rejection("unknown_version", f"version {group.policy_version} was never published (newest {newest})")
        if self.window.is_stale(group.policy_version, newest):
            raise Rejection(
                "stale_version", f"version {group.policy_version} is {newest - group.policy_version} behind {newest}"
            )
        if banned:  # reputation.is_banned, read with the newest version
            raise Rejection("banned", f"worker {group.worker_id!r} is banned")
        if self.spec.sampling.assignment == "run":
            problem = ticket_problem(self.redis, self.keys, self.task, self.spec.task.seed, group, self.ticket_draws)
            if problem:
                raise Rejection("assignment", problem)
        return newest

    def earlier_draws_retired(self, group: RolloutGroup, tokenizer) -> None:
        """A group of draw d > 0 of its ticket (envelope checked that its task and seed are that draw's): the prompt
        of every draw before d must be retired, as the worker takes the first draw whose prompt is not
        (rlfleet/fleet/assignment.py). The retired list only grows, so what the worker saw retired still is."""
        assert self.retired is not None and group.ticket is not None  # draws past 0 exist only with the filter
        self.retired.refresh()
        for draw in range(group.ticket_draw):
            task_id, _ = assigned_work(self.task, self.spec.task.seed, group.worker_id, group.ticket, draw)
            try:
                key = prompt_key(encode_prompt(tokenizer, self.task.problem(task_id)))
            except EnvironmentFailure:
                key = ""  # the worker takes a draw whose problem fails to be made (and then drops it)
            if key not in self.retired:
                raise Rejection(
                    "assignment",
                    f"draw {group.ticket_draw} of ticket {group.ticket}: the prompt of its draw {draw} (task "
                    f"{task_id}) is not retired, so that draw was the ticket's work",
                )

    def once(self, group: RolloutGroup, msg_id: bytes | None, prefill: bool, newest: int | None = None) -> None:
        """The one-time guards (guards.py): the same work, the same ticket, accepted once. `newest`: the newest
        announced version as `envelope` read it (read here when not given)."""
        if msg_id is None:
            return
        if newest is None:
            newest = latest_announced_version(self.redis, self.keys)
        oldest = self.window.oldest(newest or 0)
        problem = work_replay(self.redis, self.keys, group, msg_id, prefill, oldest)  # every engine is replayed
        if problem is None and self.spec.sampling.assignment == "run":
            problem = ticket_replay(self.redis, self.keys, group, msg_id)
        if problem:
            raise Rejection("replay", problem)

    def transcripts(self, group: RolloutGroup, problem: Problem, tokenizer, stop_ids: frozenset[int], context: int):
        """Of a task that takes turns, or a group that claims them: each sample's environment turns are exactly the
        environment's answers to its model turns, and each episode ends where the rules end it (tasks/turns.py)."""
        if not self.task.multi_turn and all(s.spans is None for s in group.samples):
            return
        budget = completion_budget(group.sampling.max_tokens, len(group.prompt_ids), context)
        limits = TurnLimits.of(self.spec.sampling, budget)
        for i, sample in enumerate(group.samples):
            try:
                problem_turns = check_transcript(self.task, problem, tokenizer, sample, stop_ids, limits)
            except EnvironmentFailure as exc:
                raise Rejection("environment", f"task {group.task_id}: {exc}") from None
            if problem_turns:
                raise Rejection("transcript", f"samples[{i}]: {problem_turns}")

    def proof_shapes(self, group: RolloutGroup, hidden_size: int) -> None:
        """Proof count and lengths; cheap, so checked on every group (a lazy worker cannot skip proofs)."""
        t, prompt_len = self.spec.verifier.toploc, len(group.prompt_ids)
        for i, sample in enumerate(group.samples):
            ranges = chunk_rows(prompt_len + len(sample.completion_ids), prompt_len, t.decode_batching_size)
            if len(sample.proofs) != len(ranges):
                raise Rejection("toploc", f"samples[{i}]: {len(sample.proofs)} proofs for {len(ranges)} chunks")
            for c, ((start, end), proof) in enumerate(zip(ranges, sample.proofs)):
                want = 2 + 2 * min(t.topk, (end - start) * hidden_size)
                if len(proof) != want:
                    raise Rejection("toploc", f"samples[{i}] proof {c} is {len(proof)} bytes, expected {want}")

    @LAPS.part("checks")
    def prefill_checks(
        self, group: RolloutGroup, model, tokenizer, scored: Scored | None = None
    ) -> tuple[list[list[float]], ReplayScore]:
        """Checks 3 (TOPLOC) then 4 (logprobs, then seed replay and possible tokens), from one batched
        prefill (`scored`: this group's rows already prefilled with the group's version, e.g. by batch.py
        with other groups); the recomputed token logprobs (G, T_i) and the replay's score."""
        t, sp, cal = self.spec.verifier.toploc, group.sampling, self.calibration(group)
        prompt_len = len(group.prompt_ids)
        if scored is None:
            rows = [group.prompt_ids + s.completion_ids for s in group.samples]
            with torch.inference_mode(), LAPS.part("prefill"):
                scored = score(
                    model,
                    rows,
                    sp.temperature,
                    tokenizer.pad_token_id,
                    want_hidden=True,
                    chunk=logits_chunk_rows(model.lm_head.out_features),
                )
        try:  # every sample's chunks in one vectorised pass; an error names its sample
            per_sample = verify_proofs_many(
                scored.hidden,
                [s.proofs for s in group.samples],
                prompt_len=prompt_len,
                decode_batching_size=t.decode_batching_size,
                topk=t.topk,
            )
        except ProofFormatError as exc:
            raise Rejection("toploc", f"malformed proof: {exc}") from None
        for i, results in enumerate(per_sample):
            bad = [(c, r) for c, r in enumerate(results) if not cal.toploc.accepts(r)]
            if bad:
                raise Rejection("toploc", f"samples[{i}] chunk {bad[0][0]}: {bad[0][1]}")
        recomputed = [scored.logprobs[i][prompt_len - 1 :] for i in range(len(group.samples))]  # (T_i,) each
        # the rows the model sampled: every completion row, a multi-turn transcript's model spans (tasks/turns.py)
        drawn = [
            None if s.spans is None else torch.tensor(model_positions(s.spans, len(s.completion_ids)), device=r.device)
            for s, r in zip(group.samples, recomputed)
        ]
        for i, sample in enumerate(group.samples):
            claimed = torch.tensor(sample.logprobs, dtype=recomputed[i].dtype, device=recomputed[i].device)
            differences = (recomputed[i] - claimed).abs()
            err = (differences if drawn[i] is None else differences[drawn[i]]).max().item()
            if not err <= cal.logprob_tolerance:  # NaN claims fail too
                raise Rejection(
                    "logprob_mismatch",
                    f"samples[{i}]: max |claimed - recomputed| = {err:.3g} > {cal.logprob_tolerance}",
                )
        with torch.inference_mode():  # the lm_head a chunk of every sample's completion rows at a time
            hidden_rows = [scored.hidden[i][prompt_len - 1 : -1] for i in range(len(group.samples))]
            completion_rows = torch.cat([r if d is None else r[d] for r, d in zip(hidden_rows, drawn)])
            step = logits_chunk_rows(model.lm_head.out_features)
            chunks = (
                (start, model.lm_head(completion_rows[start : start + step]).float() / sp.temperature)
                for start in range(0, len(completion_rows), step)
            )
            replay = self.sampling_checks(group, chunks, cal)
        return [r.tolist() for r in recomputed], replay

    def sampling_checks(
        self, group: RolloutGroup, chunks: Iterable[tuple[int, torch.Tensor]], cal: Calibration
    ) -> ReplayScore:
        """Check 4 after the logprobs, on every group whatever its engine: the seed replay and its score
        (replay.py); where the calibration tolerates some mismatches, also the possible-token check, so
        a tolerated mismatch is at least a token top-k / top-p could have left. `chunks`: (start, logits) of the
        completion rows laid end to end, divided by the temperature (replay.py `completion_chunks`); both checks
        read each chunk once, and no more than a chunk of logits is held."""
        sp = group.sampling
        replay = GroupReplay(group, cal.replay_tolerance)
        # an exact replay proves every token drawable; so does sampling from the whole vocabulary
        possible = cal.max_mismatch_share > 0 and (sp.top_p < 1.0 or sp.top_k > 0)
        impossible: int | None = None  # the first row whose token top-k / top-p could not have left
        for start, logits in chunks:
            replay.add(start, logits)
            if possible and impossible is None:
                tokens = replay.tokens[start : start + len(logits)]
                ok = possible_tokens(
                    torch.log_softmax(logits, -1),
                    tokens,
                    sp.top_p,
                    sp.top_k,
                    cal.logprob_tolerance,
                    cal.top_p_tolerance,
                )
                if not bool(ok.all()):
                    impossible = start + int((~ok).nonzero()[0])
        score = replay.score()
        if score.rejected(cal.max_mismatch_share):
            i, pos = score.first or (0, 0)
            raise Rejection(
                "seed_replay",
                f"{score.mismatches}/{score.positions} tokens are not the ones their seeds draw (share "
                f"{score.share:.3g} > {cal.max_mismatch_share}); first: samples[{i}] token {pos} "
                f"({group.samples[i].completion_ids[pos]})",
            )
        if impossible is not None:
            i, pos = replay.where(impossible)
            raise Rejection(
                "impossible_token",
                f"samples[{i}] token {pos} ({group.samples[i].completion_ids[pos]}) is outside top-k {sp.top_k} / "
                f"top-p {sp.top_p}",
            )
        return score
