"""The trainer publishes deltas by default, and what a worker rebuilds from them is exactly what it trained."""

from __future__ import annotations

import threading

from rlfleet.config import parse_bundle
from rlfleet.models.policy import load_policy
from rlfleet.services.shardcast import origin
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings
from rlfleet.services.trainer.main import Trainer
from rlfleet.versions.chain import base_of
from rlfleet.versions.checkpoint import list_versions, read_manifest
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import redis_from_url, serving, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group


def test_trainer_publishes_deltas_that_rebuild_its_weights(tmp_path, redis_url):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer_spec = "{batchSize: 2, maxAsyncLevel: 10, learningRate: 1.0e-4, steps: 4}"
    bundle = parse_bundle(trainer_run_config(policy, tmp_path / "store", trainer_spec))
    assert bundle.run.spec.shardcast.deltas.enabled  # on by default
    bundle.run.spec.shardcast.deltas.max_chain_ratio = 10.0  # fp32 deltas of this model are ~0.6 x: allow a chain
    client = redis_from_url(redis_url)
    trainer = Trainer(
        Context(bundle=view_bundle(bundle, VIEWS["trainer"]), redis=client, keys=RunKeys("tr"), stop=threading.Event()),
        None,
    )
    for i in range(8):
        client.xadd(trainer.ctx.keys.verified, group(f"g{i}", [1.0, 0.0] if i % 2 else [0.0, 1.0]).encode())
    trainer.run(4)
    store = trainer.store
    assert list_versions(store, "tr") == [0, 1, 2, 3, 4]
    manifests = [read_manifest(store, "tr", v) for v in range(5)]
    assert [base_of(m) for m in manifests] == [None, 0, 1, 2, 3]  # v0 whole (no base), then deltas
    full = sum(f.size for f in manifests[0].files)
    assert all(sum(f.size for f in m.files) < 0.8 * full for m in manifests[1:])
    with serving(origin.make_app(store, "tr")) as origin_url:
        report = {}
        path = fetch_policy(FetchSettings.over([origin_url], "tr"), 4, tmp_path / "worker", report=report)
    assert report["chain"] == [0, 1, 2, 3, 4]
    rebuilt = load_policy(path)[0].state_dict()
    trained = trainer.model.state_dict()
    assert rebuilt.keys() == trained.keys() and all(rebuilt[k].equal(trained[k]) for k in trained)
    client.close()
