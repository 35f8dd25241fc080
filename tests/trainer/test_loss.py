"""GRPO loss with two-sided clipping (rlfleet/services/trainer/loss.py) against a per-token formula."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlfleet.services.trainer.loss import LossInput, LossSettings, group_advantages, grpo_loss

EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.28, 4.0
SETTINGS = LossSettings(eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=DELTA)


def reference_token(ratio: float, adv: float) -> tuple[float, float]:
    """(objective, d objective / d logprob) of one token, case by case.

    d ratio / d logprob = ratio, so an unclipped token has gradient ratio * A, a clipped one 0.
    """
    if adv > 0:
        if ratio > 1 + EPS_HIGH:
            return (1 + EPS_HIGH) * adv, 0.0  # gains beyond 1+eps_high are not rewarded
        return ratio * adv, ratio * adv  # inside, or below 1-eps_low (min keeps the smaller r*A)
    if adv < 0:
        if ratio < 1 - EPS_LOW:
            return (1 - EPS_LOW) * adv, 0.0  # already pushed down far enough
        if ratio > DELTA:
            return DELTA * adv, 0.0  # INTELLECT-2 cap: the loss is bounded by delta*|A|
        return ratio * adv, ratio * adv  # inside, or above 1+eps_high but below delta
    return 0.0, 0.0


def reference(ratios, advs, mask):
    """(loss, grad w.r.t. logprobs) with token-level normalization over the whole batch."""
    n = max(sum(sum(row) for row in mask), 1)
    loss, grad = 0.0, []
    for row_r, a, row_m in zip(ratios, advs, mask):
        grow = []
        for r, m in zip(row_r, row_m):
            obj, dobj = reference_token(r, a)
            loss -= m * obj / n
            grow.append(-m * dobj / n)
        grad.append(grow)
    return loss, grad


def run_loss(ratios, advs, mask, old=None):
    ratios_t = torch.tensor(ratios, dtype=torch.float64)
    if old is None:
        old = -1.0 - 0.1 * torch.arange(ratios_t.numel(), dtype=torch.float64).reshape(ratios_t.shape)
    logprobs = (old + torch.log(ratios_t)).clone().requires_grad_(True)
    inputs = LossInput(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor(advs, dtype=torch.float64), mask=torch.tensor(mask)
    )
    loss, stats = grpo_loss(inputs, SETTINGS)
    loss.backward()
    return loss, logprobs.grad, stats


# Every region of the objective, one token each. Row 0: A > 0; row 1: A < 0; row 2: A = 0.
RATIOS = [
    [1.1, 1.6, 0.5, 1.0, 0.9],  # inside, above 1+eps_high, below 1-eps_low, at 1, inside
    [1.1, 0.5, 1.6, 6.0, 3.9],  # inside, below 1-eps_low, between 1+eps_high and delta, above delta, just below delta
    [1.3, 0.7, 9.0, 1.0, 1.0],
]
ADVS = [1.5, -0.7, 0.0]
MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


@pytest.mark.parametrize("coef,missing", [("entropy_coef", "entropy"), ("kl_coef", "ref_logprobs")])
def test_a_positive_coefficient_without_its_input_names_it(coef, missing):
    ratios_t = torch.tensor(RATIOS, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"{coef} > 0 needs {'the entropy' if missing == 'entropy' else missing}"):
        grpo_loss(
            LossInput(
                logprobs=ratios_t.log(),
                old_logprobs=ratios_t * 0,
                advantages=torch.tensor(ADVS),
                mask=torch.tensor(MASK),
            ),
            dataclasses.replace(SETTINGS, **{coef: 0.1}),
        )


def test_loss_and_gradient_match_per_token_formula():
    loss, grad, _ = run_loss(RATIOS, ADVS, MASK)
    want_loss, want_grad = reference(RATIOS, ADVS, MASK)
    assert loss.item() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "ratio,adv,clipped",
    [
        (1.1, 2.0, False),
        (1.5, 2.0, True),
        (0.5, 2.0, False),
        (1.1, -2.0, False),
        (0.5, -2.0, True),
        (1.5, -2.0, False),
        (10.0, -2.0, True),
        (100.0, -2.0, True),
    ],
)
def test_single_token_regions(ratio, adv, clipped):
    loss, grad, _ = run_loss([[ratio]], [adv], [[1]])
    want_loss, want_grad = reference([[ratio]], [adv], [[1]])
    assert loss.item() == pytest.approx(want_loss, rel=1e-9)
    assert grad.item() == pytest.approx(want_grad[0][0], rel=1e-9, abs=1e-15)
    assert (grad.item() == 0.0) == clipped


def test_delta_caps_negative_advantage_loss():
    # Without the cap the loss of a negative-advantage token grows with its ratio; with it, delta*|A|.
    for ratio in (5.0, 50.0, 5000.0):
        loss, grad, _ = run_loss([[ratio]], [-1.0], [[1]])
        assert loss.item() == pytest.approx(DELTA)
        assert grad.item() == 0.0


def test_masked_tokens_contribute_nothing():
    mask = [[1, 1, 0, 0], [1, 0, 1, 0]]
    base, base_grad, _ = run_loss([[1.1, 0.9, 1.0, 1.0], [1.2, 1.0, 0.95, 1.0]], [1.0, -1.0], mask)
    # Wild values at the masked positions (huge ratios, either sign of the region) change nothing.
    wild, wild_grad, _ = run_loss([[1.1, 0.9, 50.0, 0.01], [1.2, 7.0, 0.95, 1e3]], [1.0, -1.0], mask)
    assert wild.item() == pytest.approx(base.item(), rel=1e-12)
    masked = torch.tensor(mask) == 0
    assert torch.all(wild_grad[masked] == 0) and torch.all(base_grad[masked] == 0)
    torch.testing.assert_close(wild_grad[~masked], base_grad[~masked])
    want, _ = reference([[1.1, 0.9, 1.0, 1.0], [1.2, 1.0, 0.95, 1.0]], [1.0, -1.0], mask)
    assert base.item() == pytest.approx(want, rel=1e-9)


def test_token_level_normalization_weighs_long_completions_more():
    # Ratio 1 everywhere: objective per token = A. Row 0 (A=+1) has 3 tokens, row 1 (A=-1) has 1.
    ratios = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    loss, grad, _ = run_loss(ratios, [1.0, -1.0], [[1, 1, 1], [1, 0, 0]])
    # Divided by the 4 unmasked tokens of the batch: -(3 - 1) / 4; a per-sequence mean would give 0.
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[-0.25] * 3, [0.25, 0.0, 0.0]], dtype=torch.float64))


def test_all_masked_batch_gives_zero_loss():
    loss, grad, stats = run_loss([[1.5, 0.5]], [1.0], [[0, 0]])
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert stats["clip_fraction"] == 0.0


def test_stats_count_unmasked_clipped_tokens():
    _, _, stats = run_loss(RATIOS, ADVS, MASK)
    flat = [(r, m) for row_r, row_m in zip(RATIOS, MASK) for r, m in zip(row_r, row_m) if m]
    clipped = sum(r < 1 - EPS_LOW or r > 1 + EPS_HIGH for r, _ in flat)
    assert stats["clip_fraction"] == pytest.approx(clipped / len(flat))
    assert stats["ratio_mean"] == pytest.approx(sum(r for r, _ in flat) / len(flat))


def test_group_advantages_equal_rewards_are_zero():
    for value in (0.0, 1.0, 0.37):
        adv = group_advantages(torch.full((8,), value))
        assert torch.all(adv == 0), adv


def test_group_advantages_one_winner():
    rewards = [1.0, 0.0, 0.0, 0.0]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)  # population std
    want = [(r - mean) / (std + 1e-6) for r in rewards]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))
    assert adv[0].item() == pytest.approx(math.sqrt(3), rel=1e-5)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-12)
