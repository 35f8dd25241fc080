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
gathers the whole weights, keyed by parameter name, onto rank 0's CPU for publishing, one tensor at a
time and already in the published dtype; it is a collective under FSDP, so every rank calls it. The
published checkpoint is whole HF safetensors written by rank 0 (`publishable_weights`: a tied parameter
is saved once, under its first name, as `save_pretrained` does), so rollout workers and the verifier never
see shards.
Reference: torchtitan `parallelize` (per-block fully_shard, then the root) and its HF export.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlfleet.models.policy import Prefill


def shard_policy(lm, world: int, mp_policy=None, device_type: str | None = None) -> Prefill:
    """Shard `lm`'s parameters in place over the `world` ranks of the joined process group; return the
    root `Prefill` that scoring calls. Create the optimizer afterwards (it must hold the shards).
    `mp_policy`: FSDP2's MixedPrecisionPolicy (precision.py), or None to compute in the parameters' dtype.
    `device_type`: the mesh's device ("cpu", "cuda"); default where the model is (a model on the meta device
    names the device its shards will be allocated on: `load_sharded_policy`)."""
    mp = {"mp_policy": mp_policy} if mp_policy is not None else {}
    mesh = init_device_mesh(device_type or next(lm.parameters()).device.type, (world,))
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, **mp)
    root = Prefill(lm)
    fully_shard(root, mesh=mesh, **mp)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def load_sharded_policy(
    model_dir: str | Path, dtype: str, world: int, device: torch.device, mp_policy=None, prepare=None
) -> tuple[torch.nn.Module, Prefill]:
    """(the model, its root `Prefill`) from the HF directory `model_dir`, sharded over the `world` ranks like
    `shard_policy`, without any rank ever holding a whole copy (a 32B model in fp32 is 131 GB):

    1. the model is built from its config on the meta device (no storage), its buffers real (the rotary
       frequencies are computed in __init__ and are in no checkpoint); `prepare(model)` runs then
       (activation checkpointing), before sharding as in the whole-model path;
    2. `shard_policy` on the meta model, then `to_empty` allocates this rank's shards alone on `device`
       and the saved buffers are copied back;
    3. each parameter's shard is FSDP2's dim-0 chunk (torch.chunk over the ranks, the last ones shorter or
       empty): its rows are read straight from the safetensors files (`get_slice`, memory-mapped) and cast
       to `dtype` as they are copied in, one tensor at a time: a rank's peak is its shards plus one tensor's
       chunk of the file (benchmarks/trainer_load.py). A tied head is the embedding's parameter and is filled
       once, under the first name.
    Invariant: the gathered weights equal a whole `load_policy(model_dir, dtype)` bit for bit (tests/trainer/
    test_trainer_fsdp.py). Names or shapes that do not match the files raise ValueError before the run."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlfleet.models.policy import DTYPES

    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):
        lm = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    lm.tie_weights()  # from_pretrained ties a tied head to the embedding; from_config leaves them two parameters
    lm.eval()
    if prepare is not None:
        prepare(lm)
    buffers = {name: b for name, b in lm.named_buffers()}
    root = shard_policy(lm, world, mp_policy, device_type=device.type)
    lm.to_empty(device=device)
    with torch.no_grad():
        for name, b in lm.named_buffers():
            b.copy_(buffers[name])

    files = sorted(Path(model_dir).glob("*.safetensors"))
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update({key: file for key in f.keys()})
    params = dict(lm.named_parameters())  # tied parameters once, under their first name
    missing = sorted(set(params) - set(where))
    if missing:
        raise ValueError(f"{model_dir}: no weights for {missing[:3]} in its safetensors files")
    with torch.no_grad():
        for name, param in params.items():
            # One file handle per tensor: the pages read are unmapped with it, so a rank never maps more of
            # the files than one tensor's chunk; copy_ casts as it copies (no whole-chunk temporary).
            with safe_open(str(where[name]), framework="pt", device="cpu") as f:
                rows = f.get_slice(name)
                if tuple(rows.get_shape()) != tuple(param.shape):
                    raise ValueError(
                        f"{model_dir}: {name} has shape {rows.get_shape()} in its file, the model {tuple(param.shape)}"
                    )
                if not isinstance(param, DTensor) or any(
                    not (isinstance(p, Shard) and p.dim == 0) for p in param.placements
                ):
                    raise ValueError(f"{name}: expected an FSDP dim-0 shard, got {type(param).__name__}")
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                if shape[0] == 0:
                    continue  # this rank's chunk of a short tensor is empty
                param.to_local().copy_(rows[offset[0] : offset[0] + shape[0]])
    return lm, root


def is_sharded(model) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_model_state(lm, trainable_only: bool = False, dtype: torch.dtype | None = None) -> dict:
    """The whole model state dict on rank 0's CPU ({} elsewhere under FSDP). Every rank calls it.
    `trainable_only`: only the parameters that train (a LoRA run's adapters: a few MB), so a LoRA version
    gathers no part of its frozen base, on every rank. `dtype`: floating tensors are cast to it on their device
    one at a time, before they are copied to the CPU, so publishing bf16 from fp32 masters never holds an fp32
    copy of the model (a 32B model's would be 128 GB of host memory).

    Tensor by tensor, in the module's order on every rank: a sharded parameter is all-gathered (DTensor
    full_tensor, a collective) and the names of a tied parameter (lm_head.weight, the embedding) share one
    gathered tensor."""
    lead = not dist.is_initialized() or dist.get_rank() == 0
    if trainable_only:
        # Not get_model_state_dict's ignore_frozen_params, which keeps the second name of a tied frozen parameter
        # (lm_head.weight: the whole embedding).
        entries = [(name, p) for name, p in lm.named_parameters() if p.requires_grad]
    else:
        entries = list(lm.state_dict(keep_vars=True).items())
    state, gathered = {}, {}
    for name, value in entries:
        if id(value) not in gathered:
            whole = value.full_tensor() if isinstance(value, DTensor) else value  # under FSDP an all-gather
            if dtype is not None and whole.is_floating_point():
                whole = whole.to(dtype)
            gathered[id(value)] = whole.detach().cpu().contiguous() if lead else None
        if lead:
            state[name] = gathered[id(value)]
    return state


def publishable_weights(lm, model_state: dict) -> dict[str, torch.Tensor]:
    """`model_state` without the second and later names of tied parameters (HF keeps the first:
    `model.embed_tokens.weight`, not `lm_head.weight`), as contiguous CPU tensors."""
    seen, aliases = set(), set()
    for name, param in lm.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k not in aliases}
