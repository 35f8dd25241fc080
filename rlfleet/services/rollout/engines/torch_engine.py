"""The torch engine: any HF causal LM, CPU or GPU, batched sampling with a KV cache.

`TorchEngine.generate` samples G completions of one prompt as a batch of G rows (no padding needed),
with a KV cache: the prompt is prefilled once and its cache repeated G times (the rows are identical
until the first sampled token; this is most of a 1-token group's time, e.g. the first token after
a weight swap). Each step feeds the previously sampled token, so the final
hidden state of every completion position is produced by the decode itself; the last token is
fed once more after sampling stops, so proofs cover every completion token without a second
prefill. Token logprobs are those of `log_softmax(logits / temperature)` over the full vocabulary
(what the trainer and verifier recompute); top-p/top-k only restrict which tokens may be drawn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlfleet.policy import load_policy, load_weights_in_place
from rlfleet.services.rollout.engines.base import Engine, Generation
from rlfleet.streams import SamplingParams


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """(B, V) logits with tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class TorchEngine(Engine):
    def __init__(self, model_dir: Path, version: int, dtype: str = "float32"):
        self.model, self.tokenizer = load_policy(model_dir, dtype)
        self.version = version
        self.eos_id = self.tokenizer.eos_token_id

    def load_weights(self, model_dir: Path, version: int) -> None:
        load_weights_in_place(self.model, model_dir)
        self.version = version

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[Generation]:
        gen = torch.Generator().manual_seed(params.seed)
        body = self.model.model
        ids = torch.tensor([prompt_ids], dtype=torch.long)  # (1, P): the n rows share it
        out = body(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)  # every layer's keys and values (1, heads, P, d) -> (n, heads, P, d)
        hidden = [out.last_hidden_state.expand(n, -1, -1)]  # [(n, P, H)]
        tokens, logprobs = [], []
        done = torch.zeros(n, dtype=torch.bool)
        for _ in range(params.max_tokens):
            logits = self.model.lm_head(hidden[-1][:, -1]).float() / params.temperature  # (n, V)
            logp_all = torch.log_softmax(logits, dim=-1)
            probs = torch.softmax(filter_logits(logits, params.top_p, params.top_k), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # (n,)
            nxt = torch.where(done, torch.full_like(nxt, self.eos_id), nxt)
            tokens.append(nxt)
            logprobs.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            out = body(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            hidden.append(out.last_hidden_state)  # (n, 1, H): the row of the token just fed
            done = done | (nxt == self.eos_id)
            if bool(done.all()):
                break
        all_hidden = torch.cat(hidden, dim=1)  # (n, P + T, H)
        toks = torch.stack(tokens, dim=1)  # (n, T)
        lps = torch.stack(logprobs, dim=1)
        result = []
        for i in range(n):
            row = toks[i].tolist()
            stop = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            result.append(
                Generation(
                    completion_ids=row[:stop],
                    logprobs=lps[i, :stop].tolist(),
                    hidden=all_hidden[i, : len(prompt_ids) + stop].clone(),
                    finish_reason="stop" if self.eos_id in row else "length",
                    version=self.version,
                )
            )
        return result
