"""The processes of `broadcast.py --wan` (broadcast_wan.py): one topology's hosts and checkpoint
(`Bed`, `prepare`) and the runners of the systems (`run_rlfleet`, `run_reference`), each of which
starts its servers and clients on the testbed hosts, publishes, waits for every client and
measures (`Outcome`). wan_topology.py holds the topologies, the bound and
the outcome record; broadcast_wan.py the systems' table and the report."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _paths import ROOT
from broadcast_common import BROADCAST, FILE, REFERENCE_DUMMY, RUN, expect_line, finish_reports, write_bench_rlrun
from wan_topology import Outcome, System, Topology

from testbed import Testbed, cpu_seconds, machine_busy, stop_measured

PORT, REDIS_PORT, REFERENCE_PORT = 8100, 6379, 8200
# The reference's settings: pause 1 s between retries of a shard that is not there yet (its
# defaults are 2 s, then 15 s after 3 tries); --reference-concurrency and --reference-shard-mb set
# its parallel downloads per node (its default 10; 1 is its best here: its servers answer one
# request at a time from a listen backlog of 5, so more connections only time out and retry) and
# its shard size (its default 50 MB).
REFERENCE_ENV = {"SHARDCAST_FAST_RETRY_INTERVAL": "1", "SHARDCAST_SLOW_RETRY_INTERVAL": "1"}


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
        return self.start(host, [sys.executable, str(BROADCAST), role, *args], name, env)

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
    out, get = [], "import sys,urllib.request\nsys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())"
    for h in bed.relays:
        text = bed.tb.run(
            h, [sys.executable, "-c", get, f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True
        )
        m = re.search(r"^rlfleet_relay_bytes_out_total (\S+)$", text.stdout, re.MULTILINE)
        out.append(int(float(m.group(1))) if m else -1)
    return out


# ---- rlfleet ---------------------------------------------------------------------------------


def start_rlfleet(bed: Bed, config: Path, public: str, via_relays: bool, home: Path):
    """redis-server and `rlfleet origin` on the origin host and, `via_relays`, an `rlfleet relay` per relay
    host (its cache home/<host>), all answering: (the URLs clients pull from, their environment, a Redis
    client on the announcements' server)."""
    import redis

    from rlfleet.local.redis_server import redis_server_binary
    from rlfleet.wire import env as rlfleet_env

    redis_dir = home / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    sock = redis_dir / "redis.sock"
    bed.start(
        bed.origin,
        [redis_server_binary(), "--port", REDIS_PORT, "--bind", "0.0.0.0", "--protected-mode", "no",
         "--unixsocket", sock, "--save", "", "--appendonly", "no", "--dir", redis_dir],
        "redis",
    )  # fmt: skip
    env = {
        **os.environ,
        rlfleet_env.PUBLIC_KEY: public,
        rlfleet_env.REDIS_URL: f"redis://origin:{REDIS_PORT}/0",
        "PYTHONPATH": str(ROOT),
    }
    cli = [sys.executable, "-m", "rlfleet.cli"]
    options = ["--config", config, "--port", PORT, "--host", "0.0.0.0"]
    bed.start(bed.origin, [*cli, "origin", *options], "origin", env)
    bed.wait_http(bed.origin, f"http://origin:{PORT}/healthz", "origin")
    urls = [f"http://origin:{PORT}"]
    if via_relays:
        urls = [f"http://{h.name}:{PORT}" for h in bed.relays]
        for h in bed.relays:
            argv = [*cli, "relay", *options, "--upstream", f"http://origin:{PORT}", "--cache-dir", home / h.name]
            bed.start(h, [*argv, "--keep-versions", "1"], h.name, env)
        for h, url in zip(bed.relays, urls):
            bed.wait_http(h, url + "/healthz", h.name)
    return urls, env, redis.Redis(unix_socket_path=str(sock))


def run_rlfleet(bed: Bed, system: System) -> Outcome:
    from rlfleet.wire.streams import RunKeys, encode_json

    work, store, (key, manifest) = bed.work, bed.store, bed.manifest
    urls, env, client = start_rlfleet(bed, work / "rlrun.yaml", bed.public, system.via_relays, work)
    mode = "cut-through" if system.cut_through else "store-and-forward"
    clients = [
        bed.role(h, "--client", json.dumps(urls), work / h.name, bed.public, mode, name=h.name, env=env)
        for h in bed.clients
    ]
    for h, c in zip(bed.clients, clients):
        expect_line(c, h.name)
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


def prepare(bed: Bed) -> None:
    """The checkpoint (incompressible), a key pair, the RLRun config, and the version published to
    the store with its manifest held back (each system makes it visible when its clock starts)."""
    from rlfleet.versions.checkpoint import manifest_key, publish_version
    from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
    from rlfleet.versions.store import open_store

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
    write_bench_rlrun(work)
