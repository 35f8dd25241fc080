"""Processes of a local run under a restart policy, as kubelet runs the containers of a pod.

Policy (kubelet's `restartPolicy: Always` with its crash-loop back-off, scaled down for one machine;
the numbers are RestartPolicy's):
  - a component that exits is started again after a back-off that starts at `backoff_start_s` and
    doubles on each exit, up to `backoff_max_s`; once a start has stayed up `stable_s`, the
    back-off and the failure count start over;
  - a component marked `done_on_success` (the trainer ranks) is finished when it exits with 0,
    and is not started again;
  - a component that exits `crash_loop` times in a row without staying up `stable_s` is
    crash-looping: `poll` returns it and the caller stops the run, naming it and its log. Exits by
    SIGKILL are not judged so (they back off all the same): a process cannot send itself one by
    mistake, it comes from outside (the OOM killer, a user, a chaos test), and what killed it says
    nothing about the run's config or code; kubelet, too, never gives up on a pod.
Every component runs in its own session (its own process group), so a signal to the launcher's
terminal never reaches it directly and `stop_all` can end each one with its children. A component
that exits takes its process group with it (SIGKILL to what is left, as the kubelet ends a
container's processes): a trainer replica is a group of rank processes under one parent
(rlfleet/services/trainer/ranks.py) that is restarted whole, since a torch.distributed group cannot
lose one member and go on.
The run's record, RUN_DIR/processes.json (`RECORD`), names every component and the process that runs it now; the
supervisor rewrites it on each start and restart, and `run_processes` reads it. It is the one place a benchmark or
a test finds a component's process: a forked component's command line is one retitled string (forking.py) and
Redis renames its own, so neither is found reliably by reading command lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.local.forking import ForkedProcess, Preload, forkable

STOP_GRACE_S = 20  # inside a pod's default 30 s; the vLLM engine needs up to 15 s to stop
RECORD = "processes.json"  # in the run directory: {component name: {"pid", "started"} or null}


@dataclass(frozen=True)
class RestartPolicy:
    backoff_start_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    crash_loop: int = 5


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment
    done_on_success: bool = False  # exit 0 means finished (trainer ranks): never restarted
    stop_last: bool = False  # a service the others use until they exit (Redis): stopped after them
    proc: subprocess.Popen | ForkedProcess | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # when an exited component is due to start again
    restarts: int = 0
    failures: int = 0  # consecutive exits that came sooner than the policy's stable_s after their start

    @property
    def finished(self) -> bool:
        return self.done_on_success and self.proc is not None and self.proc.poll() == 0


class Supervisor:
    """Starts, restarts and stops the components of one run (see the module docstring for the policy)."""

    def __init__(self, comps: list[Component], environ: dict[str, str], policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] | None = None, preload: Preload | None = None,
                 record: Path | None = None):  # fmt: skip
        self.comps, self.environ, self.policy = comps, environ, policy
        self.record = record  # the run's record of its processes (RECORD in the run directory), if kept
        self.preload = preload  # once loaded, components are forked from it (rlfleet/local/forking.py)
        self.say = say or (lambda text: print(f"rlfleet: {text}", file=sys.stderr, flush=True))

    def start(self, comp: Component) -> subprocess.Popen | ForkedProcess:
        """Start `comp`, its output appended to its log; its process (written to the run's record)."""
        comp.log.parent.mkdir(parents=True, exist_ok=True)
        if self.preload is not None and self.preload.ready and forkable(comp.argv):
            comp.proc = self.preload.start(comp.argv, {**self.environ, **comp.env}, comp.log)
        else:
            with open(comp.log, "ab") as log:
                comp.proc = subprocess.Popen(
                    comp.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**self.environ, **comp.env},
                )
        comp.started_at, comp.restart_at = time.monotonic(), None
        self.write_record()
        return comp.proc

    def write_record(self) -> None:
        """Rewrite the run's record: each component's name and its latest process (pid and start time, which tell
        it from a later process given the same pid), null for one never started. Replaced whole, never half
        written."""
        if self.record is None:
            return
        entries = {}
        for comp in self.comps:
            pid = comp.proc.pid if comp.proc is not None else None
            entries[comp.name] = {"pid": pid, "started": _start_time(pid)} if pid is not None else None
        partial = self.record.with_name(self.record.name + ".partial")
        partial.write_text(json.dumps(entries, indent=2) + "\n")
        os.replace(partial, self.record)

    def poll(self) -> Component | None:
        """Restart what is due; the first crash-looping component, if any (the run must stop)."""
        now, policy = time.monotonic(), self.policy
        for comp in self.comps:
            if comp.proc is None or comp.finished:
                continue
            code = comp.proc.poll()
            if code is None:
                if comp.failures and now - comp.started_at >= policy.stable_s:
                    comp.failures = 0  # stayed up: the next exit starts the back-off over
                continue
            if comp.restart_at is None:
                _signal_group(comp.proc, signal.SIGKILL)  # what it started dies with it (a trainer's ranks)
                comp.failures = comp.failures + 1 if now - comp.started_at < policy.stable_s else 1
                if comp.failures >= policy.crash_loop and code != -signal.SIGKILL:
                    return comp
                backoff = min(policy.backoff_max_s, policy.backoff_start_s * 2 ** (comp.failures - 1))
                comp.restart_at = now + backoff
                self.say(f"{comp.name} exited with code {code}; restarting in {backoff:g}s (see {comp.log})")
            elif now >= comp.restart_at:
                comp.restarts += 1
                self.start(comp)
        return None

    def stop_all(self, force: Callable[[], bool] = lambda: False) -> None:
        """Stop every component: first all but the `stop_last` ones, then those (the others may still
        be talking to Redis on their way out). Each wave: SIGTERM, then SIGKILL what is left after
        STOP_GRACE_S, or at once when `force()` turns true (a second Ctrl-C). Only the component's
        own process gets SIGTERM (it stops its children itself, e.g. a vLLM engine core); whatever is
        left in its process group afterwards is killed."""
        deadline = time.monotonic() + STOP_GRACE_S
        for wave in ([c for c in self.comps if not c.stop_last], [c for c in self.comps if c.stop_last]):
            running = [(c, c.proc) for c in wave if c.proc is not None and c.proc.poll() is None]
            for _, proc in running:
                proc.send_signal(signal.SIGTERM)
            while running and time.monotonic() < deadline and not force():
                time.sleep(0.05)
                running = [(c, proc) for c, proc in running if proc.poll() is None]
            for comp, proc in running:
                if not force():
                    self.say(f"{comp.name} did not stop within {STOP_GRACE_S}s of SIGTERM; killed (see {comp.log})")
                proc.kill()
                proc.wait()
            deadline = max(deadline, time.monotonic() + 5)  # the last wave gets a few seconds of its own
        for comp in self.comps:
            if comp.proc is not None:
                _signal_group(comp.proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def run_processes(run_dir: Path) -> dict[str, int | None]:
    """Every component of the run in `run_dir` by name, with the pid of its live process, None while it has none
    (not started, exited, restarting, stopped, or killed and not yet reaped); {} when the run kept no record."""
    try:
        entries = json.loads((run_dir / RECORD).read_text())
    except FileNotFoundError:
        return {}
    return {name: _live(entry["pid"], entry["started"]) if entry else None for name, entry in entries.items()}


def _live(pid: int, started: int | None) -> int | None:
    """`pid` if that process still runs (not a zombie, and started when recorded: not a later process with its pid)."""
    if started is None:  # recorded without /proc (not Linux): the pid's existence is all there is to go on
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the command's name
    except OSError:
        return None
    return pid if fields[0] != "Z" and int(fields[19]) == started else None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None without /proc."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
