"""Sharded data parallel (`trainer.sharding: fsdp`): two CPU processes (gloo, torchrun-style env)
with FSDP2 give the same weights as one unsharded process, through a save and a restore of the
sharded optimizer state; the checkpoints they publish (v0 whole, then deltas) rebuild to whole
safetensors a plain model loads."""

from __future__ import annotations

import collections
import json
import os
import subprocess

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlfleet.config import TrainerSpec
from rlfleet.models.policy import Prefill, load_policy, load_weights_in_place
from rlfleet.services.shardcast import origin
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.trainer.distributed import Ranks
from rlfleet.services.trainer.precision import prepare_for_training
from rlfleet.services.trainer.sharding import full_model_state, load_sharded_policy, publishable_weights, shard_policy
from rlfleet.services.trainer.state import load_checkpoint, save_checkpoint
from rlfleet.services.trainer.update import UpdateSettings, grpo_update
from rlfleet.versions.checkpoint import save_model_dir
from rlfleet.versions.store import open_store
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams, group_digest
from tests.support import serving, start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group
from tests.trainer.test_trainer_dp import batch

# Step 1: plain SGD with momentum on a batch of 12 completions (6 per rank), no clipping; in
# micro-batches of at most 24 padded tokens (3 on each rank),
# logprobs in chunks of 5 positions, decoder layers checkpointed.
FIRST = TrainerSpec(
    learning_rate=0.5, max_grad_norm=1e6, micro_batch_tokens=24, logprob_chunk=5, activation_checkpointing=True
)
# Step 2: one completion (rank 1 has none of its own and joins FSDP's collectives with a
# placeholder, in the off-policy forward and once per update of its 2 epochs); the entropy bonus gives
# it a gradient, and a small clip makes the norm matter.
SECOND = TrainerSpec(
    learning_rate=0.5, entropy_coef=0.5, max_grad_norm=0.05, epochs=2, off_policy={"mode": "tis", "cap": 2.0}
)


def single_completion() -> list[RolloutGroup]:
    return [
        RolloutGroup(
            "one",
            "w",
            0,
            [1, 4, 13, 5, 15],
            SamplingParams(1.0, 1.0, 0, 6, 0),
            [Sample([5, 6, 7, 2], [-2.0, -2.0, -2.0, -2.0], [], 1.0)],
        )
    ]


def sgd(model) -> torch.optim.Optimizer:
    # The update is proportional to the gradient, so an error in how ranks split and sum the batch
    # shows in the weights; the momentum buffer is optimizer state the restore must bring back.
    return torch.optim.SGD(model.parameters(), lr=FIRST.learning_rate, momentum=0.9)


