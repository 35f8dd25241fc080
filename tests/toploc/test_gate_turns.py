"""The gate on multi-turn transcripts (rlfleet/tasks/turns.py) from a user environment behind its process boundary:
honest episodes pass every check (the model's draws replayed across turns, the environment asked again), each
attack of turn_attacks.py is rejected, and an environment that raises, hangs or answers with something that is not
a turn is a forgiven `environment` rejection, never the gate's death."""

from __future__ import annotations

from contextlib import contextmanager

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.reputation import is_banned
from rlfleet.models.policy import load_policy
from rlfleet.tasks.turns import span_bounds
from rlfleet.wire.streams import RolloutGroup, decode_json
from tests.runs import bundle_yaml, rlrun
from tests.support import tiny_policy_dir
from tests.toploc.test_gate import rejections, run_gate, verified_ids
from tests.toploc.test_gate_tasks import published_gate
from tests.toploc.turn_attacks import ATTACKS, honest_episodes, prove_turns

TURNS = {"type": "python", "entrypoint": "tests.core.turn_envs:Counter", "timeoutSeconds": 2}
SAMPLING = {"groupSize": 4, "maxTokens": 32, "maxTurns": 3, "maxTokensPerTurn": 4}


@contextmanager
def turns_gate(tmp_path, redis_url, sampling: dict = SAMPLING):
    """Version 0 of a tiny policy, published and served, for a run of the Counter environment."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    text = bundle_yaml(
        rlrun("gate", model=policy, task=TURNS, sampling=sampling, trainer={"batchSize": 1, "maxAsyncLevel": 1},
              store=tmp_path / "store")
    )  # fmt: skip
    with published_gate(tmp_path, redis_url, policy, text) as (ctx, origin_url):
        yield ctx, policy, origin_url


def test_honest_episodes_pass_and_every_transcript_attack_is_rejected(tmp_path, redis_url):
    with turns_gate(tmp_path, redis_url) as (ctx, policy, origin_url):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        model, tokenizer = load_policy(policy)
        honest = [honest_episodes(engine, spec, f"turns-ok-{n}", seed=n) for n in (3, 5, 11, 20)]
        spans = [s.spans for g in honest for s in g.samples]
        assert any(len(s) >= 5 for s in spans), f"an episode of 3 model turns: {spans}"
        attacked: dict[str, RolloutGroup] = {}
        for n, (name, (attack, _)) in enumerate(ATTACKS.items()):
            source = honest_episodes(engine, spec, f"turns-ok-{30 + n}", seed=100 + n, worker=f"w-{n}")
            group = attack(source, tokenizer, spec)
            assert group is not None, (
                f"{name}: the honest group gave it nothing to tamper with: {[s.spans for s in source.samples]}"
            )
            attacked[name] = prove_turns(group, model, tokenizer, spec)
        claimed_win = honest_episodes(engine, spec, "turns-ok-40", seed=7, worker="w-claims")
        earned = [s.reward for s in claimed_win.samples]
        assert 0.0 in earned, earned
        for sample in claimed_win.samples:
            sample.reward = 1.0  # a reward for turns that never happened: recomputed, not trusted
        for group in [*honest, claimed_win, *attacked.values()]:
            ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp_path / "cache", expected=len(honest) + 1 + len(attacked), timeout=180)

        reasons = rejections(ctx)
        assert sorted(verified_ids(ctx)) == sorted(g.rollout_id for g in [*honest, claimed_win]), reasons
        for name, group in attacked.items():
            assert reasons[group.rollout_id] in ATTACKS[name][1], (name, reasons[group.rollout_id])
        details = {
            decode_json(f)["rollout_id"]: decode_json(f)["detail"] for _, f in ctx.redis.xrange(ctx.keys.rejected)
        }
        assert "is not the environment's answer" in details[attacked["forged tool result"].rollout_id]
        assert "where the environment answers" in details[attacked["transcript cut short"].rollout_id]
        assert "the episode ends after model turn 3" in details[attacked["turns past the limit"].rollout_id]
        assert is_banned(ctx.redis, ctx.keys, "w-0"), "transcript bans: an honest worker cannot fail it"

        verified = {g.rollout_id: g for g in (RolloutGroup.decode(f) for _, f in ctx.redis.xrange(ctx.keys.verified))}
        for group in honest:  # what the trainer reads keeps the turns
            assert [s.spans for s in verified[group.rollout_id].samples] == [s.spans for s in group.samples]
        assert [s.reward for s in verified[claimed_win.rollout_id].samples] == earned, "the verifier's own rewards"


def test_an_environment_that_fails_a_turn_is_a_forgiven_rejection(tmp_path, redis_url):
    """A user environment whose `respond` raises, hangs or answers an int: the group is rejected with the failure
    in the detail, the gate goes on, and the worker is not banned (an honest worker meets the same failure)."""
    with turns_gate(tmp_path, redis_url) as (ctx, policy, origin_url):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        honest = honest_episodes(engine, spec, "turns-ok-3", seed=1, worker="w-1")
        failing = {}
        for seed, kind in enumerate(("raise", "hang", "int"), start=2):
            group = honest_episodes(engine, spec, "turns-ok-3", seed=seed, worker="w-1")
            group.task_id = f"turns-{kind}-3"  # the same prompt: only the environment's answers differ
            failing[kind] = group
        for group in [*failing.values(), honest]:
            ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp_path / "cache", expected=4, timeout=120)
        reasons = rejections(ctx)
        assert verified_ids(ctx) == [honest.rollout_id]
        assert {reasons[g.rollout_id] for g in failing.values()} == {"environment"}
        details = [decode_json(f)["detail"] for _, f in ctx.redis.xrange(ctx.keys.rejected)]
        for fragment in ("respond raised RuntimeError: the tool is down", "no answer within timeoutSeconds 2",
                         "respond returned a int, not a str"):  # fmt: skip
            assert any(fragment in d for d in details), (fragment, details)
        assert not is_banned(ctx.redis, ctx.keys, "w-1")


def test_model_spans_only_are_trained_on(tmp_path):
    """The trainer's rows hold the environment's tokens as context, but its loss mask and token count only the
    model's (rlfleet/services/trainer/update.py)."""
    from rlfleet.services.trainer.update import BatchRows, MicroBatch
    from rlfleet.wire.streams import Sample, SamplingParams

    params = SamplingParams(1.0, 1.0, 0, 24, seed=0)
    samples = [Sample([5, 6, 7, 8, 9, 10], [-0.5] * 6, [], 1.0, "stop", [2, 3, 1]), Sample([5, 6], [-0.1] * 2, [], 0.0)]
    group = RolloutGroup("t", "w", 0, [1, 2, 3], params, samples)
    batch = BatchRows.of([group])
    assert batch.completion_tokens == 3 + 2
    mb = MicroBatch.of(batch, [0, 1], device=__import__("torch").device("cpu"))
    start = batch.starts[0]
    assert mb.mask[0, start : start + 6].tolist() == [1, 1, 0, 0, 0, 1]
    assert mb.mask[1].sum() == 2 and mb.tokens == 5
    model = [t for s, e, m in span_bounds([2, 3, 1], 6) if m for t in range(s, e)]
    assert model == [0, 1, 5]
