"""The models a trainer rank holds (main.py's `Trainer`): the policy on this rank's device, whole or its FSDP
shard, its LoRA adapters, the optimizer and LR schedule over what trains, and the frozen KL reference.

Sharded without LoRA, each rank reads only its shards (sharding.load_sharded_policy): a whole copy per rank
would not fit a host at 32B. A LoRA run wraps the whole base model first (peft), so it loads it whole, then
shards it (sharding.shard_policy); so does a run of one rank, which shards nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlfleet.models.policy import Prefill, load_policy, load_tokenizer
from rlfleet.services.trainer.distributed import training_device
from rlfleet.services.trainer.lora import Adapters, attach
from rlfleet.services.trainer.precision import Precision, precision_for, prepare_for_training
from rlfleet.services.trainer.schedule import lr_factor
from rlfleet.services.trainer.sharding import load_sharded_policy, shard_policy


@dataclass
class RankModels:
    precision: Precision  # fp32 master weights for bf16 (precision.py)
    device: torch.device
    sharded: bool  # FSDP over more than one rank
    model: Any  # the HF causal LM (its parameters DTensor shards when sharded)
    tokenizer: Any
    prefill: Any  # what the loss scores through: the whole policy, or its FSDP root (sharding.py)
    lora: Adapters | None  # None: every weight trains
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    reference: Any  # the frozen starting policy (sharded like the policy) when the KL penalty is on, else None


def load_rank_models(spec, base: Path, world: int) -> RankModels:
    """Everything a rank trains with, from the base model's HF directory `base` (module docstring)."""
    t = spec.trainer
    precision = precision_for(spec.model.dtype, t)
    device = training_device()
    sharded = t.sharding == "fsdp" and world > 1
    lora = None
    if sharded and t.lora is None:
        model, prefill = load_sharded_policy(
            base,
            precision.load_dtype,
            world,
            device,
            precision.fsdp_policy(),
            prepare=lambda lm: prepare_for_training(lm, t),
        )
    else:
        model, _ = load_policy(base, precision.load_dtype)
        # LoRA's A matrices start random: every rank (and every run of the same seed) must draw the same ones.
        torch.manual_seed(t.seed)
        lora = attach(model, t.lora, base, spec.model.path)
        prepare_for_training(model, t)
        model.to(device)
        prefill = shard_policy(model, world, precision.fsdp_policy()) if sharded else Prefill(model)
    torch.manual_seed(t.seed)

    trained = lora.parameters() if lora else model.parameters()
    optimizer = torch.optim.AdamW(trained, lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t.warmup_steps, t.lr_schedule, t.steps))

    reference = None
    if t.kl_coef > 0:
        if sharded:
            reference = load_sharded_policy(base, spec.model.dtype, world, device)[1]
        else:
            reference = load_policy(base, spec.model.dtype)[0].to(device)
    return RankModels(
        precision, device, sharded, model, load_tokenizer(base), prefill, lora, optimizer, scheduler, reference
    )
