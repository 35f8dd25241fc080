"""A testbed: machines simulated by network namespaces on this one, joined by shaped links.

Layout (nothing of it lives in the root namespace, so nothing of it can clash with the machine's
own interfaces, routes or another testbed; every name starts with the owner tag rlf-<pid>-<hex>):
  site      a namespace `<tag>-s-<site>` holding a bridge `br0` (the site's switch) with the
            gateway address .1 of the site's /24, and forwarding on (the site's router)
  host      a namespace `<tag>-<host>` whose `eth0` is one end of a veth pair; the other end is
            a port of its site's bridge. Its address is the next free one of the site's /24; its
            default route is the site gateway; `lo` is up
  up        shapes what a host sends: tbf on its eth0 (egress)
  down      shapes what a host receives: eth0's ingress is redirected (u32 match-all, mirred) to an
            `ifb0` device in the host's namespace, and tbf on ifb0 shapes it
  WAN link  `connect(a, b)` joins two sites by a veth pair between their namespaces (a /30 of
            10.255.0.0/16), routes each site's /24 through it, and shapes each direction with tbf
            on the sending end. Sites route only to sites they are connected to (no transit)
  names     every host gets /etc/netns/<ns>/hosts (which `ip netns exec` mounts on /etc/hosts)
            naming every host of the testbed and whatever `add_name` added, then the host's own
            entries (`set_names`: what only it resolves, e.g. a pod's Service names); a file is
            rewritten in place, never replaced, so processes already running see the change
Invariants: a namespace is recorded before it is created, so teardown knows everything a failed
setup made; teardown stops every process inside each namespace (ours by construction), deletes
the namespaces (their veths, bridges and ifbs go with them) and /etc/netns/<ns>, and runs on
normal exit, on exceptions, on SIGTERM/SIGHUP (turned into SystemExit while the testbed is open)
and at interpreter exit. Only a SIGKILL of the owner leaves namespaces behind: each is recorded
in /run/rlfleet-testbed/<tag> before it is made, the tag carries the owner's pid, and
`python -m testbed sweep` removes what a dead owner recorded (and nothing else).
Bridged traffic inside a site is unshaped (the switch is not the bottleneck); a host's own up/down
rates are its access link, which is the model of a machine on the internet.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from testbed.commands import (
    NETNS_ETC,
    CommandError,
    namespaces,
    new_owner_tag,
    parse_rate,
    pids_in,
    register,
    require_available,
    sh,
    tbf_args,
    unregister,
)

log = logging.getLogger("testbed")

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for processes left at teardown
_CAUGHT = (signal.SIGTERM, signal.SIGHUP)  # turned into SystemExit while a testbed is open
_HELD = (signal.SIGINT, *_CAUGHT)  # held off while a testbed is torn down


class Process(Protocol):
    """What the testbed needs of a process it stops at teardown (subprocess.Popen has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


P = TypeVar("P", bound="Process | None")


@dataclass
class Site:
    name: str
    netns: str
    subnet: ipaddress.IPv4Network
    hosts: int = 0  # hosts placed so far (the next gets .hosts + 2)
    links: int = 0  # WAN links so far (interface wan<n>)

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    site: Site
    up: int | None = None  # bit/s the host may send, None = unshaped
    down: int | None = None  # bit/s the host may receive, None = unshaped
    procs: list[Process] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # hosts-file entries of this host only: name -> ip


@dataclass
class Link:
    a: Site
    b: Site
    a_dev: str  # the link's interface in a's namespace
    b_dev: str
    rate_ab: int | None
    rate_ba: int | None


class Testbed:
    """`with Testbed() as tb:` hosts, sites and links that exist until the block ends (see module doc)."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self) -> None:
        self.tag = new_owner_tag()
        self.sites: dict[str, Site] = {}
        self.hosts: dict[str, Host] = {}
        self.links: list[Link] = []
        self.names: dict[str, str] = {}  # extra hosts-file entries: name -> ip
        self._netns: list[str] = []  # every namespace we created (or began to create), in order
        self._hosts_dirty = False
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        self._lock = threading.Lock()
        self._entered = False

    # ---- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        require_available()
        if threading.current_thread() is threading.main_thread():
            for sig in _CAUGHT:
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        atexit.register(self.close)
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process in the testbed's namespaces and delete them (idempotent). A signal
        that arrives meanwhile is held and acted on after, so a second Ctrl-C cannot leave half a
        testbed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        held: list[int] = []
        saved = {}
        if threading.current_thread() is threading.main_thread():
            saved = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in _HELD}
        try:
            errors = self._teardown()
        finally:
            for sig, handler in {**saved, **self._old_handlers}.items():
                signal.signal(sig, handler)
            atexit.unregister(self.close)
        if held:
            raise KeyboardInterrupt if held[0] == signal.SIGINT else SystemExit(128 + held[0])
        if errors:
            raise CommandError("testbed teardown left things behind:\n  " + "\n  ".join(errors))

    def _teardown(self) -> list[str]:
        procs = [p for h in self.hosts.values() for p in h.procs]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        existing = set(namespaces())
        ours = [ns for ns in reversed(self._netns) if ns in existing]
        for ns in ours:  # whatever else runs in our namespaces was started there by our users
            for pid in pids_in(ns):
                _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for ns in ours:
            while pids_in(ns) and time.monotonic() < deadline:
                time.sleep(0.05)
            for pid in pids_in(ns):
                _kill(pid, signal.SIGKILL)
        errors = []
        for ns in ours:
            try:
                sh("ip", "netns", "del", ns)
            except CommandError as exc:
                errors.append(str(exc))
        for ns in self._netns:
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        left = set(namespaces()) & set(self._netns)
        errors += [f"namespace {ns} still exists" for ns in sorted(left)]
        if not left:
            unregister(self.tag)
        return errors

    # ---- building ------------------------------------------------------------------------------

    def _new_netns(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        if not self._entered or self._closed:
            raise RuntimeError("use a testbed inside `with Testbed() as tb:` (it is not open)")
        self._netns.append(ns)  # recorded first: a failure below is still torn down
        register(self.tag, ns)  # and for a sweep, should this process be killed outright
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", netns=ns)
        return ns

    def site(self, name: str, subnet: str | None = None) -> Site:
        """A switch and router for hosts: a bridge on a /24 (default 10.200.<n>.0/24)."""
        _check_name(name, "site")
        if name in self.sites:
            raise ValueError(f"site {name!r} exists already")
        net = ipaddress.ip_network(subnet or f"10.200.{len(self.sites) + 1}.0/24")
        if net.prefixlen > 29:
            raise ValueError(f"site {name!r}: subnet {net} is too small for hosts")
        ns = self._new_netns(f"s-{name}")
        site = self.sites[name] = Site(name, ns, net)
        sh("ip", "link", "add", "br0", "type", "bridge", netns=ns)
        sh("ip", "addr", "add", f"{site.gateway}/{net.prefixlen}", "dev", "br0", netns=ns)
        sh("ip", "link", "set", "br0", "up", netns=ns)
        _sysctl(ns, "net.ipv4.ip_forward", "1")
        return site

    def host(self, name: str, *, site: Site | str | None = None, up=None, down=None) -> Host:
        """A machine on `site` (default: the first site, made if none) with an `up`/`down` access
        link in bit/s (200e6 or '200mbit'; None = unshaped)."""
        _check_name(name, "host")
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        up, down = parse_rate(up), parse_rate(down)  # refused before anything is made
        if site is None:
            site = next(iter(self.sites.values()), None) or self.site("lan")
        elif isinstance(site, str):
            site = self.sites[site]
        site.hosts += 1
        ip = site.subnet.network_address + 1 + site.hosts
        if ip >= site.subnet.broadcast_address:
            raise ValueError(f"site {site.name!r} ({site.subnet}) has no address left for host {name!r}")
        ns = self._new_netns(name)
        host = self.hosts[name] = Host(name, ns, str(ip), site)
        port = f"h{site.hosts}"
        sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns, netns=site.netns)
        sh("ip", "link", "set", port, "master", "br0", "up", netns=site.netns)
        sh("ip", "addr", "add", f"{ip}/{site.subnet.prefixlen}", "dev", "eth0", netns=ns)
        sh("ip", "link", "set", "eth0", "up", netns=ns)
        sh("ip", "route", "add", "default", "via", site.gateway, netns=ns)
        self.shape(host, up=up, down=down)
        self._hosts_dirty = True
        return host

    def shape(self, host: Host, *, up=None, down=None) -> None:
        """Set (or with None, remove) the host's upload and download rates."""
        host.up, host.down = parse_rate(up), parse_rate(down)
        ns = host.netns
        sh("tc", "qdisc", "del", "dev", "eth0", "root", netns=ns, check=False)
        sh("tc", "qdisc", "del", "dev", "eth0", "ingress", netns=ns, check=False)
        if host.up is not None:
            sh("tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(host.up), netns=ns)
        if host.down is not None:
            if "ifb0" not in sh("ip", "-o", "link", "show", netns=ns):
                sh("ip", "link", "add", "ifb0", "type", "ifb", netns=ns)
                sh("ip", "link", "set", "ifb0", "up", netns=ns)
            sh("tc", "qdisc", "replace", "dev", "ifb0", "root", *tbf_args(host.down), netns=ns)
            sh("tc", "qdisc", "add", "dev", "eth0", "handle", "ffff:", "ingress", netns=ns)
            sh(
                "tc", "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "all",
                "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "ifb0",
                netns=ns,
            )  # fmt: skip

    def connect(self, a: Site | str, b: Site | str, rate=None, *, rate_ab=None, rate_ba=None) -> Link:
        """A routed WAN link between sites `a` and `b`, shaped to `rate` each way (or `rate_ab`
        a->b and `rate_ba` b->a)."""
        a = self.sites[a] if isinstance(a, str) else a
        b = self.sites[b] if isinstance(b, str) else b
        if a is b:
            raise ValueError(f"connect: site {a.name!r} to itself")
        net = ipaddress.ip_network(f"10.255.{len(self.links) * 4 // 256}.{len(self.links) * 4 % 256}/30")
        a_ip, b_ip = (str(net.network_address + i) for i in (1, 2))
        a.links, b.links = a.links + 1, b.links + 1
        a_dev, b_dev = f"wan{a.links}", f"wan{b.links}"
        sh("ip", "link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns", b.netns, netns=a.netns)
        link = Link(a, b, a_dev, b_dev, parse_rate(rate_ab or rate), parse_rate(rate_ba or rate))
        self.links.append(link)
        for site, dev, ip, other, via, rate_out in (
            (a, a_dev, a_ip, b, b_ip, link.rate_ab),
            (b, b_dev, b_ip, a, a_ip, link.rate_ba),
        ):
            sh("ip", "addr", "add", f"{ip}/30", "dev", dev, netns=site.netns)
            sh("ip", "link", "set", dev, "up", netns=site.netns)
            sh("ip", "route", "add", str(other.subnet), "via", via, netns=site.netns)
            if rate_out is not None:
                sh("tc", "qdisc", "add", "dev", dev, "root", *tbf_args(rate_out), netns=site.netns)
        return link

    def add_name(self, name: str, ip: str) -> None:
        """Resolve `name` to `ip` on every host (a hosts-file entry, e.g. a Service's DNS name)."""
        ipaddress.ip_address(ip)
        self.names[name] = ip
        self._hosts_dirty = True

    def set_names(self, host: Host | str, names: dict[str, str]) -> None:
        """Replace the entries only `host` resolves (name -> ip) and rewrite its hosts file now."""
        host = self.hosts[host] if isinstance(host, str) else host
        for ip in names.values():
            ipaddress.ip_address(ip)
        host.names = dict(names)
        self._write_hosts_file(host, self._common_hosts_lines())

    def _common_hosts_lines(self) -> list[str]:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{h.ip} {h.name}" for h in self.hosts.values()]
        return lines + [f"{ip} {name}" for name, ip in self.names.items()]

    def _write_hosts_file(self, host: Host, common: list[str]) -> None:
        d = NETNS_ETC / host.netns
        d.mkdir(parents=True, exist_ok=True)
        text = "\n".join(common + [f"{ip} {name}" for name, ip in host.names.items()]) + "\n"
        # In place (O_TRUNC, one write): `ip netns exec` bind-mounted this inode into running processes.
        with open(d / "hosts", "w") as f:
            f.write(text)

    def _write_hosts_files(self) -> None:
        if not self._hosts_dirty:
            return
        common = self._common_hosts_lines()
        for h in self.hosts.values():
            self._write_hosts_file(h, common)
        self._hosts_dirty = False

    # ---- running -------------------------------------------------------------------------------

    def popen(self, host: Host | str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside `host` (`ip netns exec`, which execs it: the pid is the program's),
        in a session of its own (teardown signals its process group). kwargs go to Popen."""
        kwargs.setdefault("start_new_session", True)

        def start(netns: str) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", netns, *map(str, argv)], **kwargs)

        return self.start_in(host, start)

    def start_in(self, host: Host | str, start: Callable[[str], P]) -> P:
        """`start(netns)`, which starts a process in `host`'s namespace in a session of its own (or returns None:
        nothing started), after the hosts files are written; the process is stopped at teardown as `popen`'s are."""
        host = self._host(host)
        self._write_hosts_files()
        proc = start(host.netns)
        if proc is not None:
            host.procs.append(proc)
        return proc

    def _host(self, host: Host | str) -> Host:
        return self.hosts[host] if isinstance(host, str) else host

    def run(self, host: Host | str, argv: list[str], timeout: float | None = None, **kwargs):
        """Run `argv` inside `host` to completion; a CompletedProcess (kwargs go to subprocess.run)."""
        host = self._host(host)
        self._write_hosts_files()
        return subprocess.run(["ip", "netns", "exec", host.netns, *map(str, argv)], timeout=timeout, **kwargs)


def _check_name(name: str, what: str) -> None:
    if not name or len(name) > 40 or not all(c.isalnum() or c in ".-" for c in name) or not name[0].isalnum():
        raise ValueError(
            f"{what} name {name!r}: use letters, digits, '.' and '-' (at most 40, a letter or digit first)"
        )
    if name != name.lower():
        raise ValueError(f"{what} name {name!r}: lower case only (it is also a host name)")


def _sysctl(netns: str, key: str, value: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "sysctl", "-qw", f"{key}={value}"], check=True)


def _signal_group(proc: Process, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
