"""Broadcast benchmark: deliver one checkpoint to N clients on loopback, in one invocation.

    .venv/bin/python benchmarks/broadcast.py [--size-mib 1024] [--clients 8] [--relays 2]
                                             [--reference-polls 30 1]
    .venv/bin/python benchmarks/broadcast.py --wan ...   (root: every node a host of a simulated
                                             WAN with shaped links; see broadcast_wan.py)
    .venv/bin/python benchmarks/broadcast.py --wan --delta ...   (delta versions of real GRPO steps on
                                             that WAN, next to whole ones; see wan_delta.py)

Systems (each a fresh set of OS processes; clients are processes too, so nothing shares a GIL):
  tree       origin -> `--relays` tier-0 relays (`rlfleet relay`, cut-through) -> clients, each
             client given every relay (weighted choice); signed manifest, per-shard sha256
  direct     every client pulls straight from the `rlfleet origin`
  reference  the reference `shardcast` package (PyPI, `pip install -e '.[bench]'`) on the same tree:
             its OriginServer, a MiddleNode per relay, a ClientNode per client (whole-file blake3,
             one `wget` per shard, its default 50 MB shards). It has no announcements: middle nodes
             poll every `check_interval` s and our driver of each ClientNode polls the version list
             at the same interval; one column per `--reference-polls` value (30 s is its default).
Timing, alike for every system: all servers and clients are started and idle first; the clock
starts when the version becomes visible at the origin (rlfleet: manifest written, then the `policy`
announcement; reference: `OriginServer.broadcast` returns, i.e. its distribution file is written)
and stops when the last client holds the complete, verified file (each client reports the
system-wide monotonic clock). Process start-up and imports are outside the measurement.
Bounds (all measured in this invocation):
  busiest-node bound  bytes the busiest node must send / single-stream loopback throughput (one
                      HTTP GET of the checkpoint from the origin, read into a reused buffer). With R
                      relays and N clients it is a relay sending ceil(N/R) copies (or the origin R);
                      for `direct`, the origin sending N. The reference is held to the tree's.
                      It assumes every node has its own CPU and NIC.
  one-box bound       every byte every node sends / the same single-stream rate: on one machine all
                      streams share its cores, and a single stream already keeps a sender and a
                      receiver busy
  hashing bound       every byte every receiver must sha256 / (hashlib sha256 rate x cores): the
                      verification work alone, spread perfectly over all cores
  disk bound (approx) every byte the receivers write, less what the kernel's dirty-page allowance
                      absorbs (MemAvailable x vm.dirty_ratio), / the disk's sequential write rate
                      (1 GiB + fsync in the work directory). On one machine all writers share one
                      disk; rlfleet writes each byte once per receiver, the reference twice per
                      client (shards, then the reassembled file). `--workdir` on a tmpfs removes it.
This is a script, not a test (docs/code.md, "Benchmarks are scripts, not tests").
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from _paths import ROOT
from broadcast_common import FILE, REFERENCE_DUMMY, RUN, expect_line, finish_times, write_bench_rlrun

# ---- the processes ---------------------------------------------------------------------------


def rlfleet_client(urls: list[str], dest: str, public_key: str, mode: str = "cut-through") -> None:
    from rlfleet.services.shardcast.client import FetchSettings, fetch_version, wait_for_version
    from rlfleet.versions.signing import parse_public_key

    key = parse_public_key(public_key)
    print("waiting", flush=True)
    version = wait_for_version(urls, RUN, 0, timeout=3600)
    if mode == "store-and-forward":  # start only once every relay holds the whole version
        while not all(relay_holds_a_version(url) for url in urls):
            time.sleep(0.05)
    progress: list[tuple[float, int]] = []  # (time, bytes received): the first chunk, every 16 MiB, the end
    got = [0, 0]  # bytes so far, bytes at the last progress point

    def on_bytes(n: int) -> None:
        got[0] += n
        if not progress or got[0] - got[1] >= (16 << 20):
            progress.append((time.monotonic(), got[0]))
            got[1] = got[0]

    fetch_version(FetchSettings.over(urls, RUN, timeout=3600, public_key=key, on_bytes=on_bytes), version, Path(dest))
    done = time.monotonic()
    print(json.dumps({"done": done, "progress": [*progress, (done, got[0])]}), flush=True)


def relay_holds_a_version(url: str) -> bool:
    """The relay's rlfleet_relay_versions_held gauge is >= 1 (it counts complete versions only)."""
    import re

    text = requests.get(url + "/metrics", timeout=5).text
    held = re.search(r"^rlfleet_relay_versions_held (\S+)$", text, re.MULTILINE)
    return held is not None and float(held.group(1)) >= 1


