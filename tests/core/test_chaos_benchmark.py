"""benchmarks/chaos.py finds the run's processes in the run's record (RUN_DIR/processes.json, written by the
supervisor) and stops, naming the kind, when a kind of process the run has cannot be found: a chaos run that kills
nothing but Redis must not pass."""

from __future__ import annotations

import os
import time

import pytest

from rlfleet.local.supervisor import RECORD, Component, Supervisor
from tests.core.test_supervisor import FAST, python
from tests.support import benchmark_module


@pytest.fixture
def chaos(monkeypatch):
    return benchmark_module(monkeypatch, "chaos")


def test_the_benchmark_finds_each_kind_in_the_record_and_stops_naming_a_kind_it_cannot_find(tmp_path, chaos):
    sleeper = python("import time; time.sleep(60)")
    names = ("redis", "trainer", "rollout/pool-0", "rollout/pool-1")
    comps = [Component(name, sleeper, tmp_path / "logs" / f"{name.replace('/', '-')}.log") for name in names]
    sup = Supervisor(comps, dict(os.environ), FAST, say=lambda _: None, record=tmp_path / RECORD)
    finder = chaos.Finder(tmp_path, patience_s=1.0)
    with pytest.raises(SystemExit, match="no record of the run's processes"):
        finder.live()
    try:
        for comp in comps:
            sup.start(comp)
        redis, trainer, *workers = comps
        assert finder.live() == {
            "redis": [redis.proc.pid],
            "trainer": [trainer.proc.pid],
            "rollout": [w.proc.pid for w in workers],
        }
        trainer.proc.kill()
        trainer.proc.wait()  # and not restarted: nothing polls the supervisor
        assert finder.live()["trainer"] == [], "down for less than the patience: the kill finds other kinds"
        time.sleep(1.1)
        with pytest.raises(SystemExit, match="no live trainer process") as stopped:
            finder.live()
        assert stopped.value.code != 0
    finally:
        sup.stop_all()


def test_versions_may_run_ahead_of_steps_after_a_trainer_restart_but_never_repeat_or_go_back(chaos):
    """A trainer killed between two resume saves redoes the steps since the last one and publishes the restored
    weights as the next version (docs/local-runs.md): steps stay 1..N, versions run ahead."""

    def records(versions: list[int]) -> list[dict]:
        return [{"step": i, "policy_version": v} for i, v in enumerate(versions, start=1)]

    assert chaos.versions_in_order(records([1, 2, 3, 4]))
    assert chaos.versions_in_order(records([1, 2, 13, 14]))  # resumed after step 2, versions 3..12 published before
    assert not chaos.versions_in_order(records([1, 2, 2, 3]))  # a version repeated
    assert not chaos.versions_in_order(records([1, 3, 2, 4]))
    assert not chaos.versions_in_order([{"step": s, "policy_version": s} for s in (1, 2, 2, 3)])  # a step twice
