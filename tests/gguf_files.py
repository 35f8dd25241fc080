"""Small GGUF files written in code with the `gguf` package's writer, as llama.cpp's convert_hf_to_gguf.py
writes a Llama: a random tiny `LlamaForCausalLM` (the reference a test compares the conversion to) exported with
llama.cpp's tensor names and its reordering of the query and key rows, and a byte-level BPE tokenizer (256 byte
tokens, a few merges, ChatML's control tokens and a chat template)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: unk, bos, eos (and pad)
MERGES = ["Ġ t", "h e", "Ġt he", "i s"]


def byte_level_vocab() -> tuple[list[str], list[int]]:
    """(tokens, llama.cpp token types): the specials (3, CONTROL), the 256 bytes in GPT-2's byte alphabet and
    the merges' results (1, NORMAL)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = [*SPECIALS, *bytes_to_unicode().values(), *merged]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def tiny_llama(seed: int = 0, *, tied: bool = True):
    """A random 2-layer Llama over the byte-level vocabulary, with grouped-query attention (4 heads, 2 kv)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(byte_level_vocab()[0]),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that a weight left out or misplaced shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a query or key projection's rows (its rotary embedding pairs neighbours, HF's halves)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_llama_gguf(model, dest: Path, *, float16: bool = False, architecture: str = "llama") -> Path:
    """`model` (tiny_llama) as the GGUF file `dest`, tensors in F32 (or F16); a tied head is written once, as
    llama.cpp does (no output.weight)."""
    import gguf

    config = model.config
    cast = np.float16 if float16 else np.float32
    writer = gguf.GGUFWriter(str(dest), architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if float16 else gguf.LlamaFileType.ALL_F32)
    tokens, types = byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    projections = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"}
    projections |= {"self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up"}
    projections |= {"mlp.down_proj": "ffn_down"}
    rows_reordered = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].astype(cast))
    for i in range(config.num_hidden_layers):
        for hf, ours in norms.items():  # norms stay F32 in an F16 file, as llama.cpp writes them
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[f"model.layers.{i}.{hf}.weight"])
        for hf, ours in projections.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if ours in rows_reordered:
                weight = _permute(weight, rows_reordered[ours])
            writer.add_tensor(f"blk.{i}.{ours}.weight", weight.astype(cast))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"].astype(cast))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
