"""The commands under the testbed: `ip` and `tc` (iproute2) run as root, rates, process CPU time,
and the register of which namespaces a testbed made (so leftovers of a killed run can be found).

We drive iproute2 by its command line rather than netlink from Python (pyroute2): the commands are
what an operator types to reproduce a topology by hand, and nothing else is needed on the machine.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

NETNS_RUN = Path("/run/netns")  # where `ip netns add` mounts a namespace's handle
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
REGISTER = Path("/run/rlfleet-testbed")  # one file per open testbed: its tag, then a namespace a line
PREFIX = "rlf"
# A testbed's tag is rlf-<owner pid>-<4 hex>, the prefix of its namespaces' names. The owner pid
# tells a live testbed from the leftovers of one whose process was killed (SIGKILL leaves no chance
# to clean up); the register, not the name, says which namespaces are a testbed's (others may use
# names like these).
TAG_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{4}}$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


class TestbedUnavailable(RuntimeError):
    """This machine cannot host a testbed (not root, iproute2 missing, namespaces refused); the
    message says which and what to do."""

    __test__ = False  # not a pytest test class despite the name


class CommandError(RuntimeError):
    """An `ip`/`tc` command failed; the message holds the command and its stderr."""


def unavailable_reason() -> str | None:
    """Why a testbed cannot run here, or None when it can (root, `ip` and `tc` on PATH)."""
    if os.geteuid() != 0:
        return "the network testbed needs root (network namespaces, veth, bridges and tc); run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network testbed needs iproute2: {' and '.join(missing)} not on PATH (apt-get install iproute2)"
    return None


def require_available() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise TestbedUnavailable(reason)


def sh(*argv: str, netns: str | None = None, check: bool = True) -> str:
    """Run one iproute2 command (in `netns` with -n); return stdout. Failure raises CommandError."""
    if netns is not None:
        argv = (argv[0], "-n", netns, *argv[1:])
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise CommandError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def parse_rate(rate: int | float | str | None) -> int | None:
    """Bits per second from 200e6, '200mbit', '200Mbit' or '1.5gbit' (None passes through)."""
    if rate is None:
        return None
    if isinstance(rate, int | float):
        value = int(rate)
    else:
        m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(?:bit|bps)?\s*", rate.lower())
        if m is None:
            raise ValueError(f"rate {rate!r}: expected bits per second, e.g. 200e6 or '200mbit'")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value < 8000:
        raise ValueError(f"rate {rate!r}: at least 8 kbit/s")
    return value


def tbf_args(rate: int) -> list[str]:
    """A token bucket at `rate` bit/s. The bucket holds at least one 64 KiB GSO packet (veths send
    them; tbf would otherwise split each one) and 4 ms at the rate; the queue holds 100 ms at the
    rate, enough that flows bursting into it back off rather than drop at sub-ms RTTs."""
    per_second = rate // 8
    burst = max(128 << 10, per_second // 250)
    limit = max(4 * burst, per_second // 10)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit)]


def new_owner_tag() -> str:
    """rlf-<pid>-<hex4>: this process's prefix for one testbed's namespaces."""
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"


def namespaces() -> list[str]:
    """Every named network namespace on the machine."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def pids_in(netns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", netns, check=False).split()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register(tag: str, netns: str) -> None:
    """Record that testbed `tag` makes `netns` (before it is made)."""
    REGISTER.mkdir(mode=0o755, exist_ok=True)
    with open(REGISTER / tag, "a") as f:
        f.write(netns + "\n")


def unregister(tag: str) -> None:
    (REGISTER / tag).unlink(missing_ok=True)


def registered() -> dict[str, list[str]]:
    """Testbed tag -> the namespaces it recorded, for every testbed not closed."""
    if not REGISTER.is_dir():
        return {}
    return {p.name: p.read_text().split() for p in REGISTER.iterdir() if TAG_RE.match(p.name)}


def stale_namespaces() -> list[str]:
    """Namespaces of testbeds whose owner process is gone: what a killed run left behind."""
    existing = set(namespaces())
    return [
        ns
        for tag, names in registered().items()
        if not pid_alive(int(TAG_RE.match(tag).group(1)))
        for ns in names
        if ns in existing
    ]


def sweep(names: list[str]) -> list[str]:
    """Delete those of `names` that a dead owner's testbed registered and no process runs in (with
    their /etc/netns entries); return them. A dead owner's register entry goes once none of its
    namespaces is left. Live testbeds and namespaces no testbed registered are never touched."""
    existing, stale = set(namespaces()), set(stale_namespaces())
    removed = []
    for ns in names:
        if ns not in existing or ns not in stale or pids_in(ns):
            continue
        sh("ip", "netns", "del", ns)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        removed.append(ns)
    left = set(namespaces())
    for tag, recorded in registered().items():
        if not pid_alive(int(TAG_RE.match(tag).group(1))) and not left & set(recorded):
            unregister(tag)
    return removed


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and of the children it has reaped (from
    /proc/PID/stat, which a zombie keeps until its parent reaps it: read it before `wait`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; the difference of two
    readings gives the machine's load over an interval, whoever caused it."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


def exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` s for `proc` to exit, without reaping it (its /proc entry stays)."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def stop_measured(proc: subprocess.Popen, grace: float = 10.0) -> float:
    """Stop `proc` if it still runs (SIGTERM to its process group, SIGKILL after `grace` s), then
    return its CPU seconds (children it reaped included) and reap it. `proc` must be unreaped."""
    if not exited(proc, 0):
        os.killpg(proc.pid, signal.SIGTERM)
        if not exited(proc, grace):
            os.killpg(proc.pid, signal.SIGKILL)
            exited(proc, 30)
    cpu = cpu_seconds(proc.pid)
    proc.wait()
    return cpu
