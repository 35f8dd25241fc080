"""`kill -9` of the trainer process and a restart: the run continues from the last committed step,
no accepted rollout is lost and none is trained twice (audited by content digest and rollout id)."""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest

from rlfleet.wire.streams import RunKeys, group_digest
from tests.support import start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group

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

    trained = {d.decode(): int(v) for d, v in redis_client.zrange(keys.trained, 0, -1, withscores=True)}
    digests = sorted(group_digest(group(rid, [1.0, 0.0])) for rid in ids)  # the trainer records what it trained
    assert sorted(trained) == digests, "every accepted rollout was trained"
    per_version = collections.Counter(trained.values())
    assert per_version == {v: 2 for v in range(1, 11)}, "each of the 10 steps trained exactly its batch of 2"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seen = [rid for r in records for rid in r["rollout_ids"]]
    assert len(seen) == len(set(seen)), "no rollout id appears in two steps"
    assert records[-1]["step"] == 10 and records[-1]["policy_version"] == 10
    assert killed_at >= 3
    assert redis_client.xlen(keys.verified) == 0, "every message was acknowledged and removed"


def test_a_step_saved_but_not_yet_recorded_is_recorded_once_on_resume(tmp_path, redis_url, redis_client):
    """A crash between saving a step's state and appending its metrics.jsonl record (e.g. Redis
    restarting under the commit): the restarted trainer appends that record, so every trained
    rollout id appears in metrics.jsonl exactly once."""
    import threading

    import redis as redis_lib

    from rlfleet.config import parse_bundle
    from rlfleet.services.trainer.main import Trainer
    from rlfleet.wire.runtime import Context
    from rlfleet.wire.views import VIEWS, view_bundle

    bundle = parse_bundle(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "store", TRAINER))
    for rid in ("a", "b"):
        redis_client.xadd(RunKeys("tr").verified, group(rid, [1.0, 0.0]).encode())

    def trainer() -> Trainer:
        ctx = Context(
            bundle=view_bundle(bundle, VIEWS["trainer"]),
            redis=redis_lib.Redis.from_url(redis_url),
            keys=RunKeys("tr"),
            stop=threading.Event(),
        )
        return Trainer(ctx, output_dir=tmp_path)

    trainer().run(1)
    metrics = tmp_path / "metrics.jsonl"
    assert [json.loads(line)["rollout_ids"] for line in metrics.read_text().splitlines()] == [["a", "b"]]
    metrics.write_text("")  # the record that the crash kept from being written
    for _ in range(2):  # a restart, and another one: the record comes back once
        trainer().run(1)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [(r["step"], r["rollout_ids"]) for r in records] == [(1, ["a", "b"])]
