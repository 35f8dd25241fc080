"""Broadcast over a simulated WAN: `benchmarks/broadcast.py --wan` (this module is its driver).

    python benchmarks/broadcast.py --wan [--topology default large] [--systems tree direct reference]
                                         [--no-cut-through] [--json PATH] [--size-mib N ...]

Every node is a host of an rlfleet.testbed (a network namespace with its own address on one bridge)
whose access link is shaped as the topology says: the origin's and the relays' uplinks (tbf on
egress), the clients' downlinks (tbf on an ifb fed by their ingress). One testbed per topology;
the systems take turns on the same hosts and links, each a fresh set of OS processes.
Topologies (TOPOLOGIES; --size-mib/--clients/--relays/--*-up/--*-down override one):
  default  512 MiB, origin up 400 Mbit/s, 2 relays up 800 Mbit/s, 8 clients down 200 Mbit/s
  large    512 MiB, origin up 400 Mbit/s, 4 relays up 800 Mbit/s, 32 clients down 50 Mbit/s
  small    64 MiB, 1 relay, 4 clients (the slow test's run)
Systems (SYSTEMS):
  tree       `rlfleet origin` -> `rlfleet relay` per relay host (cut-through) -> clients, each given
             every relay (rlfleet.services.shardcast.client: weighted choice per shard)
  tree-sf    the same, but each client starts only once every relay holds the whole version
             (store-and-forward): what cut-through saves (`--no-cut-through` adds it)
  direct     every client pulls from the origin
  reference  the `shardcast` 0.3.2 package (PyPI; `pip install shardcast==0.3.2`) on the same hosts:
             its OriginServer, a MiddleNode per relay host, a ClientNode per client. Its knobs are
             environment variables and poll intervals; it runs with REFERENCE_ENV and polls every
             --reference-poll s (its defaults: 30 s polls, 2 s then 15 s retry pauses)
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
This is a script, not a test (STYLE.md 10).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from broadcast import FILE, REFERENCE_DUMMY, ROOT, RUN, expect_line, finish_reports

from rlfleet.testbed import Testbed, cpu_seconds, machine_busy, stop_measured

PORT, REDIS_PORT, REFERENCE_PORT = 8100, 6379, 8200
MBIT = 10**6
CPU_LIMIT = 0.9
# The reference's settings: pause 1 s between retries of a shard that is not there yet (its
# defaults are 2 s, then 15 s after 3 tries); --reference-concurrency and --reference-shard-mb set
# its parallel downloads per node and its shard size (defaults: the best found here, README).
REFERENCE_ENV = {"SHARDCAST_FAST_RETRY_INTERVAL": "1", "SHARDCAST_SLOW_RETRY_INTERVAL": "1"}


@dataclass(frozen=True)
class Topology:
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
    terms = [plan.origin_sends * 8 / topo.origin_up, plan.client_receives * 8 / topo.client_down]
    if plan.relay_sends:
        terms.append(plan.relay_sends * 8 / topo.relay_up)
    return max(terms)


def tree_plan(topo: Topology) -> Plan:
    return Plan(topo.relays * topo.size, math.ceil(topo.clients / topo.relays) * topo.size, topo.size)


def direct_plan(topo: Topology) -> Plan:
    return Plan(topo.clients * topo.size, 0, topo.size)


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


@dataclass(frozen=True)
class System:
    name: str
    label: str
    plan: Callable[[Topology], Plan]
    run: Callable[[Bed, System], Outcome]
    via_relays: bool = True
    cut_through: bool = True


# ---- the hosts and processes of one topology --------------------------------------------------


class Bed:
    """One topology's testbed hosts, work directory and checkpoint, and the processes of the system
    being run (stopped, with their CPU seconds measured, by `stop`)."""

    def __init__(self, tb: Testbed, topo: Topology, work: Path, args):
        self.tb, self.topo, self.work, self.args = tb, topo, work, args
        self.origin = tb.host("origin", up=topo.origin_up)
        self.relays = [tb.host(f"relay{i}", up=topo.relay_up, down=topo.relay_down) for i in range(topo.relays)]
        self.clients = [tb.host(f"client{i}", up=topo.client_up, down=topo.client_down) for i in range(topo.clients)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = work / "logs"
        self.cpu_at_start: dict[str, float] = {}

    def start(self, host, argv: list, name: str, env: dict | None = None) -> subprocess.Popen:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = self.tb.popen(
                host, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self.procs[name] = proc
        return proc

    def role(self, host, role: str, *args, name: str, env: dict | None = None) -> subprocess.Popen:
        return self.start(host, [sys.executable, str(ROOT / "benchmarks" / "broadcast.py"), role, *args], name, env)

    def wait_http(self, host, url: str, name: str) -> None:
        """Until `url` answers 2xx from inside `host` (a stdlib loop run there: the driver lives in
        the root namespace, which the testbed does not reach)."""
        loop = (
            "import sys,time,urllib.request\nend=time.monotonic()+60\nwhile True:\n try:\n"
            "  urllib.request.urlopen(sys.argv[1],timeout=1); break\n except OSError:\n"
            "  if time.monotonic()>end: sys.exit(1)\n  time.sleep(0.05)\n"
        )
        if self.tb.run(host, [sys.executable, "-c", loop, url]).returncode != 0:
            raise SystemExit(f"{name} ({url}) did not answer within 60 s; see {self.logs / (name + '.log')}")

    def clock_starts(self) -> None:
        self.cpu_at_start = {name: cpu_seconds(p.pid) for name, p in self.procs.items()}

    def stop(self) -> dict[str, float]:
        """Stop every process (clients have exited by now, or are stopped); CPU seconds since
        `clock_starts`."""
        cpu = {name: stop_measured(p) - self.cpu_at_start.get(name, 0.0) for name, p in self.procs.items()}
        self.procs, self.cpu_at_start = {}, {}
        return cpu


def timed(bed: Bed, clients: list[subprocess.Popen], started: float, busy0: tuple[int, int]) -> Outcome:
    """The outcome (CPU still to fill in) once every client finished or timed out."""
    reports = finish_reports(clients, bed.args.timeout_s)
    all_done = len(reports) == len(clients)
    end = max(r["done"] for r in reports) if all_done else time.monotonic()
    busy1 = machine_busy()
    busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    progress = [[(round(t - started, 2), n) for t, n in r["progress"]] for r in reports if r.get("progress")]
    return Outcome(end - started if all_done else None, len(reports), {}, end - started, busy, client_progress=progress)


def relay_bytes_out(bed: Bed, port: int) -> list[int]:
    """rlfleet_relay_bytes_out_total of each relay (asked from inside its host)."""
    out = []
    for h in bed.relays:
        text = bed.tb.run(h, ["curl", "-sf", f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True)
        m = re.search(r"^rlfleet_relay_bytes_out_total (\S+)$", text.stdout, re.MULTILINE)
        out.append(int(float(m.group(1))) if m else -1)
    return out


# ---- rlfleet ---------------------------------------------------------------------------------


def run_rlfleet(bed: Bed, system: System) -> Outcome:
    import redis

    from rlfleet import env as rlfleet_env
    from rlfleet.redis_server import redis_server_binary
    from rlfleet.streams import RunKeys, encode_json

    work, store, (key, manifest) = bed.work, bed.store, bed.manifest
    (work / "redis").mkdir(exist_ok=True)
    sock = work / "redis" / "redis.sock"
    bed.start(
        bed.origin,
        [redis_server_binary(), "--port", REDIS_PORT, "--bind", "0.0.0.0", "--protected-mode", "no",
         "--unixsocket", sock, "--save", "", "--appendonly", "no", "--dir", work / "redis"],
        "redis",
    )  # fmt: skip
    env = {
        **os.environ,
        rlfleet_env.PUBLIC_KEY: bed.public,
        rlfleet_env.REDIS_URL: f"redis://origin:{REDIS_PORT}/0",
        "PYTHONPATH": str(ROOT),
    }
    cli = [sys.executable, "-m", "rlfleet.cli"]
    config = ["--config", work / "rlrun.yaml", "--port", PORT, "--host", "0.0.0.0"]
    bed.start(bed.origin, [*cli, "origin", *config], "origin", env)
    bed.wait_http(bed.origin, f"http://origin:{PORT}/healthz", "origin")
    urls = [f"http://origin:{PORT}"]
    if system.via_relays:
        urls = [f"http://{h.name}:{PORT}" for h in bed.relays]
        for h in bed.relays:
            argv = [*cli, "relay", *config, "--upstream", f"http://origin:{PORT}", "--cache-dir", work / h.name]
            bed.start(h, [*argv, "--keep-versions", "1"], h.name, env)
        for h, url in zip(bed.relays, urls):
            bed.wait_http(h, url + "/healthz", h.name)
    mode = "cut-through" if system.cut_through else "store-and-forward"
    clients = [
        bed.role(h, "--client", json.dumps(urls), work / h.name, bed.public, mode, name=h.name, env=env)
        for h in bed.clients
    ]
    for h, c in zip(bed.clients, clients):
        expect_line(c, h.name)
    client = redis.Redis(unix_socket_path=str(sock))
    bed.clock_starts()
    busy0, started = machine_busy(), time.monotonic()
    store.put_bytes(key, manifest)  # the version becomes visible...
    client.xadd(RunKeys(RUN).policy, encode_json({"version": 1, "time": time.time()}))  # ...and is announced
    outcome = timed(bed, clients, started, busy0)
    client.close()
    if system.via_relays:
        outcome.relay_bytes_out = relay_bytes_out(bed, PORT)
    outcome.cpu = bed.stop()
    store.delete_prefix(key)  # the next system publishes the same version afresh
    outcome.relay_pull_seconds = [
        float(m.group(1))
        for h in (bed.relays if system.via_relays else [])
        for m in re.finditer(r"v1 pulled and verified in ([0-9.]+) s", (bed.logs / f"{h.name}.log").read_text())
    ]
    return outcome


# ---- the reference -----------------------------------------------------------------------------


def run_reference(bed: Bed, system: System) -> Outcome:
    import shardcast

    work, poll = bed.work, str(bed.args.reference_poll)
    package = Path(shardcast.__file__).parent
    dummy = os.urandom(1 << 20)
    env = {
        **os.environ,
        **REFERENCE_ENV,
        "SHARDCAST_MAX_CONCURRENT_DOWNLOADS": str(bed.args.reference_concurrency),
        "SHARDCAST_SHARD_SIZE": str(bed.args.reference_shard_mb * 10**6),
        "PYTHONPATH": str(ROOT),
    }

    def server_dir(name: str) -> Path:
        d = work / f"ref-{name}"
        d.mkdir(parents=True)
        (d / REFERENCE_DUMMY).write_bytes(dummy)  # its clients time a download of it at start-up
        return d

    origin = bed.role(
        bed.origin, "--ref-origin", server_dir("origin"), REFERENCE_PORT, bed.source, name="origin", env=env
    )
    expect_line(origin, "reference origin")
    relays = []
    for h in bed.relays:  # one at a time: each start-up downloads /tmp/dummy.bin
        middle = bed.role(
            h, "--ref-middle", f"http://origin:{REFERENCE_PORT}", server_dir(h.name), REFERENCE_PORT, poll,
            name=h.name, env=env,
        )  # fmt: skip
        expect_line(middle, h.name)
        relays.append(f"http://{h.name}:{REFERENCE_PORT}")
    clients = []
    for h in bed.clients:
        # each ClientNode keeps its version list in a temp file beside its package: a private copy
        # of the package per client keeps them apart
        private = work / f"ref-pkg-{h.name}"
        shutil.copytree(package, private / "shardcast", ignore=shutil.ignore_patterns("__pycache__"))
        client_env = {**env, "PYTHONPATH": f"{private}{os.pathsep}{ROOT}"}
        clients.append(
            bed.role(h, "--ref-client", json.dumps(relays), work / f"ref-{h.name}", poll, name=h.name, env=client_env)
        )
        expect_line(clients[-1], h.name)
    origin.stdin.write("publish\n")
    origin.stdin.flush()
    bed.clock_starts()
    busy0 = machine_busy()
    started = expect_line(origin, "reference origin")["published"]
    outcome = timed(bed, clients, started, busy0)
    outcome.cpu = bed.stop()
    return outcome


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


def prepare(bed: Bed) -> None:
    """The checkpoint (incompressible), a key pair, the RLRun config, and the version published to
    the store with its manifest held back (each system makes it visible when its clock starts)."""
    from rlfleet.checkpoint import manifest_key, publish_version
    from rlfleet.signing import generate_keypair, load_private_key, make_signer
    from rlfleet.store import open_store

    work, size = bed.work, bed.topo.size
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    with open(src / FILE, "wb") as f:
        for left in range(size, 0, -(64 << 20)):
            f.write(os.urandom(min(left, 64 << 20)))
    (src / "config.json").write_text("{}")
    private, bed.public = generate_keypair(work / "keys")
    bed.store = open_store(f"file://{work / 'store'}")
    signer = make_signer(load_private_key(private))
    publish_version(bed.store, RUN, 1, src, signer=signer, shard_size=bed.args.shard_mib << 20)
    key = manifest_key(RUN, 1)
    bed.manifest = (key, bed.store.get_bytes(key))
    bed.store.delete_prefix(key)
    bed.source = src / FILE
    (work / "rlrun.yaml").write_text(
        f"apiVersion: rlfleet.io/v1alpha1\nkind: RLRun\nmetadata: {{name: {RUN}}}\nspec:\n"
        f"  model: {{path: 'builtin://tiny-arithmetic'}}\n  task: {{type: arithmetic}}\n"
        f"  store: {{uri: 'file://{work / 'store'}'}}\n"
    )


def run_topology(topo: Topology, systems: list[System], args, work: Path) -> dict:
    """Every system on one testbed of `topo`; the JSON record of the run."""
    results = {}
    with Testbed() as tb:
        bed = Bed(tb, topo, work, args)
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
        tag = tb.tag
    return {"topology": asdict(topo), "testbed": tag, "systems": results, "machine": machine()}


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


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> dict:
    return {"cores": os.cpu_count(), "loadavg": os.getloadavg()}


def report(run: dict) -> None:
    topo, systems = Topology(**run["topology"]), run["systems"]
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
    ap.add_argument("--systems", nargs="+", default=["tree", "direct", "reference"], choices=list(SYSTEMS))
    ap.add_argument("--no-cut-through", action="store_true", help="also run tree-sf (relays store and forward)")
    for name in ("size-mib", "clients", "relays"):
        ap.add_argument(f"--{name}", type=int, default=None, help="overrides the topology's")
    for name in ("origin-up", "relay-up", "client-down", "relay-down", "client-up"):
        ap.add_argument(f"--{name}", type=float, default=None, help="Mbit/s; overrides the topology's")
    ap.add_argument("--shard-mib", type=int, default=16, help="rlfleet shard size (the reference keeps its own)")
    ap.add_argument("--reference-poll", type=int, default=1, help="poll interval (s) of the reference's nodes")
    ap.add_argument("--reference-concurrency", type=int, default=10, help="the reference's parallel downloads")
    ap.add_argument("--reference-shard-mb", type=int, default=50, help="the reference's shard size (MB)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per system (default max(600, 10x bound))")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir, deleted)")
    args = ap.parse_args(argv)
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
    from rlfleet.testbed import unavailable_reason

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
    runs = []
    for name in args.topology:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="rlfleet-wan-")) / name
        work.mkdir(parents=True, exist_ok=True)
        try:
            runs.append(run_topology(topology(name, args), [SYSTEMS[s] for s in args.systems], args, work))
        finally:
            if not args.workdir:
                shutil.rmtree(work.parent, ignore_errors=True)
        report(runs[-1])
        if args.json:  # after every topology: a later failure keeps what was measured
            args.json.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    failed = [f"{r['topology']['name']}/{s}" for r in runs for s, v in r["systems"].items() if v["seconds"] is None]
    if failed:
        print(f"not every client finished: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
