"""Issue 16 item 4: the gate's thresholds follow the run's dtype and the group's engine unless set.

An fp32 run of the torch engine gets thresholds calibrated on honest fp32 runs
(rlfleet/services/toploc/calibration.py), not the bf16 GPU ones of the TOPLOC authors: weights one
optimizer step stale, bf16 or fp16 compute and tokens outside top-p are rejected with no threshold
set in the config, while honest groups drawn with other batch shapes and thread counts pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from rlfleet.config import parse_bundle, worker_dtype
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.services.toploc.replay import possible_tokens
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.streams import encode_json
from tests.runs import bundle_yaml, rlrun
from tests.toploc import attacks
from tests.toploc.test_gate import gate_system, rejections, run_gate, verified_ids

SAMPLING = "{groupSize: 4, maxTokens: 6, topP: 0.9}"


def publish_next(ctx, policy_dir: Path, version: int) -> None:
    """Publish and announce `version` of the run, as the trainer does."""
    signer = make_signer(load_private_key(Path(os.environ[env.SIGNING_KEY_FILE])))
    publish_version(open_store(ctx.bundle.run.spec.store.uri), ctx.run_name, version, policy_dir, signer=signer)
    ctx.redis.xadd(ctx.keys.policy, encode_json({"version": version}))


def test_an_fp32_run_rejects_what_its_numerics_rule_out_without_any_threshold_set(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, sampling=SAMPLING) as (ctx, policy, origin_url, tmp):
        spec, r = ctx.bundle.run.spec, ctx.redis
        engine = TorchEngine(policy, 0)
        stale = [attacks.honest(engine, spec, i) for i in range(3)]
        publish_next(ctx, attacks.one_step_later(policy, tmp / "v1", spec, stale), 1)
        for g in stale:
            g.policy_version = 1  # drawn with version 0, claimed as the newest
        tampered = {
            **{f"one step stale {i}": g for i, g in enumerate(stale)},
            "bf16 compute": attacks.honest(TorchEngine(policy, 0, dtype="bfloat16"), spec, 10),
            "fp16 compute": attacks.honest(attacks.half_engine(policy), spec, 11),
            "outside top-p": attacks.outside_nucleus(engine, spec, 12),
        }
        threads = torch.get_num_threads()
        honest = []
        try:
            for i, rows in enumerate((1, 2, 4)):
                torch.set_num_threads(1 + i % 2)
                honest.append(attacks.honest(engine, spec, 30 + i, worker="w-honest", per_batch=rows))
        finally:
            torch.set_num_threads(threads)
        for name, g in tampered.items():
            g.worker_id = f"w-{name}"
            r.xadd(ctx.keys.rollouts, g.encode())
        for g in honest:
            r.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=len(tampered) + len(honest))
        got = rejections(ctx)
        assert sorted(got) == sorted(g.rollout_id for g in tampered.values()), got
        assert {name: got[g.rollout_id] for name, g in tampered.items()}["outside top-p"] == "seed_replay"
        assert sorted(verified_ids(ctx)) == sorted(g.rollout_id for g in honest)


def test_calibration_follows_engine_device_and_dtype_and_explicit_settings_win():
    from rlfleet.services.toploc.calibration import AUTHORS, DEFAULTS, calibration

    def verifier(text: str, dtype: str = "float32"):
        doc = rlrun("c", model={"path": "m", "dtype": dtype}, verifier=yaml.safe_load(text))
        return parse_bundle(bundle_yaml(doc)).run.spec.verifier

    fp32 = DEFAULTS[("torch", "cpu", "float32")]
    assert calibration(verifier("{}"), "torch", "float32") == fp32
    assert calibration(verifier("{}", "bfloat16"), "torch", "bfloat16") == DEFAULTS[("torch", "cpu", "bfloat16")]
    assert calibration(verifier("{}"), "vllm", "float32") == fp32  # vLLM on CPU in fp32: as tight as torch
    assert fp32.max_mismatch_share == 0 and fp32.max_running_share == 0  # exact replay on CPU
    gpu = calibration(verifier("{workerDevice: gpu}", "bfloat16"), "vllm", "bfloat16")
    assert gpu.toploc == AUTHORS.toploc and 0 < gpu.max_running_share < gpu.max_mismatch_share < 0.1
    for c in DEFAULTS.values():  # noise is absorbed by a share of mismatches, never by a mass slack (a hole)
        assert c.replay_tolerance == 1e-3
    share = calibration(verifier("{workerDevice: gpu, maxReplayMismatchShare: 0}"), "vllm", "float32")
    assert share.max_mismatch_share == 0
    assert fp32.toploc.max_exp_mismatches < AUTHORS.toploc.max_exp_mismatches
    assert fp32.logprob_tolerance < AUTHORS.logprob_tolerance
    set_ = calibration(
        verifier("{logprobTolerance: 0.2, topPTolerance: 0.0, toploc: {maxMantErrMean: 9}}"), "torch", "float32"
    )
    assert (set_.logprob_tolerance, set_.top_p_tolerance, set_.toploc.max_mant_err_mean) == (0.2, 0.0, 9)
    assert set_.toploc.max_exp_mismatches == fp32.toploc.max_exp_mismatches  # the rest stays calibrated


def test_top_p_has_its_own_tolerance():
    """A token right after the nucleus (mass before it 0.93 > topP 0.9) is impossible at a top-p slack of
    0.01 even with a logprob slack of 0.05, which used to widen top-p by exp(0.1) (flagged only past 0.99)."""
    probs = torch.tensor([[0.6, 0.33, 0.05, 0.02]])
    logp, tokens = probs.log(), torch.tensor([2])
    assert possible_tokens(logp, tokens, 0.9, 0, 0.05, top_p_slack=0.05).tolist() == [True]
    assert possible_tokens(logp, tokens, 0.9, 0, 0.05, top_p_slack=0.01).tolist() == [False]


def test_a_run_declaring_bf16_workers_accepts_their_groups_beside_an_fp32_verifier(tmp_path, redis_url):
    """spec.verifier.workerDtype picks the calibration row: bf16 groups the gate (an fp32 model) would reject as
    bf16 compute in an fp32 run pass once the run declares bf16 workers; the row is the workers' dtype's."""
    import redis

    from rlfleet.services.toploc.calibration import DEFAULTS
    from rlfleet.services.toploc.checks import Checker, Rejection
    from rlfleet.wire.streams import RunKeys
    from tests.support import tiny_policy_dir

    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    sampling = yaml.safe_load(SAMPLING)

    def spec_of(verifier: dict):
        return parse_bundle(bundle_yaml(rlrun("bf", model=policy, sampling=sampling, verifier=verifier))).run.spec

    fp32_workers, bf16_workers = spec_of({}), spec_of({"workerDtype": "bfloat16"})
    assert (worker_dtype(fp32_workers), worker_dtype(bf16_workers)) == ("float32", "bfloat16")
    assert bf16_workers.model.dtype == "float32", "the verifier still prefills in the model's dtype"
    engine = TorchEngine(policy, 0, dtype="bfloat16")
    groups = [attacks.honest(engine, bf16_workers, i) for i in range(4)]
    client = redis.Redis.from_url(redis_url)
    verifier = TorchEngine(policy, 0)  # its fp32 model and tokenizer are the gate's

    def verdicts(spec, stream: str) -> list:  # each run its own streams: the groups are new to it
        keys = RunKeys(stream)
        client.xadd(keys.policy, encode_json({"version": 0}))
        checker = Checker(spec, client, keys, policy=lambda v: (verifier.model, verifier.tokenizer))
        assert checker.calibration(groups[0]) == DEFAULTS[("torch", "cpu", worker_dtype(spec))]
        out = []
        for n, g in enumerate(groups):
            try:
                out.append(checker.check(g, f"{n + 1}-0".encode(), prefill=True))
            except Rejection as exc:
                out.append(exc.reason)
        return out

    undeclared = verdicts(fp32_workers, "undeclared")
    assert {o for o in undeclared if isinstance(o, str)} & {"toploc", "logprob_mismatch"}, undeclared
    declared = verdicts(bf16_workers, "declared")
    assert all(not isinstance(o, str) for o in declared), declared
