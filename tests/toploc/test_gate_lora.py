"""The gate in a LoRA run: each version is an adapter, and a group is verified against base + the adapter version
it claims (real redis-server, an origin over HTTP, signed adapter versions, real TOPLOC proofs)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from rlfleet.config import parse_bundle
from rlfleet.config.training import LoraSpec
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.policy import load_policy
from rlfleet.operator.names import VERIFIER
from rlfleet.services.shardcast.origin import make_app
from rlfleet.services.toploc.main import Gate
from rlfleet.services.trainer.lora import attach
from rlfleet.versions.publish import PolicyPublisher
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, encode_json
from tests.support import redis_from_url, serving, tiny_policy_dir
from tests.toploc.test_gate import as_, gate_config, honest_group, rejections, run_gate, verified_ids

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


def publish_adapters(base: Path, store, signer, tmp: Path, versions: int) -> None:
    """Adapter versions 0..versions-1 over `base`, as the trainer publishes them (v0 the fresh adapter, later ones
    with random adapter weights standing in for training)."""
    model, _ = load_policy(base)
    adapters = attach(model, SPEC, base, str(base))
    assert adapters is not None
    publisher = PolicyPublisher(
        store, "gate", parse_bundle(gate_config(base, tmp, "{}", "{}")).run.spec.shardcast.deltas, signer
    )
    g = torch.Generator().manual_seed(0)
    for version in range(versions):
        if version:
            with torch.no_grad():
                for p in adapters.parameters():
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        adapters.save(model.state_dict(), tmp / f"out{version}")
        publisher.publish(version, tmp / f"out{version}", adapters.section)


def test_the_gate_verifies_against_base_plus_the_claimed_adapter(tmp_path, redis_url):
    base = tiny_policy_dir(tmp_path / "policy", seed=0)
    bundle = parse_bundle(gate_config(base, tmp_path / "store", "{groupSize: 4, maxTokens: 4}", "{}"))
    store = open_store(bundle.run.spec.store.uri)
    key_file, public = generate_keypair(tmp_path / "keys")
    saved = {k: os.environ.get(k) for k in (env.SIGNING_KEY_FILE, env.PUBLIC_KEY)}
    os.environ.update({env.SIGNING_KEY_FILE: str(key_file), env.PUBLIC_KEY: public})
    client = redis_from_url(redis_url)
    try:
        publish_adapters(base, store, make_signer(load_private_key(key_file)), tmp_path, 3)
        keys = RunKeys("gate")
        client.xadd(keys.policy, encode_json({"version": 2}))
        ctx = Context(bundle=bundle, redis=client, keys=keys, stop=threading.Event())
        with serving(make_app(store, "gate")) as origin_url:
            # a worker: the base, the adapters applied as they arrive (its own download of them: the gate's cache)
            gate = Gate(as_(ctx, VERIFIER), "probe", origin_url, tmp_path / "fetched")
            engine = TorchEngine(base, -1)
            groups = []
            for version in (1, 2):
                gate.policy(version)  # fetches and verifies the signed adapter version into tmp/fetched
                engine.load_weights(tmp_path / "fetched" / f"v{version}", version)
                groups += [honest_group(engine, ctx, i, version, worker=f"w-{version}") for i in range(2)]
            # made with adapter v2's weights but claiming v1 (in the async window): another adapter version
            liar = honest_group(engine, ctx, 7, version=1, worker="w-liar")
            for group in [*groups, liar]:
                client.xadd(keys.rollouts, group.encode())
            run_gate(ctx, origin_url, tmp_path / "cache", expected=5)
        assert sorted(verified_ids(ctx)) == sorted(g.rollout_id for g in groups)
        assert set(rejections(ctx)) == {liar.rollout_id}
        assert rejections(ctx)[liar.rollout_id] == "toploc"  # its proofs commit to v2's hidden states, not v1's
    finally:
        client.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
