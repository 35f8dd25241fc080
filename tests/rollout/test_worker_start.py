"""A rollout worker's start (rlfleet/services/rollout/main.py, Worker.wait_first_version): its engine starts
from the run's base model while version 0 is not yet published, and generates only with version 0's
weights, downloaded through an origin over HTTP with signed manifests and a real Redis."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.config import load_bundle
from rlfleet.services.rollout.main import RolloutOptions, Worker
from rlfleet.services.shardcast.origin import make_app
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import rlrun, write_rlrun
from tests.support import serving, tiny_policy_dir, wait_for


@pytest.mark.parametrize("base_is_local, worker_dtype", [(True, None), (False, None), (True, "bfloat16")])
def test_the_engine_starts_before_version_0_and_generates_with_its_weights(
    tmp_path, redis_client, redis_url, monkeypatch, base_is_local, worker_dtype
):
    """`worker_dtype`: the run declares its workers' dtype (spec.verifier.workerDtype) apart from the fp32 model's;
    the engine then computes in it, with each version's weights cast to it."""
    base = tiny_policy_dir(tmp_path / "base", seed=0)
    v0 = tiny_policy_dir(tmp_path / "v0", seed=1)  # other weights than the base, so the test sees which generate
    model_path = base if base_is_local else tmp_path / "not-on-this-machine"
    config = write_rlrun(
        tmp_path / "rlrun.yaml",
        rlrun(
            "start",
            model=model_path,
            task={"maxOperand": 20},
            sampling={"groupSize": 2, "maxTokens": 4},
            store=tmp_path / "store",
            **({"verifier": {"workerDtype": worker_dtype}} if worker_dtype else {}),
        ),
    )
    bundle = load_bundle(config)
    key_file, public = generate_keypair(tmp_path / "keys")
    monkeypatch.setenv(env.PUBLIC_KEY, public)
    store = open_store(bundle.run.spec.store.uri)
    publish_version(store, "start", 0, v0, signer=make_signer(load_private_key(key_file)))
    ctx = Context(
        bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=RunKeys("start"), stop=threading.Event()
    )
    with serving(make_app(store, "start")) as origin_url:
        worker = Worker(
            ctx, RolloutOptions(config=config, worker_id="w", cache_dir=tmp_path / "cache", relay_urls=[origin_url])
        )
        started = []
        thread = threading.Thread(target=lambda: started.append(worker.wait_first_version()), daemon=True)
        thread.start()
        try:
            if base_is_local:
                wait_for("the worker's engine", lambda: worker.engine is not None, 60, every=0.05)
                assert worker.engine.version == -1, "nothing is generated before version 0 is loaded"
            time.sleep(0.3)
            assert thread.is_alive(), "the worker waits for version 0"
            redis_client.xadd(ctx.keys.policy, encode_json({"version": 0}))
            thread.join(60)
        finally:
            ctx.stop.set()
            thread.join(10)
        assert started == [True]
        assert worker.engine.version == 0
        live = worker.engine.model.state_dict()
        dtype = getattr(torch, worker_dtype or "float32")
        for name, tensor in load_file(str(v0 / "model.safetensors")).items():
            assert tensor.dtype == torch.float32, "published in the model's dtype"
            torch.testing.assert_close(live[name], tensor.to(dtype), rtol=0, atol=0)
        worker.engine.close()
