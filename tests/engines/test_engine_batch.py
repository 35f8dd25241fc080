"""Batched generation in the torch engine (rlfleet/engines/torch_engine.py,
`generate_groups`): several groups of different prompt lengths, seeds and sampling parameters in one
batch give each sample what it gets alone, and the gate's checks accept such groups."""

from __future__ import annotations

import pytest
import torch

from rlfleet.config import parse_bundle
from rlfleet.engines.base import GroupRequest
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.policy import load_policy
from rlfleet.proofs.toploc import build_proofs_many
from rlfleet.services.toploc.checks import Checker
from rlfleet.tasks import make_run_task
from rlfleet.tasks.turns import completion_text
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams, encode_json
from tests.runs import bundle_yaml, rlrun
from tests.support import redis_from_url, tiny_policy_dir

# different lengths in one batch, and two of the same length (prefilled together)
PROMPTS = ["3+4=", "12+7=", "101+999+5=", "7=", "5+2="]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy_dir(tmp_path_factory.mktemp("batch") / "policy", seed=0)


@pytest.fixture(scope="module")
def engine(policy) -> TorchEngine:
    engine = TorchEngine(policy, version=0, device=torch.device("cpu"))  # the device a process chose
    assert engine.device.type == "cpu" and all(p.device.type == "cpu" for p in engine.model.parameters())
    return engine


def _params(seed, max_tokens=10, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=kw.get("temperature", 1.0),
        top_p=kw.get("top_p", 1.0),
        top_k=kw.get("top_k", 0),
        max_tokens=max_tokens,
        seed=seed,
    )


def _requests(engine) -> list[GroupRequest]:
    return [
        GroupRequest(engine.tokenizer.encode(PROMPTS[0]), _params(11), 4),
        GroupRequest(engine.tokenizer.encode(PROMPTS[1]), _params(12, temperature=0.7, top_p=0.9), 3),
        GroupRequest(engine.tokenizer.encode(PROMPTS[2]), _params(13, max_tokens=6, top_k=5), 5),
        GroupRequest(engine.tokenizer.encode(PROMPTS[3]), _params(14), 2, first=3),
        GroupRequest(engine.tokenizer.encode(PROMPTS[4]), _params(15, temperature=0.8), 3),
    ]


def test_a_batch_of_groups_gives_each_sample_what_it_gets_alone(engine):
    requests = _requests(engine)
    lengths = [len(r.prompt_ids) for r in requests]
    assert len(set(lengths)) == len(requests) - 1 and lengths[0] == lengths[4]  # padding, and a shared prefill
    batched = engine.generate_groups(requests)
    assert [len(g) for g in batched] == [r.n for r in requests]
    alone = [engine.generate(r.prompt_ids, r.params, r.n, r.first) for r in requests]
    lengths = set()
    for r, got, want in zip(requests, batched, alone):
        for b, a in zip(got, want):
            assert b.completion_ids == a.completion_ids and b.finish_reason == a.finish_reason
            assert len(b.completion_ids) <= r.params.max_tokens
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
            # exactly the sample's P + T positions, no pad row, on the CPU
            assert b.hidden.shape == (len(r.prompt_ids) + len(b.completion_ids), engine.model.config.hidden_size)
            assert b.hidden.device.type == "cpu"
            torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=1e-4)
            assert b.version == engine.version
            lengths.add(len(b.completion_ids))
    assert len(lengths) > 1, "completions of different lengths end at different steps of the batch"
    assert {g.finish_reason for gs in batched for g in gs} == {"stop", "length"}


def test_sample_i_draws_with_its_own_seed_whatever_the_batch(engine):
    prompt = engine.tokenizer.encode(PROMPTS[1])
    whole = engine.generate(prompt, _params(5), 6)
    # samples 2..5 of the same group, beside another group, draw what they drew in the whole group
    other, tail = engine.generate_groups(
        [GroupRequest(engine.tokenizer.encode(PROMPTS[2]), _params(9), 3), GroupRequest(prompt, _params(5), 4, 2)]
    )
    assert [g.completion_ids for g in tail] == [g.completion_ids for g in whole[2:]]
    assert len({tuple(g.completion_ids) for g in whole}) > 1
    # the same prompt twice in one batch with different seeds: different samples
    a, b = engine.generate_groups([GroupRequest(prompt, _params(5), 6), GroupRequest(prompt, _params(6), 6)])
    assert [g.completion_ids for g in a] == [g.completion_ids for g in whole]
    assert [g.completion_ids for g in a] != [g.completion_ids for g in b]


def test_no_requests_make_no_generations(engine):
    assert engine.generate_groups([]) == []


def test_the_gate_accepts_honest_groups_generated_in_one_batch(engine, policy, tmp_path, redis_url):
    """Every check of the gate (TOPLOC proofs, logprobs, the seed replay from the prefill, endings) on
    groups that were sampled together in one batch of different prompt lengths."""
    run = rlrun(
        "batch",
        model=policy,
        task={"maxOperand": 999},
        sampling={"groupSize": 4, "maxTokens": 8, "topP": 0.95},
        verifier={"spotCheckFraction": 1.0, "toploc": {"decodeBatchingSize": 4}},
        store=tmp_path / "store",
    )
    spec = parse_bundle(bundle_yaml(run)).run.spec
    s, toploc = spec.sampling, spec.verifier.toploc
    task = make_run_task(spec)
    problems = [task.problem(f"arith-{spec.task.seed}-{i}") for i in range(6)]
    prompts = [engine.tokenizer(p.prompt)["input_ids"] for p in problems]
    assert 1 < len({len(p) for p in prompts}) < len(prompts), "mixed prompt lengths, some prefilled together"
    params = [SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=40 + i) for i in range(6)]
    batched = engine.generate_groups([GroupRequest(p, q, s.group_size) for p, q in zip(prompts, params)])
    client = redis_from_url(redis_url)
    keys = RunKeys("batch")
    client.xadd(keys.policy, encode_json({"version": 0}))
    model = load_policy(policy)
    checker = Checker(spec, client, keys, lambda v: model)
    for problem, prompt, q, gens in zip(problems, prompts, params, batched):
        proofs = build_proofs_many([g.hidden for g in gens], len(prompt), toploc.decode_batching_size, toploc.topk)
        samples = [
            Sample(
                g.completion_ids,
                g.logprobs,
                p,
                task.score(
                    problem, completion_text(engine.tokenizer, g.completion_ids, engine.stop_ids), len(g.completion_ids)
                ),
                g.finish_reason,
            )
            for g, p in zip(gens, proofs)
        ]
        group = RolloutGroup(
            task_id=problem.task_id,
            worker_id="w-batch",
            policy_version=0,
            prompt_ids=prompt,
            sampling=q,
            samples=samples,
            engine="torch",
        )
        checker.check(group, msg_id=None)  # raises Rejection naming the failed check
    client.close()
