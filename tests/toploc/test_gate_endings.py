"""Issue 16 item 2: where a completion stops is checked, and the reward reads exactly the tokens before it.

A completion holds nothing after its first stop token and either ends with one or fills
min(maxTokens, context left); the trusted reward decodes the tokens before the stop token as they
are, special tokens included (no skipping past them).
"""

from __future__ import annotations

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.wire.streams import RolloutGroup
from tests.toploc import attacks
from tests.toploc.test_gate import gate_system, rejections, run_gate, verified_ids


def test_a_dropped_eos_and_tokens_after_eos_are_rejected(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, sampling="{groupSize: 4, maxTokens: 8}") as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        honest = [attacks.honest(engine, spec, i) for i in range(12)]
        stopped = [g for g in honest if any(s.completion_ids[-1] == engine.tokenizer.eos_token_id for s in g.samples)]
        tampered = {
            **{
                f"dropped-eos-{i}": attacks.dropped_eos(g, engine.model, engine.tokenizer, spec)
                for i, g in enumerate(stopped[:3])
            },
            **{
                f"after-eos-{i}": attacks.answer_after_eos(g, engine.model, engine.tokenizer, spec)
                for i, g in enumerate(honest[:3])
            },
        }
        assert len(tampered) == 6
        for name, g in tampered.items():
            g.worker_id = f"w-{name}"  # each its own worker: the first rejection bans (default banOn)
            ctx.redis.xadd(ctx.keys.rollouts, g.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=len(tampered))
        got = rejections(ctx)
        assert {name: got.get(g.rollout_id) for name, g in tampered.items()} == dict.fromkeys(
            tampered, "completion_end"
        )
        assert verified_ids(ctx) == []


def test_a_completion_longer_than_the_context_allows_is_rejected(tmp_path, redis_url):
    """The tiny policy's context is 64 positions: with a 6-token prompt a completion may have 57 tokens."""
    with gate_system(tmp_path, redis_url, sampling="{groupSize: 4, maxTokens: 60}") as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        group = attacks.honest(engine, spec, 1)
        prompt_len = len(group.prompt_ids)
        assert 64 - prompt_len - 1 < 60
        digit = engine.tokenizer("7", add_special_tokens=False)["input_ids"][0]
        group.samples[0].completion_ids = [digit] * 60  # maxTokens, no EOS: past the context window
        attacks.prove(group, engine.model, engine.tokenizer, spec)
        ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=1)
        assert rejections(ctx) == {group.rollout_id: "completion_end"}


def test_rewards_read_exactly_the_tokens_before_the_stop_token(tmp_path, redis_url):
    """`<bos>8<eos>` is not the answer 8 (the reward used to decode with skip_special_tokens)."""
    with gate_system(tmp_path, redis_url, verifier="{spotCheckFraction: 0.0}") as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine, tok = TorchEngine(policy, 0), TorchEngine(policy, 0).tokenizer
        group = attacks.honest(engine, spec, 1)
        answer = tok(attacks.make_run_task(spec).problem(group.task_id).answer, add_special_tokens=False)["input_ids"]
        clean, dressed = answer + [tok.eos_token_id], [tok.bos_token_id, *answer, tok.eos_token_id]
        group.samples[0].completion_ids, group.samples[1].completion_ids = clean, dressed[: spec.sampling.max_tokens]
        attacks.prove(group, engine.model, tok, spec)
        ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=1)
        [forwarded] = [RolloutGroup.decode(f) for _, f in ctx.redis.xrange(ctx.keys.verified)]
        assert [s.reward for s in forwarded.samples[:2]] == [1.0, 0.0]
