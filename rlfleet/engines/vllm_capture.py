"""Assembling what vLLM's worker captured (vllm_worker.py's `CaptureExtension`) into one completion's
hidden rows and logprobs; no vLLM call, so it reads without vLLM.

A capture entry per request: the final hidden rows it computed, keyed by position, and per sampled
position the (token, logprob) the sampler hooks recorded. A completion of prompt length P and T
tokens takes prompt rows 0..P-1 from the group's first request (which skips reading the prefix
cache), rows P..P+T-1 from its own decode steps or, for its last token when it stopped at EOS,
from its 1-token continuation request; its logprob j is the one recorded at position P + j, for
exactly the token it holds. Invariant: every position has a row and every token its logprob, or
`CaptureError` names the first missing ones (the hooks no longer match vLLM's runner, or a step
ran where the hooks do not fire, e.g. a replayed CUDA graph).
"""

from __future__ import annotations

import torch

from rlfleet.engines.vllm_pin import VLLM_VERSION


def decode_capture(entry: dict) -> tuple[dict[int, torch.Tensor], dict[int, tuple[int, float]]]:
    """(position -> (H,) row, position -> (token, logprob)) of one request's drained capture."""
    flat = torch.frombuffer(bytearray(entry["hidden"]), dtype=torch.uint8)
    hidden = flat.view(getattr(torch, entry["dtype"])).view(*entry["shape"])
    rows = {p: hidden[i] for i, p in enumerate(entry["positions"])}
    return rows, {p: (t, lp) for p, t, lp in entry["sampled"]}


class CaptureError(RuntimeError):
    """The capture holds no row, or another token, for a position of a sequence (the hooks missed a step)."""


def assemble(prompt_ids, completion, prompt_rows, rows, tail_rows, sampled) -> tuple[torch.Tensor, list[float]]:
    """(P + T, H) hidden rows and (T,) logprobs of one completion from the captured pieces."""
    p, length = len(prompt_ids), len(prompt_ids) + len(completion)
    pick = [prompt_rows.get(i) if i < p else rows.get(i, tail_rows.get(i)) for i in range(length)]
    missing = [i for i, r in enumerate(pick) if r is None]
    if missing:
        raise CaptureError(
            f"vLLM capture holds no hidden state for positions {missing[:5]} of a {length}-token "
            f"sequence; the capture hooks no longer match vLLM {VLLM_VERSION}'s runner"
        )
    logprobs = []
    for j, token in enumerate(completion):
        got = sampled.get(p + j)
        if got is None or got[0] != token:
            raise CaptureError(
                f"vLLM capture recorded {got} for completion token {j} ({token}); the sampler hook "
                f"no longer matches vLLM {VLLM_VERSION}"
            )
        logprobs.append(got[1])
    return torch.stack(pick), logprobs
