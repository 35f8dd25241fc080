"""Shardcast under attack and failure, on real servers over 127.0.0.1: malicious relays, a relay
killed mid-transfer (a real `rlfleet relay` process), cut-through, resume, retention and disk bounds,
and a relay stopping while its upstream hangs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from aiohttp import web

from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.client import FetchError, FetchSettings, fetch_version
from rlfleet.services.shardcast.protocol import file_path, healthz, latest_path
from rlfleet.services.shardcast.sources import READ_TIMEOUT, Sources
from rlfleet.versions.checkpoint import COMPLETE_MARKER, MANIFEST_NAME, publish_version
from rlfleet.versions.manifest import signing_bytes
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys, encode_json
from tests.runs import bundle_yaml, rlrun
from tests.support import serving, wait_for

RUN = "demo"
SHARD = 64 * 1024


@pytest.fixture
def keys(tmp_path):
    private, public = generate_keypair(tmp_path / "keys")
    return make_signer(load_private_key(private)), parse_public_key(public), public


def make_version(path: Path, seed: int, size: int = 1_000_000) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"seed": seed}))
    (path / "model.safetensors").write_bytes(os.urandom(size))
    return path


def same_files(a: Path, b: Path) -> bool:
    return all(
        hashlib.sha256((a / n).read_bytes()).digest() == hashlib.sha256((b / n).read_bytes()).digest()
        for n in ("config.json", "model.safetensors")
    )


def evil_relay(upstream: str, mangle) -> web.Application:
    """A relay that forwards to `upstream` and lets `mangle(request, name, body, status, headers)` lie."""

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k == "Range"}
        r = await asyncio.to_thread(requests.get, upstream + request.path, headers=headers, timeout=10)
        out = {k: v for k, v in r.headers.items() if k in ("Content-Range", "Content-Type")}
        if r.status_code in (200, 206):
            return await mangle(request, request.match_info["name"], r.content, r.status_code, out)
        return web.Response(status=r.status_code, body=r.content)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get(r"/v1/{run}/v{version:\d+}/{name:.+}", forward)
    return app


def test_malicious_relays_are_detected_and_honest_ones_finish(tmp_path, keys):
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src1, src2 = make_version(tmp_path / "v1", 1), make_version(tmp_path / "v2", 2)
    publish_version(store, RUN, 1, src1, signer=signer, shard_size=SHARD)
    publish_version(store, RUN, 2, src2, signer=signer, shard_size=SHARD)
    attacker = make_signer(load_private_key(generate_keypair(tmp_path / "attacker")[0]))
    poison = os.urandom(SHARD)
    served = {"corrupt": 0, "truncated": 0, "forged": 0, "stale": 0}

    async def corrupt(request, name, body, status, headers):
        if name != MANIFEST_NAME:
            served["corrupt"] += 1
            body = bytes([body[0] ^ 1]) + body[1:]
        return web.Response(status=status, body=body, headers=headers)

    async def truncated(request, name, body, status, headers):
        if name != MANIFEST_NAME:
            served["truncated"] += 1
            body = body[: len(body) // 2]  # a short body with a matching Content-Length
        return web.Response(status=status, body=body, headers=headers)

    async def forged(request, name, body, status, headers):
        """Poisoned first shard, with a manifest that lists its hash, signed by the wrong key."""
        if name == MANIFEST_NAME:
            served["forged"] += 1
            manifest = json.loads(body)
            entry = next(f for f in manifest["files"] if f["name"] == "model.safetensors")
            entry["shards"][0]["sha256"] = hashlib.sha256(poison).hexdigest()
            manifest["signature"] = attacker(signing_bytes(manifest))
            body = json.dumps(manifest).encode()
        elif name == "model.safetensors" and headers.get("Content-Range", "").startswith("bytes 0-"):
            body = poison
        return web.Response(status=status, body=body, headers=headers)

    async def stale(request, name, body, status, headers):
        """Answers every version with v1 (validly signed, but not what was asked for)."""
        if name == MANIFEST_NAME:
            served["stale"] += 1
            body = store.get_bytes(f"{RUN}/policy/v1/manifest.json")
        return web.Response(status=status, body=body, headers=headers)

    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "honest", RUN, 3, public_key=public))
        ) as honest_url,
        serving(evil_relay(origin_url, corrupt)) as corrupt_url,
        serving(evil_relay(origin_url, truncated)) as truncated_url,
        serving(evil_relay(origin_url, forged)) as forged_url,
        serving(evil_relay(origin_url, stale)) as stale_url,
    ):
        # alone, each liar makes the fetch fail (never succeed with bad bytes); what it says is named
        for url, version, match in [
            (corrupt_url, 1, "sha256"),
            (truncated_url, 1, "truncated"),
            (forged_url, 1, "signature does not verify"),
            (stale_url, 2, "describes run 'demo' v1"),
        ]:
            with pytest.raises(FetchError, match=match):
                fetch_version(
                    FetchSettings.over([url], RUN, timeout=1.5, public_key=public), version, tmp_path / "alone"
                )
        assert not any(p.name == "v1" or p.name == "v2" for p in (tmp_path / "alone").iterdir())
        # a relay with the public key refuses the forged manifest: it never serves it
        with serving(
            relay.make_app(
                relay.RelaySettings(forged_url, tmp_path / "fooled", RUN, 3, fetch_timeout=0.5, public_key=public)
            )
        ) as fooled:
            r = requests.get(fooled + file_path(RUN, 1, MANIFEST_NAME), timeout=10)
            assert r.status_code == 502 and "signature" in r.text
        # mixed with an honest relay, the client finishes with exactly the published bytes
        sources = Sources([corrupt_url, truncated_url, forged_url, honest_url], rng=__import__("random").Random(0))
        path = fetch_version(FetchSettings(sources, RUN, timeout=30, public_key=public), 1, tmp_path / "mixed")
        path2 = fetch_version(
            FetchSettings.over([stale_url, honest_url], RUN, timeout=30, public_key=public), 2, tmp_path / "mixed"
        )
    assert same_files(path, src1) and same_files(path2, src2)
    assert (path / MANIFEST_NAME).read_bytes() == store.get_bytes(
        f"{RUN}/policy/v1/manifest.json"
    )  # never the forged one
    assert all(served.values()), served
    assert sources.fail[corrupt_url] > 0 and sources.fail[truncated_url] > 0  # they poison every shard
    for liar in (corrupt_url, truncated_url, forged_url):  # liars weigh less than the honest relay
        assert sources.weight(liar) < sources.weight(honest_url)


def test_relay_serves_shards_before_it_holds_the_version(tmp_path, keys):
    """Cut-through: shard 0 goes out while the upstream still withholds every later shard."""
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=4 * SHARD)
    publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    release = threading.Event()

    async def hold_back(request, name, body, status, headers):
        if name == "model.safetensors" and not headers.get("Content-Range", "").startswith("bytes 0-"):
            await asyncio.to_thread(release.wait, 20)
        return web.Response(status=status, body=body, headers=headers)

    blob = (src / "model.safetensors").read_bytes()
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(evil_relay(origin_url, hold_back)) as slow,
        serving(relay.make_app(relay.RelaySettings(slow, tmp_path / "relay", RUN, 3, public_key=public))) as relay_url,
    ):
        url = relay_url + file_path(RUN, 1, "model.safetensors")
        r = requests.get(url, headers={"Range": f"bytes=0-{SHARD - 1}"}, timeout=10)
        assert r.status_code == 206 and r.content == blob[:SHARD]
        assert not (tmp_path / "relay" / RUN / "v1").exists()  # not complete, yet served
        release.set()
        path = fetch_version(
            FetchSettings.over([relay_url], RUN, timeout=20, public_key=public), 1, tmp_path / "worker"
        )
    assert same_files(path, src)


@pytest.mark.parametrize("tiers", [1, 2])
def test_relay_streams_a_shard_as_it_arrives_and_cuts_off_one_that_fails(tmp_path, keys, tiers):
    """Byte-level cut-through, through one relay and through a relay of a relay: half a shard goes
    out while the origin's side still withholds the other half; when the shard then fails its
    sha256, the response is cut short, never completed, and no relay holds the version."""
    signer, public, _ = keys
    shard, half = 4 << 20, 2 << 20  # the relay reads upstream 1 MiB at a time
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=2 * shard)
    publish_version(store, RUN, 1, src, signer=signer, shard_size=shard)
    blob = (src / "model.safetensors").read_bytes()

    def trickle(release: threading.Event, poison: bool):
        async def mangle(request, name, body, status, headers):
            if name != "model.safetensors":
                return web.Response(status=status, body=body, headers=headers)
            resp = web.StreamResponse(status=status, headers=headers)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[:half])
            await asyncio.to_thread(release.wait, 20)
            await resp.write(bytes(len(body) - half) if poison else body[half:])
            await resp.write_eof()
            return resp

        return mangle

    with serving(origin.make_app(store, RUN)) as origin_url:
        for poison in (False, True):
            release = threading.Event()
            with contextlib.ExitStack() as stack:
                relay_url = stack.enter_context(serving(evil_relay(origin_url, trickle(release, poison))))
                for tier in range(tiers):
                    cache = tmp_path / f"relay-{poison}-{tier}"
                    # a short fetch timeout bounds a poisoned pull's reads, so the relays stop soon after
                    app = relay.make_app(
                        relay.RelaySettings(relay_url, cache, RUN, 3, fetch_timeout=5, public_key=public)
                    )
                    relay_url = stack.enter_context(serving(app))
                port = int(relay_url.rsplit(":", 1)[1])
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
                conn.request("GET", file_path(RUN, 1, "model.safetensors"), headers={"Range": f"bytes=0-{shard - 1}"})
                r = conn.getresponse()
                assert r.status == 206
                assert r.read(half) == blob[:half]  # served while the upstream still holds the rest
                assert not release.is_set()
                release.set()
                if poison:  # cut off (one relay), or the last byte never comes (a relay's relay)
                    conn.sock.settimeout(5)
                    with pytest.raises((http.client.IncompleteRead, TimeoutError)):
                        r.read()
                else:
                    assert r.read() == blob[half:shard]
                conn.close()
                if not poison:  # and the whole version verifies through the last tier
                    path = fetch_version(
                        FetchSettings.over([relay_url], RUN, public_key=public), 1, tmp_path / f"worker-{tiers}"
                    )
                    assert same_files(path, src)
            assert not any((tmp_path / f"relay-True-{t}" / RUN / "v1").exists() for t in range(tiers))


def test_client_resumes_after_interruption(tmp_path, keys):
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1)
    publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    stop, got = threading.Event(), []

    def count(n):
        got.append(n)
        if sum(got) > 500_000:
            stop.set()  # a worker shutting down mid-download

    with serving(origin.make_app(store, RUN)) as origin_url:
        with pytest.raises(FetchError, match="stopped"):
            fetch_version(
                FetchSettings.over([origin_url], RUN, public_key=public, stop=stop, on_bytes=count, parallel=1),
                1,
                tmp_path / "w",
            )
        assert (tmp_path / "w" / ".v1.partial" / ".shards").read_text().count("\n") >= 7
        first, got[:] = sum(got), []
        path = fetch_version(
            FetchSettings.over([origin_url], RUN, public_key=public, on_bytes=got.append), 1, tmp_path / "w"
        )
    assert same_files(path, src) and (path / COMPLETE_MARKER).exists()
    assert sum(got) <= 1_000_100 - 7 * SHARD and first + sum(got) < 1_000_100 + 2 * SHARD  # only what was missing
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v1"]


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def relay_run_config(public_text: str) -> str:
    """The RLRun a relay process reads: the run's name and the public key its manifests are signed with."""
    return bundle_yaml(rlrun(RUN, shardcast={"publicKey": public_text}))


