"""Free ports for the servers a run starts: drawn below the kernel's ephemeral range, never one a socket holds."""

from __future__ import annotations

import socket
from contextlib import ExitStack

from rlfleet.wire.ports import EPHEMERAL_RANGE, free_port, server_port_range


def test_ports_are_drawn_below_the_ephemeral_range_and_can_be_bound():
    low, _high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    for _ in range(50):
        port = free_port()
        assert port in server_port_range() and 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free as said


def test_a_port_a_socket_holds_is_never_handed_out():
    ports = range(24100, 24110)
    with ExitStack() as held:
        for port in ports:
            if port == 24105:
                continue
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # already held by someone else: held all the same
                pass
        assert free_port(ports=ports) == 24105
        held_ports = set(ports) - {24105}
        assert not {free_port(ports=ports) for _ in range(20)} & held_ports, "never a held one, 24105 not twice"


def test_one_process_never_hands_out_a_port_twice():
    """A launcher draws every port of a run before any component binds one: no two of them may be the same."""
    ports = range(24200, 24260)
    drawn = [free_port(ports=ports) for _ in range(40)]
    assert len(set(drawn)) == len(drawn)