def reference_origin(data_dir: str, port: int, source: str) -> None:
    from shardcast import OriginServer

    origin = OriginServer(data_dir, port)
    print("waiting", flush=True)
    sys.stdin.readline()  # the driver says when to publish
    origin.broadcast(source)  # shards the file, then writes the distribution file (visible)
    print(json.dumps({"published": time.monotonic()}), flush=True)
    sys.stdin.readline()  # serve until the driver closes stdin or stops us


def reference_middle(upstream: str, data_dir: str, port: int, poll: int) -> None:
    from shardcast import MiddleNode

    MiddleNode([upstream], data_dir, port, check_interval=poll)
    print("waiting", flush=True)
    sys.stdin.readline()


def reference_client(servers: list[str], out_dir: str, poll: int) -> None:
    from shardcast import ClientNode

    client = ClientNode(servers, out_dir)
    print("waiting", flush=True)
    while True:  # the reference has no announcements: poll its distribution file
        if "v1" in client.list_available_versions():
            if client.download_version("v1", str(Path(out_dir) / FILE)):  # blake3-verified
                break
        time.sleep(poll)
    print(json.dumps({"done": time.monotonic()}), flush=True)


def delta_client(*args) -> None:
    from delta import delta_client as role  # benchmarks/delta.py: the --wan --delta client

    role(*args)


ROLES = {
    "--client": rlfleet_client,
    "--delta-client": delta_client,
    "--ref-origin": reference_origin,
    "--ref-middle": reference_middle,
    "--ref-client": reference_client,
}


# ---- the driver ------------------------------------------------------------------------------


