"""Mixed precision and activation checkpointing of the trainer's model.

A bfloat16 run (`model.dtype: bfloat16`) with `trainer.masterWeights` (the default) trains fp32
master weights: the trainer loads the model in fp32, so its parameters, gradients and AdamW moments
are fp32, and the forward and backward compute in bf16:
- one process or replicated data parallel: `torch.autocast(bf16)` around the forwards (update.py's
  `compute_dtype`): matmuls take bf16 copies of the fp32 weights, gradients land on the fp32 weights;
- FSDP2 (`trainer.sharding: fsdp`): `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`;
  the fp32 shards are all-gathered as bf16 for compute and gradients are reduce-scattered in fp32.
Why: AdamW moves a weight by about the learning rate per step; bf16 keeps 8 significant bits, so a
weight of magnitude m changes only if the step exceeds m * 2^-9, and at lr 1e-6 a bf16 model keeps
almost no update (tests/trainer/test_microbatch.py shows one that rounds to no change and is kept
here). Cost: 16 bytes of model state per parameter (fp32 weight, gradient, two moments) instead of 8.
Published versions are cast back to the run's dtype (`publish_dtype`), so workers, the verifier and
the relay tree see bf16 as before; the resume state keeps the fp32 masters.
A float32 run, or `masterWeights: false`, trains in the model's dtype as it is.

Activation checkpointing (`trainer.activationCheckpointing`): transformers'
`gradient_checkpointing_enable` with non-reentrant torch.utils.checkpoint on every decoder layer
(works under FSDP2, whose per-layer units gather again for the recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.models.policy import DTYPES


@dataclass(frozen=True)
class Precision:
    load_dtype: str  # what the trainer's parameters (and optimizer state) are
    compute_dtype: torch.dtype | None  # autocast to this (None: compute in the parameters' dtype)
    publish_dtype: torch.dtype  # what published versions are

    def fsdp_policy(self):
        """FSDP2's mixed-precision policy for these dtypes (None: FSDP computes in the parameters' dtype)."""
        if self.compute_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)


def precision_for(model_dtype: str, trainer) -> Precision:
    """The trainer's precision for a run whose model is `model_dtype`, with TrainerSpec `trainer`."""
    if model_dtype != "float32" and trainer.master_weights:
        return Precision("float32", DTYPES[model_dtype], DTYPES[model_dtype])
    return Precision(model_dtype, None, DTYPES[model_dtype])


def prepare_for_training(lm, trainer) -> None:
    """Turn on activation checkpointing when `trainer.activationCheckpointing` asks (before sharding)."""
    if trainer.activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
