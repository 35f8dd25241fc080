"""Issue 16 item 3: seeds per sample, replayed at the gate where the engine is deterministic.

The torch engine draws each sample from its own seed by inverse CDF (rlfleet/models/sampling.py), so a
sample is the same whatever batch or thread count drew it, and the gate re-draws every token from
its prefill (replay.py). vLLM draws by the same rule in its worker, so
every group is replayed whatever engine it claims; the gate admits vllm groups only when the run lists vllm in
spec.verifier.engines, and the label only picks calibrated tolerances. A run can
also assign each group's task and seed (spec.sampling.assignment: run), so a worker cannot grind them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import one_worker_stats
from tests.support import tiny_policy_dir
from tests.toploc import attacks
from tests.toploc.test_gate import gate_system, rejections, run_gate, verified_ids

SAMPLING = "{groupSize: 4, maxTokens: 6, topP: 0.9}"


def test_a_sample_is_the_same_whatever_batch_or_threads_drew_it(tmp_path):
    engine = TorchEngine(tiny_policy_dir(tmp_path / "policy", seed=0), 0)
    prompt = engine.tokenizer("12+7=")["input_ids"]
    params = attacks.SamplingParams(temperature=1.0, top_p=0.9, top_k=8, max_tokens=8, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = engine.generate(prompt, params, 6)
        torch.set_num_threads(2)
        apart = [g for i in range(6) for g in engine.generate(prompt, params, 1, first=i)]
    finally:
        torch.set_num_threads(threads)
    assert [g.completion_ids for g in together] == [g.completion_ids for g in apart]
    assert len({tuple(g.completion_ids) for g in together}) > 1  # distinct seeds, distinct samples
    for a, b in zip(together, apart):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_samples_their_seeds_do_not_draw_are_rejected(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, sampling=SAMPLING) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        model, tok = engine.model, engine.tokenizer
        cheap = TorchEngine(tiny_policy_dir(tmp / "cheap", seed=1), 0)
        honest = [attacks.honest(engine, spec, i) for i in range(8)]
        tampered = {
            "temperature 0.5, logprobs recomputed": attacks.temperature_lie(engine, honest[0], spec),
            "greedy": attacks.greedy(engine, honest[1], spec),
            "cherry-picked": attacks.cherry_picked(engine, honest[2], spec),
            "forced answers": attacks.forced(honest[3], model, tok, spec),
            "cheap-model drafts": attacks.draft(cheap, honest[4], model, tok, spec),
            "duplicated sample": attacks.duplicated(honest[5]),
            "outside top-p": attacks.outside_nucleus(engine, spec, 6),
        }
        for t, h in zip(list(tampered.values())[:6], honest):  # every attack changed some tokens
            assert attacks.tokens(t) != attacks.tokens(h)
        for name, g in tampered.items():
            g.worker_id = f"w-{name}"
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        ctx.redis.xadd(ctx.keys.rollouts, honest[7].encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=len(tampered) + 1)
        got = rejections(ctx)
        assert {n: got.get(g.rollout_id) for n, g in tampered.items()} == dict.fromkeys(tampered, "seed_replay")
        assert verified_ids(ctx) == [honest[7].rollout_id]


@pytest.mark.parametrize("engines", [None, "[torch, vllm]"])
def test_vllm_groups_need_admission_and_a_vllm_label_does_not_skip_replay(tmp_path, redis_url, engines):
    """A torch worker labelling its groups vllm (a downgrade attempt) is replayed all the same: its
    temperature lie with recomputed logprobs is caught as seed_replay, as for a torch label."""
    verifier = f"{{engines: {engines}}}" if engines else "{}"
    sampling = "{groupSize: 4, maxTokens: 6, topP: 0.5}"  # far outside the nucleus, past the vllm slack
    with gate_system(tmp_path, redis_url, sampling=sampling, verifier=verifier) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        honest = attacks.honest(engine, spec, 1, worker="w-vllm")
        lie = attacks.temperature_lie(engine, attacks.honest(engine, spec, 2), spec)
        lie.worker_id = "w-vllm-lie"
        nucleus = attacks.outside_nucleus(engine, spec, 3)
        nucleus.worker_id = "w-vllm-top-p"
        for g in (honest, lie, nucleus):
            g.engine = "vllm"
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=3)
        got = rejections(ctx)
        if engines is None:  # the run does not admit vllm: refused, naming the field to set
            assert got == dict.fromkeys([honest.rollout_id, lie.rollout_id, nucleus.rollout_id], "sampling_params")
            [record] = [r for r in _records(ctx) if r["rollout_id"] == honest.rollout_id]
            assert "spec.verifier.engines" in record["detail"]
        else:  # admitted: replayed like any group, whatever the label
            assert verified_ids(ctx) == [honest.rollout_id]
            assert got == {lie.rollout_id: "seed_replay", nucleus.rollout_id: "seed_replay"}
            assert one_worker_stats(ctx.redis, ctx.keys, "w-vllm")["counters"]["replay_mismatches"] == 0


def _records(ctx) -> list[dict]:
    from rlfleet.wire.streams import decode_json

    return [decode_json(f) for _, f in ctx.redis.xrange(ctx.keys.rejected)]


def test_run_assigned_tickets_fix_task_and_seed(tmp_path, redis_url):
    from rlfleet.fleet.assignment import assigned_work, issue_ticket

    sampling = "{groupSize: 4, maxTokens: 6, assignment: run}"
    with gate_system(tmp_path, redis_url, sampling=sampling) as (ctx, policy, origin_url, tmp):
        spec, r, keys = ctx.bundle.run.spec, ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)

        def ticketed(worker: str, ticket: int | None, **change):
            task_id, seed = assigned_work(attacks.make_run_task(spec), spec.task.seed, worker, ticket or 0)
            index = int(change.pop("index", task_id.rsplit("-", 1)[1]))
            g = attacks.honest(engine, spec, index, worker=worker)
            g.task_id, g.sampling.seed = f"arith-0-{index}", change.pop("seed", seed)
            g = attacks.resampled(engine, g, spec)  # drawn with the group's (assigned) seed
            g.ticket = ticket
            return g

        first, second = issue_ticket(r, keys, "w-a"), issue_ticket(r, keys, "w-a")
        assert (first, second) == (0, 1)
        good = ticketed("w-a", first)
        reused = ticketed("w-a", first, seed=good.sampling.seed + 1)  # same ticket, other draw
        reused.task_id, reused.sampling.seed = good.task_id, good.sampling.seed + 1
        unissued = ticketed("w-b", 0)
        ground = ticketed("w-c", issue_ticket(r, keys, "w-c"), index=12345)  # its own choice of task
        bare = ticketed("w-d", None)
        for g in (good, reused, unissued, ground, bare):
            r.xadd(keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=5)
        assert verified_ids(ctx) == [good.rollout_id]
        assert rejections(ctx) == {
            reused.rollout_id: "assignment",  # its seed is not the ticket's (the ticket is also used)
            unissued.rollout_id: "assignment",
            ground.rollout_id: "assignment",
            bare.rollout_id: "assignment",
        }
        again = copy.deepcopy(good)
        again.rollout_id, again.samples = "again", list(reversed(good.samples))
        r.xadd(keys.rollouts, again.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=6)
        assert rejections(ctx)["again"] == "replay"
        assert one_worker_stats(r, keys, "w-a")["counters"]["tickets_used"] == 1
