"""The local run's restart policy (rlfleet/local/supervisor.py) with real processes: restart with back-off,
finished components stay finished, a crash loop is reported, and stopping leaves nothing behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from rlfleet.local.supervisor import RECORD, Component, RestartPolicy, Supervisor, run_processes

FAST = RestartPolicy(backoff_start_s=0.05, backoff_max_s=0.2, stable_s=1.0, crash_loop=3)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def poll_until(sup: Supervisor, done, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        failed = sup.poll()
        if done(failed):
            return failed
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_a_component_that_dies_is_started_again_and_its_log_keeps_every_start(tmp_path: Path):
    marker = tmp_path / "starts"
    # dies once right away, then stays up
    code = f"import pathlib,time,sys;p=pathlib.Path({str(marker)!r});n=len(p.read_text()) if p.exists() else 0;" \
           f"p.write_text('x'*(n+1));print('start',n+1,flush=True);sys.exit(3) if n==0 else time.sleep(60)"  # fmt: skip
    comp = Component("worker", python(code), tmp_path / "worker.log")
    said = []
    sup = Supervisor([comp], dict(os.environ), FAST, say=said.append)
    sup.start(comp)
    # The second start's line, not its marker: the process writes the marker before it prints, and a stop
    # between the two (a loaded machine) would leave the line out of the log.
    poll_until(sup, lambda _: comp.log.exists() and "start 2" in comp.log.read_text())
    assert comp.restarts == 1 and comp.proc.poll() is None
    assert any("worker exited with code 3; restarting" in line for line in said), said
    sup.stop_all()
    assert comp.proc.poll() is not None
    assert comp.log.read_text().splitlines() == ["start 1", "start 2"]


def test_a_finished_component_is_not_restarted(tmp_path: Path):
    comp = Component("trainer", python("pass"), tmp_path / "t.log", done_on_success=True)
    sup = Supervisor([comp], dict(os.environ), FAST, say=lambda _: None)
    sup.start(comp)
    comp.proc.wait()
    for _ in range(20):
        assert sup.poll() is None
        time.sleep(0.02)
    assert comp.finished and comp.restarts == 0


def test_a_crash_loop_is_reported_after_the_policys_count_with_growing_backoff(tmp_path: Path):
    comp = Component("bad", python("import sys; sys.exit(2)"), tmp_path / "bad.log")
    said = []
    sup = Supervisor([comp], dict(os.environ), FAST, say=said.append)
    sup.start(comp)
    failed = poll_until(sup, lambda f: f is not None)
    assert failed is comp and comp.failures == FAST.crash_loop and comp.restarts == FAST.crash_loop - 1
    waits = [float(line.split("restarting in ")[1].split("s")[0]) for line in said]
    assert waits == [0.05, 0.1], said  # doubling, capped by backoff_max_s


def test_sigkills_from_outside_back_off_but_are_never_a_crash_loop(tmp_path: Path):
    comp = Component("oom", python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), tmp_path / "k.log")
    said = []
    sup = Supervisor([comp], dict(os.environ), FAST, say=said.append)
    sup.start(comp)
    failed = poll_until(sup, lambda f: f is not None or comp.restarts > 2 * FAST.crash_loop, seconds=30)
    assert failed is None and comp.failures > FAST.crash_loop
    assert all(f"exited with code {-signal.SIGKILL}" in line for line in said)
    assert float(said[-1].split("restarting in ")[1].split("s")[0]) == FAST.backoff_max_s


def test_staying_up_resets_the_failure_count(tmp_path: Path):
    comp = Component("flaky", python("import time; time.sleep(1.2); raise SystemExit(1)"), tmp_path / "f.log")
    sup = Supervisor([comp], dict(os.environ), FAST, say=lambda _: None)
    sup.start(comp)
    # each start stays up longer than stable_s, so it never counts as a crash loop
    poll_until(sup, lambda f: comp.restarts >= 3 or f is not None, seconds=30)
    assert comp.failures <= 1


def test_stop_all_kills_what_ignores_sigterm_when_forced_and_its_children_with_it(tmp_path: Path):
    child_pid = tmp_path / "child.pid"
    code = (
        "import signal,subprocess,sys,time,pathlib;signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        f"c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid));time.sleep(60)"
    )
    comp = Component("stubborn", python(code), tmp_path / "s.log")
    sup = Supervisor([comp], dict(os.environ), FAST, say=lambda _: None)
    sup.start(comp)
    deadline = time.monotonic() + 20
    while not child_pid.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    sup.stop_all(force=lambda: time.monotonic() - t0 > 0.5)  # a second Ctrl-C half a second later
    assert comp.proc.poll() is not None
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline, "the component's child outlived it"
        time.sleep(0.02)


def test_a_component_that_dies_takes_what_it_started_with_it(tmp_path: Path):
    """A trainer replica is a parent and its rank processes: when the parent dies (kill -9 included), the ranks
    it left must not hold the rendezvous port against the restarted replica."""
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess,sys,time,pathlib,os;"
        f"c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']);"
        f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid));time.sleep(60)"
    )
    comp = Component("trainer", python(code), tmp_path / "t.log")
    sup = Supervisor([comp], dict(os.environ), FAST, say=lambda _: None)
    sup.start(comp)
    deadline = time.monotonic() + 20
    while not child_pid.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid = int(child_pid.read_text())
    comp.proc.kill()
    comp.proc.wait()
    poll_until(sup, lambda _: comp.restart_at is not None)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline, "the component's child outlived it"
        time.sleep(0.02)
    sup.stop_all()


def test_the_run_record_names_each_components_live_process_through_restarts(tmp_path: Path):
    """RUN_DIR/processes.json, rewritten by the supervisor on every start, is where a benchmark or a test finds a
    component's process: by the component's name, the process running now, none while it is down or stopped."""
    sleeper = python("import time; time.sleep(60)")
    redis = Component("redis", sleeper, tmp_path / "logs" / "redis.log", stop_last=True)
    worker = Component("rollout/pool-0", sleeper, tmp_path / "logs" / "rollout-pool-0.log")
    sup = Supervisor([redis, worker], dict(os.environ), FAST, say=lambda _: None, record=tmp_path / RECORD)
    assert run_processes(tmp_path) == {}, "no record yet"
    sup.start(redis)
    assert run_processes(tmp_path) == {"redis": redis.proc.pid, "rollout/pool-0": None}, "planned, not started"
    sup.start(worker)
    first = worker.proc.pid
    assert run_processes(tmp_path) == {"redis": redis.proc.pid, "rollout/pool-0": first}
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while run_processes(tmp_path)["rollout/pool-0"] is not None:  # killed, not yet reaped: a zombie is not live
        assert time.monotonic() < deadline, "a killed process still counts as live"
        time.sleep(0.02)
    poll_until(sup, lambda _: worker.restarts == 1)
    assert worker.proc.pid != first
    assert run_processes(tmp_path) == {"redis": redis.proc.pid, "rollout/pool-0": worker.proc.pid}
    sup.stop_all()
    assert run_processes(tmp_path) == {"redis": None, "rollout/pool-0": None}
