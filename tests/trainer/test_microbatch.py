"""Bounded memory per step (update.py, rlfleet/models/logprobs.py, precision.py): micro-batches give
the one-batch gradient, logprobs never make a [tokens x vocab] tensor, fp32 master weights keep
small updates, and the off-policy weights (loss.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlfleet.config import TrainerSpec
from rlfleet.models.policy import Prefill, score
from rlfleet.services.trainer.loss import off_policy_weights
from rlfleet.services.trainer.precision import precision_for
from rlfleet.services.trainer.update import UpdateSettings, grpo_update, micro_batches
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams


def qwen(vocab: int = 64, hidden: int = 32, dtype=torch.float32, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


def groups(vocab: int, count: int = 3, size: int = 4, prompt: int = 5, seed: int = 0) -> list[RolloutGroup]:
    """`count` groups of `size` completions of lengths 2..(size + count), mixed rewards."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(count):
        samples = []
        for i in range(size):
            n = 2 + (3 * g + i) % (size + count)
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            samples.append(Sample(ids, (-torch.rand(n, generator=gen) * 3 - 1).tolist(), [], float((g + i) % 2)))
        prompt_ids = torch.randint(3, vocab, (prompt + g,), generator=gen).tolist()
        out.append(RolloutGroup(f"t-{g}", "w", 0, prompt_ids, SamplingParams(1.0, 1.0, 0, 8, 0), samples))
    return out


