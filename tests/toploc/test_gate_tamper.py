"""The tamper suite: every class of cheating is rejected with its own reason, and honest rollouts
made with other batch sizes and thread counts are not (slow suite, 256 rollouts).

The run here computes in fp32 on CPU, where an honest rollout's recomputation is exact to about
1e-6; `STRICT` calibrates the TOPLOC thresholds and the logprob tolerance to that. The authors'
defaults are calibrated for bf16 GPU non-determinism on large models and let a 64-wide model run in
bf16 through (measured: at most 7 exponent mismatches and a mantissa error mean of 3.4 per chunk).
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import is_banned, one_worker_stats
from rlfleet.proofs.toploc import build_proofs
from rlfleet.services.toploc import replay as seed_replay
from rlfleet.services.toploc.replay import possible_tokens
from rlfleet.tasks import make_task
from rlfleet.wire.streams import SCHEMA_VERSION, RolloutGroup, SamplingParams, decode_json
from tests.support import tiny_policy_dir
from tests.toploc.test_gate import gate_system, honest_group, rejections, run_gate, verified_ids

STRICT = (
    "{maxMessageBytes: 65536, logprobTolerance: 1.0e-4, "
    "toploc: {maxExpMismatches: 2, maxMantErrMean: 0.25, maxMantErrMedian: 0.5}}"
)
SAMPLING = "{groupSize: 4, maxTokens: 6, topK: 8}"


def fp8_rounded(engine: TorchEngine) -> TorchEngine:
    """A worker that stores its weights in float8 (e4m3) and computes with them."""
    with torch.no_grad():
        for p in engine.model.parameters():
            p.copy_(p.to(torch.float8_e4m3fn).float())
    return engine


def outside_top_k(engine: TorchEngine, ctx, worker: str) -> RolloutGroup:
    """An otherwise honest group sampled without top-k (claiming the run's topK): search seeds until a
    sampled token lies clearly outside the top-k (near-uniform tiny model: the first few seeds do)."""
    spec = ctx.bundle.run.spec
    for index in range(100, 140):
        group = honest_group(engine, ctx, index, worker=worker)
        params = SamplingParams(**{**group.sampling.__dict__, "top_k": 0})
        gens = engine.generate(group.prompt_ids, params, spec.sampling.group_size)
        rebuilt = copy.deepcopy(group)
        for sample, gen in zip(rebuilt.samples, gens):
            sample.completion_ids, sample.logprobs, sample.finish_reason = (
                gen.completion_ids,
                gen.logprobs,
                gen.finish_reason,
            )
            sample.proofs = build_proofs(gen.hidden, len(group.prompt_ids), spec.verifier.toploc.decode_batching_size)
        with torch.inference_mode():
            for gen in gens:
                rows = engine.model(torch.tensor([group.prompt_ids + gen.completion_ids])).logits[0].float()
                logp = torch.log_softmax(rows[len(group.prompt_ids) - 1 : -1], -1)
                if not possible_tokens(logp, torch.tensor(gen.completion_ids), 1.0, spec.sampling.top_k, 1e-3).all():
                    return rebuilt
    raise AssertionError("no seed sampled a token outside the top-k")


@pytest.mark.parametrize("chunk", ["as many rows as fit", "one row"])
def test_every_tamper_class_is_rejected_with_its_reason(tmp_path, redis_url, monkeypatch, chunk):
    """Every verdict of the table whatever the chunk of rows the prefill and the seed replay take at once
    (replay.py CHUNK_ELEMENTS): the default, one chunk for the tiny model's rows, and a row at a time."""
    if chunk == "one row":
        monkeypatch.setattr(seed_replay, "CHUNK_ELEMENTS", 1)
    with gate_system(tmp_path, redis_url, sampling=SAMPLING, verifier=STRICT) as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        honest = honest_group(engine, ctx, 1)
        tampered: dict[str, tuple[RolloutGroup, str]] = {}

        def add(name: str, group: RolloutGroup, reason: str) -> None:
            group.rollout_id, group.worker_id = f"t-{name}", f"w-{name}"
            tampered[name] = (group, reason)

        add("other-weights", honest_group(TorchEngine(tiny_policy_dir(tmp / "other", seed=1), 0), ctx, 2), "toploc")
        add("bf16", honest_group(TorchEngine(policy, 0, dtype="bfloat16"), ctx, 3), "toploc")
        add("fp8", honest_group(fp8_rounded(TorchEngine(policy, 0)), ctx, 4), "toploc")
        g = honest_group(engine, ctx, 5)
        g.samples[1].completion_ids[-1] = (g.samples[1].completion_ids[-1] + 1) % len(engine.tokenizer)
        add("altered-tokens", g, "toploc")
        g = honest_group(engine, ctx, 6)
        g.task_id = "arith-0-999"
        add("altered-task", g, "prompt_mismatch")
        g = honest_group(engine, ctx, 7)
        g.prompt_ids[1] = (g.prompt_ids[1] + 1) % len(engine.tokenizer)
        add("altered-prompt-ids", g, "prompt_mismatch")
        g = honest_group(engine, ctx, 8)
        g.samples[2].logprobs = [lp + 0.01 for lp in g.samples[2].logprobs]
        add("inflated-logprobs", g, "logprob_mismatch")
        add("outside-top-k", outside_top_k(engine, ctx, "w-x"), "seed_replay")  # torch groups are replayed
        g = copy.deepcopy(honest)
        g.policy_version = 7
        add("forged-version", g, "unknown_version")
        g = copy.deepcopy(honest)
        g.sampling.temperature = 0.5
        add("other-temperature", g, "sampling_params")
        g = copy.deepcopy(honest)
        g.samples = g.samples[:3]
        add("short-group", g, "size")
        g = honest_group(engine, ctx, 9)
        g.worker_id = "w-other-weights"  # banned by the first proof failure (default ban policy) queued before it
        inflated = honest_group(engine, ctx, 10, worker="w-greedy")
        for s in inflated.samples:
            s.reward = 1.0

        for group, _ in tampered.values():
            r.xadd(keys.rollouts, group.encode())
        replay = copy.deepcopy(honest)
        replay.worker_id = "w-replayer"
        after_ban = g
        for group in (honest, replay, after_ban, inflated):
            r.xadd(keys.rollouts, group.encode())
        malformed = [
            {b"m": b"{not json"},
            {b"x": b"1"},
            {b"m": b'{"schema": 99, "worker_id": "w-future"}'},
            {b"m": b'{"schema": %d, "worker_id": "w-partial"}' % SCHEMA_VERSION},
            {b"m": b"x" * 100_000},
        ]
        for fields in malformed:
            r.xadd(keys.rollouts, fields)
        last = honest_group(engine, ctx, 11)  # the consumer kept running through all of it
        r.xadd(keys.rollouts, last.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=len(tampered) + 4 + len(malformed) + 1)

        got = rejections(ctx)
        for name, (group, reason) in tampered.items():
            assert got.pop(group.rollout_id) == reason, name
        assert got.pop(replay.rollout_id) == "replay"
        assert got.pop(after_ban.rollout_id) == "banned"
        assert set(got) == {None}  # the undecodable ones: one record each, with its reason
        undecodable = [rec for rec in (decode_json(f) for _, f in r.xrange(keys.rejected)) if rec["rollout_id"] is None]
        assert sorted(rec["reason"] for rec in undecodable) == [
            "malformed",
            "malformed",
            "malformed",
            "schema_version",
            "size",
        ]
        assert sorted(verified_ids(ctx)) == sorted([honest.rollout_id, inflated.rollout_id, last.rollout_id])
        assert r.xlen(keys.rollouts) == 0

        # Inflated reward: not a rejection; the trusted reward is forwarded and the mismatch counted.
        [forwarded] = [
            RolloutGroup.decode(f)
            for _, f in r.xrange(keys.verified)
            if RolloutGroup.decode(f).rollout_id == inflated.rollout_id
        ]
        task = make_task(ctx.bundle.run.spec.task)
        problem = task.problem(forwarded.task_id)
        trusted = [
            task.reward(problem, engine.tokenizer.decode(s.completion_ids, skip_special_tokens=True))
            for s in forwarded.samples
        ]
        assert [s.reward for s in forwarded.samples] == trusted
        assert one_worker_stats(r, keys, "w-greedy")["counters"].get("reward_mismatch", 0) == trusted.count(0.0) > 0

        # The default ban policy bans at the first proof, logprob or sampling failure, not for the rest.
        for name, (_, reason) in tampered.items():
            assert is_banned(r, keys, f"w-{name}") == (reason in ("toploc", "logprob_mismatch", "seed_replay")), name
        assert one_worker_stats(r, keys, "w-future")["counters"] == {"rejected": 1, "rejected:schema_version": 1}
        assert not is_banned(r, keys, "w-honest") and not is_banned(r, keys, "w-replayer")


def test_bf16_compute_is_caught_by_the_logprob_check_at_the_authors_toploc_thresholds(tmp_path, redis_url):
    authors = "{logprobTolerance: 1.0e-4, toploc: {maxExpMismatches: 38, maxMantErrMean: 10, maxMantErrMedian: 8}}"
    with gate_system(tmp_path, redis_url, verifier=authors) as (ctx, policy, origin_url, tmp):
        groups = [
            honest_group(TorchEngine(policy, 0, dtype="bfloat16"), ctx, i, worker=f"w-bf16-{i}") for i in range(3)
        ]
        for g in groups:
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=3)
        assert rejections(ctx) == {g.rollout_id: "logprob_mismatch" for g in groups}


