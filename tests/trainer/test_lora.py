"""LoRA versions end to end: the trainer's PEFT adapter, published signed through the store, served by a real
origin and relay over HTTP, fetched by the worker's client and merged by the engines; logits compared to PEFT."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from rlfleet.config import DeltaSpec, parse_bundle
from rlfleet.config.training import LoraSpec
from rlfleet.engines.adapters import MergedDirs
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.adapter import load_adapted, merge_dir
from rlfleet.models.policy import load_policy
from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.trainer.lora import attach
from rlfleet.services.trainer.main import Trainer
from rlfleet.versions.adapter import ADAPTER_FILES, AdapterBaseError, base_identity
from rlfleet.versions.checkpoint import MANIFEST_NAME, read_manifest
from rlfleet.versions.manifest import ManifestError, check_manifest
from rlfleet.versions.publish import PolicyPublisher
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import redis_from_url, serving, tiny_policy_dir, trainer_run_config

RUN = "lora"
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
IDS = [[3, 7, 11, 5, 9, 2, 14], [4, 4, 8, 1, 6, 10, 12]]


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def trained_adapter(peft_model, seed: int) -> None:
    """Stand-in for training steps: every adapter weight random (B starts at zero, which would merge to nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                assert ".lora_" in name
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """v0 (fresh adapter), v1, v2 (adapter weights of seeds 1, 2) published with deltas on and signed; the trainer's
    PEFT logits of each version and the store."""
    tmp = tmp_path_factory.mktemp("lora")
    base = tiny_policy_dir(tmp / "base", seed=0)
    private, public = generate_keypair(tmp / "keys")
    store = open_store(f"file://{tmp}/store")
    publisher = PolicyPublisher(store, RUN, DeltaSpec(), make_signer(load_private_key(private)), 4096)
    model, _ = load_policy(base)
    adapters = attach(model, SPEC, base, "builtin://tiny-test")
    assert adapters is not None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the base is frozen
    assert {id(p) for p in adapters.parameters()} == {id(p) for p in model.parameters() if p.requires_grad}
    expected, kinds = {}, []
    for version in range(3):
        if version:
            trained_adapter(adapters.peft_model, version)
        expected[version] = logits(model)
        out = tmp / f"publish{version}"
        adapters.save(model.state_dict(), out)
        assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
        publisher.publish(version, out, adapters.section)
        kinds.append(publisher.last["kind"])
    assert kinds == ["full", "full", "full"]  # an adapter ships whole, deltas on or not
    return {"tmp": tmp, "base": base, "store": store, "public": parse_public_key(public), "expected": expected}


def test_an_adapter_version_names_its_base_and_is_the_adapter_alone(run):
    manifest = read_manifest(run["store"], RUN, 2)
    assert manifest is not None and manifest.delta is None and manifest.signature
    assert manifest.adapter is not None and manifest.adapter.base == base_identity(run["base"])
    assert sorted(f.name for f in manifest.files) == sorted(ADAPTER_FILES)
    weights = sum(p.stat().st_size for p in run["base"].glob("*.safetensors"))
    assert sum(f.size for f in manifest.files) < weights / 4  # even on this tiny model
    doc = manifest.to_json()
    with pytest.raises(ManifestError, match="adapter"):
        check_manifest({**doc, "adapter": {**doc["adapter"], "base": "nope"}})
    with pytest.raises(ManifestError, match="ships whole"):
        check_manifest(
            {
                **doc,
                "delta": {"format": 1, "base": 1, "files": [{**f.to_json(), "from": "file"} for f in manifest.files]},
            }
        )


def test_worker_merges_what_the_relay_serves_to_the_trainers_logits(run, tmp_path):
    base = run["base"]
    with (
        serving(origin.make_app(run["store"], RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3))) as relay_url,
    ):
        settings = FetchSettings.over([relay_url], RUN, timeout=30, public_key=run["public"])
        paths = {v: fetch_policy(settings, v, tmp_path / "worker") for v in (0, 1, 2)}
    assert json.loads((paths[2] / MANIFEST_NAME).read_text())["adapter"]["base"] == base_identity(base)
    engine = TorchEngine(base, -1)
    assert torch.equal(logits(engine.model), run["expected"][0])  # a fresh adapter is the base exactly
    for version in (1, 2, 1, 0, 2):  # back and forth: merging never accumulates
        engine.load_weights(paths[version], version)
        torch.testing.assert_close(logits(engine.model), run["expected"][version], rtol=1e-4, atol=1e-4)
        assert engine.version == version
    assert not torch.allclose(run["expected"][1], run["expected"][2])
    # vLLM's route (on CPU it has no LoRA support): base + adapter written as a whole directory and reloaded
    merged_dirs = MergedDirs(base)
    for version in (1, 2):
        merged = merged_dirs.resolve(paths[version])
        torch.testing.assert_close(logits(load_policy(merged)[0]), run["expected"][version], rtol=1e-4, atol=1e-4)
    assert merged_dirs.resolve(base) == base  # a whole version passes through
    # the verifier's policy: base + the claimed adapter
    model, _ = load_adapted(paths[2], base)
    torch.testing.assert_close(logits(model), run["expected"][2], rtol=1e-4, atol=1e-4)