class Procs:
    """Processes of one column; every one is stopped (SIGTERM, then SIGKILL) when the block ends."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs, self.procs = env, logs, []

    def start(self, argv: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            env=env or self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.logs / f"{name}.log", "ab"),
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def role(self, role: str, *args, name: str, env: dict | None = None) -> subprocess.Popen:
        return self.start([sys.executable, __file__, role, *map(str, args)], name, env)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_healthy(url: str, proc: subprocess.Popen, path: str = "/healthz") -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(url + path, timeout=1).ok:
                return
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{url} did not start")
        time.sleep(0.1)


def single_stream(url: str) -> float:
    """Bytes/s of one HTTP GET of the whole file, read into a reused buffer (best of two)."""
    from urllib.parse import urlsplit

    from rlfleet.services.shardcast.protocol import file_path

    parts, best = urlsplit(url), 0.0
    buf = memoryview(bytearray(1 << 20))
    for _ in range(2):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        started, n = time.monotonic(), 0
        conn.request("GET", file_path(RUN, 1, FILE))
        r = conn.getresponse()
        if r.status != 200:
            raise SystemExit(f"single-stream GET: HTTP {r.status}")
        while got := r.readinto(buf):
            n += got
        best = max(best, n / (time.monotonic() - started))
        conn.close()
    return best


def disk_write_rate(work: Path) -> float:
    """Bytes/s of writing 1 GiB sequentially into `work` and fsyncing it."""
    block = os.urandom(16 << 20)
    path = work / "disk-rate.bin"
    started = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(64):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = 64 * len(block) / (time.monotonic() - started)
    path.unlink()
    return rate


def dirty_allowance() -> float:
    """Bytes the kernel lets writers dirty before it throttles them to the disk (approximate)."""
    vm = Path("/proc/sys/vm")
    if (vm / "dirty_bytes").exists() and int((vm / "dirty_bytes").read_text()) > 0:
        return float(int((vm / "dirty_bytes").read_text()))
    available = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    return available * int((vm / "dirty_ratio").read_text()) / 100


def sha256_rate() -> float:
    data = os.urandom(64 << 20)
    started = time.monotonic()
    for _ in range(4):
        hashlib.sha256(data).digest()
    return 4 * len(data) / (time.monotonic() - started)


def run_rlfleet(
    column: str, args, work: Path, env: dict, public: str, store, manifest: tuple[str, bytes], redis_client
) -> float:
    from rlfleet.wire.ports import free_port
    from rlfleet.wire.streams import RunKeys, encode_json

    cli = [sys.executable, "-m", "rlfleet.cli"]
    config = work / "rlrun.yaml"
    with Procs(env, work) as procs:
        port = free_port()
        origin = f"http://127.0.0.1:{port}"
        wait_healthy(origin, procs.start([*cli, "origin", "--config", str(config), "--port", str(port)], "origin"))
        urls = [origin]
        if column == "tree":
            urls = []
            for i in range(args.relays):
                rport = free_port()
                proc = procs.start(
                    [
                        *cli,
                        "relay",
                        "--config",
                        str(config),
                        "--port",
                        str(rport),
                        "--upstream",
                        origin,
                        "--cache-dir",
                        str(work / f"relay{i}"),
                        "--keep-versions",
                        "1",
                    ],
                    f"relay{i}",
                )
                urls.append(f"http://127.0.0.1:{rport}")
                wait_healthy(urls[-1], proc)
        clients = [
            procs.role("--client", json.dumps(urls), work / f"client{i}", public, name=f"{column}-client{i}")
            for i in range(args.clients)
        ]
        for i, c in enumerate(clients):
            expect_line(c, f"client {i}")
        started = time.monotonic()
        store.put_bytes(*manifest)  # the version becomes visible...
        redis_client.xadd(RunKeys(RUN).policy, encode_json({"version": 1, "time": time.time()}))  # ...and is announced
        done = finish_times(clients, args.timeout)
    store.delete_prefix(manifest[0])
    return max(done) - started if len(done) == len(clients) else math.inf


def run_reference(poll: int, args, work: Path, source: Path) -> float:
    import shardcast

    from rlfleet.wire.ports import free_port

    package = Path(shardcast.__file__).parent
    dummy = os.urandom(1 << 20)
    with Procs(dict(os.environ), work) as procs:

        def server_dir(name: str) -> Path:
            d = work / name
            d.mkdir(parents=True)
            (d / REFERENCE_DUMMY).write_bytes(dummy)
            return d

        port = free_port()
        origin_url = f"http://127.0.0.1:{port}"
        origin = procs.role("--ref-origin", server_dir("ref-origin"), port, source, name="ref-origin")
        expect_line(origin, "reference origin")
        relays = []
        for i in range(args.relays):  # one at a time: each start-up downloads /tmp/dummy.bin
            rport = free_port()
            middle = procs.role(
                "--ref-middle", origin_url, server_dir(f"ref-relay{i}"), rport, poll, name=f"ref-relay{i}"
            )
            expect_line(middle, f"reference relay {i}")
            relays.append(f"http://127.0.0.1:{rport}")
        clients = []
        for i in range(args.clients):
            # each ClientNode keeps its version list in a temp file next to its package: a private
            # copy of the package per client process keeps eight of them on one machine apart
            private = work / f"ref-pkg{i}"
            shutil.copytree(package, private / "shardcast", ignore=shutil.ignore_patterns("__pycache__"))
            env = {**os.environ, "PYTHONPATH": f"{private}{os.pathsep}{ROOT}"}
            clients.append(
                procs.role(
                    "--ref-client", json.dumps(relays), work / f"ref-client{i}", poll, name=f"ref-client{i}", env=env
                )
            )
            expect_line(clients[-1], f"reference client {i}")
        origin.stdin.write("publish\n")
        origin.stdin.flush()
        started = expect_line(origin, "reference origin")["published"]
        done = finish_times(clients, args.timeout)
    if len(done) < len(clients):
        print(
            f"reference, poll {poll} s: {len(clients) - len(done)} of {len(clients)} clients not done after "
            f"{args.timeout:g} s (see {work}/ref-client*.log); {len(done)} finished within "
            f"{max(done, default=started) - started:.1f} s",
            file=sys.stderr,
        )
        return math.inf
    return max(done) - started


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ROLES:
        role, rest = ROLES[sys.argv[1]], sys.argv[2:]
        if sys.argv[1] == "--client":
            role(json.loads(rest[0]), *rest[1:])
        elif sys.argv[1] == "--delta-client":
            role(json.loads(rest[0]), rest[1], rest[2], json.loads(rest[3]))
        elif sys.argv[1] == "--ref-origin":
            role(rest[0], int(rest[1]), rest[2])
        elif sys.argv[1] == "--ref-middle":
            role(rest[0], rest[1], int(rest[2]), int(rest[3]))
        else:
            role(json.loads(rest[0]), rest[1], int(rest[2]))
        return 0
    if "--wan" in sys.argv[1:]:
        import broadcast_wan

        return broadcast_wan.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--shard-mib", type=int, default=16, help="rlfleet shard size (the reference keeps its own)")
    ap.add_argument(
        "--reference-polls",
        type=int,
        nargs="*",
        default=[30, 1],
        help="poll intervals (s) of the reference's middle nodes and clients; one column each",
    )
    ap.add_argument("--systems", nargs="*", default=["tree", "direct", "reference"])
    ap.add_argument("--timeout", type=float, default=600, help="seconds a system may take before it counts as not done")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, deleted after)")
    args = ap.parse_args()
    for name, value in (
        ("--size-mib", args.size_mib),
        ("--clients", args.clients),
        ("--relays", args.relays),
        ("--shard-mib", args.shard_mib),
    ):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")

    from rlfleet.local.redis_server import EmbeddedRedis
    from rlfleet.versions.checkpoint import manifest_key, publish_version
    from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
    from rlfleet.versions.store import open_store
    from rlfleet.wire import env as rlfleet_env

    reference_ok = True
    if "reference" in args.systems:
        try:
            import shardcast  # noqa: F401  (only: is it installed?)
        except ImportError:
            reference_ok = False
            print(
                "reference: the `shardcast` package is not installed; `pip install -e '.[bench]'` adds it "
                "(reference columns skipped)",
                file=sys.stderr,
            )
        if reference_ok and shutil.which("wget") is None:
            reference_ok = False
            print(
                "reference: shardcast downloads with `wget`, which is not on PATH (reference columns skipped)",
                file=sys.stderr,
            )

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlfleet-broadcast-"))
    size = args.size_mib << 20
    results: dict[str, float] = {}
    try:
        src = work / "src"
        src.mkdir(parents=True, exist_ok=True)
        with open(src / FILE, "wb") as f:  # incompressible, written in 64 MiB pieces
            for left in range(size, 0, -(64 << 20)):
                f.write(os.urandom(min(left, 64 << 20)))
        (src / "config.json").write_text("{}")
        private, public = generate_keypair(work / "keys")
        store = open_store(f"file://{work / 'store'}")
        publish_version(
            store, RUN, 1, src, signer=make_signer(load_private_key(private)), shard_size=args.shard_mib << 20
        )
        key = manifest_key(RUN, 1)
        manifest = (key, store.get_bytes(key))
        write_bench_rlrun(work)
        with EmbeddedRedis(work / "redis") as redis_url:
            import redis

            redis_client = redis.Redis.from_url(redis_url)
            env = {
                **os.environ,
                rlfleet_env.PUBLIC_KEY: public,
                rlfleet_env.REDIS_URL: redis_url,
                "PYTHONPATH": str(ROOT),
            }
            with Procs(env, work) as procs:  # the bounds, measured against the origin alone
                from rlfleet.wire.ports import free_port

                port = free_port()
                url = f"http://127.0.0.1:{port}"
                wait_healthy(
                    url,
                    procs.start(
                        [
                            sys.executable,
                            "-m",
                            "rlfleet.cli",
                            "origin",
                            "--config",
                            str(work / "rlrun.yaml"),
                            "--port",
                            str(port),
                        ],
                        "origin",
                    ),
                )
                results["stream"] = single_stream(url)
            results["sha256"] = sha256_rate()
            results["disk"] = disk_write_rate(work)
            results["dirty"] = dirty_allowance()
            store.delete_prefix(key)
            for column in ("tree", "direct"):
                if column in args.systems:
                    results[column] = run_rlfleet(column, args, work, env, public, store, manifest, redis_client)
                    print(f"{column}: {results[column]:.2f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
                    for d in [*work.glob("client*"), *work.glob("relay*")]:
                        if d.is_dir():
                            shutil.rmtree(d)
        if "reference" in args.systems and reference_ok:
            for poll in args.reference_polls:
                name = f"reference, poll {poll} s"
                results[name] = run_reference(poll, args, work, src / FILE)
                print(f"{name}: {results[name]:.2f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
                for d in work.glob("ref-*"):
                    if d.is_dir():
                        shutil.rmtree(d)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    report(args, size, results)
    return 0


def report(args, size: int, results: dict[str, float]) -> None:
    n, r, stream = args.clients, args.relays, results["stream"]
    cores = os.cpu_count() or 1
    tree_busiest = max(r, math.ceil(n / r)) * size
    bounds = {  # per system: (busiest-node bytes, all bytes sent, bytes written by receivers)
        "tree": (tree_busiest, (r + n) * size, (r + n) * size),
        "direct": (n * size, n * size, n * size),
        "reference": (tree_busiest, (r + n) * size, (r + 2 * n) * size),
    }

    def disk_bound(written: int) -> float:
        return max(0.0, written - results["dirty"]) / results["disk"]

    references = sorted(k for k in results if k.startswith("reference"))
    print(
        f"\n{args.size_mib} MiB to {n} clients via {r} relays on loopback; rlfleet shards {args.shard_mib} MiB; "
        f"{cores} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"single-stream loopback {stream / 2**20:.0f} MiB/s; sha256 {results['sha256'] / 2**20:.0f} MiB/s per core; "
        f"disk writes {results['disk'] / 2**20:.0f} MiB/s after a dirty-page allowance of "
        f"{results['dirty'] / 2**30:.1f} GiB"
    )
    print(
        f"tree bounds: busiest node (a relay, {tree_busiest / 2**20:.0f} MiB) {tree_busiest / stream:.2f} s; "
        f"one box {(r + n) * size / stream:.2f} s; hashing {(r + n) * size / (results['sha256'] * cores):.2f} s"
    )
    head = (
        f"{'system':<22} {'last client s':>13} {'MiB/s':>7} {'x busiest-node bound':>21} {'x one-box bound':>16}"
        f" {'disk bound s':>12}"
    )
    head += "".join(f" {k.replace('reference, ', 'ref ') + ' / this':>17}" for k in references)
    print(head)
    for name in [k for k in ("tree", "direct") if k in results] + references:
        t = results[name]
        busiest, everything, written = bounds[name.partition(",")[0]]  # the reference runs the same tree
        line = (
            f"{name:<22} {t:>13.2f} {n * size / t / 2**20:>7.0f} {t / (busiest / stream):>21.2f} "
            f"{t / (everything / stream):>16.2f} {disk_bound(written):>12.2f}"
        )
        line += "".join(f" {results[k] / t:>17.2f}" for k in references)
        print(line)
    if not references:
        print("reference: not run (see the message above)")


if __name__ == "__main__":
    sys.exit(main())
