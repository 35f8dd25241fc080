"""The torch engine: any HF causal LM, CPU or GPU, batched sampling with a KV cache.

`TorchEngine.generate` samples G completions of one prompt as a batch of G rows (no padding needed),
with a KV cache: the prompt is prefilled once and its cache repeated G times (the rows are identical
until the first sampled token; this is most of a 1-token group's time, e.g. the first token after
a weight swap). Each step feeds the previously sampled token, so the final
hidden state of every completion position is produced by the decode itself; the last token is
fed once more after sampling stops, so proofs cover every completion token without a second
prefill. Token logprobs are those of `log_softmax(logits / temperature)` over the full vocabulary
(what the trainer and verifier recompute); top-p/top-k only restrict which tokens may be drawn.

Tokens are drawn as rlfleet/models/sampling.py says (inverse CDF of each sample's own uniform stream), so a
sample depends on the weights, the prompt and its seed only, not on the batch it was drawn in: the
gate replays it from one prefill (rlfleet/services/toploc/replay.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rlfleet.models.policy import load_policy, load_weights_in_place
from rlfleet.models.sampling import (
    completion_budget,
    context_length,
    draw,
    keep_mask,
    sample_seed,
    sample_uniforms,
    stop_token_ids,
)
from rlfleet.services.rollout.engines.base import Engine, Generation
from rlfleet.wire.streams import SamplingParams


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """(B, V) logits with tokens outside top-k / the top-p nucleus set to -inf."""
    return logits.masked_fill(~keep_mask(logits, top_p, top_k), float("-inf"))


class TorchEngine(Engine):
    name = "torch"

    def __init__(self, model_dir: Path, version: int, dtype: str = "float32"):
        self.model, self.tokenizer = load_policy(model_dir, dtype)
        self.version = version
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id

    def load_weights(self, model_dir: Path, version: int) -> None:
        load_weights_in_place(self.model, model_dir)
        self.version = version

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int, first: int = 0) -> list[Generation]:
        budget = completion_budget(params.max_tokens, len(prompt_ids), context_length(self.model))
        if budget < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to generate in the model's "
                f"{context_length(self.model)}-token context; shorten spec.task's prompts or use a longer-context model"
            )
        uniforms = torch.from_numpy(
            np.stack([sample_uniforms(sample_seed(params.seed, first + i), budget) for i in range(n)])
        )  # (n, budget) float64
        stops = torch.tensor(sorted(self.stop_ids))
        body = self.model.model
        ids = torch.tensor([prompt_ids], dtype=torch.long)  # (1, P): the n rows share it
        out = body(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)  # every layer's keys and values (1, heads, P, d) -> (n, heads, P, d)
        hidden = [out.last_hidden_state.expand(n, -1, -1)]  # [(n, P, H)]
        tokens, logprobs = [], []
        done = torch.zeros(n, dtype=torch.bool)
        for t in range(budget):
            logits = self.model.lm_head(hidden[-1][:, -1]).float() / params.temperature  # (n, V)
            logp_all = torch.log_softmax(logits, dim=-1)
            nxt = draw(logits, keep_mask(logits, params.top_p, params.top_k), uniforms[:, t])  # (n,)
            nxt = torch.where(done, torch.full_like(nxt, self.eos_id), nxt)
            tokens.append(nxt)
            logprobs.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            out = body(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            hidden.append(out.last_hidden_state)  # (n, 1, H): the row of the token just fed
            self.heartbeat = time.monotonic()  # a forward step completed (liveness, base.py)
            done = done | torch.isin(nxt, stops)
            if bool(done.all()):
                break
        all_hidden = torch.cat(hidden, dim=1)  # (n, P + T, H)
        toks = torch.stack(tokens, dim=1)  # (n, T)
        lps = torch.stack(logprobs, dim=1)
        result = []
        for i in range(n):
            row = toks[i].tolist()
            stop = next((j + 1 for j, tok in enumerate(row) if tok in self.stop_ids), None)
            end = stop or len(row)
            result.append(
                Generation(
                    completion_ids=row[:end],
                    logprobs=lps[i, :end].tolist(),
                    hidden=all_hidden[i, : len(prompt_ids) + end].clone(),
                    finish_reason="stop" if stop else "length",
                    version=self.version,
                )
            )
        return result
