"""GRPO with INTELLECT-2's two-sided clipping.

Advantages are group-normalized: A_i = (r_i - mean(r)) / (std(r) + 1e-6) over the G completions of
one prompt (population std; a group whose rewards are all equal has A = 0).

Per token with ratio r = exp(logp_new - logp_old) and advantage A (one per completion):
  objective = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
  if A < 0: objective = max(objective, delta * A)        # ratio capped at delta (INTELLECT-2 §3.1)
Without the cap a negative-advantage token with a huge ratio gives an unbounded loss and the
gradient spikes INTELLECT-2 reports; with it the loss per token is bounded by delta * |A|.
Per-token loss = -objective - entropy_coef * H_t + kl_coef * k3_t, where H_t is the policy's entropy
at the token and k3_t = exp(ref - logp) - (ref - logp) - 1 (Schulman's unbiased, non-negative KL
estimator against a frozen reference policy), clamped to [0, 10] so one outlier token cannot
dominate.
Normalization: `token` = sum over tokens / number of completion tokens of the batch (DAPO: long and
short completions weigh by their tokens); `sequence` = mean over completions of each completion's
token mean (original GRPO). With data parallelism every rank divides by the *whole* batch's count
(`denominator`), so the gradients summed over ranks equal the single-process gradient.

References: DeepSeekMath (GRPO), INTELLECT-2 technical report (two-sided clipping, delta = 4),
DAPO (token-level normalization, decoupled eps_low / eps_high), J. Schulman "Approximating KL
divergence" (k3).
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
    normalization: str = "token",
    entropy: torch.Tensor | None = None,  # (B, T) policy entropy per position, when entropy_coef > 0
    entropy_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,  # (B, T) under the frozen reference, when kl_coef > 0
    kl_coef: float = 0.0,
    denominator: float | None = None,  # data parallel: the whole batch's tokens (token) or completions (sequence)
) -> tuple[torch.Tensor, dict[str, float]]:
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None].expand_as(ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    objective = torch.where(adv < 0, torch.maximum(objective, delta * adv), objective)
    per_token = -objective
    stats: dict[str, float] = {}
    if entropy_coef > 0:
        if entropy is None:
            raise ValueError("grpo_loss: entropy_coef > 0 needs the entropy (score(..., want_entropy=True))")
        per_token = per_token - entropy_coef * entropy
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs (the frozen reference's scores)")
        log_ratio = ref_logprobs - logprobs
        k3 = torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, 0.0, 10.0)
        per_token = per_token + kl_coef * k3
    mask = mask.to(per_token.dtype)
    tokens = mask.sum().clamp(min=1.0)
    if normalization == "token":
        loss = (per_token * mask).sum() / (denominator or tokens)
    elif normalization == "sequence":
        per_seq = mask.sum(-1)
        has = per_seq > 0
        loss = ((per_token * mask).sum(-1)[has] / per_seq[has]).sum() / (denominator or has.sum().clamp(min=1))
    else:
        raise ValueError(f"spec.trainer.normalization: {normalization!r} is not token or sequence")
    with torch.no_grad():
        clipped_frac = (((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).to(mask.dtype) * mask).sum() / tokens
        stats.update(ratio_mean=float((ratio * mask).sum() / tokens), clip_fraction=float(clipped_frac))
        if entropy is not None:
            stats["entropy_mean"] = float((entropy * mask).sum() / tokens)
        if kl_coef > 0:
            stats["kl_mean"] = float((k3 * mask).sum() / tokens)
    return loss, stats
