"""The network testbed on real namespaces, veths, bridges and tc: shaping limits what a real TCP
transfer achieves, names resolve through the per-host hosts files, and nothing is left behind
after an exception, a SIGTERM or (after a sweep) a SIGKILL. Root only; skipped with the reason
otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed import Testbed, TestbedUnavailable, stale_namespaces, sweep, unavailable_reason
from testbed.commands import NETNS_ETC, REGISTER, namespaces
from tests.support import REPO

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

MBIT = 10**6
# Receiver inside one host: accept one connection, read it to the end, print the rate from the
# first byte to the last (what the link let through, not start-up).
SINK = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 16); n = 0; first = None
while k := c.recv_into(buf):
    first = first or time.monotonic(); n += k
print(json.dumps({"bytes": n, "bps": 8 * n / (time.monotonic() - first)}), flush=True)
"""
SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9000)); block = bytes(1 << 16)
for _ in range(int(sys.argv[2]) >> 16): s.sendall(block)
s.close()
"""


def transfer(tb: Testbed, src, dst, to: str, nbytes: int) -> float:
    """Payload bit/s of one TCP stream of `nbytes` from host `src` to host `dst` (addressed as `to`)."""
    sink = tb.popen(dst, [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    sent = tb.run(src, [sys.executable, "-c", SOURCE, to, str(nbytes)], timeout=60, capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    result = json.loads(sink.stdout.readline())
    sink.wait(10)
    assert result["bytes"] == nbytes
    return result["bps"]


def root_links() -> set[str]:
    return {
        line.split(":")[1].strip() for line in subprocess.check_output(["ip", "-o", "link"], text=True).splitlines()
    }


def test_shaping_limits_real_transfers_in_each_direction_and_across_sites():
    with Testbed() as tb:
        a = tb.host("a", up=40 * MBIT)
        b = tb.host("b", down=20 * MBIT)
        c = tb.host("c")
        remote = tb.site("remote")
        d = tb.host("d", site=remote)
        tb.connect(a.site, remote, rate_ab=30 * MBIT, rate_ba=60 * MBIT)
        tb.add_name("svc.default.svc.cluster.local", c.ip)

        up = transfer(tb, a, c, "c", 5 << 20)  # a's uplink
        down = transfer(tb, c, b, "b", 3 << 20)  # b's downlink
        free = transfer(tb, b, c, "svc.default.svc.cluster.local", 20 << 20)  # b's uplink is not shaped
        wan_out = transfer(tb, c, d, d.ip, 4 << 20)  # c -> remote: the WAN link's a->b direction
        wan_in = transfer(tb, d, c, c.ip, 8 << 20)
    # payload rates: TCP/IP/Ethernet headers take ~4.4 % of a shaped link; a short transfer's
    # start-up burst may exceed the rate a little
    assert 0.8 * 40 * MBIT < up < 1.05 * 40 * MBIT
    assert 0.8 * 20 * MBIT < down < 1.05 * 20 * MBIT
    assert 0.8 * 30 * MBIT < wan_out < 1.05 * 30 * MBIT
    assert 0.8 * 60 * MBIT < wan_in < 1.05 * 60 * MBIT
    assert free > 150 * MBIT


def test_teardown_after_an_exception_leaves_nothing_behind():
    links_before = root_links()
    with pytest.raises(RuntimeError, match="boom"), Testbed() as tb:
        tb.host("a", up=10 * MBIT, down=10 * MBIT)
        other = tb.site("other")
        tb.host("b", site=other, down=5 * MBIT)
        tb.connect("lan", "other", 20 * MBIT)
        sleeper = tb.popen("b", ["sleep", "600"])
        made = [ns for ns in namespaces() if ns.startswith(tb.tag)]
        assert len(made) == 4  # two sites, two hosts
        assert (NETNS_ETC / f"{tb.tag}-a" / "hosts").read_text().count("10.200.") == 2
        raise RuntimeError("boom")
    assert sleeper.poll() == -signal.SIGTERM
    assert not [ns for ns in namespaces() if ns.startswith(tb.tag)]
    assert not [d for d in NETNS_ETC.glob(f"{tb.tag}-*")]
    assert root_links() == links_before  # nothing was ever made in the root namespace


def test_a_failed_setup_is_torn_down_too():
    with pytest.raises(ValueError, match="no address left"), Testbed() as tb:
        tiny = tb.site("tiny", subnet="10.201.0.0/29")
        for i in range(10):
            tb.host(f"h{i}", site=tiny)
    assert not [ns for ns in namespaces() if ns.startswith(tb.tag)]


# The owner answers SIGINT as an interactive Python does, whatever it inherited: a test run started in the
# background of a non-interactive shell (nohup, `cmd &`) passes SIGINT on as ignored, and Python then installs no
# handler for it.
OWNER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from testbed import Testbed
with Testbed() as tb:
    tb.host("a", down=10e6); tb.host("b", up=10e6)
    tb.popen("a", ["sleep", "600"])
    print(tb.tag, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_owner_leaves_nothing_or_a_sweepable_rest(sig):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env)
    tag = owner.stdout.readline().strip()
    assert tag.startswith("rlf-")
    owner.send_signal(sig)
    owner.wait(30)
    left = [ns for ns in namespaces() if ns.startswith(tag)]
    if sig != signal.SIGKILL:
        assert left == []
        return
    # SIGKILL gives no chance to clean up: the rest is recognisably stale once its processes end
    assert len(left) == 3 and set(left) <= set(stale_namespaces())
    for ns in left:
        for pid in subprocess.check_output(["ip", "netns", "pids", ns], text=True).split():
            os.kill(int(pid), signal.SIGKILL)  # the sleep the killed owner started
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:  # a killed process may linger a moment as a zombie
        left = sorted(set(left) - set(sweep(left)))
        time.sleep(0.05)
    assert not [ns for ns in namespaces() if ns.startswith(tag)]
    assert not list(NETNS_ETC.glob(f"{tag}-*"))
    assert not (REGISTER / tag).exists()


def test_a_sweep_leaves_namespaces_no_testbed_registered():
    """Someone else's namespace named like a dead owner's testbed is not the sweep's to remove."""
    lookalike = f"rlf-{dead_pid()}-abcd-lookalike"
    subprocess.run(["ip", "netns", "add", lookalike], check=True)
    try:
        assert lookalike not in stale_namespaces()
        assert sweep([lookalike]) == []
        assert lookalike in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", lookalike], check=True)


