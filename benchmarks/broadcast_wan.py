"""Broadcast over a simulated WAN: `benchmarks/broadcast.py --wan` (this module: topologies, the bound,
the systems, the report; wan_runs.py: the processes of each system on the testbed hosts).

    python benchmarks/broadcast.py --wan [--topology default large] [--systems tree direct reference]
                                         [--no-cut-through] [--json PATH] [--size-mib N ...]

Every node is a host of an testbed (a network namespace with its own address on one bridge)
whose access link is shaped as the topology says: the origin's and the relays' uplinks (tbf on
egress), the clients' downlinks (tbf on an ifb fed by their ingress). One testbed per topology;
the systems take turns on the same hosts and links, each a fresh set of OS processes.
Topologies (TOPOLOGIES; --size-mib/--clients/--relays/--*-up/--*-down override one):
  default  512 MiB, origin up 400 Mbit/s, 2 relays up 800 Mbit/s, 8 clients down 200 Mbit/s
  large    512 MiB, origin up 400 Mbit/s, 4 relays up 800 Mbit/s, 32 clients down 50 Mbit/s
  small    64 MiB, 1 relay, 4 clients (the slow test's run)
Systems (SYSTEMS):
  tree       `rlfleet origin` -> `rlfleet relay` per relay host (cut-through) -> clients, each given
             every relay (rlfleet.services.shardcast.sources: weighted round robin per shard)
  tree-sf    the same, but each client starts only once every relay holds the whole version
             (store-and-forward): what cut-through saves (`--no-cut-through` adds it)
  direct     every client pulls from the origin
  reference  the `shardcast` 0.3.2 package (PyPI; `pip install shardcast==0.3.2`) on the same hosts:
             its OriginServer, a MiddleNode per relay host, a ClientNode per client. Its knobs are
             environment variables and poll intervals; it runs with its best ones found here
             (wan_runs.REFERENCE_ENV, --reference-poll 1, --reference-concurrency 1; its
             defaults: 30 s polls, 2 s then 15 s retry pauses, 10 downloads at once)
A new system is one SYSTEMS entry (its plan, for the bound, and its runner); a new topology one
TOPOLOGIES entry.
The redis-server the rlfleet systems announce on runs on the origin host; components reach it
over the testbed's links (a few hundred bytes per version).
Bound (`bound_seconds`, one function for every system): the bytes each bottleneck must carry,
over its rate, whichever is slowest: max(origin bytes / origin up, busiest relay bytes / relay
up, checkpoint / client down). Tree: the origin sends one copy per relay and a relay
ceil(clients / relays); direct: the origin sends one per client. Rates are link rates, so the
Ethernet/IP/TCP headers (1514 wire bytes per 1448 payload bytes, 4.4 %) are inside the ratio.
Timing: all servers and clients are up and idle first; the clock starts when the version becomes
visible (rlfleet: manifest written to the store, then announced; reference: `broadcast()`
returned) and stops when the last client holds the complete, verified version (clients report
the system-wide monotonic clock).
CPU: every process's CPU seconds during the broadcast (user + system, of the process and the
children it reaped), and the machine's busy share (/proc/stat, everyone's load). A run counts as
CPU-limited when the machine was >= 90 % busy or one process used >= 90 % of a core.
This is a script, not a test (docs/code.md, "Benchmarks are scripts, not tests").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from wan_runs import Bed, prepare, run_reference, run_rlfleet
from wan_topology import (
    CPU_LIMIT,
    MBIT,
    TOPOLOGIES,
    Outcome,
    System,
    Topology,
    bound_seconds,
    direct_plan,
    load,
    machine,
    tree_plan,
)

from testbed import Testbed

SYSTEMS = {
    s.name: s
    for s in (
        System("tree", "rlfleet tree", tree_plan, run_rlfleet),
        System("tree-sf", "rlfleet tree, store-and-forward", tree_plan, run_rlfleet, cut_through=False),
        System("direct", "rlfleet direct", direct_plan, run_rlfleet, via_relays=False),
        System("reference", "reference shardcast 0.3.2", tree_plan, run_reference),
    )
}


# ---- one run ----------------------------------------------------------------------------------


def run_topology(topo: Topology, systems: list[System], args, work: Path, series: dict | None = None) -> dict:
    """Every system, then every delta series (wan_delta.py), on one testbed of `topo`; the JSON record of the run."""
    results, delta = {}, None
    with Testbed() as tb:
        bed = Bed(tb, topo, work, args)
        if systems:
            prepare(bed)
        for system in systems:
            timeout = args.timeout or max(600.0, 10 * bound_seconds(system.plan(topo), topo))
            bed.args = argparse.Namespace(**{**vars(args), "timeout_s": timeout})
            bed.logs = work / "logs" / system.name
            outcome = system.run(bed, system)
            results[system.name] = record(system, topo, outcome)
            print(f"{system.label}: {describe(results[system.name])}", file=sys.stderr)
            for d in work.iterdir():  # the receivers' copies; the checkpoint and store stay
                if d.is_dir() and d.name.startswith(("client", "relay", "ref-")):
                    shutil.rmtree(d)
        if series:
            import wan_delta

            bed.args = argparse.Namespace(**{**vars(args), "timeout_s": args.timeout})
            delta = wan_delta.run_all(bed, series)
        tag = tb.tag
    run = {"topology": asdict(topo), "testbed": tag, "systems": results, "machine": machine()}
    return run if delta is None else {**run, "delta": delta}


def record(system: System, topo: Topology, o: Outcome) -> dict:
    hot = max(o.cpu.items(), key=lambda kv: kv[1], default=("none", 0.0))
    ours = sum(o.cpu.values()) / (o.wall * (os.cpu_count() or 1))
    limited = o.busy >= CPU_LIMIT or hot[1] >= CPU_LIMIT * o.wall
    return {
        "label": system.label,
        "seconds": o.seconds,
        "bound_seconds": bound_seconds(system.plan(topo), topo),
        "clients_ok": o.clients_ok,
        "clients": topo.clients,
        "plan_bytes": asdict(system.plan(topo)),
        "cpu_seconds": o.cpu,
        "busiest_process": {"name": hot[0], "cpu_seconds": hot[1]},
        "machine_busy": o.busy,
        "loadavg": os.getloadavg(),  # at the end of this system's run
        "our_cpu_share": ours,
        "cpu_limited": limited,
        "relay_pull_seconds": o.relay_pull_seconds,
        "relay_bytes_out": o.relay_bytes_out,
        "first_byte_seconds": [p[0][0] for p in o.client_progress],
        "client_progress": o.client_progress,
    }


def describe(r: dict) -> str:
    t = "not done" if r["seconds"] is None else f"{r['seconds']:.1f} s"
    return f"{t}, {r['clients_ok']}/{r['clients']} clients, bound {r['bound_seconds']:.1f} s (load {load()})"


def report(run: dict) -> None:
    topo, systems = Topology(**run["topology"]), run["systems"]
    if "delta" in run:
        import wan_delta

        wan_delta.report(topo, run["delta"])
    if not systems:
        return
    print(
        f"\nWAN {topo.name}: {topo.size_mib} MiB; origin up {topo.origin_up / MBIT:g} Mbit/s; {topo.relays} relays up "
        f"{topo.relay_up / MBIT:g} Mbit/s; {topo.clients} clients down {topo.client_down / MBIT:g} Mbit/s "
        f"({os.cpu_count()} cores, load {load()})"
    )
    print(
        f"{'system':<34} {'clients':>7} {'seconds':>8} {'bound s':>8} {'x bound':>8} {'busy':>5} {'ours':>5} "
        f"{'busiest process (cpu s)':>24}  limited by"
    )
    for r in systems.values():
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        ratio = "-" if r["seconds"] is None else f"{r['seconds'] / r['bound_seconds']:.2f}"
        hot = f"{r['busiest_process']['name']} ({r['busiest_process']['cpu_seconds']:.1f})"
        print(
            f"{r['label']:<34} {r['clients_ok']:>3}/{r['clients']:<3} {secs:>8} {r['bound_seconds']:>8.1f} "
            f"{ratio:>8} {r['machine_busy']:>5.0%} {r['our_cpu_share']:>5.0%} {hot:>24}  "
            f"{'CPU' if r['cpu_limited'] else 'links'}"
        )
    print(
        "  busy: the machine's CPU use during the run (everyone's); ours: this run's processes' share of all "
        f"cores; CPU-limited when busy >= {CPU_LIMIT:.0%} or one process used >= {CPU_LIMIT:.0%} of a core"
    )
    for r in systems.values():
        cpu = r["cpu_seconds"]
        clients = [v for k, v in cpu.items() if k.startswith("client")]
        others = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if not k.startswith("client"))
        spread = f"clients {min(clients):.1f}-{max(clients):.1f} (sum {sum(clients):.1f})" if clients else ""
        print(f"  cpu s, {r['label']}: {others}; {spread}")
        if r["relay_pull_seconds"]:
            pulls = ", ".join(f"{s:.1f}" for s in r["relay_pull_seconds"])
            sent = ", ".join(f"{b / topo.size:.2f}" for b in r["relay_bytes_out"])
            print(f"  {r['label']}: relays held the whole version after {pulls} s; sent {sent} checkpoints")
        if r["first_byte_seconds"]:
            first = r["first_byte_seconds"]
            print(f"  {r['label']}: clients' first byte after {min(first):.2f}-{max(first):.2f} s")
    tree = systems.get("tree", {}).get("seconds")
    for other in ("tree-sf", "direct", "reference"):
        theirs = systems.get(other, {}).get("seconds")
        if tree and theirs:
            print(f"  tree is {theirs / tree:.2f}x faster than {systems[other]['label']}")


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(prog="broadcast.py --wan", description=__doc__.split("\n")[0])
    ap.add_argument("--wan", action="store_true")
    ap.add_argument("--topology", nargs="+", default=["default"], choices=sorted(TOPOLOGIES))
    ap.add_argument(
        "--systems",
        nargs="*",
        default=None,
        choices=list(SYSTEMS),
        help="default: tree direct reference (none with --delta)",
    )
    ap.add_argument(
        "--delta", action="store_true", help="delta versions of real GRPO steps, next to whole (wan_delta.py)"
    )
    ap.add_argument(
        "--delta-series", nargs="+", default=None, help="series for --delta (default: all of wan_delta.SERIES)"
    )
    ap.add_argument("--delta-steps", type=int, default=3, help="GRPO steps per series (versions v0..vK)")
    ap.add_argument(
        "--delta-lr", nargs="+", type=float, default=[1e-4], help="learning rates of the series' steps (a series each)"
    )
    ap.add_argument("--series-dir", type=Path, default=None, help="keep the series' versions here and reuse them")
    ap.add_argument("--no-cut-through", action="store_true", help="also run tree-sf (relays store and forward)")
    for name in ("size-mib", "clients", "relays"):
        ap.add_argument(f"--{name}", type=int, default=None, help="overrides the topology's")
    for name in ("origin-up", "relay-up", "client-down", "relay-down", "client-up"):
        ap.add_argument(f"--{name}", type=float, default=None, help="Mbit/s; overrides the topology's")
    ap.add_argument("--shard-mib", type=int, default=16, help="rlfleet shard size (the reference keeps its own)")
    ap.add_argument("--reference-poll", type=int, default=1, help="poll interval (s) of the reference's nodes")
    ap.add_argument("--reference-concurrency", type=int, default=1, help="the reference's parallel downloads")
    ap.add_argument("--reference-shard-mb", type=int, default=50, help="the reference's shard size (MB)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per system (default max(600, 10x bound))")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir, deleted)")
    args = ap.parse_args(argv)
    if args.systems is None:
        args.systems = [] if args.delta else ["tree", "direct", "reference"]
    if args.delta:
        from wan_delta import SERIES

        args.delta_series = args.delta_series or list(SERIES)
        unknown = [s for s in args.delta_series if s not in SERIES]
        for bad, message in (
            (unknown, f"--delta-series: {unknown} unknown; choose from {', '.join(SERIES)}"),
            (args.delta_steps < 1, "--delta-steps: at least 1 (a version to send after v0)"),
            (min(args.delta_lr) <= 0, "--delta-lr: learning rates are > 0"),
        ):
            if bad:
                raise SystemExit(message)
    elif not args.systems:
        raise SystemExit("--systems: name at least one system, or add --delta")
    if args.no_cut_through and "tree-sf" not in args.systems:
        args.systems.insert(args.systems.index("tree") + 1 if "tree" in args.systems else 0, "tree-sf")
    return args


def topology(name: str, args) -> Topology:
    topo, changes = TOPOLOGIES[name], {}
    for field_name in ("size_mib", "clients", "relays"):
        if getattr(args, field_name) is not None:
            if getattr(args, field_name) < 1:
                raise SystemExit(f"--{field_name.replace('_', '-')} must be >= 1")
            changes[field_name] = getattr(args, field_name)
    for field_name in ("origin_up", "relay_up", "client_down", "relay_down", "client_up"):
        if getattr(args, field_name) is not None:
            changes[field_name] = int(getattr(args, field_name) * MBIT)
    return replace(topo, **changes)


def main(argv: list[str]) -> int:
    from testbed import unavailable_reason

    args = parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--wan: {reason}")
    if "reference" in args.systems:
        try:
            import shardcast  # noqa: F401  (only: is it installed?)
        except ImportError:
            raise SystemExit("--wan reference: `pip install shardcast==0.3.2` (or drop it from --systems)") from None
        if shutil.which("wget") is None:
            raise SystemExit("--wan reference: shardcast downloads with `wget`, which is not on PATH")
    series, scratch = {}, Path(tempfile.mkdtemp(prefix="rlfleet-wan-series-"))
    runs = []
    try:
        if args.delta:  # made before any testbed: training is not part of the measurement
            import wan_delta

            for lr in args.delta_lr:
                for name in args.delta_series:
                    series[f"{name}@{lr:g}"] = (name, lr, wan_delta.series_versions(name, lr, args, scratch))
        for name in args.topology:
            work = Path(args.workdir or tempfile.mkdtemp(prefix="rlfleet-wan-")) / name
            work.mkdir(parents=True, exist_ok=True)
            try:
                runs.append(run_topology(topology(name, args), [SYSTEMS[s] for s in args.systems], args, work, series))
            finally:
                if not args.workdir:
                    shutil.rmtree(work.parent, ignore_errors=True)
            report(runs[-1])
            if args.json:  # after every topology: a later failure keeps what was measured
                args.json.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [f"{r['topology']['name']}/{s}" for r in runs for s, v in r["systems"].items() if v["seconds"] is None]
    failed += [
        f"{r['topology']['name']}/{s['series']}/v{row['version']}/{phase}"
        for r in runs
        for s in r.get("delta", {}).get("series", [])
        for row in s["versions"]
        for phase in ("whole", "delta")
        if row[phase] is None
    ]
    if failed:
        print(f"not every client finished: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
