"""The WAN broadcast's model (`broadcast.py --wan`, broadcast_wan.py): its topologies (hosts and their
access links), what each system's nodes must send (`Plan`), the bound that follows (`bound_seconds`), a
system (`System`: its plan and its runner) and what one run measured (`Outcome`).

Bound: the bytes each bottleneck must carry, over its rate, whichever is slowest: max(origin bytes /
origin up, busiest relay bytes / relay up, checkpoint / client down). Tree: the origin sends one copy
per relay and a relay ceil(clients / relays); direct: the origin sends one per client. Rates are link
rates, so the Ethernet/IP/TCP headers (1514 wire bytes per 1448 payload bytes, 4.4 %) are inside the
ratio. It imports no other benchmark: the runners (wan_runs.py) and the driver (broadcast_wan.py) sit
above it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

MBIT = 10**6
CPU_LIMIT = 0.9


@dataclass(frozen=True)
class Topology:
    """Hosts and their access links (bit/s; None: unshaped)."""

    name: str
    size_mib: int
    clients: int
    relays: int
    origin_up: int  # bit/s
    relay_up: int
    client_down: int
    relay_down: int | None = None  # None: unshaped
    client_up: int | None = None

    @property
    def size(self) -> int:
        return self.size_mib << 20


TOPOLOGIES = {
    t.name: t
    for t in (
        Topology("default", 512, 8, 2, 400 * MBIT, 800 * MBIT, 200 * MBIT),
        Topology("large", 512, 32, 4, 400 * MBIT, 800 * MBIT, 50 * MBIT),
        Topology("small", 64, 4, 1, 400 * MBIT, 800 * MBIT, 200 * MBIT),
    )
}


@dataclass(frozen=True)
class Plan:
    """Bytes each bottleneck must carry for one broadcast."""

    origin_sends: int
    relay_sends: int  # the busiest relay; 0 when no relay is used
    client_receives: int


def bound_seconds(plan: Plan, topo: Topology) -> float:
    """Seconds the slowest link needs for its bytes (the module doc's bound)."""
    terms = [plan.origin_sends * 8 / topo.origin_up, plan.client_receives * 8 / topo.client_down]
    if plan.relay_sends:
        terms.append(plan.relay_sends * 8 / topo.relay_up)
    return max(terms)


def tree_plan(topo: Topology) -> Plan:
    return Plan(topo.relays * topo.size, math.ceil(topo.clients / topo.relays) * topo.size, topo.size)


def direct_plan(topo: Topology) -> Plan:
    return Plan(topo.clients * topo.size, 0, topo.size)


@dataclass(frozen=True)
class System:
    """One column: what its nodes must send (`plan`, for the bound) and how it runs (`run`)."""

    name: str
    label: str
    plan: Callable[[Topology], Plan]
    run: Callable[..., Outcome]  # (wan_runs.Bed, System) -> Outcome
    via_relays: bool = True
    cut_through: bool = True


@dataclass
class Outcome:
    seconds: float | None  # publish -> last verified client; None when a client did not finish
    clients_ok: int
    cpu: dict[str, float]  # process -> CPU seconds during the broadcast
    wall: float  # seconds the clock ran (to the last client, or to the timeout)
    busy: float  # the machine's busy share over `wall`
    relay_pull_seconds: list[float] = field(default_factory=list)  # relay log: version pulled in
    relay_bytes_out: list[int] = field(default_factory=list)  # per relay, from its /metrics
    client_progress: list[list[tuple[float, int]]] = field(default_factory=list)  # per client: (s, bytes)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> dict:
    return {"cores": os.cpu_count(), "loadavg": os.getloadavg()}
