"""`kill -9` of the trainer process and a restart: the run continues from the last committed step,
no accepted rollout is lost and none is trained twice (audited by content digest and rollout id)."""

from __future__ import annotations

import collections
import json
import signal
import time
from pathlib import Path

import pytest
import redis as redis_lib
import torch

from rlfleet.models.policy import load_policy
from rlfleet.operator.progress import read_progress
from rlfleet.versions.store import open_store
from rlfleet.wire.streams import RunKeys, group_digest
from tests.support import start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group

TRAINER = "{batchSize: 2, maxAsyncLevel: 100, learningRate: 1.0e-3, steps: 10}"


def steps_done(out) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def final_weights(config_text: str) -> dict[str, torch.Tensor]:
    """The weights of the run's last saved state (its DCP checkpoint), read into a plain model."""
    from rlfleet.config import parse_bundle
    from rlfleet.services.trainer.state import load_checkpoint, load_state

    spec = parse_bundle(config_text).run.spec
    store = open_store(spec.store.uri)
    model, _ = load_policy(Path(spec.model.path))
    optimizer = torch.optim.AdamW(model.parameters())
    load_checkpoint(store, load_state(store, "tr")["checkpoint"], model, optimizer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 3])
def test_kill_9_and_restart_loses_nothing_and_trains_nothing_twice(tmp_path, redis_url, redis_client, every):
    """Killed after step 4 while waiting for step 5's batch: with checkpointEvery 3 the state is step 3's, so step
    4's groups are trained again from the weights saved before them; the final weights are exactly those of a run
    that was never killed (same batches in the same order, on the CPU deterministic)."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    trainer = TRAINER.replace("}", f", checkpointEvery: {every}}}")
    config = tmp_path / "rlrun.yaml"
    config.write_text(trainer_run_config(policy, tmp_path / "store", trainer))
    keys = RunKeys("tr")
    ids = [f"g{i}" for i in range(20)]
    for rid in ids[:9]:  # steps 1-4, and one group of step 5
        redis_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())

    first = start_trainer(config, redis_url, tmp_path)
    deadline = time.monotonic() + 300
    held = 1 + 2 * (4 % every)  # g8, and step 4's groups while no state holds them
    while steps_done(tmp_path) < 4 or redis_client.xpending(keys.verified, keys.trainer_group)["pending"] < held:
        assert first.poll() is None, (tmp_path / "trainer.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # waiting for step 5's second group
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert steps_done(tmp_path) == 4
    for rid in ids[9:]:
        redis_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())

    second = start_trainer(config, redis_url, tmp_path)
    assert second.wait(300) == 0, (tmp_path / "trainer.log").read_text()
    saved = 4 - 4 % every
    assert f"resumed after step {saved} " in (tmp_path / "trainer.log").read_text()

    trained = {d.decode(): int(v) for d, v in redis_client.zrange(keys.trained, 0, -1, withscores=True)}
    digests = sorted(group_digest(group(rid, [1.0, 0.0])) for rid in ids)  # the trainer records what it trained
    assert sorted(trained) == digests, "every accepted rollout was trained"
    per_version = collections.Counter(trained.values())
    assert sorted(per_version.values()) == [2] * 10, "each of the 10 steps trained exactly its batch of 2"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11)), "each step recorded once (step 4's again)"
    seen = [rid for r in records for rid in r["rollout_ids"]]
    assert sorted(seen) == sorted(ids), "no rollout id appears in two steps, none is missing"
    # Versions are immutable: with every 3, v4 (from weights the crash lost) stays; the restored weights of step 3
    # are published as v5 and step 4 retrained as v6.
    assert records[-1]["policy_version"] == (10 if every == 1 else 12)
    assert sorted(per_version) == (list(range(1, 11)) if every == 1 else [1, 2, 3, *range(6, 13)])
    assert redis_client.xlen(keys.verified) == 0, "every message was acknowledged and removed"
    # The operator's status (Complete at spec.trainer.steps) counts steps, not versions.
    progress = read_progress(redis_url, "tr")
    assert (progress["step"], progress["policyVersion"]) == (10, 10 if every == 1 else 12)

    # The same 20 groups through a trainer that is never killed (another store, another Redis database).
    reference = tmp_path / "reference"
    reference.mkdir()
    reference_config = trainer_run_config(policy, reference / "store", trainer)
    (reference / "rlrun.yaml").write_text(reference_config)
    reference_url = redis_url.rsplit("/", 1)[0] + "/1"
    reference_client = redis_lib.Redis.from_url(reference_url)
    for rid in ids:
        reference_client.xadd(keys.verified, group(rid, [1.0, 0.0]).encode())
    assert start_trainer(reference / "rlrun.yaml", reference_url, reference).wait(300) == 0
    expected, got = final_weights(reference_config), final_weights(config.read_text())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


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
