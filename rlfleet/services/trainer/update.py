"""One GRPO update, single-process or data-parallel over `torch.distributed`.

Every rank holds the whole batch (rank 0 reads it from the stream and broadcasts it); rank r
computes the loss of completions r, r + W, r + 2W, ... divided by the whole batch's token (or
completion) count, gradients are summed with all-reduce, then clipped and applied identically on
every rank, so all ranks keep the same weights and the update equals the single-process one up
to float summation order. With `trainer.sharding: fsdp` the model is sharded (sharding.py): the
same split and the same sum, done by FSDP's reduce-scatter in the backward instead of the
all-reduce here. The batch statistics (loss, ratio, clip fraction, entropy, KL) are the whole
batch's on every rank. Launch is torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
(gloo on CPU, NCCL on GPU), which ranks.py gives every rank it starts.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from rlfleet.models.device import choose_device
from rlfleet.models.policy import score
from rlfleet.services.trainer.loss import group_advantages, grpo_loss
from rlfleet.services.trainer.sharding import is_sharded
from rlfleet.wire import env
from rlfleet.wire.streams import RolloutGroup


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
) -> dict:
    """Apply one update for `groups` with TrainerSpec `t`; return batch statistics (same on every rank).
    `model` is a causal LM or the trainer's (possibly sharded) `Prefill` of one."""
    sharded = is_sharded(model)
    device = next(model.parameters()).device
    rows, old, group_adv, starts, rewards = [], [], [], [], []
    for g in groups:
        group_rewards = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
        rewards.extend(group_rewards.tolist())
        for s, a in zip(g.samples, group_advantages(group_rewards)):
            rows.append(g.prompt_ids + s.completion_ids)
            old.append(s.logprobs)
            group_adv.append(a)
            starts.append(len(g.prompt_ids) - 1)  # index in the (L-1,) logprob row of the first completion token
    total_tokens = sum(len(o) for o in old)
    denominator = float(total_tokens) if t.normalization == "token" else float(len(rows))
    mine = list(range(rank, len(rows), world))
    rows, old, starts = [rows[i] for i in mine], [old[i] for i in mine], [starts[i] for i in mine]
    advantages = (torch.stack([group_adv[i] for i in mine]) if mine else torch.zeros(0)).to(device)

    model.train()
    if rows:  # what every update of this batch shares: the mask, the sampling logprobs, the reference's
        width = max(len(r) for r in rows) - 1

        def aligned(per_row: list[torch.Tensor]) -> torch.Tensor:
            """(B, T) tensor of each row's completion-token values, from per-row (L_i - 1,) tensors."""
            out = torch.zeros(len(rows), width, device=device)
            for i, (values, start) in enumerate(zip(per_row, starts)):
                out[i, start : start + len(old[i])] = values[start : start + len(old[i])]
            return out

        mask = aligned([torch.ones(len(r) - 1) for r in rows])
        sampled = aligned([torch.tensor([0.0] * s + o) for s, o in zip(starts, old)])
        ref_lp = None
        if reference is not None:
            with torch.no_grad():
                ref_lp = aligned(score(reference, rows, temperature, pad_id).logprobs)
    elif sharded and reference is not None:  # join the reference's FSDP collectives as the other ranks do
        with torch.no_grad():
            score(reference, [[pad_id, pad_id]], temperature, pad_id)

    def one_pass() -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """One optimizer update over this rank's rows (every rank joins it): (loss, statistics, grad norm)."""
        optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        loss = torch.zeros(())
        if rows:
            scored = score(model, rows, temperature, pad_id, want_entropy=t.entropy_coef > 0)
            loss, stats = grpo_loss(
                aligned(scored.logprobs),
                sampled,
                advantages,
                mask,
                t.eps_low,
                t.eps_high,
                t.delta,
                normalization=t.normalization,
                entropy=aligned(scored.entropy) if scored.entropy else None,
                entropy_coef=t.entropy_coef,
                ref_logprobs=ref_lp,
                kl_coef=t.kl_coef,
                denominator=denominator,
            )
            loss.backward()
        elif sharded:
            # FSDP's gathers and reduce-scatters run inside forward and backward: this rank joins them
            # with a placeholder row whose loss is multiplied by zero, so it adds nothing to the gradient.
            placeholder = score(model, [[pad_id, pad_id]], temperature, pad_id).logprobs[0]
            (placeholder.sum() * 0.0).backward()
        if world > 1:
            for p in [] if sharded else model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            total = torch.tensor([loss.item()], device=device)  # NCCL reduces GPU tensors only
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            loss = total[0]
            stats = whole_batch_token_means(stats, sum(len(o) for o in old), t, device)
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


def whole_batch_token_means(stats: dict[str, float], tokens: int, t, device) -> dict[str, float]:
    """The loss's per-token means (ratio, clip fraction, entropy, KL) over the whole batch, from each
    rank's means over its `tokens` completion tokens: sum of mean x tokens over ranks / all tokens.
    Every rank calls it (a rank without completions adds zeros); which means exist follows from the
    config `t`, so all ranks reduce the same vector."""
    keys = ["ratio_mean", "clip_fraction"] + ["entropy_mean"] * (t.entropy_coef > 0) + ["kl_mean"] * (t.kl_coef > 0)
    sums = torch.tensor(
        [stats.get(k, 0.0) * tokens for k in keys] + [float(tokens)], dtype=torch.float64, device=device
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return {k: float(v) for k, v in zip(keys, sums[:-1] / sums[-1].clamp(min=1.0))}