def dead_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


STUBBORN = """
import sys, time
from testbed import Testbed
with Testbed() as tb:
    tb.host("a", down=10e6)
    stubborn = tb.popen("a", ["sh", "-c", "trap '' TERM; echo ready; exec sleep 600"], stdout=-1, text=True)
    assert stubborn.stdout.readline().strip() == "ready"  # it ignores SIGTERM: teardown waits, then SIGKILLs it
    print(tb.tag, flush=True)
    time.sleep(600)
"""


def test_a_second_signal_during_teardown_does_not_cut_it_short():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, env=env)
    tag = owner.stdout.readline().strip()
    owner.send_signal(signal.SIGTERM)  # teardown starts and waits for the stubborn process
    time.sleep(1.0)
    assert owner.poll() is None and [ns for ns in namespaces() if ns.startswith(tag)]
    owner.send_signal(signal.SIGINT)  # an impatient Ctrl-C
    assert owner.wait(30) != 0
    assert not [ns for ns in namespaces() if ns.startswith(tag)]


def test_refusal_names_the_reason():
    check = "from testbed import Testbed\nwith Testbed(): pass"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    no_tools = subprocess.run(
        [sys.executable, "-c", check], env={**env, "PATH": "/nonexistent"}, capture_output=True, text=True
    )
    assert no_tools.returncode != 0 and "TestbedUnavailable" in no_tools.stderr
    assert "iproute2" in no_tools.stderr and "ip and tc not on PATH" in no_tools.stderr
    # the interpreter itself is root's to run here, so the child drops its effective uid after start
    drop = "import os\nimport testbed\nos.setegid(65534)\nos.seteuid(65534)\n"
    as_nobody = subprocess.run([sys.executable, "-c", drop + check], env=env, capture_output=True, text=True)
    assert as_nobody.returncode != 0 and "needs root" in as_nobody.stderr, as_nobody.stderr
    assert issubclass(TestbedUnavailable, RuntimeError)


def test_bad_names_and_rates_are_refused_before_anything_is_made():
    with pytest.raises(RuntimeError, match="with Testbed"):
        Testbed().host("a")
    with Testbed() as tb:
        with pytest.raises(ValueError, match="lower case"):
            tb.host("Origin")
        with pytest.raises(ValueError, match="rate 'fast'"):
            tb.host("a", up="fast")
        assert [ns for ns in namespaces() if ns.startswith(tb.tag)] == []
        assert tb.host("a", up="1.5mbit").up == 1_500_000  # the name is still free


RESOLVE = """
import socket, sys
for line in sys.stdin:
    try:
        print(socket.gethostbyname(line.strip()), flush=True)
    except OSError:
        print("unknown", flush=True)
"""


def test_a_hosts_own_names_resolve_only_there_and_reach_running_processes():
    with Testbed() as tb:
        a, b = tb.host("a"), tb.host("b")
        tb.add_name("everywhere.test", b.ip)
        resolver = tb.popen(
            a, [sys.executable, "-c", RESOLVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

        def resolve(name: str) -> str:
            resolver.stdin.write(name + "\n")
            resolver.stdin.flush()
            return resolver.stdout.readline().strip()

        assert resolve("everywhere.test") == b.ip
        assert resolve("svc.ns.svc.cluster.local") == "unknown"
        tb.set_names(a, {"svc.ns.svc.cluster.local": b.ip, "svc": b.ip})
        assert resolve("svc.ns.svc.cluster.local") == b.ip  # the running process sees the new entry
        assert resolve("svc") == b.ip and resolve("everywhere.test") == b.ip
        tb.set_names(a, {"svc": a.ip})
        assert resolve("svc") == a.ip and resolve("svc.ns.svc.cluster.local") == "unknown"
        seen_by_b = tb.run(b, ["getent", "hosts", "svc"], capture_output=True, text=True)
        assert seen_by_b.returncode != 0, seen_by_b.stdout  # only a resolves its own names
        tb.run(tb.host("c"), ["true"])  # a new host rewrites every file, keeping each host's own entries
        assert resolve("svc") == a.ip and resolve("c") == tb.hosts["c"].ip
        resolver.stdin.close()
        resolver.wait(10)
        with pytest.raises(ValueError):
            tb.set_names(a, {"svc": "not-an-ip"})
