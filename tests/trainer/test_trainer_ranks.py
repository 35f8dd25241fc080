"""Two trainer ranks as the operator's StatefulSet runs them (torchrun-style env, `--hold-when-done`):
only rank 0 reports the trainer's series on /metrics, and both wait to be stopped after the last step
instead of exiting into a restart."""

from __future__ import annotations

import signal
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.local.redis_server import free_port
from rlfleet.wire.streams import RunKeys
from tests.support import start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group

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
