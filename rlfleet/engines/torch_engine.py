"""The torch engine: any HF causal LM, on the device it is given, batched sampling with a KV cache.

`TorchEngine.generate_groups` samples several groups (each its own prompt, seed and sampling
parameters) as one batch of rows, one row per sample:
- Prefill: each request's prompt is prefilled once, unpadded, in one forward with the other requests'
  prompts of the same length (a batch of one when its length is alone; otherwise only the batch shape
  differs from a one-group call, as in decode below), and its cache repeated for the request's n rows
  (the rows are identical until the first sampled token).
- Padded cache: the prompts' caches are left-padded with zero keys and values to the longest prompt
  Pmax and stacked, so row r holds its prompt of P_r tokens at cache slots Pmax-P_r .. Pmax-1.
  Every decode step passes an attention mask that hides the pad slots (they get exactly zero
  weight) and explicit position ids (P_r + t for the t-th completion token), so each row's
  attention and rotary positions are those of the row alone; only the batch shape differs, whose
  float noise the gate's replayTolerance absorbs. Decode queries are never pad, so no row of the
  softmax is fully masked.
- Decode: all rows step together. Each step feeds the previously sampled token, so the final hidden
  state of every completion position is produced by the decode itself; the last token is fed once
  more after sampling stops, so proofs cover every completion token without a second prefill.
  A row is done at its first stop token or at its own budget (`completion_budget` of its prompt);
  done rows are fed EOS until every row is done and their extra tokens are dropped.
Invariants: the hidden rows a Generation returns are exactly its P + T positions (no pad slot), on
the CPU; every tensor is made on the model's device; one call runs on one weights version (the
worker swaps weights between calls). Token logprobs are those of `log_softmax(logits / temperature)`
over the full vocabulary (what the trainer and verifier recompute); top-p/top-k only restrict which
tokens may be drawn.

Tokens are drawn as rlfleet/models/sampling.py says (inverse CDF of each sample's own uniform stream,
`sample_seed(seed, first + i)`), so a sample depends on the weights, the prompt and its seed only,
not on the batch it was drawn in: the gate replays it from one prefill (rlfleet/services/toploc/replay.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlfleet.engines.adapters import InPlace
from rlfleet.engines.base import Engine, Generation, GroupRequest
from rlfleet.models.policy import load_policy, load_weights_in_place
from rlfleet.models.sampling import (
    completion_budget,
    context_length,
    draw,
    keep_mask,
    keep_mask_rows,
    sample_seed,
    sample_uniforms,
    stop_token_ids,
)
from rlfleet.versions.adapter import is_adapter_dir


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """(B, V) logits with tokens outside top-k / the top-p nucleus set to -inf."""
    return logits.masked_fill(~keep_mask(logits, top_p, top_k), float("-inf"))


class TorchEngine(Engine):
    name = "torch"
    # benchmarks/rollout.py on 2 CPU cores, groups of 8: 1 -> 4 -> 8 -> 16 in flight gave 617 -> 1533 -> 2088
    # -> 2258 tokens/s; past 8 little is gained, while the (rows, vocabulary) logits of each step (float64
    # in `draw`) grow with every row: for a 150k-token vocabulary 128 rows hold ~150 MB per copy
    default_groups_in_flight = 8

    def __init__(self, model_dir: Path, version: int, dtype: str = "float32", device: str | torch.device = "cpu"):
        self.model, self.tokenizer = load_policy(model_dir, dtype, device)  # make_engine chooses the device
        self.device = next(self.model.parameters()).device
        self.version = version
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.context = context_length(self.model)
        self.eos_id = self.tokenizer.eos_token_id
        self.adapters = InPlace(self.model, model_dir)  # a LoRA run's versions: adapters over this base

    def load_weights(self, model_dir: Path, version: int) -> None:
        if is_adapter_dir(model_dir):
            self.adapters.apply(model_dir)
        else:
            load_weights_in_place(self.model, model_dir)
            self.adapters = InPlace(self.model, model_dir)  # whole weights: the base of any later adapter
        self.version = version

    def load_own_adapter(self, adapter_dir: Path, version: int) -> None:
        """Merge an adapter that this process trained over this engine's own base, as the trainer's held-out
        evaluation holds it: a copy taken before the publisher writes and signs the manifest that names the base
        (so `load_weights`, which refuses an adapter without one, cannot take it). Anything fetched goes through
        `load_weights`."""
        self.adapters.merger.apply(adapter_dir)
        self.version = version

    def _budget(self, prompt_ids: list[int], max_tokens: int) -> int:
        context = self.context
        budget = completion_budget(max_tokens, len(prompt_ids), context)
        if budget < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to generate in the model's "
                f"{context}-token context; shorten spec.task's prompts or use a longer-context model"
            )
        return budget

    def _prefill(self, requests: list[GroupRequest], pmax: int) -> tuple[DynamicCache, torch.Tensor]:
        """The padded cache of every row (module docstring) and the rows' (B, Pmax, H) prompt states. The
        requests whose prompts have the same length are prefilled in one forward, unpadded."""
        by_length: dict[int, list[int]] = {}
        for k, r in enumerate(requests):
            by_length.setdefault(len(r.prompt_ids), []).append(k)
        # request index -> each layer's (keys, values), (1, heads, P, d), and its (1, P, H) prompt states
        states: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {}
        for ks in by_length.values():
            ids = torch.tensor([requests[k].prompt_ids for k in ks], dtype=torch.long, device=self.device)  # (b, P)
            out = self.model.model(input_ids=ids, use_cache=True)
            for j, k in enumerate(ks):
                kv = [(layer.keys[j : j + 1], layer.values[j : j + 1]) for layer in out.past_key_values.layers]
                states[k] = (kv, out.last_hidden_state[j : j + 1])
        layers: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        hidden = []
        for k, r in enumerate(requests):
            kv, prompt_hidden = states[k]
            pad = pmax - len(r.prompt_ids)
            for i, pair in enumerate(kv):
                if i == len(layers):
                    layers.append(([], []))
                for slot, tensor in zip(layers[i], pair):
                    slot.append(F.pad(tensor, (0, 0, pad, 0)).expand(r.n, -1, -1, -1))
            hidden.append(F.pad(prompt_hidden, (0, 0, pad, 0)).expand(r.n, -1, -1))
        cache = DynamicCache(ddp_cache_data=[(torch.cat(k), torch.cat(v)) for k, v in layers], config=self.model.config)
        return cache, torch.cat(hidden)

    @torch.inference_mode()
    def generate_groups(self, requests: list[GroupRequest]) -> list[list[Generation]]:
        if not requests:
            return []
        dev = self.device
        budgets = [self._budget(r.prompt_ids, r.params.max_tokens) for r in requests]
        row_of = [k for k, r in enumerate(requests) for _ in range(r.n)]  # request of each row
        lengths = [len(requests[k].prompt_ids) for k in row_of]
        row_budget = [budgets[k] for k in row_of]
        filters = [(requests[k].params.top_p, requests[k].params.top_k) for k in row_of]
        pmax, steps, rows = max(lengths), max(budgets), len(row_of)
        uniforms = np.zeros((rows, steps))
        row = 0
        for r, budget in zip(requests, budgets):
            for i in range(r.n):
                stream = sample_uniforms(sample_seed(r.params.seed, r.first + i), r.draws_from + budget)
                uniforms[row, :budget] = stream[r.draws_from :]
                row += 1
        u = torch.from_numpy(uniforms).to(dev)  # (B, steps) float64
        temperature = torch.tensor([requests[k].params.temperature for k in row_of], device=dev)[:, None]
        stops = torch.tensor(sorted(self.stop_ids), device=dev)
        last = torch.tensor(row_budget, device=dev) - 1  # the step at which a row has its budget
        length = torch.tensor(lengths, device=dev)
        # None when no row is padded: then nothing differs from a row decoded alone but the batch shape
        pad_mask = (
            (torch.arange(pmax, device=dev)[None, :] >= pmax - length[:, None]).long() if min(lengths) < pmax else None
        )
        cache, prompt_hidden = self._prefill(requests, pmax)
        hidden = [prompt_hidden]  # [(B, Pmax, H), then (B, 1, H) per step]
        tokens, logprobs = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        for t in range(steps):
            logits = self.model.lm_head(hidden[-1][:, -1]).float() / temperature  # (B, V)
            logp_all = torch.log_softmax(logits, dim=-1)
            nxt = draw(logits, keep_mask_rows(logits, filters), u[:, t])  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, self.eos_id), nxt)
            tokens.append(nxt)
            logprobs.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
            mask = None if pad_mask is None else F.pad(pad_mask, (0, t + 1), value=1)  # (B, Pmax + t + 1)
            out = self.model.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=(length + t)[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            hidden.append(out.last_hidden_state)  # (B, 1, H): the row of the token just fed
            self.heartbeat = time.monotonic()  # a forward step completed (liveness, base.py)
            done = done | torch.isin(nxt, stops) | (last <= t)
            if bool(done.all()):
                break
        all_hidden = torch.cat(hidden, dim=1)  # (B, Pmax + T, H)
        toks = torch.stack(tokens, dim=1).tolist()  # (B, T)
        lps = torch.stack(logprobs, dim=1).cpu()
        result: list[list[Generation]] = [[] for _ in requests]
        for b, (k, p, budget) in enumerate(zip(row_of, lengths, row_budget)):
            row_tokens = toks[b][:budget]
            stop = next((j + 1 for j, tok in enumerate(row_tokens) if tok in self.stop_ids), None)
            end = stop or len(row_tokens)
            result[k].append(
                Generation(
                    completion_ids=row_tokens[:end],
                    logprobs=lps[b, :end].tolist(),
                    hidden=all_hidden[b, pmax - p : pmax + end].to("cpu", copy=True),  # its P + T rows only
                    finish_reason="stop" if stop else "length",
                    version=self.version,
                )
            )
        return result