def relay_process(config: Path, redis_url: str, port: int, upstream: str, cache: Path, log: Path) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "relay",
        "--config",
        str(config),
        "--redis-url",
        redis_url,
        "--port",
        str(port),
        "--upstream",
        upstream,
        "--cache-dir",
        str(cache),
    ]
    proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok:
                return proc
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"relay did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def test_relay_killed_mid_transfer_then_restarts_and_catches_up(tmp_path, keys, redis_url, redis_client):
    signer, public, public_text = keys
    store = open_store(f"file://{tmp_path}/store")
    src1 = make_version(tmp_path / "v1", 1, size=12_000_000)  # ~180 shards: both relays serve some of them
    publish_version(store, RUN, 1, src1, signer=signer, shard_size=SHARD)
    config = tmp_path / "rlrun.yaml"
    config.write_text(relay_run_config(public_text))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    with serving(origin.make_app(store, RUN)) as origin_url:
        try:
            for i, port in enumerate(ports):
                procs.append(
                    relay_process(
                        config, redis_url, port, origin_url, tmp_path / f"relay{i}", tmp_path / f"relay{i}.log"
                    )
                )
            received, killed = [0], []

            def kill_first(n: int) -> None:
                received[0] += n
                # Mid-transfer, and only once relay 0 has served a shard (which relay a shard comes
                # from is the client's weighted random pick, so a byte count alone can come too early).
                if received[0] > 3_000_000 and sources.ok[urls[0]] > 0 and not killed:
                    procs[0].send_signal(signal.SIGKILL)
                    killed.append(procs[0].wait())

            sources = Sources(urls)
            path = fetch_version(
                FetchSettings(sources, RUN, timeout=60, public_key=public, on_bytes=kill_first), 1, tmp_path / "worker"
            )
            assert killed and same_files(path, src1)
            assert sources.ok[urls[0]] > 0 and sources.fail[urls[0]] > 0  # it served, then died mid-transfer

            # restarted on the same port and cache: it catches up with the announced version
            procs[0] = relay_process(
                config, redis_url, ports[0], origin_url, tmp_path / "relay0", tmp_path / "relay0.log"
            )
            src2 = make_version(tmp_path / "v2", 2, size=500_000)
            publish_version(store, RUN, 2, src2, signer=signer, shard_size=SHARD)
            redis_client.xadd(RunKeys(RUN).policy, encode_json({"version": 2}))
            held = tmp_path / "relay0" / RUN
            deadline = time.monotonic() + 20
            while not (held / "v2" / COMPLETE_MARKER).exists():
                assert time.monotonic() < deadline, "restarted relay did not catch up"
                time.sleep(0.05)
            path2 = fetch_version(
                FetchSettings.over([urls[0]], RUN, timeout=20, public_key=public), 2, tmp_path / "worker"
            )
            assert same_files(path2, src2)
            # a v1 pull cut by the kill was dropped once v2 was pulled (v1 stays only if it had completed)
            assert {p.name for p in held.iterdir()} - {"v1"} == {"v2"}
            assert all((p / COMPLETE_MARKER).exists() for p in held.iterdir())
        finally:
            for proc in procs:
                stop_process(proc)


