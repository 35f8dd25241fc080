"""A local run's warm start (rlfleet/local/forking.py): components forked from a launcher that imported their code
run as started ones do: their own session, environment and log, the exit status exec would give, signals and
restarts as the supervisor expects; and a command that is not a component is still started by exec."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from rlfleet.local.forking import ForkedProcess, Preload, forkable
from rlfleet.local.supervisor import RECORD, Component, Supervisor, run_processes
from rlfleet.services.shardcast.protocol import ROUTE_HEALTH
from rlfleet.wire import env
from rlfleet.wire.components import ORIGIN
from rlfleet.wire.ports import free_port
from tests.core.test_supervisor import FAST, poll_until, python
from tests.support import REPO, wait_for

CLI = [sys.executable, "-m", "rlfleet.cli"]


def origin_argv(config: Path, port: int) -> list[str]:
    return [*CLI, ORIGIN, "--config", str(config), "--port", str(port)]


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{ROUTE_HEALTH}", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def forked_origin(tmp_path: Path, redis_url: str) -> tuple[Component, Supervisor, int]:
    """The example's origin as a launcher plans it (its Redis URL and store only in the environment given), on a
    supervisor that forks it from a Preload of the origin's code; and its port."""
    config = tmp_path / "rlrun.yaml"
    shutil.copyfile(REPO / "examples" / "arithmetic" / "rlrun.yaml", config)  # names no spec.redis.url
    environ = {**os.environ, env.REDIS_URL: redis_url, env.STORE_URI: f"file://{tmp_path / 'store'}"}
    preload = Preload([ORIGIN])
    preload.load(environ)
    port = free_port()
    comp = Component(ORIGIN, origin_argv(config, port), tmp_path / "logs" / "origin.log")
    sup = Supervisor([comp], environ, FAST, say=lambda _: None, preload=preload, record=tmp_path / RECORD)
    return comp, sup, port


def test_a_forked_origin_serves_in_its_own_session_with_its_environment_and_stops_on_sigterm(tmp_path, redis_url):
    before = dict(os.environ)
    # Without the launcher's environment the origin would stop: no Redis URL in the file, none in this process's.
    assert env.REDIS_URL not in os.environ
    comp, sup, port = forked_origin(tmp_path, redis_url)
    assert sup.preload is not None and sup.preload.ready and "rlfleet.services.shardcast.origin" in sys.modules
    assert dict(os.environ) == before  # imported under the components' environment, and this one given back
    proc = sup.start(comp)
    assert isinstance(proc, ForkedProcess)
    wait_for("the forked origin's health answer", lambda: answers(port), timeout=30)
    assert os.getpgid(proc.pid) == proc.pid  # its own session: a signal to the launcher's terminal misses it
    assert proc.poll() is None

    sup.stop_all()
    assert proc.returncode == 0  # SIGTERM is the component's own (component_context), not the launcher's
    log = comp.log.read_text()
    assert f"serving on http://127.0.0.1:{port}" in log and "Traceback" not in log


def test_a_forked_component_exits_with_the_status_and_message_exec_gives(tmp_path):
    argv = [*CLI, ORIGIN, "--config", str(tmp_path / "missing.yaml"), "--port", str(free_port())]
    assert forkable(argv)
    executed = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    preload = Preload([ORIGIN])
    preload.load(dict(os.environ))
    proc = preload.start(argv, dict(os.environ), tmp_path / "forked.log")
    assert proc.wait(timeout=60) == executed.returncode != 0
    assert "missing.yaml" in executed.stderr
    assert (tmp_path / "forked.log").read_text().strip().splitlines()[-1] == executed.stderr.strip().splitlines()[-1]


def test_a_killed_forked_component_reports_the_signal_and_is_started_again(tmp_path, redis_url):
    comp, sup, port = forked_origin(tmp_path, redis_url)
    first = sup.start(comp)
    wait_for("the first start", lambda: answers(port), timeout=30)
    # A forked component rewrites its command line (one string, forking.py): the run's record still finds it.
    assert run_processes(tmp_path) == {ORIGIN: first.pid}
    first.send_signal(signal.SIGKILL)
    poll_until(sup, lambda _: comp.restarts == 1)
    assert first.returncode == -signal.SIGKILL and comp.proc is not first and isinstance(comp.proc, ForkedProcess)
    wait_for("the second start", lambda: answers(port), timeout=30)
    assert run_processes(tmp_path) == {ORIGIN: comp.proc.pid}
    sup.stop_all()
    assert comp.proc.returncode == 0
    assert comp.log.read_text().count("serving on") == 2


def test_a_command_that_is_not_a_component_is_started_by_exec(tmp_path):
    preload = Preload([ORIGIN])
    preload.load(dict(os.environ))
    comp = Component("script", python("print('hello')"), tmp_path / "script.log", done_on_success=True)
    assert not forkable(comp.argv) and not forkable([*CLI, "validate", "x.yaml"])
    sup = Supervisor([comp], dict(os.environ), FAST, say=lambda _: None, preload=preload)
    proc = sup.start(comp)
    assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
    assert comp.log.read_text() == "hello\n"
