"""The trainer's ranks: which one this process is, where it computes, and how they talk.

Launch is torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo on CPU, NCCL on GPU), which
ranks.py gives every rank it starts. A one-process trainer is rank 0 of a world of 1 and joins no
process group; every function here is then a no-op or the identity.

Rank 0 alone reads the streams, publishes and commits (main.py); the others receive what it read
(`broadcast`) and take the same update (update.py).

Collectives time out (`trainer.collectiveTimeoutSeconds`, given to the process group): a rank stuck in one
fails and the replica restarts whole. Collecting a step's verified groups can take longer than any
collective should (a fleet that is still warming up, a slow verifier), so the other ranks do not wait for
rank 0 inside a collective: rank 0 marks each step it has read in the process group's key-value store
(`lead_at`) and the others poll that store (`await_lead`) before they join the step's broadcast. A poll has
no timeout; a rank 0 that died takes its store with it, and the poll raises.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from rlfleet.models.device import choose_device
from rlfleet.wire import env

T = TypeVar("T")

LEAD_POLL_MAX_S = 0.05  # how late, at most, a waiting rank sees that rank 0 has read its batch


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


def init_distributed(collective_timeout_s: float | None = None) -> Ranks:
    """This process's ranks from the torchrun-style environment; joins the process group when world > 1
    (NCCL when this rank computes on a GPU, else gloo), its collectives failing after `collective_timeout_s`
    (None: the backend's default)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if training_device().type == "cuda" else "gloo"
        timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    return Ranks(rank, world)


def _lead_key(mark: str) -> str:
    return f"rlfleet/lead/{mark}"


def lead_at(mark: str, ranks: Ranks, done: str | None = None) -> None:
    """Rank 0: tell the other ranks it has reached `mark` (they wait in `await_lead`), and forget `done`, a
    mark every rank has passed. Nothing on the other ranks or in a world of one."""
    if ranks.world == 1 or not ranks.is_lead:
        return
    store = dist.distributed_c10d._get_default_store()  # the process group's own rendezvous store
    store.set(_lead_key(mark), "1")
    if done is not None:
        store.delete_key(_lead_key(done))


def await_lead(mark: str, ranks: Ranks) -> None:
    """Ranks 1..n: wait, outside any collective and with no timeout, until rank 0 has reached `mark`
    (`lead_at`). Polls the store: its `wait` would log a warning at every timeout of a long wait."""
    if ranks.world == 1 or ranks.is_lead:
        return
    store, key, pause = dist.distributed_c10d._get_default_store(), _lead_key(mark), 0.001
    while not store.check([key]):
        time.sleep(pause)
        pause = min(2 * pause, LEAD_POLL_MAX_S)


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
