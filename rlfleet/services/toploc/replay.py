"""Seed replay and its score: is each token of a sample the one its seed draws? (check 4 of checks.py,
every spot-checked group, whatever engine it claims)

Both engines draw token t of sample i as the inverse CDF of the filtered distribution at the
uniform u_t of the sample's own stream (rlfleet/models/sampling.py; vLLM through its worker's sampler
hook). The gate holds the same distribution from its prefill (logits (T, V) of the claimed version
at the run's temperature) and the same uniforms from the seed, so it re-draws the positions a chunk
of rows at a time (`GroupReplay`, CHUNK_ELEMENTS), no decoding. A position *matches* when u_t * mass
falls in the claimed token's CDF interval widened by `tolerance`, under the gate's top-k/top-p set
or that set with its boundaries moved by +-`tolerance` (a near tie at the k-th logit or at the top_p
mass): the float noise of another batch shape, thread count, engine or precision.

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

Where the calibration tolerates some mismatches (GPU rows), `possible_tokens` adds the impossible_token check:
every claimed token must at least be one top-k / top-p could have left.

What replay cannot catch: a worker that chooses the seed itself can try many and submit the group it
likes (grinding); the run can assign seeds and tasks instead (rlfleet/fleet/assignment.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rlfleet.models.sampling import keep_mask, sample_seed, sample_uniforms
from rlfleet.tasks.turns import model_positions

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


def possible_tokens(
    logp: torch.Tensor, tokens: torch.Tensor, top_p: float, top_k: int, slack: float, top_p_slack: float = 0.0
) -> torch.Tensor:
    """(T,) bool: whether each sampled token can survive top-k then top-p filtering (rlfleet.models.sampling.keep_mask).

    logp (T, V) is log_softmax(logits / temperature) recomputed by the verifier; it may differ from the
    worker's by about `slack` per entry, so only tokens more likely than the sampled one by 2*slack count
    as certainly ranked above it. A token is impossible when top_k or more tokens are certainly above
    it, or when their mass (renormalised over an upper bound of the top-k mass) exceeds top_p by more
    than `top_p_slack`.
    """
    tok = logp.gather(-1, tokens[:, None])  # (T, 1)
    above = logp > tok + 2 * slack  # (T, V)
    ok = torch.ones(tokens.shape[0], dtype=torch.bool, device=logp.device)
    if top_k > 0:
        ok &= above.sum(-1) < top_k
    if top_p < 1.0:
        probs = logp.exp()  # (T, V)
        if 0 < top_k < logp.shape[-1]:
            kth = logp.topk(top_k, dim=-1).values[:, -1:]  # (T, 1)
            z = probs.masked_fill(logp < kth - 2 * slack, 0.0).sum(-1)  # >= the worker's kept mass
        else:
            z = torch.ones(tokens.shape[0], device=logp.device)
        mass = (probs * above).sum(-1) / z  # (T,) mass certainly before the token in the nucleus order
        ok &= mass <= top_p + top_p_slack
    return ok


# Entries of a (rows, vocabulary) logits chunk replayed at once (the gate's prefill scores its logprobs in chunks
# of as many rows too). The replay makes several tensors of a chunk's shape (softmax, float64 CDF, masks,
# log-probabilities): 0.75 GiB at its peak whatever the group's length (benchmarks/replay_memory.py), where the
# replay of all rows at once peaked at about 9x the group's logits, 40 GB alone at 16 x 4,096 rows of a 152k
# vocabulary in fp32.
CHUNK_ELEMENTS = 1 << 24


def logits_chunk_rows(vocab: int) -> int:
    """Rows of a logits chunk at this vocabulary (at least one)."""
    return max(1, CHUNK_ELEMENTS // vocab)


def completion_chunks(logits: list[torch.Tensor], rows: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, chunk) of the samples' completion rows `logits` (T_i, V) taken as one (sum T_i, V) sequence, `rows`
    rows a chunk (default logits_chunk_rows): chunk rows [start, start + len) of it. For logits already held whole."""
    if not logits:
        return
    rows = rows or logits_chunk_rows(logits[0].shape[-1])
    bounds = np.cumsum([0, *(len(x) for x in logits)])
    for start in range(0, int(bounds[-1]), rows):
        stop = min(start + rows, int(bounds[-1]))
        parts = []
        for i, x in enumerate(logits):  # the slices of the samples that overlap [start, stop)
            lo, hi = max(start, int(bounds[i])), min(stop, int(bounds[i + 1]))
            if lo < hi:
                parts.append(x[lo - int(bounds[i]) : hi - int(bounds[i])])
        yield start, parts[0] if len(parts) == 1 else torch.cat(parts)