def test_retention_and_disk_bound_hold_over_many_versions(tmp_path, keys):
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    size = 200_000
    bound = int(2.5 * size)
    root = tmp_path / "relay" / RUN

    def disk() -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(
                relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3, public_key=public, max_disk_bytes=bound)
            )
        ) as relay_url,
    ):
        for v in range(1, 11):
            src = make_version(tmp_path / "src", v, size=size)
            publish_version(store, RUN, v, src, signer=signer, shard_size=SHARD)
            path = fetch_version(
                FetchSettings.over([relay_url], RUN, timeout=20, public_key=public), v, tmp_path / "worker"
            )
            assert same_files(path, src)
            deadline = time.monotonic() + 5
            while not (root / f"v{v}" / COMPLETE_MARKER).exists():
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert disk() <= bound, (v, disk())
            held = {p.name for p in root.iterdir()}
            assert held == {f"v{u}" for u in range(max(1, v - 1), v + 1)}, held  # the bound allows two

        # The gauge is set by the retention pass that follows v10's rename, a moment after the
        # directory (and the fetch's last byte) became visible: ask until that pass has run.
        def counted_two() -> str | None:
            body = requests.get(relay_url + "/metrics", timeout=10).text
            return body if "rlfleet_relay_versions_held 2.0" in body else None

        metrics = wait_for("the relay's /metrics to count two versions held", counted_two, 5, every=0.02)
        assert "rlfleet_relay_shard_seconds_bucket" in metrics
        big = make_version(tmp_path / "big", 99, size=bound)
        publish_version(store, RUN, 11, big, signer=signer, shard_size=SHARD)
        r = requests.get(relay_url + file_path(RUN, 11, MANIFEST_NAME), timeout=10)
        assert r.status_code == 502 and "disk bound" in r.text
        assert {p.name for p in root.iterdir()} == {"v9", "v10"}  # refused before anything was dropped


