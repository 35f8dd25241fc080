"""One GRPO update, single-process or data-parallel over `torch.distributed`.

Every rank holds the whole batch (rank 0 reads it from the stream and broadcasts it); rank r
computes the loss of completions r, r + W, r + 2W, ... (of those computed) divided by the whole batch's token (or
completion) count, gradients are summed with all-reduce, then clipped and applied identically on
every rank, so all ranks keep the same weights and the update equals the single-process one up
to float summation order. With `trainer.sharding: fsdp` the model is sharded (sharding.py): the
same split and the same sum, done by FSDP's reduce-scatter in the backward instead of the
all-reduce here. The batch statistics (loss, ratio, clip fraction, entropy, KL) are the whole
batch's on every rank; the per-token ones over the rows computed. Rows of zero advantage are not computed when
the loss has no entropy or KL term (`rows_with_gradient`): they add nothing to it or its gradient, and late in a
run most groups of solved prompts are all correct.

Bounded memory per step: each rank sorts its rows by length and packs them into micro-batches of
at most `trainer.microBatchTokens` padded tokens (`micro_batches`); every micro-batch is one
forward and backward, gradients accumulate, and one optimizer step follows. Each micro-batch's
loss is divided by the whole batch's count (tokens or completions, over all ranks), so the
accumulated gradient is exactly the one-batch gradient (loss.py). Token logprobs are taken
`trainer.logprobChunk` positions at a time (rlfleet/models/logprobs.py), so no tensor of a
micro-batch's positions by the vocabulary exists. Under FSDP every rank runs as many passes as the
rank with the most micro-batches (all ranks hold the batch, so each computes every plan), the
extra ones on a zero-weight placeholder. Before the first update, without gradients and in the
same micro-batches: the frozen reference's logprobs (klCoef > 0) and, with `trainer.offPolicy`
tis/mis, the trainer's own logprobs, from which loss.py's importance weights come. `compute_dtype`
autocasts the forwards (fp32 master weights computing in bf16, precision.py).

Launch is torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU, NCCL on GPU),
which ranks.py gives every rank it starts.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.models.device import choose_device
from rlfleet.models.policy import score
from rlfleet.services.trainer.loss import group_advantages, grpo_loss, off_policy_weights
from rlfleet.services.trainer.sharding import is_sharded
from rlfleet.wire import env
from rlfleet.wire.streams import RolloutGroup
from rlfleet.wire.timing import Laps, timed


def training_device() -> torch.device:
    """Where this rank computes: rlfleet/models/device.py's choice for its GPU index (LOCAL_RANK,
    torchrun-style; 0 in a one-replica pod). A GPU is made current before NCCL joins, as NCCL requires."""
    device = choose_device(rank=env.get_int(env.LOCAL_RANK, 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed() -> tuple[int, int]:
    """(rank, world size) from the torchrun-style environment; joins the process group when world > 1
    (NCCL when this rank computes on a GPU, else gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if training_device().type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    return rank, world


def leave_distributed() -> None:
    """Leave the process group, if this process joined one. Every rank must, before it exits: gloo's
    worker threads still alive at interpreter shutdown abort the process (SIGABRT, "terminate called
    without an active exception"; 3 exits in 80 in a 4-rank all-reduce loop here, none with this)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(obj, rank: int, world: int):
    """Rank 0's `obj` on every rank."""
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class MicroBatch:
    """Rows of one forward/backward and what the loss needs of them, aligned (B, T) on completion tokens."""

    rows: list[list[int]]
    mask: torch.Tensor  # 1 on completion tokens
    sampled: torch.Tensor  # the engine's claimed logprobs
    advantages: torch.Tensor  # (B,), or (B, T) once importance-weighted
    tokens: int  # completion tokens
    old: torch.Tensor | None = None  # the trainer's own logprobs before the update (offPolicy tis/mis)
    ref: torch.Tensor | None = None  # the frozen reference's logprobs (klCoef > 0)

    def align(self, per_row: list[torch.Tensor], starts: list[int], lengths: list[int]) -> torch.Tensor:
        """(B, T) of each row's completion-token values, from per-row (L_i - 1,) tensors."""
        out = torch.zeros_like(self.mask)
        for i, (values, start, n) in enumerate(zip(per_row, starts, lengths)):
            out[i, start : start + n] = values[start : start + n]
        return out


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


def rows_with_gradient(advantages: list[torch.Tensor], t) -> list[int]:
    """Indices of the rows whose loss has a gradient. A row of zero advantage (its group's rewards all equal) adds
    exactly zero to the policy-gradient loss and its gradient whatever its ratio, so without an entropy or KL
    term (TrainerSpec `t`) its forward and backward are skipped; it still counts in the loss's denominator, so
    the update is the one the whole batch gives. A batch of such rows only is computed whole (its update is zero
    either way, and every pass runs as before)."""
    everything = list(range(len(advantages)))
    if t.entropy_coef > 0 or t.kl_coef > 0:
        return everything
    return [i for i, a in enumerate(advantages) if bool(a != 0)] or everything


def grpo_update(
    model,
    optimizer,
    groups: list[RolloutGroup],
    t,
    temperature: float,
    pad_id: int,
    reference=None,
    rank: int = 0,
    world: int = 1,
    compute_dtype: torch.dtype | None = None,
    laps: Laps | None = None,
) -> dict:
    """Apply one update for `groups` with TrainerSpec `t`; return batch statistics (same on every rank).
    `model` is a causal LM or the trainer's (possibly sharded) `Prefill` of one. `compute_dtype`:
    autocast the forward to it (fp32 master weights computing in bf16; precision.py). `laps`: the step's
    parts (split.py) get `prepare`, `forward_backward` and `optimizer`; on a GPU each part waits for its
    kernels before it ends, so a part's seconds are its own work and not the queued work of the one before."""
    with timed(laps, "prepare"):
        return _update(model, optimizer, groups, t, temperature, pad_id, reference, rank, world, compute_dtype, laps)


def _update(model, optimizer, groups, t, temperature, pad_id, reference, rank, world, compute_dtype, laps) -> dict:
    """grpo_update's body; what is not in a nested part is `prepare` (the batch's rows, tensors, micro-batches)."""
    sharded = is_sharded(model)
    device = next(model.parameters()).device
    rows, sampled, group_adv, starts, rewards = [], [], [], [], []
    for g in groups:
        group_rewards = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
        rewards.extend(group_rewards.tolist())
        for s, a in zip(g.samples, group_advantages(group_rewards)):
            rows.append(g.prompt_ids + s.completion_ids)
            sampled.append(s.logprobs)
            group_adv.append(a)
            starts.append(len(g.prompt_ids) - 1)  # index in the (L-1,) logprob row of the first completion token
    total_tokens = sum(len(o) for o in sampled)
    denominator = float(total_tokens) if t.normalization == "token" else float(len(rows))
    computed = rows_with_gradient(group_adv, t)
    # Rank r takes the computed rows r, r + W, ...; every rank holds the whole batch, so each knows every rank's
    # plan and, under FSDP (whose collectives run inside forward and backward), runs as many passes as the
    # rank with the most micro-batches, the extra ones on a zero-weight placeholder.
    plans = [
        [[mine[i] for i in mb] for mb in micro_batches([len(rows[i]) for i in mine], t.micro_batch_tokens)]
        for mine in (computed[r::world] for r in range(world))
    ]
    passes = max(len(p) for p in plans) if sharded else len(plans[rank])
    micro = []
    for idx in plans[rank]:
        mb_rows = [rows[i] for i in idx]
        lengths = [len(sampled[i]) for i in idx]
        mask = torch.zeros(len(idx), max(len(r) for r in mb_rows) - 1, device=device)
        mb = MicroBatch(mb_rows, mask, mask, torch.stack([group_adv[i] for i in idx]).to(device), sum(lengths))
        mb_starts = [starts[i] for i in idx]
        mb.mask = mb.align([torch.ones(len(r) - 1) for r in mb_rows], mb_starts, lengths)
        mb.sampled = mb.align(
            [torch.tensor([0.0] * s + sampled[i]) for s, i in zip(mb_starts, idx)], mb_starts, lengths
        )
        micro.append((mb, mb_starts, lengths))
    chunk = t.logprob_chunk
    autocast = (
        torch.autocast(device.type, dtype=compute_dtype) if compute_dtype is not None else contextlib.nullcontext()
    )

    def scores(net, i: int, want_entropy: bool = False):
        """Micro-batch i's scores by `net` (None on a placeholder pass, which only joins FSDP's collectives)."""
        if i >= len(micro):
            placeholder = score(net, [[pad_id, pad_id]], temperature, pad_id, chunk=chunk).logprobs[0]
            return None, placeholder
        mb, mb_starts, lengths = micro[i]
        scored = score(net, mb.rows, temperature, pad_id, want_entropy=want_entropy, chunk=chunk)
        entropy = mb.align(scored.entropy, mb_starts, lengths) if scored.entropy else None
        return (mb.align(scored.logprobs, mb_starts, lengths), entropy), None

    model.train()
    off_stats: dict[str, float] = {}

    @contextlib.contextmanager
    def synchronized(name: str):
        """The part `name`, ending only once the device has done its work (asynchronous on a GPU)."""
        with timed(laps, name):
            yield
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    with autocast:
        # before any update: the reference's and the trainer's own logprobs
        with torch.no_grad(), synchronized("forward_backward"):
            for i in range(passes):
                if reference is not None:
                    got, _ = scores(reference, i)
                    if got:
                        micro[i][0].ref = got[0]
                if t.off_policy.mode != "none":
                    got, _ = scores(model, i)
                    if got:
                        mb = micro[i][0]
                        mb.old = got[0]
                        weights, stats = off_policy_weights(
                            mb.old, mb.sampled, mb.mask, t.off_policy.mode, t.off_policy.cap
                        )
                        mb.advantages = mb.advantages[:, None] * weights
                        for k, v in stats.items():
                            off_stats[k] = (
                                max(off_stats.get(k, 0.0), v) if k.endswith("_max") else off_stats.get(k, 0.0) + v
                            )

        def one_pass() -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
            """One optimizer update over this rank's rows (every rank joins it): (loss, statistics, grad norm).
            Gradients accumulate over the micro-batches; each one's loss is divided by the whole batch's count."""
            with synchronized("forward_backward"):
                optimizer.zero_grad(set_to_none=True)
                sums: dict[str, float] = {}
                loss = torch.zeros((), device=device)
                for i in range(passes):
                    got, placeholder = scores(model, i, want_entropy=t.entropy_coef > 0)
                    if got is None:
                        (placeholder.sum() * 0.0).backward()
                        continue
                    mb = micro[i][0]
                    mb_loss, stats = grpo_loss(
                        got[0],
                        mb.old if mb.old is not None else mb.sampled,
                        mb.advantages,
                        mb.mask,
                        t.eps_low,
                        t.eps_high,
                        t.delta,
                        normalization=t.normalization,
                        entropy=got[1],
                        entropy_coef=t.entropy_coef,
                        ref_logprobs=mb.ref,
                        kl_coef=t.kl_coef,
                        denominator=denominator,
                    )
                    mb_loss.backward()
                    loss = loss + mb_loss.detach()
                    for k, v in stats.items():  # per-token means of the micro-batch -> sums over tokens
                        sums[k] = sums.get(k, 0.0) + v * mb.tokens
                if world > 1 and not sharded:
                    for p in model.parameters():
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                stats = whole_batch_means({**sums, **off_stats}, sum(mb.tokens for mb, _, _ in micro), t, world, device)
                if world > 1:
                    total = loss.reshape(1).clone()
                    dist.all_reduce(total, op=dist.ReduceOp.SUM)
                    loss = total[0]
            with synchronized("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                optimizer.step()
            return loss, stats, grad_norm

        for _ in range(t.epochs):  # GRPO's mu updates; the statistics returned are the last one's
            loss, stats, grad_norm = one_pass()
    model.eval()
    rewards_arr = np.array(rewards)
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "reward_mean": float(rewards_arr.mean()),
        "accuracy": float((rewards_arr >= 1.0).mean()),
        "samples": len(rewards),
        "completion_tokens_mean": total_tokens / len(rewards),
        **stats,
    }


def whole_batch_means(sums: dict[str, float], tokens: int, t, world: int, device) -> dict[str, float]:
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


def lr_factor(warmup: int, schedule: str, total: int):
    """Multiplier of the base learning rate at step s (0-based): linear warmup, then the schedule."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
