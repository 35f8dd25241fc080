"""A warm start for the box's pods in process mode: a zygote process imports the components' code once and forks
each `rlfleet <component>` container from itself, inside the pod's namespaces, as `rlfleet run` forks its
components (rlfleet/local/forking.py).

Why: every rlfleet pod is a Python process that imports torch, transformers and its service before it does anything
(2.5-5 CPU-seconds), and a cluster test starts dozens of them (a test of the rollout roll-out restarts every
worker), so on two cores the imports were a large part of what the cluster tests cost.

What a forked pod has, against one started by `ip netns exec NS unshare --uts -- python podexec.py SPEC`:
  - the same namespaces: the child enters the pod's network namespace (setns), unshares its mount and UTS
    namespaces and mounts what `ip netns exec` mounts (a sysfs of that namespace, /etc/netns/NS/* over /etc/*),
    then runs podexec's steps (host name, the image's layer, volumes, working directory);
  - the same environment: a zygote imports under the pods' environment, so what a library reads at import time
    (HF_HOME, HOME, the hub's switches, PYTHON*) is the pod's: one zygote per distinct import-time environment
    (the whole environment but the variables read only at run time, `RUNTIME`), started on the first pod that
    needs it, at most `MAX_ZYGOTES` in a test process;
  - the same process: `rlfleet <component> ...` run by runpy in its own session (so the kubelet signals its
    group), its output appended to the pod's log, its exit status the program's. The kubelet's handle
    (`ForkedPod`) learns it from the zygote, which reaps its children and writes `exit N` on the connection
    the start was asked on.
One difference shows: /proc/PID/environ is the block a process was exec'd with, so a forked pod's shows its zygote's
(renaming it takes CAP_SYS_RESOURCE, which this machine's root lacks); `kubelet.environment_of` reads what the
program was given instead.
A command that is not an rlfleet component (Redis, the operator, `rlfleet join`), a pod with code of its own on
PYTHONPATH (`image_python_path`), a pod whose zygote could not start (the reason said once in the test's output),
and every pod when INABOX_ZYGOTE=0 (to compare, or to rule the zygote out) starts by exec as before.

Run as `python zygote.py SOCKET`: import, listen on the Unix socket SOCKET, print `ready`, serve until the test
process that started it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZYGOTE = Path(__file__).resolve()
REPO = ZYGOTE.parents[3]
MAX_ZYGOTES = 4
START_TIMEOUT_S = 180.0
# Variables read when a program runs, not when it imports: pods that differ only in these share a zygote.
RUNTIME_PREFIXES = ("RLFLEET_", "KUBERNETES_", "AWS_", "POD_", "WANDB_", "MLFLOW_")
RUNTIME = {"HOSTNAME", "HF_TOKEN", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
RUNTIME |= {"MASTER_ADDR", "MASTER_PORT"}

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_SLAVE, MNT_DETACH, PR_SET_PDEATHSIG = 1 << 19, 2, 1


def import_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of a pod's environment its imports may read (what selects its zygote)."""
    return {k: v for k, v in env.items() if k not in RUNTIME and not k.startswith(RUNTIME_PREFIXES)}


def image_python_path(env: dict[str, str]) -> bool:
    """Whether a pod's PYTHONPATH is the image's (this checkout). A pod that puts code of its own first (a
    sitecustomize, as tests/cluster/test_wedged_worker.py does) runs it at interpreter start-up, where it may read
    any variable, run-time ones too: only an exec'd interpreter runs it as that pod's."""
    return env.get("PYTHONPATH", "") in ("", str(REPO))


def component_argv(argv: list[str]) -> list[str] | None:
    """`argv` as forking.py runs it (`<python> -m rlfleet.cli <component> ...`) when it is `rlfleet <component>`
    of this virtualenv; None for any other command."""
    from rlfleet.wire.components import COMPONENTS

    if len(argv) < 2 or argv[1] not in COMPONENTS:
        return None
    if argv[0] not in ("rlfleet", str(Path(sys.executable).with_name("rlfleet"))):
        return None
    return [sys.executable, "-m", "rlfleet.cli", *argv[1:]]


# ---- the test process's side ----------------------------------------------------------------------------------


