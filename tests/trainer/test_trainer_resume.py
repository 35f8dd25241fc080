"""`kill -9` of the trainer process and a restart: the run continues from the last committed step,
no accepted rollout is lost and none is trained twice (audited by rollout id)."""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest
from support import start_trainer, tiny_policy_dir, trainer_run_config
from test_trainer import group

from rlfleet.streams import RunKeys

TRAINER = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 10}"


def steps_done(out) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.slow
def test_kill_9_and_restart_loses_nothing_and_trains_nothing_twice(tmp_path, redis_url, redis_client):
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    keys = RunKeys("tr")
    ids = [f"g{i}" for i in range(20)]
    for rid in ids:
        redis_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())

    first = start_trainer(config, redis_url, tmp_path)
    deadline = time.monotonic() + 300
    while steps_done(tmp_path) < 3:
        assert first.poll() is None, (tmp_path / "trainer.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = steps_done(tmp_path)

    second = start_trainer(config, redis_url, tmp_path)
    assert second.wait(300) == 0, (tmp_path / "trainer.log").read_text()
    assert "resumed after step" in (tmp_path / "trainer.log").read_text()

    trained = {rid.decode(): int(v) for rid, v in redis_client.zrange(keys.trained, 0, -1, withscores=True)}
    assert sorted(trained) == sorted(ids), "every accepted rollout was trained"
    per_version = collections.Counter(trained.values())
    assert per_version == {v: 2 for v in range(1, 11)}, "each of the 10 steps trained exactly its batch of 2"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen = [rid for r in records for rid in r["rollout_ids"]]
    assert len(seen) == len(set(seen)), "no rollout id appears in two steps"
    assert records[-1]["step"] == 10 and records[-1]["policy_version"] == 10
    assert killed_at >= 3
    assert redis_client.xlen(keys.verified) == 0, "every message was acknowledged and removed"