def test_relay_killed_mid_pull_resumes_with_only_the_missing_shards(tmp_path, keys, redis_url, redis_client):
    """SIGKILL a relay process mid-pull; restarted on the same cache, it re-hashes the shards its
    journal lists and asks upstream only for the others (counted at a proxy in front of the origin)."""
    signer, public, public_text = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=3_000_000)
    manifest = publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    model = manifest.file("model.safetensors")
    index = manifest.files.index(model)
    asked: list[tuple[str, int]] = []  # (Range header, body bytes) of every model request upstream saw

    async def count_and_slow(request, name, body, status, headers):
        if name == "model.safetensors":
            asked.append((request.headers.get("Range", ""), len(body)))
            await asyncio.sleep(0.05)  # so the kill lands mid-pull
        return web.Response(status=status, body=body, headers=headers)

    config = tmp_path / "rlrun.yaml"
    config.write_text(relay_run_config(public_text))
    port, cache = free_port(), tmp_path / "relay"
    partial = cache / RUN / ".v1.partial"
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(evil_relay(origin_url, count_and_slow)) as upstream,
    ):
        proc = relay_process(config, redis_url, port, upstream, cache, tmp_path / "relay.log")
        try:
            redis_client.xadd(RunKeys(RUN).policy, encode_json({"version": 1}))  # it starts pulling
            deadline = time.monotonic() + 30
            while not (partial / ".shards").exists() or (partial / ".shards").read_text().count("\n") < 10:
                assert time.monotonic() < deadline, "the relay did not start pulling"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(0.5)  # requests upstream was still answering for the dead relay end here
            journaled = {tuple(map(int, line.split())) for line in (partial / ".shards").read_text().splitlines()}
            kept = sum(model.shards[j].size for i, j in journaled if i == index)
            assert 0 < kept < model.size
            before = len(asked)
            proc = relay_process(config, redis_url, port, upstream, cache, tmp_path / "relay.log")
            wait = time.monotonic() + 30
            while not (cache / RUN / "v1" / COMPLETE_MARKER).exists():  # it resumes the announced v1
                assert time.monotonic() < wait, "the restarted relay did not finish v1"
                time.sleep(0.05)
            after = asked[before:]
            assert sum(n for _, n in after) == model.size - kept  # exactly the missing shards
            resumed = {
                f"bytes={s.offset}-{s.offset + s.size - 1}"
                for j, s in enumerate(model.shards)
                if (index, j) in journaled
            }
            assert not resumed & {rng for rng, _ in after}  # no journaled shard was asked for again
            path = fetch_version(
                FetchSettings.over([f"http://127.0.0.1:{port}"], RUN, timeout=20, public_key=public),
                1,
                tmp_path / "worker",
            )
            assert same_files(path, src)
        finally:
            stop_process(proc)


