"""Two trainer ranks as the operator's StatefulSet runs them (torchrun-style env, `--hold-when-done`):
only rank 0 reports the trainer's series on /metrics, and both wait to be stopped after the last step
instead of exiting into a restart."""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis as redis_lib
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load

from rlfleet.models.policy import load_policy
from rlfleet.versions.checkpoint import read_manifest, version_key
from rlfleet.versions.store import open_store
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys, group_digest
from tests.support import start_trainer, tiny_policy_dir, trainer_run_config, wait_for
from tests.trainer.test_trainer import group
from tests.trainer.test_trainer_resume import final_weights

TRAINER = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 1, replicas: 2}"


def trainer_series(port: int) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("rlfleet_trainer_") and not s.labels
    }


def test_only_rank_zero_reports_and_every_rank_holds_after_the_last_step(tmp_path, redis_url, redis_client):
    """Bug: with trainer.replicas > 1 every rank served the trainer's gauges but only rank 0 set them, so
    the dashboards' avg() of reward and staleness was divided by the world size. And a trainer that exited
    0 after its last step was restarted by its StatefulSet (CrashLoopBackOff)."""
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    for rid in ("a", "b"):
        redis_client.xadd(RunKeys("tr").verified, group(rid, [1.0, 0.0]).encode())
    master, ports = str(free_port()), [free_port(), free_port()]
    ranks = [
        start_trainer(
            config,
            redis_url,
            tmp_path,
            "--metrics-port",
            str(ports[rank]),
            "--hold-when-done",
            log=f"rank{rank}.log",
            env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master},
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 240
        while "every step is done" not in (tmp_path / "rank1.log").read_text():
            for rank, proc in enumerate(ranks):
                assert proc.poll() is None, (tmp_path / f"rank{rank}.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()
            time.sleep(0.2)
        time.sleep(1)
        assert all(proc.poll() is None for proc in ranks), "a rank exited after its last step"
        assert trainer_series(ports[0])["rlfleet_trainer_step"] == 1
        assert trainer_series(ports[1]) == {}, "rank 1 serves trainer series it never sets"
    finally:
        for proc in ranks:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in ranks]
    assert codes == [0, 0]


def dist_env(world: int) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def run_trainer(config, redis_url, out, *extra: str, world: int = 1) -> str:
    """`rlfleet trainer` to its end; its log."""
    proc = start_trainer(config, redis_url, out, *extra, env=dist_env(world) if world > 1 else {})
    log = out / "trainer.log"
    assert proc.wait(300) == 0, log.read_text()
    return log.read_text()


def one_step_on(ranks: int, policy, trainer: str, tmp_path, redis_url) -> tuple[Path, str]:
    """One step of `trainer` on `ranks` rank processes (`--ranks`, gloo) over the same two groups, in a directory
    and a Redis database of its own; (the directory, the trainer's log). Every group is taken."""
    out = tmp_path / f"ranks{ranks}"
    out.mkdir()
    config = out / "rlrun.yaml"
    config.write_text(trainer_run_config(policy, out / "store", trainer))
    url = redis_url.rsplit("/", 1)[0] + f"/{ranks}"
    client = redis_lib.Redis.from_url(url)
    for rid in ("a", "b"):
        client.xadd(RunKeys("tr").verified, group(rid, [1.0, 0.0]).encode())
    log = run_trainer(config, url, out, "--ranks", str(ranks), world=ranks)
    assert ("rank 1 of 2" in log) == (ranks == 2), log
    assert client.xlen(RunKeys("tr").verified) == 0
    return out, log


def test_two_ranks_of_one_replica_train_the_update_of_one_rank(tmp_path, redis_url):
    """`--ranks 2` (ranksPerReplica: 2, no GPU: gloo): one command starts both ranks, which split the batch and
    save the resume state each its share (DCP); it holds the weights one rank gets from the same batch."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 1, ranksPerReplica: 2}"
    runs = {}
    for ranks in (2, 1):
        out, _ = one_step_on(ranks, policy, trainer, tmp_path, redis_url)
        runs[ranks] = final_weights((out / "rlrun.yaml").read_text())
    initial = load_policy(policy)[0].state_dict()
    assert any(not torch.equal(runs[1][k], v) for k, v in initial.items()), "the step moved the weights"
    for name, value in runs[1].items():
        torch.testing.assert_close(runs[2][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_two_lora_ranks_publish_the_adapter_one_rank_trains(tmp_path, redis_url):
    """A LoRA run on two ranks gathers only the adapters to publish (Trainer.version_state) and publishes the
    adapter version one rank makes from the same batch. Both ranks must start from the same adapter: its A
    matrices are random (they were drawn unseeded, different on each rank)."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-2, steps: 1, lora: {rank: 4, alpha: 8}}"
    adapters = {}
    for ranks in (2, 1):
        out, _ = one_step_on(ranks, policy, trainer, tmp_path, redis_url)
        store = open_store(f"file://{out / 'store'}")
        manifest = read_manifest(store, "tr", 1)
        assert manifest is not None and manifest.adapter is not None
        adapters[ranks] = load(store.get_bytes(version_key("tr", 1, "adapter_model.safetensors")))
    assert adapters[1] and all(".lora_" in name for name in adapters[1])
    assert any(v.abs().sum() > 0 for k, v in adapters[1].items() if ".lora_B." in k), "the step moved the adapter"
    assert adapters[2].keys() == adapters[1].keys()
    for name, value in adapters[1].items():
        torch.testing.assert_close(adapters[2][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_ranks_that_wait_for_groups_past_their_collective_timeout_survive_and_step(tmp_path, redis_url):
    """Bug: ranks 1..n waited for rank 0 to collect the step's groups inside a broadcast, so a wait longer than
    the collective timeout (NCCL's default is 10 minutes) killed the replica. Here the timeout is 4 s (the
    step's real collectives, a save among them, stay well inside it on a loaded machine) and the groups of each
    step come 2.5 timeouts late: before the first step and between the two."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer = (
        "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 2, ranksPerReplica: 2,"
        " collectiveTimeoutSeconds: 4}"
    )
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(policy, tmp_path / "store", trainer))
    client = redis_lib.Redis.from_url(redis_url)
    proc = start_trainer(config, redis_url, tmp_path, "--ranks", "2", env=dist_env(2))
    log = tmp_path / "trainer.log"
    try:
        for step in (1, 2):
            if step == 1:
                wait_for("both ranks up", lambda: "rank 1 of 2" in log.read_text() and proc.poll() is None, 120)
            else:
                wait_for("step 1", lambda: "step 1 version 1" in log.read_text() or proc.poll() is not None, 120)
            time.sleep(10)  # the wait for groups: 2.5 collective timeouts
            assert proc.poll() is None, log.read_text()
            for rid in (f"{step}a", f"{step}b"):
                client.xadd(RunKeys("tr").verified, group(rid, [1.0, 0.0]).encode())
        assert proc.wait(120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "step 2 version 2" in log.read_text()
    assert client.xlen(RunKeys("tr").verified) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp", "none"])
def test_the_resume_state_of_two_ranks_resumes_on_one_and_back(tmp_path, redis_url, redis_client, sharding):
    """Saved by 2 ranks (FSDP shards, or replicated tensors each written by one rank), resumed by 1 process, saved
    again and resumed by 2: every group trained once, and the weights those of one process that never stopped."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer = f"{{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 6, sharding: {sharding}}}"
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(policy, tmp_path / "store", trainer))
    keys, ids = RunKeys("tr"), [f"g{i}" for i in range(12)]
    for rid in ids:
        redis_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())
    for steps, ranks in ((2, 2), (4, 1), (6, 2)):
        log = run_trainer(config, redis_url, tmp_path, "--steps", str(steps), "--ranks", str(ranks), world=ranks)
    assert "resumed after step 2 " in log and "resumed after step 4 " in log
    saved = {k.rsplit("/", 1)[1] for k in open_store(f"file://{tmp_path}/store").list("tr/trainer/checkpoints/")}
    assert saved == {".metadata", "__0_0.distcp", "__1_0.distcp"}, "each of the 2 ranks wrote its share, one step's"
    trained = {d.decode(): int(v) for d, v in redis_client.zrange(keys.trained, 0, -1, withscores=True)}
    assert sorted(trained) == sorted(group_digest(group(rid, [1.0, 0.0])) for rid in ids)
    assert collections.Counter(trained.values()) == {v: 2 for v in range(1, 7)}, "each step trained its batch once"

    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "rlrun.yaml").write_text(trainer_run_config(policy, reference / "store", trainer))
    url = redis_url.rsplit("/", 1)[0] + "/1"
    client = redis_lib.Redis.from_url(url)
    for rid in ids:
        client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())
    run_trainer(reference / "rlrun.yaml", url, reference)
    expected, got = final_weights((reference / "rlrun.yaml").read_text()), final_weights(config.read_text())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_replica_s_ranks_die_together(tmp_path, redis_url):
    """A process group cannot lose a member: when one rank of a `--ranks 2` replica is killed, the parent kills
    the other and exits with the killed rank's status, so the supervisor or the kubelet restarts them together."""
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    parent = start_trainer(config, redis_url, tmp_path, "--ranks", "2", env=dist_env(2))
    deadline = time.monotonic() + 240
    while (log := (tmp_path / "trainer.log").read_text()).count("rank ") < 2 or "rank 1 of 2" not in log:
        assert parent.poll() is None, log
        assert time.monotonic() < deadline, log
        time.sleep(0.2)
    ranks = psutil.Process(parent.pid).children()
    assert len(ranks) == 2
    local = {int(p.environ()["LOCAL_RANK"]): p for p in ranks}
    local[1].kill()
    assert parent.wait(60) == 128 + signal.SIGKILL
    local[0].wait(30)
    assert not local[0].is_running(), "the other rank did not outlive its group"
