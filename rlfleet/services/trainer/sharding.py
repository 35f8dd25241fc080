"""Sharded data parallel for the trainer (`trainer.sharding: fsdp`), with PyTorch FSDP2.

Layout: a 1-D device mesh over the W trainer ranks (replicas x ranks per replica); `fully_shard` on
every decoder layer, then on the policy's `Prefill` (embedding, final norm, tied output head) as the
root unit. Each rank holds 1/W of every parameter, of its gradient and of its AdamW moments (dim-0 shards, DTensors).
In the forward a unit all-gathers its parameters and frees them after use; in the backward it
gathers them again and reduce-scatters the gradients.

Gradient scale: update.py divides every rank's loss by the *whole* batch's token (or completion)
count, so the batch gradient is the SUM of the ranks' gradients, not FSDP's default mean; every
unit is set to reduce by sum (divide factor 1 and sum-only collectives, since gloo has no
PREMUL_SUM). The collectives run inside the forward and backward, so every rank must run the same
forwards and backwards: a rank without completions of its own runs one on a placeholder with zero
weight (update.py).

State in and out: the resume state is not gathered; every rank saves its shards with
torch.distributed.checkpoint and any world size reads them back (state.py). `full_model_state`
gathers the whole weights, keyed by parameter name (torch.distributed.checkpoint.state_dict's full
state dicts), onto rank 0's CPU for publishing; it is a collective under FSDP, so every rank calls
it. The published checkpoint is whole HF safetensors written by rank 0 (`publishable_weights`: a
tied parameter is saved once, under its first name, as `save_pretrained` does), so rollout workers
and the verifier never see shards.
Reference: torchtitan `parallelize` (per-block fully_shard, then the root) and its HF export.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from rlfleet.models.policy import Prefill


def shard_policy(lm, world: int, mp_policy=None) -> Prefill:
    """Shard `lm`'s parameters in place over the `world` ranks of the joined process group; return the
    root `Prefill` that scoring calls. Create the optimizer afterwards (it must hold the shards).
    `mp_policy`: FSDP2's MixedPrecisionPolicy (precision.py), or None to compute in the parameters' dtype."""
    mp = {"mp_policy": mp_policy} if mp_policy is not None else {}
    mesh = init_device_mesh(next(lm.parameters()).device.type, (world,))  # shards stay where the model is
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, **mp)
    root = Prefill(lm)
    fully_shard(root, mesh=mesh, **mp)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def is_sharded(model) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _full_options(**extra) -> StateDictOptions:
    # Outside a process group there is nothing to gather: the plain state dicts are already whole.
    if dist.is_initialized():
        return StateDictOptions(full_state_dict=True, cpu_offload=True, **extra)
    return StateDictOptions(**extra)


def full_model_state(lm) -> dict:
    """The whole model state dict on rank 0's CPU ({} elsewhere under FSDP). Every rank calls it."""
    return get_model_state_dict(lm, options=_full_options())


def publishable_weights(lm, model_state: dict) -> dict[str, torch.Tensor]:
    """`model_state` without the second and later names of tied parameters (HF keeps the first:
    `model.embed_tokens.weight`, not `lm_head.weight`), as contiguous CPU tensors."""
    seen, aliases = set(), set()
    for name, param in lm.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k not in aliases}
