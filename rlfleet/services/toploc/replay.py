"""Seed replay and its score: is each token of a sample the one its seed draws? (check 4 of checks.py,
every spot-checked group, whatever engine it claims)

Both engines draw token t of sample i as the inverse CDF of the filtered distribution at the
uniform u_t of the sample's own stream (rlfleet/models/sampling.py; vLLM through its worker's sampler
hook). The gate holds the same distribution from its prefill (logits (T, V) of the claimed version
at the run's temperature) and the same uniforms from the seed, so it re-draws every position at
once, no decoding. A position *matches* when u_t * mass falls in the claimed token's CDF interval
widened by `tolerance`, under the gate's top-k/top-p set or that set with its boundaries moved by
+-`tolerance` (a near tie at the k-th logit or at the top_p mass): the float noise of another
batch shape, thread count, engine or precision.

Score of a group (`ReplayScore`), over its P positions:
  mismatch share  m / P, m = positions that do not match. The group is rejected (`seed_replay`) when
                  m / P > max_mismatch_share (calibration.py: 0 on CPU, where honest draws replay
                  exactly; a small share on GPU, where bf16 kernels move near-ties);
  surprise        sum_t [ -log q_t(x_t) - H(q_t) ], q_t the verifier's filtered, renormalised
                  distribution, x_t the claimed token (a Token-DiFR-style statistic): the claimed
                  tokens' -log probability relative to its expected value under honest sampling, so
                  ~0 on average for honest groups, negative for greedy, low-temperature or cherry-
                  picked tokens, positive for tokens from another distribution. -log q is capped at
                  SURPRISE_CAP (a token outside the filtered set). It is reported and accumulated per
                  worker (rlfleet/fleet/reputation.py), not thresholded per group: over a few positions its noise
                  is of the order of the entropy.
A worker's running mismatch share (its counters `replay_mismatches` / `replay_positions`) bans it
past `max_running_share` (main.py), so a worker cannot stay just under the per-group share forever.

What replay cannot catch: a worker that chooses the seed itself can try many and submit the group it
likes (grinding); the run can assign seeds and tasks instead (rlfleet/fleet/assignment.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlfleet.models.sampling import keep_mask, sample_seed, sample_uniforms

SURPRISE_CAP = 30.0  # -log q of a token the filtered distribution excludes (q = 0)


@dataclass(frozen=True)
class ReplayScore:
    positions: int = 0
    mismatches: int = 0
    surprise: float = 0.0  # sum over positions of -log q(claimed) - H(q)
    first: tuple[int, int] | None = None  # (sample, position) of the first mismatch

    @property
    def share(self) -> float:
        return self.mismatches / self.positions if self.positions else 0.0

    def rejected(self, max_share: float) -> bool:
        """Whether the group's mismatch share is over `max_share` (0: any mismatch)."""
        return self.mismatches > 0 and self.share > max_share


def _consistent(logits: torch.Tensor, keep: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor, tol: float):
    """(T,) bool: token t lies where u_t draws under the distribution restricted to `keep` (T, V)."""
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1).double()  # (T, V)
    cdf = probs.cumsum(-1)
    hi = cdf.gather(-1, tokens[:, None])[:, 0]
    lo = hi - probs.gather(-1, tokens[:, None])[:, 0]
    target = u * cdf[:, -1]
    return keep.gather(-1, tokens[:, None])[:, 0] & (target >= lo - tol) & (target < hi + tol)


def _replay_rows(
    logits: torch.Tensor, toks: torch.Tensor, u: torch.Tensor, top_p: float, top_k: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """((T,) bool: rows whose token `toks` (T,) the uniforms `u` (T,) draw from `logits` (T, V), already divided by
    the temperature; (T,) each row's surprise term). Rows are independent, so the rows of several samples are
    replayed in one pass."""
    logits = logits.float()
    filtered = 0 < top_k < logits.shape[-1] or top_p < 1.0
    keep = keep_mask(logits, top_p, top_k)
    ok = _consistent(logits, keep, toks, u, tolerance)
    if filtered:  # without top-k/top-p every slack keeps the whole vocabulary: the same test again
        for slack in (-tolerance, tolerance):
            ok |= _consistent(logits, keep_mask(logits, top_p, top_k, slack), toks, u, tolerance)
    logq = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1).double()
    entropy = -(logq.exp() * logq.clamp(min=-SURPRISE_CAP)).sum(-1)  # (T,), 0 * -inf avoided by the clamp
    nll = (-logq.gather(-1, toks[:, None])[:, 0]).clamp(max=SURPRISE_CAP)
    return ok, nll - entropy


def replay_sample(
    logits: torch.Tensor, tokens: list[int], seed: int, top_p: float, top_k: int, tolerance: float
) -> tuple[torch.Tensor, float]:
    """((T,) bool: positions whose token `seed` draws from `logits` (T, V), already divided by the temperature;
    the sample's surprise)."""
    device = logits.device  # the prefill's (a GPU's when the verifier has one): the draw is redone there
    toks = torch.tensor(tokens, dtype=torch.long, device=device)
    u = torch.from_numpy(sample_uniforms(seed, len(tokens))).to(device)
    ok, surprise = _replay_rows(logits, toks, u, top_p, top_k, tolerance)
    return ok, float(surprise.sum())


def replay_mismatch(
    logits: torch.Tensor, tokens: list[int], seed: int, top_p: float, top_k: int, tolerance: float
) -> int | None:
    """The first position whose token is not the one `seed` draws from `logits` (T, V), or None."""
    ok, _ = replay_sample(logits, tokens, seed, top_p, top_k, tolerance)
    bad = (~ok).nonzero()
    return int(bad[0]) if len(bad) else None


def group_score(logits: list[torch.Tensor], group, tolerance: float) -> ReplayScore:
    """The replay score of `group` (module docstring); logits[i] (T_i, V) of sample i. Every sample's rows are
    replayed in one pass (`_replay_rows`), each with its own seed's uniforms."""
    sp = group.sampling
    if not group.samples:
        return ReplayScore()
    device = logits[0].device
    lengths = [len(s.completion_ids) for s in group.samples]
    toks = torch.tensor([t for s in group.samples for t in s.completion_ids], dtype=torch.long, device=device)
    uniforms = [sample_uniforms(sample_seed(sp.seed, i), n) for i, n in enumerate(lengths)]
    u = torch.from_numpy(np.concatenate(uniforms)).to(device)
    ok, surprise = _replay_rows(torch.cat(list(logits)), toks, u, sp.top_p, sp.top_k, tolerance)
    bad = (~ok).nonzero()[:, 0].tolist()
    first = None
    if bad:
        starts = np.cumsum([0, *lengths])
        i = int(np.searchsorted(starts, bad[0], side="right")) - 1
        first = (i, bad[0] - int(starts[i]))
    return ReplayScore(len(ok), len(bad), float(surprise.sum()), first)
