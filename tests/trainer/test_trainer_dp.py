"""Data-parallel training: two CPU processes (gloo, torchrun-style env) give the same updated
weights and the same batch statistics as one process on the same batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlfleet.config import TrainerSpec
from rlfleet.models.policy import load_policy
from rlfleet.services.trainer.distributed import Ranks
from rlfleet.services.trainer.update import UpdateSettings, grpo_update
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams
from tests.support import tiny_policy_dir


def batch() -> list[RolloutGroup]:
    """Three groups of four completions of different lengths, with mixed rewards."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(3):
        samples = []
        for i in range(4):
            n = 2 + (g + i) % 4
            ids = torch.randint(3, 17, (n,), generator=gen).tolist()
            samples.append(Sample(ids, (-torch.rand(n, generator=gen) * 3).tolist(), [], float((g + i) % 2)))
        groups.append(
            RolloutGroup(f"arith-0-{g}", "w", 0, [1, 4, 13, 5, 15], SamplingParams(1.0, 1.0, 0, 6, 0), samples)
        )
    return groups


def update_once(policy_dir, spec: TrainerSpec, rank: int = 0, world: int = 1) -> tuple[dict[str, torch.Tensor], dict]:
    """(updated weights, batch statistics) of one update of the policy at `policy_dir` on `batch()`."""
    torch.manual_seed(0)
    model, tokenizer = load_policy(policy_dir)
    # The KL reference: another policy, so the KL term and its gradient are not zero.
    reference = load_policy(policy_dir.parent / "reference")[0] if spec.kl_coef > 0 else None
    # Plain SGD and no clipping: the update is proportional to the gradient, so any error in how the
    # ranks split and normalize the batch shows in the weights (Adam's first step would hide a scale).
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.learning_rate)
    settings = UpdateSettings.of(spec, 1.0, tokenizer.pad_token_id)
    stats = grpo_update(model, optimizer, batch(), settings, reference, Ranks(rank, world))
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, stats


def _rank_main(rank: int, world: int, port: int, policy_dir: str, spec_json: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rlfleet.services.trainer.distributed import init_distributed, leave_distributed

    assert init_distributed() == Ranks(rank, world)
    weights, stats = update_once(Path(policy_dir), TrainerSpec.model_validate_json(spec_json), rank, world)
    save_file(weights, f"{out}/rank{rank}.safetensors")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(stats))
    leave_distributed()


@pytest.mark.parametrize(
    "normalization, entropy_coef, kl_coef", [("token", 0.0, 0.0), ("sequence", 0.0, 0.0), ("token", 0.01, 0.1)]
)
def test_two_processes_update_like_one(tmp_path, normalization, entropy_coef, kl_coef):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    tiny_policy_dir(tmp_path / "reference", seed=1)
    spec = TrainerSpec(
        learning_rate=1.0, normalization=normalization, max_grad_norm=1e6, entropy_coef=entropy_coef, kl_coef=kl_coef
    )
    initial = {k: v.clone() for k, v in load_policy(policy)[0].state_dict().items()}
    single, single_stats = update_once(policy, spec)
    mp.spawn(_rank_main, args=(2, free_port(), str(policy), spec.model_dump_json(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        parallel = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        for name, value in single.items():
            torch.testing.assert_close(parallel[name], value, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
        # The ranks hold different token counts, so one rank's own means would differ from these.
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stats.keys() == single_stats.keys()
        for key, value in single_stats.items():
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"rank {rank}: {key}"
    assert any(not torch.equal(single[k], initial[k]) for k in single), "the update changed the weights"
    assert ("entropy_mean" in single_stats, "kl_mean" in single_stats) == (entropy_coef > 0, kl_coef > 0)
