"""Trainer resume state: `{store}/{run}/trainer/state.pt`, beside the run's policy versions.

Protocol of one step (main.py), chosen so that `kill -9` at any point loses no accepted rollout
and trains none twice:
  1. update the weights;
  2. save the state: step, version v+1, weights, optimizer, scheduler, the *commit* of the step
     (the rollout ids and content digests it trained and their stream message ids) and its metrics record; weights and
     optimizer are whole, keyed by parameter name (sharding.full_state), whatever the sharding and
     replica count;
  3. publish version v+1 and announce it;
  4. commit: record the content digests (streams.group_digest) as trained, XACK and delete their messages;
  5. append the step's record to metrics.jsonl.
On restart the state is loaded, version v+1 is published if step 3 did not finish, the commit is
replayed (idempotent: a set insert and acks), and the record is appended if step 5 did not happen,
so metrics.jsonl holds every step once. Messages read but not committed before
the crash are still pending for the trainer's consumer and are read again first; a group whose
digest is already recorded as trained is acknowledged and skipped.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch

from rlfleet.versions.store import CheckpointStore

STATE_FORMAT = 2  # 2: optimizer state keyed by parameter name (was: by index)


def trainer_state_key(run: str) -> str:
    return f"{run}/trainer/state.pt"


def save_state(
    store: CheckpointStore,
    run: str,
    *,
    step: int,
    version: int,
    model_state: dict,
    optimizer_state: dict,
    scheduler,
    rollout_ids: list[str],
    message_ids: list[bytes],
    record: dict | None = None,
    digests: Sequence[str] = (),
) -> None:
    buf = io.BytesIO()
    torch.save(
        {
            "format": STATE_FORMAT,
            "step": step,
            "version": version,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "commit": {
                "rollout_ids": rollout_ids,
                "digests": list(digests),
                "message_ids": [m.decode() if isinstance(m, bytes) else m for m in message_ids],
            },
            "record": record,
        },
        buf,
    )
    store.put_bytes(trainer_state_key(run), buf.getvalue())


def load_state(store: CheckpointStore, run: str) -> dict | None:
    """The saved state, or None for a fresh run."""
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
