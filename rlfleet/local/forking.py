"""A warm start for a local run: the launcher imports the components' code once and forks each component from itself.

Every component of `rlfleet run` is a Python process that imports torch, transformers and its own service code before
it does anything: 2.5-5 CPU-seconds each, so the six of the example starting together on two cores kept the trainer
from publishing version 0 for ~9 s. `Preload.load` imports that code once in the launcher (one core, ~4.5 s, while
the others are free), and `Preload.start` forks a component from there: the child starts with every module in memory
(shared copy-on-write) and runs `python -m rlfleet.cli <component> ...` by runpy, as `-m` does, with what a started
process would have: the same arguments, environment, session (its own process group) and log. Restarts fork too.

What forking a launcher requires, and how each is kept:
  - the launcher has run no torch operation, so a child inherits no OpenMP pool and no CUDA context (torch creates
    both lazily, on first use; a forked child makes its own);
  - what a library reads from the environment at import time is read while the import runs under the components'
    environment (`Preload.load(environ)`: the hub's offline switches, OMP_NUM_THREADS); the rest each child reads
    from its own, which replaces the launcher's before the component's main runs;
  - the child leaves no path back into the launcher: it drops the launcher's exit handlers, logging handlers and
    signal handlers, closes every inherited descriptor above stderr, and ends by os._exit with main's status after
    running what a Python process runs at exit (non-daemon threads joined, its own atexit handlers, logging flushed).
A component whose command is not `python -m rlfleet.cli` is started by exec as before (`forkable`), and so is every
component when the launcher could not import (`Preload.ready` false: the import error is said once).
"""

from __future__ import annotations

import atexit
import importlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rlfleet.wire.components import COMPONENTS

CLI = ("-m", "rlfleet.cli")
# transformers' auto classes import most of the library (~2 s); the architecture module itself is cheap after them.
TRANSFORMERS = ("transformers.models.auto.modeling_auto", "transformers.tokenization_utils_fast")


def forkable(argv: list[str]) -> bool:
    """True for `<this python> -m rlfleet.cli <component> ...`: what a forked child can run in-process."""
    return len(argv) > 3 and argv[0] == sys.executable and tuple(argv[1:3]) == CLI and argv[3] in COMPONENTS


class ForkedProcess:
    """A forked child, with the part of subprocess.Popen's interface the supervisor uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for a signal, as Popen's
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            return self.returncode
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may be another process's by now
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Preload:
    """The components' modules imported in the launcher, and the fork that starts a component from them."""

    def __init__(self, kinds: Iterable[str]):
        self.modules = [*dict.fromkeys(COMPONENTS[k].module for k in kinds), *TRANSFORMERS]
        self.ready = False

    def load(self, environ: dict[str, str]) -> None:
        """Import every module under the components' environment; on failure fork nothing (the error said once)."""
        _prepare_command_lines()
        try:
            with _environment(environ):
                for name in self.modules:
                    importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  # the same import fails in the child, where its log names it
            print(f"rlfleet: components start by exec (the launcher could not import them: {exc})", file=sys.stderr)
            return
        self.ready = True

    def start(
        self, argv: list[str], environ: dict[str, str], log: Path, enter: Callable[[], None] | None = None
    ) -> ForkedProcess:
        """Fork and run `rlfleet <argv[3:]>` in the child, its output appended to `log`, in its own session.
        `enter`, when given, runs in the child first, on the log and with no descriptor of the parent's: what a
        container runtime would do before the command (the cluster-in-a-box tests enter a pod's namespaces)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child writes the launcher's buffered lines again
        pid = os.fork()
        if pid == 0:  # pragma: no cover  # the child: never returns (coverage cannot see past os._exit either)
            _child(argv, environ, log, enter)
        return ForkedProcess(pid)


def _child(argv: list[str], environ: dict[str, str], log: Path, enter: Callable[[], None] | None) -> None:
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.closerange(3, _max_fd())  # fd may be one of them: it is closed here too
        sys.stdout, sys.stderr = _unbuffered(1), _unbuffered(2)  # PYTHONUNBUFFERED's streams, on the log
        if enter is not None:
            enter()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        atexit._clear()  # the launcher's (Prometheus, temporary files) are not this process's
        for handler in logging.root.handlers[:]:
            logging.root.removeHandler(handler)
        _show_command_line(argv)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = [argv[0], *argv[3:]]  # runpy puts the module's file first, as `python -m` does
        code = _exit_status(lambda: runpy.run_module(argv[2], run_name="__main__", alter_sys=True))
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit: non-daemon threads finish
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:  # noqa: BLE001  # nothing may unwind into the launcher's frames
        traceback.print_exc()
    finally:
        for out in (sys.stdout, sys.stderr):
            try:
                out.flush()
            except Exception:  # noqa: BLE001, S110  # a closed log: nothing left to say
                pass
        os._exit(code)


def _exit_status(run: Callable[[], object]) -> int:
    """The exit status the interpreter would give `run` as its program: SystemExit's code, 0 when it returns, 1
    after a traceback."""
    try:
        run()
        return 0
    except SystemExit as exc:
        result = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        return 128 + signal.SIGINT
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    if result is None or isinstance(result, int):
        return result or 0
    print(result, file=sys.stderr)
    return 1


def _prepare_command_lines() -> None:
    """Let the children rewrite their command line: setproctitle measures the area it may write (the launcher's
    arguments and the environment strings after them) and moves the environment out of it. It must see that area as
    the process started, before anything sets or clears a variable, so the launcher does it once, before the imports.
    """
    try:
        from setproctitle import getproctitle
    except ImportError:  # the `local` extra installs it; without it a child shows the launcher's command
        return
    getproctitle()


def _show_command_line(argv: list[str]) -> None:
    """What `ps`, top and /proc/PID/cmdline show for this process: the command it runs, not the launcher's (written
    over the launcher's, spaces between the arguments, as gunicorn and Ray name their workers)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join(argv))


def _unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True, line_buffering=True)


def _max_fd() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 65536


@contextmanager
def _environment(environ: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
