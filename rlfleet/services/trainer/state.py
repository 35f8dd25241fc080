"""Trainer resume state: sharded weights and optimizer every `checkpointEvery` steps, and the commit.

Layout in the run's checkpoint store (rlfleet/versions/store.py), beside the run's policy versions:
  {run}/trainer/checkpoints/step-{k:08d}/   weights and AdamW state of step k, torch.distributed.checkpoint
                                            (DCP) files: `.metadata` and one `__{rank}_0.distcp` per rank
  {run}/trainer/state.pt                    the commit point (STATE_FORMAT): step k, version, the LR
                                            scheduler, the checkpoint's key, the *commit* and step k's record
Saving (`save_checkpoint`, every rank, a collective): each rank's DCP writer writes only what it holds:
its FSDP shards (DTensors, no gather to one rank), or under replication its share of the replicated
tensors (DCP's planner gives each to one rank). A rank writes into a local staging directory and uploads
its files to the store (the store is a file tree or S3, the ranks may be pods on different nodes, so
the store, not a shared disk, is where the pieces meet); a barrier, then rank 0 writes `state.pt`
(`save_state`), which makes the checkpoint the current one, and deletes the older checkpoints.
Loading (`load_checkpoint`): every rank fetches the checkpoint's files and DCP reads into its own state
dict whatever its layout, so a run resumes with another world size or sharding (saved by 2 FSDP ranks,
read by 1 plain process, and back).

Exactly once, with a state saved every N steps (main.py runs it):
  - step s trains its batch and publishes version v+1 every step (workers need every version); its
    groups are added to the *pending commit* (their rollout ids, content digests with the version that
    trained them, and stream message ids, the dropped ones too), which nothing outside the trainer sees:
    they are neither recorded as trained nor acknowledged, and stay pending for the trainer's consumer;
  - at a save step (s % N == 0, the last step, or a stop) every rank saves its checkpoint, rank 0 writes
    `state.pt` holding the pending commit, and only then replays it: the digests join the run's trained
    set (`keys.trained`) and the messages are XACKed and deleted;
  - on restart the weights, optimizer and scheduler are restored from the checkpoint `state.pt` names;
    its commit is replayed (idempotent: a set insert and acks) and its step's record appended if the
    crash came before it was (so metrics.jsonl holds it once); records of later steps are removed. The
    groups trained after the save were never committed: they are read again (first the consumer's
    pending messages, in the order they were first read) and trained again from the weights saved
    *before* them, so the final weights hold each group's update once, and the trained set and
    metrics.jsonl list each group once. A kill between two saves costs the steps since the last one.
  - versions are immutable (rlfleet/versions/publish.py) and those published after the save came from
    weights that no longer exist: a restart that finds versions newer than the state's publishes the
    restored weights as the version after the newest (`resume_version`) and counts on from there, so no
    number is ever published twice with different weights. Groups sampled from the abandoned versions
    are trained as any other group of their version's age (maxAsyncLevel). With N = 1 no version is
    published past the state's (the state is saved before its version is published), so version = step.
"""

from __future__ import annotations

import io
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rlfleet.versions.checkpoint import list_versions
from rlfleet.versions.store import CheckpointStore

STATE_FORMAT = 3  # 3: weights and optimizer in DCP files beside state.pt, saved every checkpointEvery steps


def trainer_state_key(run: str) -> str:
    return f"{run}/trainer/state.pt"


def checkpoint_prefix(run: str) -> str:
    return f"{run}/trainer/checkpoints/"


def checkpoint_key(run: str, step: int) -> str:
    return f"{checkpoint_prefix(run)}step-{step:08d}"


