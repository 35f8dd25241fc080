"""The verifier, the trainer and a worker on a Redis with one ACL user per role (issue 16 item 6), as
`rlfleet run` starts them: each role's grants (rlfleet/wire/redis_acl.py) are enough for the component's
real work, and a worker's forged `verified` entry is refused by Redis itself."""

from __future__ import annotations

import dataclasses

import pytest
import redis
import requests

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.operator.names import TRAINER, VERIFIER
from rlfleet.services.toploc.api import serve_in_thread
from rlfleet.services.toploc.main import Gate
from rlfleet.services.trainer.main import Trainer
from rlfleet.services.trainer.sharding import full_model_state
from rlfleet.services.trainer.state import Commit
from rlfleet.wire.ports import free_port
from rlfleet.wire.redis_acl import ADMIN, RunAcl, user_name
from rlfleet.wire.streams import group_digest
from tests.support import redis_from_url
from tests.toploc import attacks
from tests.toploc.test_gate import as_, gate_system, rejections, run_gate, verified_ids


def test_each_component_works_with_its_own_redis_user(tmp_path):
    acl = RunAcl.generate("gate")
    server = EmbeddedRedis(
        tmp_path / "redis", acl=acl.acl_file(), auth=(user_name(ADMIN, "gate"), acl.passwords[ADMIN])
    )
    with server, gate_system(tmp_path, server.url) as (ctx, policy, origin_url, tmp):
        spec = ctx.bundle.run.spec
        as_role = {role: redis_from_url(acl.url(server.base_url, role)) for role in acl.passwords}
        worker, verifier = as_role["worker"], dataclasses.replace(ctx, redis=as_role["verifier"])
        engine = TorchEngine(policy, 0)
        good, bad = attacks.honest(engine, spec, 1), attacks.honest(engine, spec, 2, worker="w-bad")
        bad.task_id = "arith-0-999"
        for g in (good, bad):
            worker.xadd(ctx.keys.rollouts, g.encode())
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.xadd(ctx.keys.verified, attacks.replay_new_rollout_id(good).encode())  # skip the gate: refused

        run_gate(verifier, origin_url, tmp / "cache", expected=2)  # read, check, commit, reputation, guards
        assert verified_ids(ctx) == [good.rollout_id] and rejections(ctx) == {bad.rollout_id: "prompt_mismatch"}
        port = free_port()
        api = serve_in_thread(Gate(as_(verifier, VERIFIER), "v-api", origin_url, tmp / "cache-api"), "127.0.0.1", port)
        try:
            base = f"http://127.0.0.1:{port}"
            assert requests.get(base + "/healthz", timeout=10).json()["status"] == "ok"
            assert requests.get(base + "/workers/w-bad", timeout=10).json()["counters"]["rejected"] == 1
            assert "w-honest" in requests.get(base + "/workers", timeout=10).json()
        finally:
            api.stop()

        trainer = Trainer(dataclasses.replace(as_(ctx, TRAINER), redis=as_role["trainer"]), output_dir=None)
        batch = trainer.read_batch()
        groups, ack = batch.groups, batch.ack
        trainer.step(groups)
        trainer.version += 1
        commit = Commit()
        commit.add([g.rollout_id for g in groups], [group_digest(g) for g in groups], trainer.version, ack)
        trainer.commit(commit)
        trainer.publish(full_model_state(trainer.model))
        trainer.publishing.wait()  # stored and announced beside the caller (publishing.py)
        assert [g.rollout_id for g in groups] == [good.rollout_id]
        assert as_role["reader"].xrevrange(ctx.keys.policy, count=1)  # the announcement workers read