def gradients(model, spec: TrainerSpec, batch, reference=None) -> dict[str, torch.Tensor]:
    """The accumulated gradient of one update (SGD at lr 0 leaves the weights; no clipping)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grpo_update(Prefill(model), optimizer, batch, UpdateSettings.of(spec, 0.9, 0), reference)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_micro_batches_pack_by_padded_tokens_longest_first():
    assert micro_batches([3, 9, 4, 8, 2], 18) == [[1, 3], [2, 0, 4]]
    assert micro_batches([30, 2], 16) == [[0], [1]]  # a row over budget goes alone
    assert micro_batches([], 16) == []


@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("regularised", [False, True])
def test_micro_batches_accumulate_the_one_batch_gradient(normalization, regularised):
    model = qwen(dtype=torch.float64)
    reference = qwen(dtype=torch.float64, seed=1) if regularised else None
    batch = groups(64)
    coefs = {"entropy_coef": 0.05, "kl_coef": 0.2} if regularised else {}
    common = dict(normalization=normalization, max_grad_norm=1e9, **coefs)
    whole = gradients(model, TrainerSpec(micro_batch_tokens=100_000, **common), batch, reference)
    lengths = [len(g.prompt_ids) + len(s.completion_ids) for g in batch for s in g.samples]
    assert len(micro_batches(lengths, 40)) == 4
    split = gradients(model, TrainerSpec(micro_batch_tokens=40, logprob_chunk=7, **common), batch, reference)
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_chunked_scores_and_their_gradients_equal_the_whole_vocabulary_ones():
    model = qwen(dtype=torch.float64)
    rows = [[5, 9, 11, 3, 7, 40], [8, 2, 60], [1, 2, 3, 4]]
    results = []
    for chunk in (0, 2):
        model.zero_grad()
        scored = score(model, rows, 0.7, 0, want_entropy=True, chunk=chunk)
        total = sum(lp.sum() for lp in scored.logprobs) + sum(e.sum() for e in scored.entropy)
        total.backward()
        results.append((scored, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (whole, whole_grads), (chunked, chunked_grads) = results
    for a, b in zip(whole.logprobs + whole.entropy, chunked.logprobs + chunked.entropy):
        torch.testing.assert_close(b, a)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, msg=name)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op makes while active, forward and backward alike."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest_in_update(spec: TrainerSpec, vocab: int, batch) -> int:
    model = qwen(vocab=vocab, hidden=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LargestTensor() as tracker:
        grpo_update(Prefill(model), optimizer, batch, UpdateSettings.of(spec, 1.0, 0))
    return tracker.largest


def test_no_tensor_of_a_micro_batch_by_the_vocabulary_exists_in_a_step():
    vocab = 32_000
    batch = groups(vocab, count=2, size=4, prompt=40)  # rows of 42..48 tokens
    budget = 4 * 48  # four rows per micro-batch
    positions = budget  # an upper bound of a micro-batch's scored positions
    lengths = [len(g.prompt_ids) + len(s.completion_ids) for g in batch for s in g.samples]
    smallest_mb = min(sum(lengths[i] - 1 for i in mb) for mb in micro_batches(lengths, budget))
    chunked = largest_in_update(TrainerSpec(micro_batch_tokens=budget, logprob_chunk=32), vocab, batch)
    assert chunked < smallest_mb * vocab  # no [micro-batch tokens x vocab] tensor
    assert chunked <= 32 * vocab  # the largest is one chunk's logits
    # The tracker sees such a tensor when chunks span the micro-batch, so the bound above is a real one.
    whole = largest_in_update(TrainerSpec(micro_batch_tokens=budget, logprob_chunk=positions), vocab, batch)
    assert whole >= smallest_mb * vocab


def changed_fraction(before: dict, model) -> float:
    changed = total = 0
    for name, p in model.named_parameters():
        changed += int((p.detach() != before[name]).sum())
        total += p.numel()
    return changed / total


def test_fp32_master_weights_keep_an_update_that_bf16_weights_round_away():
    spec = TrainerSpec(learning_rate=1e-6, master_weights=True)
    precision = precision_for("bfloat16", spec)
    assert precision.load_dtype == "float32" and precision.compute_dtype == torch.bfloat16
    assert precision_for("bfloat16", TrainerSpec(master_weights=False)).compute_dtype is None
    assert precision_for("float32", spec).compute_dtype is None
    batch = groups(64)
    bf16 = qwen(dtype=torch.bfloat16)
    master = copy.deepcopy(bf16).float()
    results = {}
    for name, model, compute in (("bf16", bf16, None), ("master", master, precision.compute_dtype)):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate)
        grpo_update(Prefill(model), optimizer, batch, UpdateSettings.of(spec, 1.0, 0, compute))
        results[name] = changed_fraction(before, model)
    assert results["bf16"] < 0.05, results  # AdamW moves by ~1e-6: below bf16 resolution but for weights near 0
    assert results["master"] > 0.5, results


def test_off_policy_weights_truncate_or_mask_the_ratio_of_trainer_to_sampler():
    sampler = torch.log(torch.tensor([[0.5, 0.1, 0.2, 0.3], [0.4, 0.4, 0.05, 0.9]]))
    trainer = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.3], [0.2, 0.4, 0.5, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rho = torch.tensor([[1.0, 3.0, 0.5, 0.0], [0.5, 1.0, 10.0, 1.0]])
    tis, stats = off_policy_weights(trainer, sampler, mask, "tis", 2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.5, 0.0], [0.5, 1.0, 2.0, 1.0]]))
    assert stats["offpolicy_truncated_fraction"] == 2.0  # two tokens over the cap (a sum; the caller divides)
    assert stats["offpolicy_ratio_mean"] == pytest.approx(float(rho.sum()))
    assert stats["offpolicy_ratio_max"] == pytest.approx(10.0)
    mis, stats = off_policy_weights(trainer, sampler, mask, "mis", 2.0)
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]]))
    assert stats["offpolicy_masked_fraction"] == 2.0


def test_an_off_policy_update_reports_the_ratio_and_weighs_the_gradient():
    model = qwen(dtype=torch.float64)
    batch = groups(64)
    for g in batch:  # the sampler claims the trainer's own logprobs, but doubles one token's probability
        for i, s in enumerate(g.samples):
            row = g.prompt_ids + s.completion_ids
            lp = score(model, [row], 0.9, 0).logprobs[0][len(g.prompt_ids) - 1 :].tolist()
            s.logprobs = [v + (math.log(2.0) if (i == 0 and j == 0) else 0.0) for j, v in enumerate(lp)]
    base = dict(max_grad_norm=1e9)
    tis = TrainerSpec(off_policy={"mode": "tis", "cap": 2.0}, **base)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = grpo_update(Prefill(model), optimizer, batch, UpdateSettings.of(tis, 0.9, 0))
    tokens = sum(len(s.completion_ids) for g in batch for s in g.samples)
    assert stats["offpolicy_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert stats["offpolicy_ratio_mean"] == pytest.approx((tokens - 3 + 3 * 0.5) / tokens, abs=1e-5)
    assert stats["offpolicy_truncated_fraction"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-9)  # against the trainer's own logprobs
    none = gradients(model, TrainerSpec(**base), batch)
    weighted = gradients(model, tis, batch)
    assert any(not torch.allclose(none[n], weighted[n]) for n in none)


def test_a_bf16_run_trains_fp32_masters_and_publishes_bf16(tmp_path, redis_url):
    import threading

    from safetensors.torch import load_file

    from rlfleet.config import parse_bundle
    from rlfleet.services.trainer.main import Trainer
    from rlfleet.services.trainer.sharding import full_model_state
    from rlfleet.wire.runtime import Context
    from rlfleet.wire.streams import RunKeys
    from rlfleet.wire.views import VIEWS, view_bundle
    from tests.runs import bundle_yaml, rlrun
    from tests.support import redis_from_url, tiny_policy_dir
    from tests.trainer.test_trainer import group

    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    config = bundle_yaml(
        rlrun(
            "tr",
            model={"path": str(policy), "dtype": "bfloat16"},
            task={"maxOperand": 20},
            sampling={"groupSize": 2, "maxTokens": 4},
            trainer={"batchSize": 2, "learningRate": 1e-6},
            store=tmp_path / "store",
            shardcast={"requireSignatures": False},
        )
    )
    client = redis_from_url(redis_url)
    ctx = Context(
        bundle=view_bundle(parse_bundle(config), VIEWS["trainer"]),
        redis=client,
        keys=RunKeys("bf"),
        stop=threading.Event(),
    )
    trainer = Trainer(ctx, output_dir=None)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.step([group("a", [1.0, 0.0]), group("b", [0.0, 1.0])])
    assert changed_fraction(before, trainer.model) > 0.5  # the fp32 masters took the 1e-6 step
    # The version is gathered tensor by tensor in the published dtype: no fp32 copy of the model on the way.
    state = trainer.version_state()
    masters = trainer.model.state_dict()
    assert state.keys() == masters.keys() and {t.dtype for t in state.values()} == {torch.bfloat16}
    assert all(state[k].equal(masters[k].to(torch.bfloat16)) for k in masters)
    trainer.publish(full_model_state(trainer.model))  # fp32 handed in: still published as bf16
    trainer.publishing.wait()  # stored beside the caller (publishing.py)
    published = list((tmp_path / "store").rglob("*.safetensors"))
    assert published
    for path in published:
        assert {t.dtype for t in load_file(str(path)).values()} == {torch.bfloat16}
    client.close()


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_rows_of_zero_advantage_are_not_computed_and_the_update_is_the_whole_batchs(normalization, monkeypatch):
    from rlfleet.services.trainer import update

    model = qwen(dtype=torch.float64)
    batch = groups(64)
    flat = batch[1]
    for s in flat.samples:  # every completion of the second group right: zero advantage, no gradient
        s.reward = 1.0
    computed: list[int] = []

    def counted(net, rows, *args, **kwargs):
        computed.append(len(rows))
        return score(net, rows, *args, **kwargs)

    monkeypatch.setattr(update, "score", counted)
    spec = TrainerSpec(normalization=normalization, max_grad_norm=1e9)
    skipped = gradients(model, spec, batch)
    assert sum(computed) == sum(len(g.samples) for g in batch) - len(flat.samples), "the flat group is not scored"
    # The same rows without the flat group, its tokens (or completions) still in the denominator: the same gradient.
    rest = [batch[0], batch[2]]
    alone = gradients(model, spec, rest)
    count = (
        (lambda gs: sum(len(s.completion_ids) for g in gs for s in g.samples))
        if normalization == "token"
        else (lambda gs: sum(len(g.samples) for g in gs))
    )
    scale = count(rest) / count(batch)
    assert any(g.abs().sum() > 0 for g in skipped.values())
    for name, grad in alone.items():  # scaled by another denominator: float32 logits round differently
        torch.testing.assert_close(skipped[name], grad * scale, rtol=1e-4, atol=1e-6 * float(grad.abs().max()))
    # An entropy or KL term gives every row a gradient: nothing is skipped.
    computed.clear()
    gradients(model, TrainerSpec(normalization=normalization, max_grad_norm=1e9, entropy_coef=0.01), batch)
    assert sum(computed) == sum(len(g.samples) for g in batch)
    # A batch of flat groups only is computed whole, and its update is zero.
    for g in batch:
        for s in g.samples:
            s.reward = 0.0
    computed.clear()
    zero = gradients(model, spec, batch)
    assert sum(computed) == sum(len(g.samples) for g in batch)
    assert all(g.abs().sum() == 0 for g in zero.values())


@pytest.mark.parametrize("off_policy", ["none", "tis", "mis"])
def test_a_multi_turn_transcript_s_environment_tokens_never_reach_the_gradient(off_policy):
    """Rows of episodes (Sample.spans: model, environment, model) train on the model's tokens only: whatever the
    claimed logprobs at the environment's tokens say, the update is the same, with entropy, KL and off-policy
    weights on; and the environment's tokens still shape it as context (other tokens there, another gradient)."""
    model, reference = qwen(dtype=torch.float64), qwen(dtype=torch.float64, seed=1)
    spec = TrainerSpec(entropy_coef=0.05, kl_coef=0.2, max_grad_norm=1e9, off_policy={"mode": off_policy, "cap": 2.0})
    batch = groups(64)
    for g in batch:
        for s in g.samples:
            n = len(s.completion_ids)
            s.completion_ids += [7, 8, 9] + s.completion_ids[:2]
            s.logprobs += [0.0, 0.0, 0.0] + s.logprobs[:2]
            s.spans = [n, 3, 2]
    base = gradients(model, spec, batch, reference)
    claimed = copy.deepcopy(batch)
    for g in claimed:
        for s in g.samples:
            s.logprobs[s.spans[0] : s.spans[0] + 3] = [-9.0, -0.5, -30.0]  # nonsense where nothing was sampled
    assert any(g.abs().sum() > 0 for g in base.values())
    for name, grad in gradients(model, spec, claimed, reference).items():
        torch.testing.assert_close(grad, base[name], rtol=1e-12, atol=1e-15, msg=name)
    other = copy.deepcopy(batch)
    for g in other:
        for s in g.samples:
            s.completion_ids[s.spans[0] : s.spans[0] + 3] = [10, 11, 12]
    moved = gradients(model, spec, other, reference)
    assert any(not torch.allclose(moved[n], base[n]) for n in base), "the environment's tokens are context"
