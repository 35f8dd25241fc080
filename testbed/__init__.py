"""Several machines on this one: network namespaces as hosts, bridges as sites, shaped links
(tbf; ifb for a host's download), processes run inside a host, and teardown that leaves nothing.
Shared by the WAN tests, `benchmarks/broadcast.py --wan` and the cluster-in-a-box runner; bed.py
states the layout and its invariants. Root and iproute2 are required; `unavailable_reason()` says
why not, for a test to skip with."""

from testbed.bed import Host, Link, Site, Testbed
from testbed.commands import (
    CommandError,
    TestbedUnavailable,
    cpu_seconds,
    machine_busy,
    parse_rate,
    stale_namespaces,
    stop_measured,
    sweep,
    unavailable_reason,
)

__all__ = [
    "CommandError",
    "Host",
    "Link",
    "Site",
    "Testbed",
    "TestbedUnavailable",
    "cpu_seconds",
    "machine_busy",
    "parse_rate",
    "stale_namespaces",
    "stop_measured",
    "sweep",
    "unavailable_reason",
]
