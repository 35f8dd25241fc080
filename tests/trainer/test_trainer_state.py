"""The resume state (services/trainer/state.py) in both stores: the DCP checkpoint of one process round-trips
weights and AdamW state through S3 and a file tree, a new save makes the older one go, and a restart that finds
versions published past the state publishes the restored weights as a new version."""

from __future__ import annotations

import uuid

import boto3
import pytest
import torch

from rlfleet.models.policy import load_policy
from rlfleet.services.trainer.state import (
    Commit,
    checkpoint_prefix,
    load_checkpoint,
    load_state,
    resume_version,
    save_checkpoint,
    save_state,
)
from rlfleet.versions.checkpoint import manifest_key
from rlfleet.versions.store import open_store
from tests.support import tiny_policy_dir


def trained(policy):
    """A policy and its AdamW after two steps (moments and step count not zero)."""
    model, _ = load_policy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    for _ in range(2):
        model(torch.tensor([[1, 4, 13, 5]])).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_env")
    bucket = f"state-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/runs", endpoint_url=endpoint)


def test_the_checkpoint_round_trips_weights_and_optimizer_and_replaces_the_older_one(tmp_path, store):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    model, optimizer, scheduler = trained(policy)
    for step in (3, 6):
        key = save_checkpoint(store, "tr", step, model, optimizer)
        commit = Commit()
        commit.add(["a"], ["digest-a"], step, [b"1-0"])
        save_state(store, "tr", step=step, version=step, checkpoint=key, scheduler=scheduler, commit=commit)
    assert {k.split("/")[3] for k in store.list(checkpoint_prefix("tr"))} == {"step-00000006"}, "step 3's is gone"

    state = load_state(store, "tr")
    assert (state["step"], state["version"], state["checkpoint"]) == (6, 6, key)
    assert Commit.from_dict(state["commit"]) == Commit(["a"], {"digest-a": 6}, ["1-0"])
    fresh, _ = load_policy(policy)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(store, state["checkpoint"], fresh, fresh_optimizer)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh_optimizer.state[q][moment], optimizer.state[p][moment], rtol=0, atol=0)
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 5e-3


def test_a_state_naming_a_missing_checkpoint_says_so(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    model, _ = load_policy(tiny_policy_dir(tmp_path / "policy", seed=0))
    with pytest.raises(FileNotFoundError, match="step-00000009: the trainer state names a checkpoint"):
        load_checkpoint(store, "tr/trainer/checkpoints/step-00000009", model, torch.optim.AdamW(model.parameters()))


def test_versions_published_past_the_state_make_the_restored_weights_a_new_version(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    assert resume_version(store, "tr", 0) == 0, "a fresh run"
    for v in range(4):
        store.put_bytes(manifest_key("tr", v), b"{}")
    assert resume_version(store, "tr", 3) == 3, "the state's version is the newest: published again, idempotent"
    assert resume_version(store, "tr", 4) == 4, "saved but not yet published"
    assert resume_version(store, "tr", 2) == 4, "v3 came from weights the crash lost: the restored ones are v4"