def _rank_main(rank: int, world: int, port: int, policy_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlfleet.services.trainer.distributed import init_distributed

    assert init_distributed() == Ranks(rank, world)
    model, tokenizer = load_policy(policy_dir)
    prepare_for_training(model, FIRST)
    prefill = shard_policy(model, world)
    optimizer = sgd(model)
    grpo_update(
        prefill, optimizer, batch(), UpdateSettings.of(FIRST, 1.0, tokenizer.pad_token_id), ranks=Ranks(rank, world)
    )
    weights = full_model_state(model)
    if rank == 0:
        save_model_dir(model, tokenizer, f"{out}/published", state_dict=publishable_weights(model, weights))
    store = open_store(f"file://{out}/store")
    key = save_checkpoint(store, "fsdp", 1, model, optimizer)  # each rank its shards (state.py)

    # Resume as a restarted trainer does: a fresh sharded model and optimizer, then the sharded state.
    model, tokenizer = load_policy(policy_dir)
    prefill = shard_policy(model, world)
    optimizer = sgd(model)
    load_checkpoint(store, key, model, optimizer)
    stats = grpo_update(
        prefill,
        optimizer,
        single_completion(),
        UpdateSettings.of(SECOND, 1.0, tokenizer.pad_token_id),
        ranks=Ranks(rank, world),
    )
    weights = full_model_state(model)
    if rank == 0:
        # tied names share one gathered tensor, which safetensors will not write twice: a copy per name
        save_file({k: v.clone() for k, v in weights.items()}, f"{out}/resumed.safetensors")
        torch.save({"grad_norm": stats["grad_norm"]}, f"{out}/stats.pt")
    dist.destroy_process_group()


def test_two_sharded_processes_update_like_one_and_publish_a_whole_checkpoint(tmp_path):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    torch.manual_seed(0)
    model, tokenizer = load_policy(policy)
    prepare_for_training(model, FIRST)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = sgd(model)
    grpo_update(model, optimizer, batch(), UpdateSettings.of(FIRST, 1.0, tokenizer.pad_token_id))
    after_first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats = grpo_update(model, optimizer, single_completion(), UpdateSettings.of(SECOND, 1.0, tokenizer.pad_token_id))
    after_second = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert stats["grad_norm"] > SECOND.max_grad_norm, "the second step is clipped"

    mp.spawn(_rank_main, args=(2, free_port(), str(policy), str(tmp_path)), nprocs=2, join=True)

    published = load_file(str(tmp_path / "published" / "model.safetensors"))
    assert "lm_head.weight" not in published, "the tied head is saved once, as save_pretrained does"
    plain, _ = load_policy(tmp_path / "published")  # a plain (unsharded) model loads it
    for name, value in after_first.items():
        torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    load_weights_in_place(load_policy(policy)[0], tmp_path / "published")  # and so does a worker's hot-swap

    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    for name, value in after_second.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert torch.load(tmp_path / "stats.pt")["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4), (
        "the norm spans all shards"
    )
    assert any(not torch.equal(after_second[k], after_first[k]) for k in after_first), (
        "the second step moved the weights"
    )
    assert any(not torch.equal(after_first[k], initial[k]) for k in initial), "the first step moved the weights"


def _sharded_load_main(rank: int, world: int, port: int, policy_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlfleet.services.trainer.distributed import init_distributed

    init_distributed()
    model, prefill = load_sharded_policy(policy_dir, "float32", world, torch.device("cpu"))
    local = {name: p.to_local().numel() for name, p in model.named_parameters()}
    weights = full_model_state(model)
    if rank == 0:
        # tied names share one gathered tensor, which safetensors will not write twice: a copy per name
        save_file({k: v.clone() for k, v in weights.items()}, f"{out}/gathered.safetensors")
    torch.save(local, f"{out}/local{rank}.pt")
    # the sharded model scores like the whole one: a forward through FSDP's gathers
    with torch.no_grad():
        _, logits = prefill(torch.tensor([[1, 4, 13, 5, 15]]), torch.ones(1, 5, dtype=torch.long))
    torch.save(logits, f"{out}/logits{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("tied", [True, False])
def test_each_rank_loads_only_its_shards_and_they_gather_to_the_whole_model(tmp_path, tied):
    """#41: a trainer rank used to load the whole model, then shard it (131 GB per rank for 32B in fp32).
    Three ranks (uneven dim-0 chunks: the vocabulary rows and the norms do not divide by 3) read their rows
    only; gathered, the weights equal a whole load bit for bit, tied head or not."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=3)
    if not tied:  # the same model with its own output head
        model, tokenizer = load_policy(policy)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        save_model_dir(model, tokenizer, tmp_path / "untied")
        policy = tmp_path / "untied"
    whole, _ = load_policy(policy)
    assert (whole.lm_head.weight is whole.model.embed_tokens.weight) == tied

    world = 3
    mp.spawn(_sharded_load_main, args=(world, free_port(), str(policy), str(tmp_path)), nprocs=world, join=True)

    gathered = load_file(str(tmp_path / "gathered.safetensors"))
    expected = whole.state_dict()
    assert set(gathered) == set(expected)
    for name, value in expected.items():
        assert torch.equal(gathered[name], value), name
    locals_ = [torch.load(tmp_path / f"local{rank}.pt") for rank in range(world)]
    for name, param in whole.named_parameters():
        held = [local[name] for local in locals_]
        assert sum(held) == param.numel() and max(held) < param.numel(), (name, held)
    with torch.no_grad():
        _, reference = Prefill(whole)(torch.tensor([[1, 4, 13, 5, 15]]), torch.ones(1, 5, dtype=torch.long))
    for rank in range(world):
        torch.testing.assert_close(torch.load(tmp_path / f"logits{rank}.pt"), reference, rtol=1e-5, atol=1e-6)


TRAINER = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 4, replicas: 2, sharding: fsdp}"


def start_ranks(config, redis_url, out, steps: int) -> list[subprocess.Popen]:
    """The two trainer replicas, launched the way the operator's StatefulSet pods are (torchrun-style env)."""
    port = str(free_port())
    return [
        start_trainer(
            config,
            redis_url,
            out,
            "--steps",
            str(steps),
            log=f"rank{rank}.log",
            env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for rank in (0, 1)
    ]


@pytest.mark.slow
def test_two_fsdp_trainer_processes_train_resume_and_publish_whole_checkpoints(tmp_path, redis_url, redis_client):
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    keys = RunKeys("tr")
    ids = [f"g{i}" for i in range(8)]
    for rid in ids:
        redis_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())

    for steps in (2, 4):  # stop after step 2, then restart both replicas: they resume from the saved state
        for rank, proc in enumerate(start_ranks(config, redis_url, tmp_path, steps)):
            assert proc.wait(300) == 0, (tmp_path / f"rank{rank}.log").read_text()
    assert "resumed after step 2" in (tmp_path / "rank0.log").read_text()

    trained = {d.decode(): int(v) for d, v in redis_client.zrange(keys.trained, 0, -1, withscores=True)}
    digests = sorted(group_digest(group(rid, [1.0, 0.0])) for rid in ids)  # the trainer records what it trained
    assert sorted(trained) == digests, "every accepted rollout was trained"
    assert collections.Counter(trained.values()) == {v: 2 for v in range(1, 5)}, "each step trained its batch of 2 once"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4], "only rank 0 reports"

    base, _ = load_policy(tmp_path / "policy")
    store = open_store(f"file://{tmp_path}/store")
    with serving(origin.make_app(store, "tr")) as origin_url:  # v4 is a delta: rebuilt as a worker rebuilds it
        v4 = fetch_policy(FetchSettings.over([origin_url], "tr"), 4, tmp_path / "worker")
    latest, _ = load_policy(v4)  # whole safetensors, plain model
    assert any(not torch.equal(latest.state_dict()[k], v) for k, v in base.state_dict().items()), (
        "training moved the weights"
    )


def _mixed_rank_main(rank: int, world: int, port: int, policy_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlfleet.services.trainer.distributed import init_distributed
    from rlfleet.services.trainer.precision import precision_for

    init_distributed()
    spec = TrainerSpec(learning_rate=1e-6, micro_batch_tokens=24)
    precision = precision_for("bfloat16", spec)
    model, tokenizer = load_policy(policy_dir, precision.load_dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    prefill = shard_policy(model, world, precision.fsdp_policy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate)
    grpo_update(
        prefill, optimizer, batch(), UpdateSettings.of(spec, 1.0, tokenizer.pad_token_id), ranks=Ranks(rank, world)
    )
    weights = full_model_state(model)
    if rank == 0:
        changed = sum(int((weights[k] != v).sum()) for k, v in initial.items())
        dtypes = sorted({str(v.dtype) for v in weights.values()})
        json.dump({"changed": changed / sum(v.numel() for v in initial.values()), "dtypes": dtypes}, open(out, "w"))
    dist.destroy_process_group()


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(tmp_path):
    """A bf16 run under FSDP2 (MixedPrecisionPolicy bf16 compute, fp32 reduction) keeps fp32 shards:
    an AdamW step of 1e-6, below bf16's resolution, changes most weights."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    out = tmp_path / "mixed.json"
    mp.spawn(_mixed_rank_main, args=(2, free_port(), str(policy), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["dtypes"] == ["torch.float32"]
    assert result["changed"] > 0.5, result