class GroupReplay:
    """The replay of one group fed its completion rows' logits a chunk at a time (`add`), then its `score`.

    Row t of the group is model token t of the samples' completions laid end to end (sample 0's first): every token
    of a completion, the model spans' tokens of a multi-turn transcript (rlfleet/tasks/turns.py), whose k-th model
    token draws with its stream's k-th uniform. Every row is
    replayed alone (`_replay_rows`), so chunking changes no verdict: the score is the one of all rows at once. The
    tokens and uniforms of every row are held (a few bytes a row, on the device of the first chunk: the prefill's,
    a GPU's when the verifier has one, where the draws are redone); logits only a chunk at a time."""

    def __init__(self, group, tolerance: float):
        sp = group.sampling
        self.top_p, self.top_k, self.tolerance = sp.top_p, sp.top_k, tolerance
        # the positions each sample's model drew: all of a completion, a multi-turn transcript's model spans
        self.positions = [model_positions(s.spans, len(s.completion_ids)) for s in group.samples]
        lengths = [len(p) for p in self.positions]
        self.starts = np.cumsum([0, *lengths])
        tokens = [s.completion_ids[t] for s, positions in zip(group.samples, self.positions) for t in positions]
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        uniforms = [sample_uniforms(sample_seed(sp.seed, i), n) for i, n in enumerate(lengths)]
        self.uniforms = torch.from_numpy(np.concatenate(uniforms) if uniforms else np.zeros(0))
        self.mismatches, self.surprise = 0, 0.0
        self.first_row: int | None = None

    @property
    def rows(self) -> int:
        return int(self.starts[-1])

    def where(self, row: int) -> tuple[int, int]:
        """(sample, completion position) of row `row`."""
        i = int(np.searchsorted(self.starts, row, side="right")) - 1
        return i, self.positions[i][row - int(self.starts[i])]

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Replay rows [start, start + len(logits)) from their logits (already divided by the temperature); each row
        once (a row added twice would be counted twice)."""
        if self.tokens.device != logits.device:
            self.tokens, self.uniforms = self.tokens.to(logits.device), self.uniforms.to(logits.device)
        stop = start + logits.shape[0]
        ok, surprise = _replay_rows(
            logits, self.tokens[start:stop], self.uniforms[start:stop], self.top_p, self.top_k, self.tolerance
        )
        bad = (~ok).nonzero()[:, 0]
        if len(bad):  # chunks may come in any order
            row = start + int(bad[0])
            self.first_row = row if self.first_row is None else min(self.first_row, row)
        self.mismatches += len(bad)
        self.surprise += float(surprise.sum())

    def score(self) -> ReplayScore:
        first = self.where(self.first_row) if self.first_row is not None else None
        return ReplayScore(self.rows, self.mismatches, self.surprise, first)


def group_score(logits: list[torch.Tensor], group, tolerance: float) -> ReplayScore:
    """The replay score of `group` (module docstring); logits[i] (T_i, V) of sample i, replayed a chunk of rows at
    a time (GroupReplay)."""
    if not group.samples:
        return ReplayScore()
    replay = GroupReplay(group, tolerance)
    for start, chunk in completion_chunks(logits):
        replay.add(start, chunk)
    return replay.score()