def test_an_adapter_over_another_base_is_refused_and_changes_nothing(run, tmp_path):
    other = tiny_policy_dir(tmp_path / "other", seed=1)
    published = tmp_path / "v1"
    shutil.copytree(run["tmp"] / "store" / RUN / "policy" / "v1", published)
    engine = TorchEngine(other, -1)
    before = logits(engine.model)
    with pytest.raises(AdapterBaseError, match="give it the run's spec.model"):
        engine.load_weights(published, 1)
    assert torch.equal(logits(engine.model), before) and engine.version == -1
    with pytest.raises(AdapterBaseError):
        MergedDirs(other).resolve(published)
    with pytest.raises(AdapterBaseError):
        load_adapted(published, other)
    # the same weights in another directory are the same base
    copy = shutil.copytree(run["base"], tmp_path / "copy")
    assert base_identity(copy) == base_identity(run["base"]) != base_identity(other)
    merge_dir(copy, published, tmp_path / "merged")  # a copy of the base is that base


def test_targets_that_name_no_linear_layer_are_refused_naming_the_field(tmp_path):
    base = tiny_policy_dir(tmp_path / "base", seed=0)
    model, _ = load_policy(base)
    with pytest.raises(ValueError, match=r"spec.trainer.lora.targetModules: \['qkv'\] name no linear layer"):
        attach(model, LoraSpec(target_modules=["q_proj", "qkv"]), base, "x")
    assert attach(model, None, base, "x") is None


def lora_trainer(tmp_path, redis_url) -> Trainer:
    policy = tmp_path / "policy"
    if not policy.exists():
        tiny_policy_dir(policy, seed=0)
    trainer = "{batchSize: 2, maxAsyncLevel: 1, learningRate: 1.0e-2, klCoef: 0.1, lora: {rank: 4, alpha: 8}}"
    bundle = parse_bundle(trainer_run_config(policy, tmp_path / "store", trainer))
    ctx = Context(
        bundle=view_bundle(bundle, VIEWS["trainer"]),
        redis=redis_from_url(redis_url),
        keys=RunKeys("tr"),
        stop=threading.Event(),
    )
    return Trainer(ctx, output_dir=None)


def test_the_trainer_trains_only_the_adapter_publishes_it_and_resumes_it(tmp_path, redis_url):
    from tests.trainer.test_trainer import group

    trainer = lora_trainer(tmp_path, redis_url)
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if ".lora_" not in k}
    for i in range(4):
        trainer.ctx.redis.xadd(trainer.ctx.keys.verified, group(f"g{i}", [1.0, 0.0] if i % 2 else [0.0, 1.0]).encode())
    trainer.run(2)
    gathered = trainer.version_state()  # what a version publishes: the adapters, never a copy of the base
    assert set(gathered) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert gathered and all(".lora_" in n for n in gathered)
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "the base is frozen"
    lora_b = [v for k, v in after.items() if ".lora_B." in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "the adapters moved (B starts at zero)"
    store = trainer.store
    identity = base_identity(tmp_path / "policy")
    for version in (0, 1, 2):
        manifest = read_manifest(store, "tr", version)
        assert manifest is not None and manifest.adapter is not None and manifest.adapter.base == identity
        assert sorted(f.name for f in manifest.files) == sorted(ADAPTER_FILES) and manifest.delta is None
    # A restarted trainer resumes the adapter and optimizer state and re-publishes v2 as it is (idempotent).
    again = lora_trainer(tmp_path, redis_url)
    assert again.resume() == 3 and again.version == 2
    resumed = again.model.state_dict()
    assert all(torch.equal(resumed[k], after[k]) for k in after)
    assert again.optimizer.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()
    assert len(again.optimizer.param_groups[0]["params"]) == len(again.lora.parameters())
