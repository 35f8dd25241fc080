"""What `rlfleet run` prints while it waits (rlfleet/local/progress.py), without a terminal: the build's warm start,
and before the first step what the run waits for, read from a real Redis."""

from __future__ import annotations

from rlfleet.local import progress
from rlfleet.local.progress import BuildProgress, Progress, startup_status
from rlfleet.wire.streams import RunKeys, encode_json


def test_startup_status_follows_the_streams(redis_client):
    keys = RunKeys("p")
    assert "not published version 0" in startup_status(redis_client, keys, 16)
    redis_client.xadd(keys.policy, encode_json({"version": 0}))
    assert "workers loading it" in startup_status(redis_client, keys, 16)
    for _ in range(3):
        redis_client.xadd(keys.rollouts, {b"m": b"{}"})
    redis_client.xadd(keys.verified, {b"m": b"{}"})
    assert startup_status(redis_client, keys, 16) == "first batch: 1/16 groups verified, 3 waiting for the verifier"


def test_workers_that_outpace_the_first_step_never_read_as_more_than_a_whole_batch(redis_client):
    """Verified groups beyond the batch are the next steps' (before: "first batch: 12/4 groups verified")."""
    keys = RunKeys("fast")
    redis_client.xadd(keys.policy, encode_json({"version": 0}))
    for _ in range(12):
        redis_client.xadd(keys.verified, {b"m": b"{}"})
    redis_client.xadd(keys.rollouts, {b"m": b"{}"})
    assert startup_status(redis_client, keys, 4) == (
        "first batch: 4/4 groups verified (12 so far); the trainer is on its first step"
    )
    assert startup_status(redis_client, keys, 12).startswith("first batch: 12/12 groups verified (12 so far)")


def test_without_a_terminal_a_wait_is_never_silent(capsys, monkeypatch):
    bar = Progress(total=5, enabled=False)
    bar.waiting("starting")
    bar.waiting("starting")  # unchanged and within the heartbeat: not repeated
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0)
    bar.waiting("starting")  # unchanged, heartbeat due
    bar.waiting("first batch")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["rlfleet: starting"] * 2 + ["rlfleet: first batch"]
    assert all(line.endswith("s)") for line in lines), "each line says how long the run has waited"

    monkeypatch.setattr(progress, "HEARTBEAT_S", 3600)
    build = BuildProgress("builtin://tiny-math", tty=False)
    build(0, 3)
    build(1, 3)  # within the heartbeat: quiet
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0)
    build(2, 3)  # heartbeat due
    build(3, 3)
    assert capsys.readouterr().err.splitlines() == [
        "rlfleet: building builtin://tiny-math: warm start, 3 steps (cached afterwards)",
        "rlfleet: warm start 2/3 steps",
        "rlfleet: warm start 3/3 steps",
    ]
