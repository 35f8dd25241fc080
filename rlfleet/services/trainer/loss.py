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

Micro-batches: the loss is a sum over tokens (token) or completions (sequence) divided by a count
fixed for the whole batch (`denominator`), so the loss of a batch is the sum of its micro-batches'
losses, and gradients accumulated over micro-batches (update.py) equal the one-batch gradient; the
entropy and KL terms are per-token terms of the same sum, so they split the same way.

Off-policy correction (`trainer.offPolicy`, `off_policy_weights`). The engine that sampled (vLLM,
often bf16) and the trainer disagree on logprobs even for the same weights. With pi_s the sampler's
claimed probability of the token, pi_old the trainer's own, recomputed with the weights before the
update (no gradient), and rho = pi_old / pi_s per token:
  tis: w = min(rho, cap)          (truncated importance sampling)
  mis: w = 1 if rho <= cap else 0 (masked importance sampling: the token is dropped)
and the clipped ratio is taken against pi_old instead of pi_s; w is detached and multiplies the
token's clipped objective. Since the objective is positively homogeneous in A (min, clip and the
delta cap all scale with A >= 0 weights), w * objective(A) = objective(w * A), so w enters as a
per-token advantage (advantages of shape (B, T)). Masked tokens keep their place in the
normalisation (the loss scale does not depend on how many are dropped). The entropy and KL terms are
regularisers of the current policy and are not weighted. `none` keeps the ratio against pi_s.

References: DeepSeekMath (GRPO), INTELLECT-2 technical report (two-sided clipping, delta = 4),
DAPO (token-level normalization, decoupled eps_low / eps_high), J. Schulman "Approximating KL
divergence" (k3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from rlfleet.config import TrainerSpec


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The loss's constants, from the run's TrainerSpec (`of`), made once per trainer: the clip range
    1 - eps_low .. 1 + eps_high, the cap `delta` on the ratio of negative-advantage tokens, the
    normalization (token or sequence) and the weights of the entropy bonus and of the KL penalty."""

    eps_low: float
    eps_high: float
    delta: float
    normalization: Literal["token", "sequence"] = "token"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0

    @classmethod
    def of(cls, t: TrainerSpec) -> LossSettings:
        """The settings of TrainerSpec `t` (epsLow, epsHigh, delta, normalization, entropyCoef, klCoef)."""
        return cls(
            eps_low=t.eps_low,
            eps_high=t.eps_high,
            delta=t.delta,
            normalization=t.normalization,
            entropy_coef=t.entropy_coef,
            kl_coef=t.kl_coef,
        )


@dataclass(frozen=True, kw_only=True)
class LossInput:
    """One micro-batch's tensors, B completions by T positions, aligned on their completion tokens (update.py
    puts each completion's tokens at their positions in its row and zeros elsewhere)."""

    logprobs: torch.Tensor  # (B, T) under the policy being trained, with gradients
    old_logprobs: torch.Tensor  # (B, T) under the policy that sampled (or the trainer's own before the update)
    advantages: torch.Tensor  # (B,), or (B, T) per token (importance-weighted, off_policy_weights)
    mask: torch.Tensor  # (B, T) 1 on completion tokens
    entropy: torch.Tensor | None = None  # (B, T) policy entropy per position, when entropy_coef > 0
    ref_logprobs: torch.Tensor | None = None  # (B, T) under the frozen reference, when kl_coef > 0
    # Data parallel and micro-batches: the whole batch's tokens (token) or completions (sequence); None: this one's.
    denominator: float | None = None


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(G,) rewards of one group -> (G,) normalized advantages; exactly zero when every reward is the same (the mean
    of equal floats can differ from them in the last bit, which would leave ~1e-10 advantages: update.py skips
    the rows of such a group)."""
    if bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


def grpo_loss(batch: LossInput, settings: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of `batch` (the module docstring's per-token loss, normalized) and its statistics: ratio_mean,
    clip_fraction, and entropy_mean and kl_mean when those terms are on, as means over its completion tokens."""
    s = settings
    ratio = torch.exp(batch.logprobs - batch.old_logprobs)
    adv = batch.advantages if batch.advantages.dim() == 2 else batch.advantages[:, None].expand_as(ratio)
    clipped = torch.clamp(ratio, 1.0 - s.eps_low, 1.0 + s.eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    objective = torch.where(adv < 0, torch.maximum(objective, s.delta * adv), objective)
    per_token = -objective
    stats: dict[str, float] = {}

    if s.entropy_coef > 0:
        if batch.entropy is None:
            raise ValueError("grpo_loss: entropy_coef > 0 needs the entropy (score(..., want_entropy=True))")
        per_token = per_token - s.entropy_coef * batch.entropy
    if s.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs (the frozen reference's scores)")
        log_ratio = batch.ref_logprobs - batch.logprobs
        k3 = torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, 0.0, 10.0)
        per_token = per_token + s.kl_coef * k3

    mask = batch.mask.to(per_token.dtype)
    tokens = mask.sum().clamp(min=1.0)
    denominator = batch.denominator
    if s.normalization == "token":
        loss = (per_token * mask).sum() / (denominator or tokens)
    elif s.normalization == "sequence":
        per_seq = mask.sum(-1)
        has = per_seq > 0
        loss = ((per_token * mask).sum(-1)[has] / per_seq[has]).sum() / (denominator or has.sum().clamp(min=1))
    else:
        raise ValueError(f"spec.trainer.normalization: {s.normalization!r} is not token or sequence")

    with torch.no_grad():
        clipped_frac = (((ratio < 1 - s.eps_low) | (ratio > 1 + s.eps_high)).to(mask.dtype) * mask).sum() / tokens
        stats.update(ratio_mean=float((ratio * mask).sum() / tokens), clip_fraction=float(clipped_frac))
        if batch.entropy is not None:
            stats["entropy_mean"] = float((batch.entropy * mask).sum() / tokens)
        if s.kl_coef > 0:
            stats["kl_mean"] = float((k3 * mask).sum() / tokens)
    return loss, stats


def off_policy_weights(
    trainer_old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) detached importance weights of the tokens (mode tis or mis, see the module docstring) and
    their statistics as sums over the masked tokens, for the caller to pool across micro-batches and
    ranks: offpolicy_ratio_mean and offpolicy_{truncated,masked}_fraction (sums), offpolicy_ratio_max."""
    with torch.no_grad():
        mask = mask.to(torch.float32)
        rho = torch.exp(trainer_old.float() - sampler.float()) * mask
        over = (rho > cap).to(torch.float32) * mask
        if mode == "tis":
            weights, share = torch.clamp(rho, max=cap), "offpolicy_truncated_fraction"
        elif mode == "mis":
            weights, share = rho.le(cap).to(torch.float32), "offpolicy_masked_fraction"
        else:
            raise ValueError(f"spec.trainer.offPolicy.mode: {mode!r} is not none, tis or mis")
        stats = {
            "offpolicy_ratio_mean": float(rho.sum()),
            share: float(over.sum()),
            "offpolicy_ratio_max": float(rho.max()) if rho.numel() else 0.0,
        }
    return weights * mask, stats