@dataclass
class Commit:
    """What the steps since the last save trained: committed (trained set, acks) once a save holds it."""

    rollout_ids: list[str] = field(default_factory=list)
    digests: dict[str, int] = field(default_factory=dict)  # content digest -> the version that trained it
    message_ids: list[str] = field(default_factory=list)

    def add(self, rollout_ids: list[str], digests: list[str], version: int, message_ids: list) -> None:
        self.rollout_ids += rollout_ids
        self.digests.update(dict.fromkeys(digests, version))
        self.message_ids += [m.decode() if isinstance(m, bytes) else m for m in message_ids]

    def to_dict(self) -> dict:
        return {"rollout_ids": self.rollout_ids, "digests": self.digests, "message_ids": self.message_ids}

    @classmethod
    def from_dict(cls, d: dict) -> Commit:
        return cls(list(d["rollout_ids"]), dict(d["digests"]), list(d["message_ids"]))


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextmanager
def _alone() -> Iterator[None]:
    """DCP warns whenever it runs without a process group; a one-process trainer does so on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(store: CheckpointStore, run: str, step: int, lm, optimizer) -> str:
    """Write this rank's part of the weights and optimizer state of step `step`; return the checkpoint's key.
    Every rank calls it (a collective); all ranks' files are in the store when it returns."""
    key = checkpoint_key(run, step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        store.delete_prefix(f"{key}/")  # what a crash left of an earlier save of this step (another world size)
    if _world() > 1:
        dist.barrier()
    model_state, optimizer_state = get_state_dict(lm, optimizer)  # this rank's shards, keyed by parameter name
    with tempfile.TemporaryDirectory(prefix="rlfleet-dcp-") as tmp:
        with _alone():
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp, no_dist=_world() == 1)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                store.put_file(f"{key}/{path.relative_to(tmp).as_posix()}", path)
    if _world() > 1:
        dist.barrier()  # every rank's files are uploaded before rank 0 makes them the current checkpoint
    return key


def load_checkpoint(store: CheckpointStore, key: str, lm, optimizer) -> None:
    """Restore weights and optimizer state from the checkpoint `key` into this rank's layout (any world size
    or sharding). Every rank calls it; each fetches the checkpoint's files."""
    model_state, optimizer_state = get_state_dict(lm, optimizer)  # the layout to fill (creates AdamW's moments)
    with tempfile.TemporaryDirectory(prefix="rlfleet-dcp-") as tmp:
        files = store.list(f"{key}/")
        if not files:
            raise FileNotFoundError(f"{key}: the trainer state names a checkpoint the store does not hold")
        for name in files:
            dest = Path(tmp) / name[len(key) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            store.download(name, dest)
        with _alone():
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp, no_dist=_world() == 1)
    set_state_dict(lm, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def save_state(
    store: CheckpointStore,
    run: str,
    *,
    step: int,
    version: int,
    checkpoint: str,
    scheduler,
    commit: Commit,
    record: dict | None = None,
) -> None:
    """Make `checkpoint` (step `step`, version `version`) the current state (rank 0, after save_checkpoint),
    then delete older checkpoints."""
    buf = io.BytesIO()
    torch.save(
        {
            "format": STATE_FORMAT,
            "step": step,
            "version": version,
            "checkpoint": checkpoint,
            "scheduler": scheduler.state_dict(),
            "commit": commit.to_dict(),
            "record": record,
        },
        buf,
    )
    store.put_bytes(trainer_state_key(run), buf.getvalue())
    prefix = checkpoint_prefix(run)
    for old in {k[len(prefix) :].split("/")[0] for k in store.list(prefix)} - {checkpoint[len(prefix) :]}:
        store.delete_prefix(f"{prefix}{old}/")


def load_state(store: CheckpointStore, run: str) -> dict | None:
    """The saved state (without weights: load_checkpoint reads `state["checkpoint"]`), or None for a fresh run."""
    try:
        raw = store.get_bytes(trainer_state_key(run))
    except KeyError:
        return None
    state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{trainer_state_key(run)}: state format {state.get('format')!r} is not {STATE_FORMAT}; "
            f"delete it to start the run over"
        )
    return state


def resume_version(store: CheckpointStore, run: str, saved: int) -> int:
    """The version the restored weights are published as: the state's, unless versions after it were published
    (from weights trained after the save and lost with the crash): then the one after the newest."""
    newest = max(list_versions(store, run), default=saved)
    return saved if newest <= saved else newest + 1
