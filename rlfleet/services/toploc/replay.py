"""Seed replay: is each token of a sample the one its seed draws? (check 4 of checks.py, `torch` groups)

The torch engine draws token t of sample i as the inverse CDF of the filtered distribution at the
uniform u_t of the sample's own stream (rlfleet/models/sampling.py). The gate holds the same distribution
from its prefill (logits (T, V) of the claimed version at the run's temperature) and the same
uniforms from the seed, so it re-draws every position at once, no decoding: the worker's token must
be the one drawn. Exact but for float noise: the gate's logits differ from the decode's by about
1e-6 in fp32 (another batch shape, other threads), so a token is accepted when u_t * mass falls in its
CDF interval widened by `tolerance`, under the gate's top-k/top-p set or that set with its
boundaries moved by +-`tolerance` (a near tie at the k-th logit or at the top_p mass).

What this catches that no threshold can: a temperature lie with recomputed logprobs, greedy or
low-temperature decoding, cherry-picked or duplicated samples, forced completions, drafts from a
cheaper model proven with one real prefill: each picks tokens its seed would not. What it cannot:
a worker that chooses the seed itself can try many and submit the group it likes (grinding); the
run can assign seeds and tasks instead (rlfleet/wire/assignment.py). vLLM draws with its own sampler (on
a GPU not bit-reproducibly either), so `vllm` groups are not replayed (checks.py).
"""

from __future__ import annotations

import torch

from rlfleet.models.sampling import keep_mask, sample_seed, sample_uniforms


def _consistent(logits: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor, tol: float):
    """(T,) bool: token t lies where u_t draws under the distribution restricted to `keep` (T, V)."""
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1).double()  # (T, V)
    cdf = probs.cumsum(-1)
    hi = cdf.gather(-1, tokens[:, None])[:, 0]
    lo = hi - probs.gather(-1, tokens[:, None])[:, 0]
    target = u * cdf[:, -1]
    return keep.gather(-1, tokens[:, None])[:, 0] & (target >= lo - tol) & (target < hi + tol)


def replay_mismatch(
    logits: torch.Tensor, tokens: list[int], seed: int, top_p: float, top_k: int, tolerance: float
) -> int | None:
    """The first position whose token is not the one `seed` draws from `logits` (T, V) (already divided by
    the temperature), or None when every token is."""
    device = logits.device  # the prefill's (a GPU's when the verifier has one): the draw is redone there
    toks = torch.tensor(tokens, dtype=torch.long, device=device)
    u = torch.from_numpy(sample_uniforms(seed, len(tokens))).to(device)
    logits = logits.float()
    ok = torch.zeros(len(tokens), dtype=torch.bool, device=device)
    for slack in (0.0, -tolerance, tolerance):
        ok |= _consistent(logits, keep_mask(logits, top_p, top_k, slack), toks, u, tolerance)
    bad = (~ok).nonzero()
    return int(bad[0]) if len(bad) else None


def group_replay(logits: list[torch.Tensor], group, tolerance: float) -> tuple[int, int] | None:
    """(sample, position) of the first token of `group` its seeds do not draw, or None; logits[i] (T_i, V)."""
    sp = group.sampling
    for i, (rows, sample) in enumerate(zip(logits, group.samples)):
        pos = replay_mismatch(rows, sample.completion_ids, sample_seed(sp.seed, i), sp.top_p, sp.top_k, tolerance)
        if pos is not None:
            return i, pos
    return None
