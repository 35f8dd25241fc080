"""`rlfleet verifier`: the gate between untrusted workers and the trainer.

Each inbox group goes through these checks in order; the first failure rejects the whole group
with that reason (the `REASONS` below):
  1. envelope: decodable, current schema, G samples, the run's sampling parameters, a completion
     no longer than maxTokens, token ids inside the vocabulary, a policy version that was published
     and is inside the staleness window, a rollout id never seen before (replay);
  2. prompt: rebuilt from the task id by the trusted task source, compared token by token;
  3. TOPLOC: one prefill of prompt + completion with the claimed version, every proof chunk checked
     against the configured thresholds;
  4. logprobs: the claimed token logprobs match the recomputed ones within `logprobTolerance`;
  5. reward: recomputed by the trusted task verifier; the claimed one is only compared and counted.
Accepted groups go to `verified` with the trusted rewards, rejected ones to `rejected` with the
reason; forwarding, the ack and the deletion from the inbox happen in one MULTI transaction, so
a crash never forwards a group twice. Pending messages of a dead replica are claimed with
XAUTOCLAIM after `CLAIM_IDLE_MS`.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch
from prometheus_client import Counter

from rlfleet.policy import load_policy, score
from rlfleet.runtime import Context, component_context, configure_torch_threads, ensure_group, latest_announced_version
from rlfleet.services.shardcast.client import fetch_version
from rlfleet.services.toploc.proof import ProofFormatError, Thresholds, verify_proofs
from rlfleet.streams import MessageError, RolloutGroup, encode_json
from rlfleet.tasks.base import make_task

log = logging.getLogger("rlfleet.verifier")

REASONS = ("malformed", "sampling_params", "unknown_version", "stale_version", "replay", "prompt_mismatch",
           "toploc", "logprob_mismatch")
CLAIM_IDLE_MS = 30_000
SEEN_TTL_S = 7 * 24 * 3600

VERDICTS = Counter("rlfleet_verifier_groups_total", "Groups verified", ["verdict", "reason"])
REWARD_MISMATCH = Counter("rlfleet_verifier_reward_mismatch_total", "Samples whose claimed reward differed from the trusted one")


class Rejection(Exception):
    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class Gate:
    def __init__(self, ctx: Context, consumer: str, origin_url: str, cache_dir: Path):
        self.ctx, self.consumer, self.origin_url, self.cache_dir = ctx, consumer, origin_url, cache_dir
        self.spec = ctx.bundle.run.spec
        self.task = make_task(self.spec.task)
        t = self.spec.verifier.toploc
        self.thresholds = Thresholds(t.max_exp_mismatches, t.max_mant_err_mean, t.max_mant_err_median)
        self.models: OrderedDict[int, tuple] = OrderedDict()
        ensure_group(ctx.redis, ctx.keys.rollouts, ctx.keys.verifier_group)

    def policy(self, version: int):
        """(model, tokenizer) of `version`, fetched from the trusted origin; the last few are kept."""
        if version not in self.models:
            path = fetch_version([self.origin_url], self.ctx.run_name, version, self.cache_dir, timeout=120, stop=self.ctx.stop)
            self.models[version] = load_policy(path, self.spec.model.dtype)
            while len(self.models) > self.spec.trainer.max_async_level + 2:
                self.models.popitem(last=False)
        self.models.move_to_end(version)
        return self.models[version]

    def check_envelope(self, group: RolloutGroup, msg_id: bytes) -> None:
        s = self.spec.sampling
        if len(group.samples) != s.group_size:
            raise Rejection("malformed", f"{len(group.samples)} samples, the run uses groupSize {s.group_size}")
        claimed = group.sampling
        if (claimed.temperature, claimed.top_p, claimed.top_k, claimed.max_tokens) != (s.temperature, s.top_p, s.top_k, s.max_tokens):
            raise Rejection("sampling_params", f"{claimed} differs from the run's sampling spec")
        for i, sample in enumerate(group.samples):
            if not 1 <= len(sample.completion_ids) <= s.max_tokens:
                raise Rejection("malformed", f"samples[{i}] has {len(sample.completion_ids)} tokens (1..{s.max_tokens} allowed)")
        newest = latest_announced_version(self.ctx.redis, self.ctx.keys)
        if newest is None or not 0 <= group.policy_version <= newest:
            raise Rejection("unknown_version", f"version {group.policy_version} was never published (newest {newest})")
        if newest - group.policy_version > self.spec.trainer.max_async_level:
            raise Rejection("stale_version", f"version {group.policy_version} is {newest - group.policy_version} behind {newest}")
        # The guard stores the inbox entry id, so a redelivery of the same entry is not a replay.
        key = self.ctx.keys.seen(group.rollout_id)
        if not self.ctx.redis.set(key, msg_id, nx=True, ex=SEEN_TTL_S) and self.ctx.redis.get(key) != msg_id:
            raise Rejection("replay", f"rollout id {group.rollout_id} was already submitted")

    def check(self, group: RolloutGroup, msg_id: bytes) -> list[float]:
        """Run every check; return the trusted rewards or raise Rejection."""
        self.check_envelope(group, msg_id)
        try:
            problem = self.task.problem(group.task_id)
        except KeyError as exc:
            raise Rejection("prompt_mismatch", str(exc)) from None
        model, tokenizer = self.policy(group.policy_version)
        if tokenizer(problem.prompt)["input_ids"] != group.prompt_ids:
            raise Rejection("prompt_mismatch", f"prompt tokens differ from task {group.task_id}")
        vocab = model.config.vocab_size
        if any(not 0 <= t < vocab for s in group.samples for t in s.completion_ids):
            raise Rejection("malformed", "token id outside the vocabulary")
        rows = [group.prompt_ids + s.completion_ids for s in group.samples]
        with torch.inference_mode():
            scored = score(model, rows, group.sampling.temperature, tokenizer.pad_token_id, want_hidden=True)
        toploc, prompt_len = self.spec.verifier.toploc, len(group.prompt_ids)
        for i, sample in enumerate(group.samples):
            try:
                results = verify_proofs(scored.hidden[i], sample.proofs, prompt_len=prompt_len,
                                        decode_batching_size=toploc.decode_batching_size, topk=toploc.topk)
            except ProofFormatError as exc:
                raise Rejection("toploc", f"samples[{i}]: malformed proof: {exc}") from None
            bad = [(c, r) for c, r in enumerate(results) if not self.thresholds.accepts(r)]
            if bad:
                c, r = bad[0]
                raise Rejection("toploc", f"samples[{i}] chunk {c}: {r}")
            recomputed = scored.logprobs[i][prompt_len - 1:]
            err = (recomputed - torch.tensor(sample.logprobs)).abs().max().item()
            if err > self.spec.verifier.logprob_tolerance:
                raise Rejection("logprob_mismatch", f"samples[{i}]: max |claimed - recomputed| = {err:.4f}")
        rewards = []
        for sample in group.samples:
            text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
            rewards.append(self.task.reward(problem, text))
            if rewards[-1] != sample.reward:
                REWARD_MISMATCH.inc()
        return rewards

    def handle(self, msg_id: bytes, fields: dict) -> None:
        keys, maxlen = self.ctx.keys, self.spec.redis.stream_max_len
        group = None
        try:
            group = RolloutGroup.decode(fields)
            rewards = self.check(group, msg_id)
        except (Rejection, MessageError) as exc:
            reason = exc.reason if isinstance(exc, Rejection) else "malformed"
            detail = exc.detail if isinstance(exc, Rejection) else str(exc)
            worker = group.worker_id if group else "unknown"
            log.warning("rejected %s from %s: %s: %s", msg_id.decode(), worker, reason, detail)
            record = {"reason": reason, "detail": detail, "worker_id": worker, "inbox_id": msg_id.decode(),
                      "rollout_id": group.rollout_id if group else None}
            out = {**encode_json(record), b"original": next(iter(fields.values()), b"")}
            stream, verdict = keys.rejected, "rejected"
        else:
            for sample, reward in zip(group.samples, rewards):
                sample.reward = reward
            out, stream, verdict, reason, worker = group.encode(), keys.verified, "accepted", "", group.worker_id
        with self.ctx.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(stream, out, maxlen=maxlen, approximate=True)
            pipe.hincrby(keys.stats, verdict, 1)
            if reason:
                pipe.hincrby(keys.stats, f"rejected:{reason}", 1)
            pipe.hincrby(keys.workers, f"{worker}:{verdict}", 1)
            pipe.xack(keys.rollouts, keys.verifier_group, msg_id)
            pipe.xdel(keys.rollouts, msg_id)
            pipe.execute()
        VERDICTS.labels(verdict, reason).inc()

    def run(self) -> None:
        keys, r = self.ctx.keys, self.ctx.redis
        next_claim = 0.0
        while not self.ctx.stop.is_set():
            entries = []
            if time.monotonic() >= next_claim:
                # Redis 6.2 answers [cursor, entries], 7.x adds the deleted ids.
                entries = r.xautoclaim(keys.rollouts, keys.verifier_group, self.consumer, CLAIM_IDLE_MS, count=16)[1]
                next_claim = time.monotonic() + CLAIM_IDLE_MS / 3000
            if not entries:
                resp = r.xreadgroup(keys.verifier_group, self.consumer, {keys.rollouts: ">"}, count=4, block=500)
                entries = [e for _, batch in resp or [] for e in batch]
            for msg_id, fields in entries:
                if fields:  # a claimed entry trimmed meanwhile has no fields
                    self.handle(msg_id, fields)


def main(args) -> int:
    ctx = component_context(args, "verifier")
    configure_torch_threads()
    Gate(ctx, args.consumer, args.origin_url, Path(args.cache_dir)).run()
    return 0