def test_possible_tokens_follows_top_k_and_top_p_with_slack():
    logp = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 5), -1)  # (5, 5)
    tokens = torch.arange(5)  # row t samples token t, the t-th most likely
    assert possible_tokens(logp, tokens, 1.0, 2, 0.0).tolist() == [True, True, False, False, False]
    # top-p: token t survives when the mass strictly before it is <= top_p (p = .64 .24 .09 .03 .01)
    assert possible_tokens(logp, tokens, 0.7, 0, 0.0).tolist() == [True, True, False, False, False]
    assert possible_tokens(logp, tokens, 0.9, 0, 0.0).tolist() == [True, True, True, False, False]
    # top-p inside top-k renormalises over the kept mass: .64/.97 = .66 < .7 < (.64 + .24)/.97
    assert possible_tokens(logp, tokens, 0.7, 3, 0.0).tolist() == [True, True, False, False, False]
    # a near tie at the boundary (within the slack) is given the benefit of the doubt
    tied = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.99999, 1.0]]), -1)
    assert possible_tokens(tied, torch.tensor([2]), 1.0, 2, 1e-4).tolist() == [True]
    assert possible_tokens(tied, torch.tensor([3]), 1.0, 2, 1e-4).tolist() == [False]


@pytest.mark.slow
def test_honest_rollouts_with_other_batching_and_threads_are_all_accepted(tmp_path, redis_url):
    sampling = "{groupSize: 4, maxTokens: 12, temperature: 0.8, topP: 0.9, topK: 8}"
    verifier = "{toploc: {decodeBatchingSize: 4}}"  # the calibrated fp32 defaults, and every sample replayed
    with gate_system(tmp_path, redis_url, sampling=sampling, verifier=verifier) as (ctx, policy, origin_url, tmp):
        engine, threads = TorchEngine(policy, 0), torch.get_num_threads()
        groups = []
        try:
            for i in range(64):  # 256 rollouts: every combination of batch rows (4, 2, 1) and threads (1, 2)
                torch.set_num_threads(1 + i % 2)
                groups.append(honest_group(engine, ctx, i, worker=f"w-{i % 6}", per_batch=(4, 2, 1)[i % 3]))
        finally:
            torch.set_num_threads(threads)
        for g in groups:
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=len(groups), timeout=300)
        assert rejections(ctx) == {}
        assert len(verified_ids(ctx)) == 64 and sum(len(g.samples) for g in groups) >= 200
