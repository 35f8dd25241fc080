"""The local launcher's plan: the processes `rlfleet run` starts (pure; nothing is started)."""

from __future__ import annotations

from rlfleet.config import load_bundle
from rlfleet.local.launcher import plan
from tests.support import REPO

ROOT = REPO


def test_trainer_replicas_are_ranks_with_the_torchrun_environment_of_the_trainer_pods(tmp_path):
    config = tmp_path / "rlrun.yaml"
    text = (ROOT / "examples" / "arithmetic" / "rlrun.yaml").read_text()
    config.write_text(
        text.replace("    maxAsyncLevel: 2\n", "    maxAsyncLevel: 2\n    replicas: 3\n    sharding: fsdp\n")
    )
    comps = plan(load_bundle(config), config, tmp_path)
    trainers = [c for c in comps if c.argv[3] == "trainer"]
    assert [c.name for c in trainers] == ["trainer/2", "trainer/1", "trainer"], "rank 0 last: the launcher waits on it"
    assert [c.env["RANK"] for c in trainers] == ["2", "1", "0"]
    assert {c.env["WORLD_SIZE"] for c in trainers} == {"3"}
    assert len({(c.env["MASTER_ADDR"], c.env["MASTER_PORT"]) for c in trainers}) == 1, "one rendezvous"
    assert len({c.log for c in trainers}) == 3


def test_one_trainer_replica_gets_no_distributed_environment(tmp_path):
    config = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
    trainers = [c for c in plan(load_bundle(config), config, tmp_path) if c.argv[3] == "trainer"]
    assert [(c.name, c.env) for c in trainers] == [("trainer", {})]
