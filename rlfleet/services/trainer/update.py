"""One GRPO update, single-process or data-parallel over `torch.distributed`.

Every rank holds the whole batch (rank 0 reads it from the stream and broadcasts it); rank r computes the
loss of completions r, r + W, r + 2W, ... (of those computed) divided by the whole batch's token (or
completion) count, gradients are summed with all-reduce, then clipped and applied identically on every rank,
so all ranks keep the same weights and the update equals the single-process one up to float summation order.
With `trainer.sharding: fsdp` the model is sharded (sharding.py): the same split and the same sum, done by
FSDP's reduce-scatter in the backward instead of the all-reduce here. The batch statistics (loss, ratio,
clip fraction, entropy, KL) are the whole batch's on every rank; the per-token ones over the rows computed.
Rows of zero advantage are not computed when the loss has no entropy or KL term (`rows_with_gradient`): they
add nothing to it or its gradient, and late in a run most groups of solved prompts are all correct.

Bounded memory per step: each rank sorts its rows by length and packs them into micro-batches of at most
`trainer.microBatchTokens` padded tokens (`micro_batches`); every micro-batch is one forward and backward,
gradients accumulate, and one optimizer step follows. Each micro-batch's loss is divided by the whole
batch's count (tokens or completions, over all ranks), so the accumulated gradient is exactly the one-batch
gradient (loss.py). Token logprobs are taken `trainer.logprobChunk` positions at a time
(rlfleet/models/logprobs.py), so no tensor of a micro-batch's positions by the vocabulary exists. Under FSDP
every rank runs as many passes as the rank with the most micro-batches (all ranks hold the batch, so each
computes every plan), the extra ones on a zero-weight placeholder. Before the first update, without
gradients and in the same micro-batches: the frozen reference's logprobs (klCoef > 0) and, with
`trainer.offPolicy` tis/mis, the trainer's own logprobs, from which loss.py's importance weights come.
`compute_dtype` autocasts the forwards (fp32 master weights computing in bf16, precision.py).

The ranks and their process group are distributed.py's; the learning-rate schedule is schedule.py's.

The update in order (`grpo_update`): the batch's rows (`BatchRows`), this rank's micro-batches (`Plan`),
the scores taken before any update (`score_before_update`), then `trainer.epochs` optimizer updates
(`one_pass`), each a forward and backward per micro-batch, the gradient all-reduce and the AdamW step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.config import TrainerSpec
from rlfleet.models.policy import score
from rlfleet.services.trainer.distributed import SINGLE, Ranks
from rlfleet.services.trainer.loss import LossInput, LossSettings, group_advantages, grpo_loss, off_policy_weights
from rlfleet.services.trainer.sharding import is_sharded
from rlfleet.tasks.turns import model_token_mask
from rlfleet.wire.streams import RolloutGroup
from rlfleet.wire.timing import Laps, timed


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """What an update needs besides the model and the batch, made once per trainer (`of`): the run's
    TrainerSpec, the loss's constants taken from it, the sampling temperature the logprobs are scored
    at, the tokenizer's pad id, and the dtype the forwards autocast to (None: the parameters' own)."""

    trainer: TrainerSpec
    loss: LossSettings
    temperature: float
    pad_id: int
    compute_dtype: torch.dtype | None = None

    @classmethod
    def of(
        cls, t: TrainerSpec, temperature: float, pad_id: int, compute_dtype: torch.dtype | None = None
    ) -> UpdateSettings:
        """The settings of TrainerSpec `t` for scoring at `temperature` with padding `pad_id`."""
        return cls(
            trainer=t, loss=LossSettings.of(t), temperature=temperature, pad_id=pad_id, compute_dtype=compute_dtype
        )


@dataclass(frozen=True)
class BatchRows:
    """The batch as rows, one per completion, in group order: `rows[i]` is the prompt and completion token ids,
    `sampled[i]` the engine's logprob of each completion token, `advantages[i]` its group-normalized advantage
    (a 0-d tensor, loss.py group_advantages), `starts[i]` the index of its first completion token in the
    (L - 1,) logprob row, `rewards[i]` its reward, `drawn[i]` of a multi-turn transcript 1.0 at the tokens the model
    sampled and 0.0 at the environment's (rlfleet/tasks/turns.py; None: every completion token is the model's). The
    environment's tokens are in the rows, so the model's later turns are scored with them in context, but out of
    the loss, its ratios and its token counts."""

    rows: list[list[int]]
    sampled: list[list[float]]
    advantages: list[torch.Tensor]
    starts: list[int]
    rewards: list[float]
    drawn: list[list[float] | None]
    turns: list[int]  # model turns of each row (1 but for a multi-turn transcript)

    @classmethod
    def of(cls, groups: list[RolloutGroup]) -> BatchRows:
        rows: list[list[int]] = []
        sampled: list[list[float]] = []
        advantages: list[torch.Tensor] = []
        starts: list[int] = []
        rewards: list[float] = []
        drawn: list[list[float] | None] = []
        turns: list[int] = []
        for g in groups:
            group_rewards = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
            rewards.extend(group_rewards.tolist())
            for s, a in zip(g.samples, group_advantages(group_rewards)):
                rows.append(g.prompt_ids + s.completion_ids)
                sampled.append(s.logprobs)
                advantages.append(a)
                starts.append(len(g.prompt_ids) - 1)
                drawn.append(None if s.spans is None else model_token_mask(s.spans))
                turns.append(1 if s.spans is None else (len(s.spans) + 1) // 2)
        return cls(rows, sampled, advantages, starts, rewards, drawn, turns)

    @property
    def completion_tokens(self) -> int:
        """The tokens the model sampled (a multi-turn transcript's environment tokens do not count)."""
        return sum(len(o) if d is None else int(sum(d)) for o, d in zip(self.sampled, self.drawn))

    def denominator(self, normalization: str) -> float:
        """What every micro-batch's loss is divided by (loss.py): the batch's completion tokens, or completions."""
        return float(self.completion_tokens) if normalization == "token" else float(len(self.rows))


def _aligned(like: torch.Tensor, per_row: list[torch.Tensor], starts: list[int], lengths: list[int]) -> torch.Tensor:
    """A tensor shaped as `like` (B, T) holding each row's completion-token values from per-row (L_i - 1,)
    tensors (row i's `lengths[i]` values from `starts[i]`), zeros elsewhere."""
    out = torch.zeros_like(like)
    for i, (values, start, n) in enumerate(zip(per_row, starts, lengths)):
        out[i, start : start + n] = values[start : start + n]
    return out


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward/backward and what the loss needs of them, aligned (B, T) on completion tokens."""

    rows: list[list[int]]
    starts: list[int]  # index of each row's first completion token in its (L - 1,) logprob row
    lengths: list[int]  # completion tokens of each row
    mask: torch.Tensor  # 1 on the completion tokens the model sampled (a transcript's environment tokens: 0)
    sampled: torch.Tensor  # the engine's claimed logprobs
    advantages: torch.Tensor  # (B,), or (B, T) once importance-weighted
    old: torch.Tensor | None = None  # the trainer's own logprobs before the update (offPolicy tis/mis)
    ref: torch.Tensor | None = None  # the frozen reference's logprobs (klCoef > 0)
    drawn_tokens: int | None = None  # of rows with multi-turn transcripts, the tokens the model sampled

    @classmethod
    def of(cls, batch: BatchRows, idx: list[int], device: torch.device) -> MicroBatch:
        """The micro-batch of `batch`'s rows `idx`, its tensors on `device`."""
        rows = [batch.rows[i] for i in idx]
        starts = [batch.starts[i] for i in idx]
        lengths = [len(batch.sampled[i]) for i in idx]
        blank = torch.zeros(len(idx), max(len(r) for r in rows) - 1, device=device)
        ones = [
            torch.ones(len(r) - 1) if batch.drawn[i] is None else torch.tensor([0.0] * s + batch.drawn[i])  # type: ignore[operator]
            for r, s, i in zip(rows, starts, idx)
        ]
        mask = _aligned(blank, ones, starts, lengths)
        sampled = _aligned(
            mask, [torch.tensor([0.0] * s + batch.sampled[i]) for s, i in zip(starts, idx)], starts, lengths
        )
        advantages = torch.stack([batch.advantages[i] for i in idx]).to(device)
        drawn = [batch.drawn[i] for i in idx]
        drawn_tokens = (
            int(sum(n if d is None else sum(d) for n, d in zip(lengths, drawn)))
            if any(d is not None for d in drawn)
            else None
        )
        return cls(rows, starts, lengths, mask, sampled, advantages, drawn_tokens=drawn_tokens)

    @property
    def tokens(self) -> int:
        """Completion tokens the model sampled (those of the loss)."""
        return self.drawn_tokens if self.drawn_tokens is not None else sum(self.lengths)

    def align(self, per_row: list[torch.Tensor]) -> torch.Tensor:
        """(B, T) of each row's completion-token values, from per-row (L_i - 1,) tensors."""
        return _aligned(self.mask, per_row, self.starts, self.lengths)


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` packed into micro-batches of at most `budget` padded tokens (rows x longest
    row): longest first, so each micro-batch holds rows of similar length; a row over budget goes alone."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def rows_with_gradient(advantages: list[torch.Tensor], t: TrainerSpec) -> list[int]:
    """Indices of the rows whose loss has a gradient. A row of zero advantage (its group's rewards all equal) adds
    exactly zero to the policy-gradient loss and its gradient whatever its ratio, so without an entropy or KL
    term (TrainerSpec `t`) its forward and backward are skipped; it still counts in the loss's denominator, so
    the update is the one the whole batch gives. A batch of such rows only is computed whole (its update is zero
    either way, and every pass runs as before)."""
    everything = list(range(len(advantages)))
    if t.entropy_coef > 0 or t.kl_coef > 0:
        return everything
    return [i for i, a in enumerate(advantages) if bool(a != 0)] or everything


@dataclass(frozen=True)
class Plan:
    """This rank's share of the update: its micro-batches, the passes it runs (under FSDP, as many as the rank
    with the most micro-batches; the passes past its own are placeholders), and the loss's denominator."""

    micro: list[MicroBatch]
    passes: int
    denominator: float
    device: torch.device
    sharded: bool

    @classmethod
    def of(cls, batch: BatchRows, t: TrainerSpec, ranks: Ranks, device: torch.device, sharded: bool) -> Plan:
        """Rank r takes the computed rows r, r + W, ...; every rank holds the whole batch, so each knows every
        rank's plan and, under FSDP (whose collectives run inside forward and backward), runs as many passes
        as the rank with the most micro-batches, the extra ones on a zero-weight placeholder."""
        computed = rows_with_gradient(batch.advantages, t)
        plans = [
            [[mine[i] for i in mb] for mb in micro_batches([len(batch.rows[i]) for i in mine], t.micro_batch_tokens)]
            for mine in (computed[r :: ranks.world] for r in range(ranks.world))
        ]
        passes = max(len(p) for p in plans) if sharded else len(plans[ranks.rank])
        micro = [MicroBatch.of(batch, idx, device) for idx in plans[ranks.rank]]
        return cls(micro, passes, batch.denominator(t.normalization), device, sharded)

    def at(self, i: int) -> MicroBatch | None:
        """Pass `i`'s micro-batch; None for a placeholder pass."""
        return self.micro[i] if i < len(self.micro) else None


def grpo_update(
    model,
    optimizer: torch.optim.Optimizer,
    groups: list[RolloutGroup],
    settings: UpdateSettings,
    reference=None,
    ranks: Ranks = SINGLE,
    laps: Laps | None = None,
) -> dict:
    """Apply one update for `groups`; return batch statistics (same on every rank). `model` is a causal LM or
    the trainer's (possibly sharded) `Prefill` of one; `reference` the frozen reference policy (klCoef > 0).
    `laps`: the step's parts (split.py) get `prepare`, `forward_backward` and `optimizer`; on a GPU each part
    waits for its kernels before it ends, so a part's seconds are its own work and not the queued work of the
    one before. What is not in a nested part is `prepare` (the batch's rows, tensors, micro-batches)."""
    with timed(laps, "prepare"):
        t = settings.trainer
        device = next(model.parameters()).device
        batch = BatchRows.of(groups)
        plan = Plan.of(batch, t, ranks, device, is_sharded(model))
        model.train()
        with _autocast(device, settings.compute_dtype):
            with torch.no_grad(), _synchronized(laps, "forward_backward", device):
                plan, off_stats = score_before_update(model, reference, plan, settings)
            for _ in range(t.epochs):  # GRPO's mu updates; the statistics returned are the last one's
                loss, stats, grad_norm = one_pass(model, optimizer, plan, off_stats, settings, ranks, laps)
        model.eval()
        rewards = np.array(batch.rewards)
        return {
            "loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards >= 1.0).mean()),
            "samples": len(rewards),
            "completion_tokens_mean": batch.completion_tokens / len(rewards),
            "turns_mean": sum(batch.turns) / len(rewards),
            **stats,
        }


def _autocast(device: torch.device, compute_dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `compute_dtype` (fp32 master weights computing in bf16, precision.py), or nothing."""
    if compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


@contextlib.contextmanager
def _synchronized(laps: Laps | None, name: str, device: torch.device) -> Iterator[None]:
    """The part `name`, ending only once the device has done its work (asynchronous on a GPU)."""
    with timed(laps, name):
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _scores(net, mb: MicroBatch, s: UpdateSettings, want_entropy: bool = False):
    """(B, T) logprobs of `mb`'s rows by `net`, and their entropy (B, T) when `want_entropy`, else None."""
    scored = score(net, mb.rows, s.temperature, s.pad_id, want_entropy=want_entropy, chunk=s.trainer.logprob_chunk)
    entropy = mb.align(scored.entropy) if scored.entropy else None
    return mb.align(scored.logprobs), entropy


def _placeholder(net, s: UpdateSettings) -> torch.Tensor:
    """The logprobs of a two-pad row by `net`: a pass with no rows of its own still joins FSDP's collectives."""
    return score(net, [[s.pad_id, s.pad_id]], s.temperature, s.pad_id, chunk=s.trainer.logprob_chunk).logprobs[0]


def score_before_update(model, reference, plan: Plan, s: UpdateSettings) -> tuple[Plan, dict[str, float]]:
    """Before any update and without gradients: the reference's logprobs of each micro-batch (klCoef > 0) and,
    with offPolicy tis/mis, the trainer's own, from which the importance weights come (loss.py; they multiply
    the advantages). Returns the plan with them and the off-policy statistics, pooled over the micro-batches
    (sums, and maxima for `*_max`)."""
    t = s.trainer
    micro = list(plan.micro)
    off_stats: dict[str, float] = {}
    for i in range(plan.passes):
        mb = plan.at(i)
        if reference is not None:
            if mb is None:
                _placeholder(reference, s)
            else:
                mb = micro[i] = replace(mb, ref=_scores(reference, mb, s)[0])
        if t.off_policy.mode != "none":
            if mb is None:
                _placeholder(model, s)
                continue
            old = _scores(model, mb, s)[0]
            weights, stats = off_policy_weights(old, mb.sampled, mb.mask, t.off_policy.mode, t.off_policy.cap)
            micro[i] = replace(mb, old=old, advantages=mb.advantages[:, None] * weights)
            for k, v in stats.items():
                off_stats[k] = max(off_stats.get(k, 0.0), v) if k.endswith("_max") else off_stats.get(k, 0.0) + v
    return replace(plan, micro=micro), off_stats


def one_pass(
    model,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    off_stats: dict[str, float],
    s: UpdateSettings,
    ranks: Ranks,
    laps: Laps | None,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """One optimizer update over this rank's rows (every rank joins it): (loss, statistics, grad norm).
    Gradients accumulate over the micro-batches; each one's loss is divided by the whole batch's count."""
    t, device = s.trainer, plan.device
    with _synchronized(laps, "forward_backward", device):
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        loss = torch.zeros((), device=device)
        for i in range(plan.passes):
            mb = plan.at(i)
            if mb is None:
                (_placeholder(model, s).sum() * 0.0).backward()
                continue
            logprobs, entropy = _scores(model, mb, s, want_entropy=t.entropy_coef > 0)
            inputs = LossInput(
                logprobs=logprobs,
                old_logprobs=mb.old if mb.old is not None else mb.sampled,
                advantages=mb.advantages,
                mask=mb.mask,
                entropy=entropy,
                ref_logprobs=mb.ref,
                denominator=plan.denominator,
            )
            mb_loss, stats = grpo_loss(inputs, s.loss)
            mb_loss.backward()
            loss = loss + mb_loss.detach()
            for k, v in stats.items():  # per-token means of the micro-batch -> sums over tokens
                sums[k] = sums.get(k, 0.0) + v * mb.tokens
        if ranks.world > 1 and not plan.sharded:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        tokens = sum(mb.tokens for mb in plan.micro)
        stats = whole_batch_means({**sums, **off_stats}, tokens, t, ranks.world, device)
        if ranks.world > 1:
            total = loss.reshape(1).clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            loss = total[0]
    with _synchronized(laps, "optimizer", device):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
    return loss, stats, grad_norm


def whole_batch_means(
    sums: dict[str, float], tokens: int, t: TrainerSpec, world: int, device: torch.device
) -> dict[str, float]:
    """The per-token means (ratio, clip fraction, entropy, KL, off-policy ratio and share) of the whole
    batch, from this rank's sums over its `tokens` completion tokens, and the maxima (`*_max`) over all
    ranks. Every rank calls it (a rank without completions adds zeros); which keys exist follows from
    the config `t`, so all ranks reduce the same vectors."""
    keys = ["ratio_mean", "clip_fraction"] + ["entropy_mean"] * (t.entropy_coef > 0) + ["kl_mean"] * (t.kl_coef > 0)
    maxima = []
    if t.off_policy.mode != "none":
        share = "offpolicy_truncated_fraction" if t.off_policy.mode == "tis" else "offpolicy_masked_fraction"
        keys += ["offpolicy_ratio_mean", share]
        maxima = ["offpolicy_ratio_max"]
    totals = torch.tensor([sums.get(k, 0.0) for k in keys] + [float(tokens)], dtype=torch.float64, device=device)
    peaks = torch.tensor([sums.get(k, 0.0) for k in maxima] + [0.0], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    means = {k: float(v) for k, v in zip(keys, totals[:-1] / totals[-1].clamp(min=1.0))}
    return {**means, **{k: float(v) for k, v in zip(maxima, peaks[:-1])}}
