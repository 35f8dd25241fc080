"""GRPO with INTELLECT-2's two-sided clipping.

Advantages are group-normalized: A_i = (r_i - mean(r)) / (std(r) + 1e-6) over the G completions of
one prompt (population std; a group whose rewards are all equal has A = 0).

Per token with ratio r = exp(logp_new - logp_old) and advantage A (one per completion):
  objective = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
  if A < 0: objective = max(objective, delta * A)        # ratio capped at delta (INTELLECT-2 §3.1)
Without the cap a negative-advantage token with a huge ratio gives an unbounded loss and the
gradient spikes INTELLECT-2 reports; with it the loss per token is bounded by delta * |A|.
Loss = -sum(objective * mask) / sum(mask): token-level normalization over the whole batch (DAPO),
so long and short completions weigh by their tokens.

References: DeepSeekMath (GRPO), INTELLECT-2 technical report (two-sided clipping, delta = 4),
DAPO (token-level normalization, decoupled eps_low / eps_high).
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(G,) rewards of one group -> (G,) normalized advantages."""
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


def grpo_loss(
    logprobs: torch.Tensor,  # (B, T) under the policy being trained
    old_logprobs: torch.Tensor,  # (B, T) under the policy that sampled
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 on completion tokens
    eps_low: float,
    eps_high: float,
    delta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].expand_as(ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    objective = torch.where(adv < 0, torch.maximum(objective, delta * adv), objective)
    mask = mask.to(objective.dtype)
    tokens = mask.sum().clamp(min=1.0)
    loss = -(objective * mask).sum() / tokens
    with torch.no_grad():
        clipped_frac = (((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(mask.dtype) * mask).sum() / tokens
        stats = {"ratio_mean": float((ratio * mask).sum() / tokens), "clip_fraction": float(clipped_frac)}
    return loss, stats
