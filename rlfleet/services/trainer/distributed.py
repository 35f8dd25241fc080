"""The trainer's ranks: which one this process is, where it computes, and how they talk.

Launch is torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU, NCCL on GPU), which
ranks.py gives every rank it starts. A one-process trainer is rank 0 of a world of 1 and joins no
process group; every function here is then a no-op or the identity.

Rank 0 alone reads the streams, publishes and commits (main.py); the others receive what it read
(`broadcast`) and take the same update (update.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from rlfleet.models.device import choose_device
from rlfleet.wire import env

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks: rank `rank` of `world`."""

    rank: int = 0
    world: int = 1

    @property
    def is_lead(self) -> bool:
        """Whether this is rank 0, the one that reads the streams, publishes and commits."""
        return self.rank == 0


SINGLE = Ranks(0, 1)  # a one-process trainer


def training_device() -> torch.device:
    """Where this rank computes: rlfleet/models/device.py's choice for its GPU index (LOCAL_RANK,
    torchrun-style; 0 in a one-replica pod). A GPU is made current before NCCL joins, as NCCL requires."""
    device = choose_device(rank=env.get_int(env.LOCAL_RANK, 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed() -> Ranks:
    """This process's ranks from the torchrun-style environment; joins the process group when world > 1
    (NCCL when this rank computes on a GPU, else gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if training_device().type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    return Ranks(rank, world)


def leave_distributed() -> None:
    """Leave the process group, if this process joined one. Every rank must, before it exits: gloo's
    worker threads still alive at interpreter shutdown abort the process (SIGABRT, "terminate called
    without an active exception"; 3 exits in 80 in a 4-rank all-reduce loop here, none with this)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast(obj: T, ranks: Ranks) -> T:
    """Rank 0's `obj` on every rank."""
    if ranks.world == 1:
        return obj
    box = [obj if ranks.is_lead else None]
    dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])