class ForkedPod:
    """A pod's program forked by a zygote: the part of subprocess.Popen's interface the kubelet and the testbed use.
    Its exit status comes on `conn`; if the zygote is gone first, the program counts as killed once its pid is."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._buffer = b""
        self._orphan = False

    def _read(self, timeout: float) -> None:
        if self._orphan:
            if not _alive(self.pid):
                self.returncode = -signal.SIGKILL
            return
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if not ready:
            return
        data = self.conn.recv(256)
        if not data:  # the zygote ended (the test process is ending): the pid says when the program has
            self._orphan = True
            return
        self._buffer += data
        if self._buffer.endswith(b"\n"):
            self.returncode = int(self._buffer.split()[-1])
            self.conn.close()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read(0)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            with self._lock:
                if self.returncode is None:
                    self._read(max(0.0, left))
                code = self.returncode
            if code is not None:
                return code
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pod program {self.pid}", timeout or 0)
            if self._orphan:
                time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may be another process's by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygotes:
    """This test process's zygotes, one per import-time environment, started when a pod first needs one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._procs: dict[tuple, subprocess.Popen] = {}
        self._sockets: dict[tuple, str | None] = {}  # None: this environment's zygote could not start

    def socket_for(self, env: dict[str, str]) -> str | None:
        """The socket of the zygote for a pod of environment `env`, started (and waited for) if need be; None when
        there is none (the pod starts by exec)."""
        if os.environ.get("INABOX_ZYGOTE") == "0" or not image_python_path(env):
            return None
        return self._socket(import_environment(env))

    def fork(self, path: str, argv: list[str], spec_path: Path, netns: str, log: Path) -> ForkedPod | None:
        """Start the pod of `spec_path` (podexec's spec; argv as component_argv gives it) forked from the zygote at
        `path`; None when that zygote fails (said once; its environment's pods start by exec from then on)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            request = {"argv": argv, "spec": str(spec_path), "netns": netns, "log": str(log)}
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    raise ConnectionError("the zygote closed the connection before it forked")
                reply += chunk
        except OSError as exc:
            conn.close()
            print(f"inabox: zygote {path} failed ({exc}); pods start by exec", file=sys.stderr)
            with self._lock:
                self._sockets = {k: (None if v == path else v) for k, v in self._sockets.items()}
            return None
        return ForkedPod(conn, int(reply))

    def _socket(self, environ: dict[str, str]) -> str | None:
        key = tuple(sorted(environ.items()))
        with self._lock:
            if key in self._sockets:
                return self._sockets[key]
            if len(self._procs) >= MAX_ZYGOTES:
                return None
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="inabox-zygotes-"))
                atexit.register(self.close)
            n = len(self._procs)
            path, log = str(self._dir / f"{n}.sock"), open(self._dir / f"{n}.log", "ab")
            with log:
                proc = subprocess.Popen(
                    [sys.executable, str(ZYGOTE), path],
                    env=environ,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self._procs[key] = proc
            self._sockets[key] = path if _ready(proc, path) else None
            if self._sockets[key] is None:
                text = (self._dir / f"{n}.log").read_text(errors="replace")[-2000:]
                print(f"inabox: a zygote did not start; pods start by exec:\n{text}", file=sys.stderr)
            return self._sockets[key]

    def close(self) -> None:
        with self._lock:
            for proc in self._procs.values():
                proc.terminate()
            for proc in self._procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            self._procs.clear()
            self._sockets.clear()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def _ready(proc: subprocess.Popen, path: str) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    return False


ZYGOTES = Zygotes()


# ---- the zygote's side -----------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_pod(netns: str, spec: dict) -> None:
    """In the forked child: what `ip netns exec NETNS unshare --uts --` and podexec.py do before the exec."""
    import podexec  # beside this file: the zygote runs it as a script

    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    _check(_libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
    os.close(fd)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    podexec.mount(None, "/", None, podexec.MS_REC | MS_SLAVE)  # as `ip netns exec`: nothing propagates back
    # A sysfs of this network namespace, as `ip netns exec` mounts (read-only when the machine's is).
    _check(_libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    readonly = podexec.MS_RDONLY if os.statvfs("/sys").f_flag & os.ST_RDONLY else 0
    podexec.mount(netns, "/sys", "sysfs", readonly)
    etc = Path("/etc/netns") / netns
    for entry in sorted(os.listdir(etc)) if etc.is_dir() else []:
        podexec.mount(str(etc / entry), f"/etc/{entry}", None, podexec.MS_BIND)
    podexec.enter(spec)


def serve(path: str) -> None:
    from rlfleet.local.forking import ForkedProcess, Preload
    from rlfleet.wire.components import COMPONENTS

    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")  # ends with the test process
    preload = Preload(COMPONENTS)
    preload.load(dict(os.environ))
    if not preload.ready:
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears when it accepts: the test process waits for the name
    print("ready", flush=True)
    reading: dict[socket.socket, bytes] = {}
    children: dict[int, tuple[ForkedProcess, socket.socket]] = {}
    while True:
        ready, _, _ = select.select([listener, *reading], [], [], 0.1)
        for sock in ready:
            if sock is listener:
                reading[listener.accept()[0]] = b""
                continue
            data = sock.recv(65536)
            reading[sock] += data
            if not data or reading[sock].endswith(b"\n"):
                line = reading.pop(sock)
                if not line.endswith(b"\n"):
                    sock.close()
                    continue
                request = json.loads(line)
                spec = json.loads(Path(request["spec"]).read_text())
                proc = preload.start(
                    request["argv"], spec["env"], Path(request["log"]), lambda: enter_pod(request["netns"], spec)
                )
                sock.sendall(f"{proc.pid}\n".encode())
                children[proc.pid] = (proc, sock)
        for pid, (proc, sock) in list(children.items()):
            if (code := proc.poll()) is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(f"exit {code}\n".encode())
                sock.close()
                del children[pid]


if __name__ == "__main__":
    serve(sys.argv[1])