def test_a_failed_pull_keeps_its_verified_shards_and_the_next_pull_asks_only_for_the_rest(tmp_path, keys):
    """Bug: a relay deleted the partial dir of a pull that failed (its upstream down past the pull's deadline), so
    every try of a version too large for one deadline started from zero. Now it keeps the journal of verified
    shards and the next pull fetches only the others (counted at a proxy in front of the origin)."""
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1)
    manifest = publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    model = manifest.file("model.safetensors")
    served: list[int] = []  # the model bytes upstream sent, per response
    upstream_breaks_after = [6]  # model shards upstream serves before it answers 503 (empty: it never breaks)

    async def breaks(request, name, body, status, headers):
        if name == "model.safetensors":
            if upstream_breaks_after and len(served) >= upstream_breaks_after[0]:
                return web.Response(status=503, text="upstream restarting")
            served.append(len(body))
        return web.Response(status=status, body=body, headers=headers)

    cache = tmp_path / "relay"
    with serving(origin.make_app(store, RUN)) as origin_url, serving(evil_relay(origin_url, breaks)) as upstream:
        settings = relay.RelaySettings(upstream, cache, RUN, 3, fetch_timeout=2.0, public_key=public, parallel=1)
        with serving(relay.make_app(settings)) as relay_url:
            client = FetchSettings.over([relay_url], RUN, timeout=5, public_key=public)
            with pytest.raises(FetchError):
                fetch_version(client, 1, tmp_path / "first-worker")
            journal = cache / RUN / ".v1.partial" / ".shards"
            wait_for("the failed pull's journal", lambda: journal.exists() and journal.read_text(), 10)
            kept = sum(served)
            assert kept == 6 * SHARD and not (cache / RUN / "v1").exists()
            upstream_breaks_after.clear()
            path = fetch_version(client, 1, tmp_path / "second-worker")
    assert same_files(path, src) and (cache / RUN / "v1" / COMPLETE_MARKER).exists()
    assert sum(served) == model.size, "the second pull asked upstream only for the shards the first did not verify"


