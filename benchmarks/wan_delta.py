"""`benchmarks/broadcast.py --wan --delta`: delta versions of real GRPO steps over the simulated WAN, each
next to the same version sent whole, on the same testbed hosts and links (broadcast_wan.py's topology).

    python benchmarks/broadcast.py --wan --delta [--topology default] [--delta-series ...] [--delta-steps 3]
                                                 [--delta-lr 1e-4 1e-6] [--series-dir DIR] [--json PATH]

Series (SERIES): K + 1 consecutive policy versions v0..vK made by K real GRPO steps (benchmarks/delta.py
make_series): the builtin model at fp32 and at bf16, and the large builtin-style model (>= 256 MiB) at bf16
and at fp32, each at every --delta-lr (default 1e-4, trainer.learningRate's default; GRPO on LLMs uses
1e-6 and below): a series is named <series>@<lr>. Training is not measured;
with --series-dir the versions are kept there and reused by the next run (the large ones take minutes).
Per series, two phases, each a fresh set of processes on the tree (origin -> relays, cut-through -> clients,
wan_runs.start_rlfleet):
  whole  the versions published with deltas off; clients fetch v1..vK whole
  delta  the versions published through the trainer's PolicyPublisher, every one after v0 as a delta
         against the one before (fullEvery, maxRatio and maxChainRatio out of the way, so every row is
         the codec's delta); clients fetch v0 before the clock, then v1..vK in turn with
         assemble.fetch_policy: the patch downloaded and every resulting file rebuilt from the version
         held and checked against the signed manifest before it is installed
A version's clock starts when its manifest is written to the store (then it is announced) and stops when
the last client installed it verified (clients report the system-wide monotonic clock).
Bound: wan_topology.bound_seconds (the full-checkpoint rows' function) of the bytes that version sends:
each relay pulls every file its manifest lists, the busiest relay serves ceil(clients / relays) clients,
and a client downloads the files of its route (the patch files, or the whole files); manifests (a few
KiB) are left out.
Reported per version and phase: MiB per client and ÷ the whole checkpoint, seconds, bound, x bound, the
last client's seconds after its last byte (the rebuild's tail), CPU seconds of the clients and relays
during that version, the machine's busy share and load; then per series, side by side, the ratios
delta ÷ whole: `delta_bytes_ratio` (the mean over v1..vK of a delta client's bytes ÷ the whole
checkpoint's) and `delta_time_ratio` (the mean over v1..vK of the seconds to the last verified client,
delta ÷ whole), both per series in --json.
This is a script, not a test (docs/code.md, "Benchmarks are scripts, not tests").
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from broadcast_common import expect_line, finish_reports
from delta import RUN, make_series, publish_series
from wan_runs import PORT, Bed, relay_bytes_out, start_rlfleet
from wan_topology import CPU_LIMIT, Plan, Topology, bound_seconds, load

from testbed import cpu_seconds, machine_busy

SERIES = {
    "builtin-float32": ("builtin", "float32"),
    "builtin-bfloat16": ("builtin", "bfloat16"),
    "large-bfloat16": ("large", "bfloat16"),
    "large-float32": ("large", "float32"),
}
PHASES = ("whole", "delta")


def series_versions(name: str, lr: float, args, scratch: Path) -> list[Path]:
    """v0..vK of series `name` at learning rate `lr` (made now, or reused from --series-dir)."""
    kind, dtype = SERIES[name]
    root = args.series_dir or scratch
    where = root / f"{name}-lr{lr:g}-steps{args.delta_steps}"
    paths = [where / f"v{v}" for v in range(args.delta_steps + 1)]
    if (where / "made").exists():
        return paths
    shutil.rmtree(where, ignore_errors=True)
    print(f"{name}: {args.delta_steps} GRPO steps at lr {lr:g} (load {load()})", file=sys.stderr)
    started = time.monotonic()
    made = make_series(kind, dtype, lr, args.delta_steps, where)
    assert made == paths, made
    shutil.rmtree(where / "init", ignore_errors=True)  # the large model's starting point (v0 is its copy)
    (where / "made").write_text(f"{time.monotonic() - started:.0f} s\n")
    return paths


def run_series(bed: Bed, label: str, name: str, lr: float, paths: list[Path], keys: tuple) -> dict:
    """Both phases of one series on the testbed; its JSON record."""
    whole_bytes = sum(p.stat().st_size for p in paths[0].rglob("*") if p.is_file())
    phases = {phase: run_phase(bed, label, phase, paths, keys) for phase in PHASES}
    versions = []
    for v in range(1, len(paths)):
        versions.append({"version": v, **{phase: phases[phase].get(v) for phase in PHASES}})
    both = [r for r in versions if r["whole"] and r["delta"]]
    return {
        "series": label,
        "model": SERIES[name][0],
        "dtype": SERIES[name][1],
        "learning_rate": lr,
        "whole_bytes": whole_bytes,
        "delta_bytes_ratio": mean([r["delta"]["client_bytes"] / r["delta"]["whole_bytes"] for r in both]),
        "delta_time_ratio": mean([r["delta"]["seconds"] / r["whole"]["seconds"] for r in both]),
        "versions": versions,
    }


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_phase(bed: Bed, name: str, phase: str, paths: list[Path], keys: tuple) -> dict[int, dict]:
    """One phase (module docstring): {version: its record} for v1..vK (those every client finished)."""
    from rlfleet.config import DeltaSpec
    from rlfleet.versions.chain import delta_files, result_files, size_of, transfer_bytes, whole_files
    from rlfleet.versions.checkpoint import manifest_key
    from rlfleet.versions.manifest import parse_manifest
    from rlfleet.versions.store import open_store
    from rlfleet.wire.streams import RunKeys, encode_json

    signer, public = keys
    topo, args = bed.topo, bed.args
    home = bed.work / f"delta-{name}-{phase}"
    home.mkdir(parents=True)
    spec = DeltaSpec(enabled=False) if phase == "whole" else DeltaSpec(full_every=10**6, max_ratio=1.0)
    spec = spec.model_copy(update={"max_chain_ratio": 100.0})
    publish_series(paths, home / "store", spec, signer, args.shard_mib << 20)
    store = open_store(f"file://{home / 'store'}")
    held_back = []  # (key, manifest bytes): each version becomes visible when its clock starts
    for v in range(len(paths)):
        key = manifest_key(RUN, v)
        held_back.append((key, store.get_bytes(key)))
        store.delete_prefix(key)
    config = home / "rlrun.yaml"
    config.write_text(
        f"apiVersion: rlfleet.io/v1alpha1\nkind: RLRun\nmetadata: {{name: {RUN}}}\nspec:\n"
        f"  model: {{path: 'builtin://tiny-arithmetic'}}\n  task: {{type: arithmetic}}\n"
        f"  store: {{uri: 'file://{home / 'store'}'}}\n"
    )
    bed.logs = bed.work / "logs" / f"{name}-{phase}"
    urls, env, announce = start_rlfleet(bed, config, public, True, home)
    first = 1 if phase == "whole" else 0  # the delta phase's clients hold v0 before the first clock
    wanted = list(range(first, len(paths)))
    clients = [
        bed.role(h, "--delta-client", json.dumps(urls), home / h.name, public, json.dumps(wanted), name=h.name, env=env)
        for h in bed.clients
    ]
    for h, c in zip(bed.clients, clients):
        expect_line(c, h.name)
    rows, relay_out = {}, relay_bytes_out(bed, PORT)
    for v in wanted:
        manifest = parse_manifest(held_back[v][1], RUN, v)
        route = delta_files(manifest) if phase == "delta" and v > 0 else whole_files(manifest)
        client_bytes, pull_bytes = size_of(route), transfer_bytes(manifest)
        plan = Plan(topo.relays * pull_bytes, math.ceil(topo.clients / topo.relays) * client_bytes, client_bytes)
        bound = bound_seconds(plan, topo)
        cpu0 = {n: cpu_seconds(p.pid) for n, p in bed.procs.items()}
        busy0, started = machine_busy(), time.monotonic()
        store.put_bytes(*held_back[v])  # the version becomes visible...
        announce.xadd(RunKeys(RUN).policy, encode_json({"version": v, "time": time.time()}))  # ...and is announced
        reports = finish_reports(clients, args.timeout or max(300.0, 20 * bound))
        wall = time.monotonic() - started
        cpu = {n: cpu_seconds(p.pid) - cpu0[n] for n, p in bed.procs.items()}
        busy1 = machine_busy()
        if len(reports) < len(clients):
            print(f"{name} {phase} v{v}: {len(reports)}/{len(clients)} clients within the timeout", file=sys.stderr)
            break
        if v == 0:
            continue
        out = relay_bytes_out(bed, PORT)
        last = max(reports, key=lambda r: r["done"])
        rows[v] = {
            "seconds": last["done"] - started,
            "bound_seconds": bound,
            "plan_bytes": plan.__dict__,
            "client_bytes": client_bytes,
            "whole_bytes": size_of(result_files(manifest)),
            "received_bytes": [r["bytes"] for r in reports],
            "relay_bytes_out": [b - a for a, b in zip(relay_out, out)],
            "first_byte_seconds": [r["first"] - started for r in reports if r["first"]],
            "last_byte_seconds": [r["last"] - started for r in reports if r["last"]],
            "after_last_byte_seconds": [r["done"] - r["last"] for r in reports if r["last"]],
            "kinds": sorted({"/".join(r["report"]["kinds"]) for r in reports}),
            "rejected": [x for r in reports for x in r["report"]["rejected"]],
            "cpu_seconds": cpu,
            "wall": wall,
            "machine_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]),
            "loadavg": os.getloadavg(),
        }
        rows[v]["cpu_limited"] = rows[v]["machine_busy"] >= CPU_LIMIT or max(cpu.values()) >= CPU_LIMIT * wall
        relay_out = out
        print(f"{name} {phase} v{v}: {describe(rows[v])}", file=sys.stderr)
    announce.close()
    bed.stop()
    shutil.rmtree(home)
    return rows


def describe(r: dict) -> str:
    return (
        f"{r['seconds']:.2f} s, bound {r['bound_seconds']:.2f} s, {r['client_bytes'] / 2**20:.1f} MiB a client "
        f"(load {load()})"
    )


def run_all(bed: Bed, series: dict[str, tuple[str, float, list[Path]]]) -> dict:
    """Every series ({label: (SERIES name, learning rate, v0..vK)}) on this testbed: the run record's `delta`
    part."""
    from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer

    private, public = generate_keypair(bed.work / "delta-keys")
    keys = (make_signer(load_private_key(private)), public)
    results = [run_series(bed, label, *what, keys) for label, what in series.items()]
    return {
        "delta_bytes_ratio": {r["series"]: r["delta_bytes_ratio"] for r in results},
        "delta_time_ratio": {r["series"]: r["delta_time_ratio"] for r in results},
        "series": results,
    }


def report(topo: Topology, delta: dict) -> None:
    print(
        f"\nDelta versions, WAN {topo.name}: origin up {topo.origin_up / 10**6:g} Mbit/s; {topo.relays} relays up "
        f"{topo.relay_up / 10**6:g} Mbit/s; {topo.clients} clients down {topo.client_down / 10**6:g} Mbit/s "
        f"({os.cpu_count()} cores, load {load()})"
    )
    print(
        f"{'series':<24} {'v':>2} {'sent':<5} {'MiB/client':>10} {'/ whole':>7} {'seconds':>8} {'bound s':>8} "
        f"{'x bound':>7} {'tail s':>6} {'cpu clients max/sum':>19} {'relays':>6} {'busy':>5} {'load':>5}  limited by"
    )
    for s in delta["series"]:
        for row in s["versions"]:
            for phase in PHASES:
                r = row[phase]
                if r is None:
                    print(f"{s['series']:<24} {row['version']:>2} {phase:<5} not every client finished")
                    continue
                clients = [c for n, c in r["cpu_seconds"].items() if n.startswith("client")]
                relays = sum(c for n, c in r["cpu_seconds"].items() if n.startswith("relay"))
                print(
                    f"{s['series']:<24} {row['version']:>2} {phase:<5} {r['client_bytes'] / 2**20:>10.2f} "
                    f"{r['client_bytes'] / r['whole_bytes']:>7.3f} {r['seconds']:>8.2f} {r['bound_seconds']:>8.2f} "
                    f"{r['seconds'] / r['bound_seconds']:>7.2f} {max(r['after_last_byte_seconds']):>6.2f} "
                    f"{max(clients):>9.1f}/{sum(clients):<9.1f} {relays:>6.1f} {r['machine_busy']:>5.0%} "
                    f"{r['loadavg'][0]:>5.1f}  {'CPU' if r['cpu_limited'] else 'links'}"
                )
    print(
        "  tail s: the last client's seconds between its last byte and the version installed verified (the "
        f"rebuild's part not overlapped with the download); busy: the machine's CPU use (everyone's); CPU-limited "
        f"when busy >= {CPU_LIMIT:.0%} or one process used >= {CPU_LIMIT:.0%} of a core"
    )
    summary(delta["series"])


def summary(series: list[dict]) -> None:
    """Per series, means over the versions both phases finished: delta ÷ whole in bytes and in time."""
    print(
        f"\n{'series':<24} {'whole MiB':>9} {'bytes d/w':>9} {'whole s':>8} {'delta s':>8} {'time d/w':>8} "
        f"{'x bound whole':>13} {'x bound delta':>13} {'cpu s/client w/d':>16}"
    )
    for s in series:
        both = [r for r in s["versions"] if r["whole"] and r["delta"]]
        if not both:
            print(f"{s['series']:<24} no version finished in both phases")
            continue
        seconds = {p: mean([r[p]["seconds"] for r in both]) for p in PHASES}
        x = {p: mean([r[p]["seconds"] / r[p]["bound_seconds"] for r in both]) for p in PHASES}
        cpu = {p: mean([client_cpu(r[p]) for r in both]) for p in PHASES}
        print(
            f"{s['series']:<24} {s['whole_bytes'] / 2**20:>9.1f} {s['delta_bytes_ratio']:>9.3f} "
            f"{seconds['whole']:>8.2f} {seconds['delta']:>8.2f} {s['delta_time_ratio']:>8.3f} "
            f"{x['whole']:>13.2f} {x['delta']:>13.2f} {cpu['whole']:>8.1f}/{cpu['delta']:<7.1f}"
        )
    print(
        "  means over v1..vK; bytes d/w: a client's bytes, delta ÷ whole (delta_bytes_ratio); time d/w: seconds to "
        "the last verified client, delta ÷ whole (delta_time_ratio); x bound: seconds ÷ the bound of the bytes "
        "sent; cpu s/client: a client's CPU seconds for the version (whole: receive and sha256; delta: receive, "
        "rebuild from the version held and sha256)"
    )


def client_cpu(row: dict) -> float:
    """Mean CPU seconds of the clients during one version."""
    return mean([c for n, c in row["cpu_seconds"].items() if n.startswith("client")])
