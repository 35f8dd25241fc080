"""Free TCP ports for the servers a run or a test starts on this machine (`rlfleet run`'s components, the trainer's
rendezvous, the tests' servers).

A port is chosen here and bound moments later by another process, so it must stay free in between. A port the
kernel hands out for port 0 comes from its ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999
by default), the range it also takes the local port of every outgoing connection from: a Redis client or an HTTP
request opened in between could take it ("Address already in use"), which under parallel tests happened. So ports
are drawn at random from the range just below the ephemeral one, where no outgoing connection lands, and each is
checked free by binding it before it is handed out, and never handed out twice by one process (a launcher draws
every port of a run before any component binds one: two draws of the same port gave the relay the origin's
metrics port). Two processes drawing at once collide only if they draw the same port among thousands before
either binds it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
SERVER_PORTS = 12000  # how many ports below the ephemeral range are drawn from
_draw = random.SystemRandom()  # no state shared with a forked child
_handed_out: set[int] = set()  # the ports this process drew (a few per run: never pruned)


def server_port_range() -> range:
    """The ports drawn from: the SERVER_PORTS ports below the kernel's ephemeral range (above 1023)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA dynamic range starts at 49152
        low = 49152
    return range(max(1024, low - SERVER_PORTS), low)


def free_port(host: str = "127.0.0.1", ports: range | None = None) -> int:
    """A TCP port on `host` that no socket holds now, drawn from `ports` (default: server_port_range(), outside the
    ephemeral range; the module docstring)."""
    ports = ports or server_port_range()
    for _ in range(200):
        port = _draw.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the whole range taken: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]
