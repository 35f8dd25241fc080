"""Token logprobs in chunks of positions, so `[positions x vocabulary]` never exists whole.

For N scored positions with final hidden states h (N, H), output head W (V, H) and targets y (N,):
  logp_n = log_softmax(W h_n / T)[y_n],   entropy_n = -sum_v p_nv log p_nv
computed `chunk` positions at a time. Each chunk's logits are made in fp32 (whatever the model's
dtype), reduced to its (chunk,) logprobs and entropies, and dropped. With gradients on, every chunk
runs under non-reentrant activation checkpointing: the forward keeps only the chunk's hidden
states (a view) and the backward recomputes that chunk's logits, takes their gradient and frees
them before the next chunk's (autograd runs the chunks' backwards one after another, latest
first). Peak memory of the head is then O(chunk x V) instead of O(N x V): for 8,192 positions and
Qwen2.5's 151,936 tokens, 0.6 GB per 1,024-position chunk instead of 5 GB of fp32 logits, plus as
much again for log_softmax and its gradient. The result is the same math as the whole-batch
log_softmax, position by position (float summation order inside a row is the same; only the
matmul's blocking may differ).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool):
    logits = head(hidden).float() / temperature  # (c, V): the only vocabulary-wide tensors, one chunk's
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else logp.new_zeros(0)
    return logp, ent


def chunked_token_logprobs(
    head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int, want_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) logprobs of `targets` and, if asked, (N,) entropies, from (N, H) `hidden` through `head`
    (the LM's output layer), `chunk` positions at a time."""
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        args = (head, hidden[start : start + chunk], targets[start : start + chunk], temperature, want_entropy)
        logp, ent = checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if want_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if want_entropy else None)
