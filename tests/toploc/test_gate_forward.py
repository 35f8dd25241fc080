"""Issue 16 item 5: the trainer trains on the logprobs the gate recomputed, where the gate has them.

A spot-checked group leaves the gate with the recomputed token logprobs in place of the worker's,
so a shift inside the logprob tolerance does not skew the trainer's importance ratios; a group that
skipped the prefill keeps the worker's (the gate has nothing better).
"""

from __future__ import annotations

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.policy import score
from rlfleet.operator.names import TRAINER
from rlfleet.services.trainer.main import Trainer
from rlfleet.wire.streams import RolloutGroup
from tests.toploc import attacks
from tests.toploc.test_gate import as_, gate_system, run_gate

SHIFT = 0.03


@pytest.mark.parametrize("spot_check", [1.0, 0.0])
def test_verified_groups_carry_the_recomputed_logprobs(tmp_path, redis_url, spot_check):
    verifier = f"{{logprobTolerance: 0.05, spotCheckFraction: {spot_check}}}"  # the shift is inside the tolerance
    with gate_system(tmp_path, redis_url, verifier=verifier) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        engine = TorchEngine(policy, 0)
        group = attacks.honest(engine, spec, 1)
        for s in group.samples:
            s.logprobs = [lp + SHIFT for lp in s.logprobs]  # every token claimed more likely
        ctx.redis.xadd(ctx.keys.rollouts, group.encode())
        run_gate(ctx, origin_url, tmp / "cache", expected=1)
        [forwarded] = [RolloutGroup.decode(f) for _, f in ctx.redis.xrange(ctx.keys.verified)]
        p = len(group.prompt_ids)
        with torch.inference_mode():
            rows = [group.prompt_ids + s.completion_ids for s in group.samples]
            truth = score(engine.model, rows, spec.sampling.temperature, engine.tokenizer.pad_token_id).logprobs
        for s, claimed, true in zip(forwarded.samples, group.samples, truth):
            want = true[p - 1 :] if spot_check else torch.tensor(claimed.logprobs)
            torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=0, atol=1e-5)

        trainer = Trainer(as_(ctx, TRAINER), output_dir=None)
        stats = trainer.step(trainer.read_batch().groups)
        # The first step's ratio is new/old policy = exactly the behaviour policy: 1 on the gate's logprobs.
        expected = 1.0 if spot_check else float(torch.exp(torch.tensor(-SHIFT)))
        assert stats["ratio_mean"] == pytest.approx(expected, abs=2e-3)