@contextlib.contextmanager
def hung_server():
    """A server that accepts connections and never answers (a SIGSTOPped origin's kernel still
    completes handshakes); yields (base URL, the list of connections it accepted)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (close alone does not)
        listener.close()
        for conn in accepted:
            conn.close()
        thread.join(5)


def test_a_relay_stops_at_once_while_every_request_upstream_hangs(tmp_path, keys, redis_client):
    """The upstream hangs with one of each request the relay makes in flight: the pull of an
    announced version, the probe for a version a client asks for, `latest`. The relay stops well
    before READ_TIMEOUT would free any of them (a probe once read for 60 s and kept a stopping relay
    past its grace period), and the clients waiting on the probe and on `latest` get 502."""
    _, public, _ = keys
    answers: dict[str, int] = {}

    def ask(name: str, path: str) -> None:
        with contextlib.suppress(requests.RequestException):
            answers[name] = requests.get(relay_url + path, timeout=30).status_code

    with hung_server() as (upstream, accepted):
        app = relay.make_app(
            relay.RelaySettings(upstream, tmp_path / "relay", RUN, 3, public_key=public), redis_client=redis_client
        )
        with serving(app) as relay_url:
            redis_client.xadd(RunKeys(RUN).policy, encode_json({"version": 1}))  # the pull of v1
            clients = [
                threading.Thread(target=ask, args=("probe", file_path(RUN, 2, MANIFEST_NAME))),
                threading.Thread(target=ask, args=("latest", latest_path(RUN))),
            ]
            for client in clients:
                client.start()
            wait_for("the pull, the probe and `latest` to reach the upstream", lambda: len(accepted) >= 3)
            assert answers == {}  # all three wait on the upstream
            stopping = time.monotonic()
        stopped_in = time.monotonic() - stopping
        for client in clients:
            client.join(5)
    assert stopped_in < READ_TIMEOUT / 2, f"the relay took {stopped_in:.1f} s to stop"
    assert answers == {"probe": 502, "latest": 502}
