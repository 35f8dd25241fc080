"""Delta versions through Shardcast on real servers over 127.0.0.1: store -> origin -> relay -> workers
rebuilding versions from the one they hold; relay retention of chains; every bad delta refused."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests
from aiohttp import web

from rlfleet.config import DeltaSpec
from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchError, FetchSettings
from rlfleet.services.shardcast.protocol import healthz
from rlfleet.versions.checkpoint import COMPLETE_MARKER, MANIFEST_NAME
from rlfleet.versions.manifest import FileEntry, Manifest, Shard, signing_bytes
from rlfleet.versions.publish import PolicyPublisher, local_entries
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from tests.support import serving, trained_versions

RUN = "demo"
SHARD = 8192
PATCH = "delta/model.safetensors.delta"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """v0 whole, v1..v3 deltas (bf16, real AdamW steps), v4 whole and a delta (fullEvery 4):
    (store dir, sources, public key)."""
    tmp = tmp_path_factory.mktemp("published")
    private, public = generate_keypair(tmp / "keys")
    store = open_store(f"file://{tmp}/store")
    sources = trained_versions(tmp / "src", 5, "bfloat16")
    publisher = PolicyPublisher(
        store, RUN, DeltaSpec(full_every=4, max_chain_ratio=100.0), make_signer(load_private_key(private)), SHARD
    )
    kinds = []
    for v, src in enumerate(sources):
        shutil.copytree(src, tmp / f"copy{v}")
        publisher.publish(v, tmp / f"copy{v}")
        kinds.append(publisher.last["kind"])
    assert kinds == ["full", "delta", "delta", "delta", "full+delta"]
    return tmp / "store", sources, parse_public_key(public)


def same_as(path: Path, src: Path) -> bool:
    """`path` holds exactly the files of `src` (and nothing but them, the manifest and .complete)."""
    want = {e.name: e.sha256 for e in local_entries(src)}
    return {e.name: e.sha256 for e in local_entries(path)} == want and not list(path.rglob("*.delta"))


def test_workers_rebuild_delta_versions_fetched_through_a_relay(published, tmp_path):
    store_dir, sources, public = published
    store = open_store(f"file://{store_dir}")
    full = sum(e.size for e in local_entries(sources[0]))
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3, public_key=public))
        ) as relay_url,
    ):
        got, report = [], {}
        path = fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 0, tmp_path / "a", report=report)
        assert report["kinds"] == ["full"] and same_as(path, sources[0])
        for v in (1, 2, 3):  # a worker holding v-1 downloads only the delta
            got.clear()
            path = fetch_policy(
                FetchSettings.over([relay_url], RUN, public_key=public, on_bytes=got.append),
                v,
                tmp_path / "a",
                report=report,
            )
            assert report["chain"] == [v] and report["kinds"] == ["delta"] and not report["rejected"]
            assert sum(got) == report["bytes"] < 0.4 * full
            assert same_as(path, sources[v]) and (path / COMPLETE_MARKER).exists()
        # a new worker: the last full version and the deltas after it
        path = fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 3, tmp_path / "b", report=report)
        assert report["chain"] == [0, 1, 2, 3] and same_as(path, sources[3])
        # one that is behind: from the version it holds
        shutil.copytree(tmp_path / "a" / "v1", tmp_path / "c" / "v1")
        path = fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 3, tmp_path / "c", report=report)
        assert report["chain"] == [2, 3] and same_as(path, sources[3])
        # v4 is whole and a delta: the worker holding v3 downloads the delta, a new one the whole files
        path = fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 4, tmp_path / "a", report=report)
        assert report["chain"] == [4] and report["kinds"] == ["delta"] and report["bytes"] < 0.4 * full
        assert same_as(path, sources[4])
        path = fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 4, tmp_path / "d", report=report)
        assert report["chain"] == [4] and report["kinds"] == ["full"] and report["bytes"] == full
        assert same_as(path, sources[4])
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "v3").state_dict()
    original = AutoModelForCausalLM.from_pretrained(sources[3]).state_dict()
    assert all(loaded[k].equal(original[k]) for k in original)


def test_relay_keeps_the_chains_of_the_versions_it_keeps(published, tmp_path):
    store_dir, sources, public = published
    store = open_store(f"file://{tmp_path}/store")
    for v in range(4):  # v0..v3 only for now
        for key in open_store(f"file://{store_dir}").list(f"{RUN}/policy/v{v}/"):
            store.put_bytes(key, (store_dir / key).read_bytes())
    with ExitStack() as stack:
        origin_url = stack.enter_context(serving(origin.make_app(store, RUN)))
        relay_cm = serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 1, public_key=public))
        )
        relay_url = relay_cm.__enter__()
        try:
            fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 3, tmp_path / "w1")
            held = sorted(p.name for p in (tmp_path / "relay" / RUN).iterdir())
            assert held == ["v0", "v1", "v2", "v3"]  # keepVersions 1, plus the chain of v3
            stack.close()  # the origin is gone: the relay alone serves a new worker the whole chain
            report = {}
            path = fetch_policy(
                FetchSettings.over([relay_url], RUN, public_key=public, timeout=20), 3, tmp_path / "w2", report=report
            )
            assert report["chain"] == [0, 1, 2, 3] and same_as(path, sources[3])
        finally:
            relay_cm.__exit__(None, None, None)
    for key in open_store(f"file://{store_dir}").list(f"{RUN}/policy/v4/"):  # v4 is whole (and a delta)
        store.put_bytes(key, (store_dir / key).read_bytes())
    with (  # restarted relay over the same cache: it keeps the chain, then drops it once v4 needs none
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 1, public_key=public))
        ) as relay_url,
    ):
        assert sorted(p.name for p in (tmp_path / "relay" / RUN).iterdir()) == ["v0", "v1", "v2", "v3"]
        fetch_policy(FetchSettings.over([relay_url], RUN, public_key=public), 4, tmp_path / "w1")
        deadline = time.monotonic() + 10  # the relay prunes once its pull is complete, maybe after the client
        while sorted(p.name for p in (tmp_path / "relay" / RUN).iterdir()) != ["v4"]:
            assert time.monotonic() < deadline, sorted(p.name for p in (tmp_path / "relay" / RUN).iterdir())
            time.sleep(0.05)


def test_a_new_worker_takes_a_whole_version_when_the_versions_before_it_are_pruned(published, tmp_path):
    """v4 is whole and a delta against v3, which retention has dropped from the store: a new worker's
    walk past the whole v4 finds v3 nowhere (404 from the relay) and builds the whole v4 at once, instead
    of waiting for v3 until its deadline (a worker started after a run resumed never loaded a version)."""
    store_dir, sources, public = published
    store = open_store(f"file://{tmp_path}/store")
    for key in open_store(f"file://{store_dir}").list(f"{RUN}/policy/v4/"):
        store.put_bytes(key, (store_dir / key).read_bytes())
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 2, public_key=public))
        ) as relay_url,
    ):
        report = {}
        path = fetch_policy(
            FetchSettings.over([relay_url], RUN, public_key=public, timeout=60), 4, tmp_path / "w", report=report
        )
        assert (report["chain"], report["kinds"]) == ([4], ["full"]) and same_as(path, sources[4])


def test_a_worker_far_behind_takes_a_whole_version_when_that_is_smaller(tmp_path):
    """fp32 at a high learning rate: deltas of ~0.7 x a checkpoint. A worker holding v1 could rebuild v3
    from two deltas (~1.4 x) but downloads the whole v3 (1 x); one holding v2 takes v3's delta."""
    private, public = generate_keypair(tmp_path / "keys")
    key = parse_public_key(public)
    store = open_store(f"file://{tmp_path}/store")
    sources = trained_versions(tmp_path / "src", 4, "float32", lr=1e-2)
    spec = DeltaSpec(full_every=3, max_ratio=1.0, max_chain_ratio=100.0)
    publisher = PolicyPublisher(store, RUN, spec, make_signer(load_private_key(private)), SHARD)
    for v, src in enumerate(sources):
        shutil.copytree(src, tmp_path / f"copy{v}")
        publisher.publish(v, tmp_path / f"copy{v}")
        assert publisher.last["kind"] == ["full", "delta", "delta", "full+delta"][v]
        assert v == 0 or 0.5 < publisher.last["delta_bytes"] / publisher.last["full_bytes"] < 1.0
    with serving(origin.make_app(store, RUN)) as origin_url:
        for held, chain, kinds in ((1, [3], ["full"]), (2, [3], ["delta"]), (0, [3], ["full"])):
            dest = tmp_path / f"worker-{held}"
            fetch_policy(FetchSettings.over([origin_url], RUN, public_key=key), held, dest)
            report = {}
            path = fetch_policy(FetchSettings.over([origin_url], RUN, public_key=key), 3, dest, report=report)
            assert (report["chain"], report["kinds"]) == (chain, kinds), held
            assert same_as(path, sources[3])


def evil_relay(upstream: str, mangle) -> web.Application:
    """Forwards to `upstream`; `mangle(version, name, body, status, headers)` may lie about files."""

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k == "Range"}
        r = await asyncio.to_thread(requests.get, upstream + request.path, headers=headers, timeout=10)
        out = {k: v for k, v in r.headers.items() if k in ("Content-Range", "Content-Type")}
        if r.status_code in (200, 206):
            version, name = int(request.match_info["version"]), request.match_info["name"]
            body = mangle(version, name, r.content)
            return web.Response(status=r.status_code, body=body, headers=out)
        return web.Response(status=r.status_code, body=r.content)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get(r"/v1/{run}/v{version:\d+}/{name:.+}", forward)
    return app


def test_every_bad_delta_is_refused_and_the_client_recovers(published, tmp_path):
    """Each fault, alone, never gets a version installed; beside an honest relay the worker ends with
    exactly the published bytes. Damaged or foreign bases are refused and rebuilt from the full version."""
    store_dir, sources, public = published
    store = open_store(f"file://{store_dir}")
    attacker = make_signer(load_private_key(generate_keypair(tmp_path / "attacker")[0]))
    served = dict.fromkeys(["flipped", "truncated", "forged", "unsigned", "mismatched"], 0)

    def flipped(version, name, body):
        if name == PATCH:
            served["flipped"] += 1
            at = served["flipped"] * 7919 % len(body)  # a different byte each time
            body = body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1 :]
        return body

    def truncated(version, name, body):
        if name == PATCH:
            served["truncated"] += 1
            body = body[: len(body) // 2]
        return body

    def forged(version, name, body):
        """The rebuilt file's hash swapped for one of the attacker's choosing, re-signed with the wrong key."""
        if name == MANIFEST_NAME and version == 2:
            served["forged"] += 1
            manifest = json.loads(body)
            entry = next(e for e in manifest["delta"]["files"] if e["name"] == "model.safetensors")
            entry["sha256"] = hashlib.sha256(b"poison").hexdigest()
            manifest["signature"] = attacker(signing_bytes(manifest))
            body = json.dumps(manifest).encode()
        return body

    def unsigned(version, name, body):
        """The delta re-pointed at another base without a new signature."""
        if name == MANIFEST_NAME and version == 2:
            served["unsigned"] += 1
            manifest = json.loads(body)
            manifest["delta"]["base"] = 0
            body = json.dumps(manifest).encode()
        return body

    def mismatched(version, name, body):
        """A valid, signed delta manifest, of another version."""
        if name == MANIFEST_NAME and version == 2:
            served["mismatched"] += 1
            body = store.get_bytes(f"{RUN}/policy/v3/manifest.json")
        return body

    faults = {"flipped": "sha256", "truncated": "truncated", "forged": "signature does not verify"}
    faults |= {"unsigned": "signature does not verify", "mismatched": "describes run 'demo' v3"}
    mangles = {"flipped": flipped, "truncated": truncated, "forged": forged}
    mangles |= {"unsigned": unsigned, "mismatched": mismatched}
    with ExitStack() as stack:
        origin_url = stack.enter_context(serving(origin.make_app(store, RUN)))
        honest = stack.enter_context(
            serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3, public_key=public)))
        )
        held = fetch_policy(FetchSettings.over([honest], RUN, public_key=public), 1, tmp_path / "held")
        for fault, match in faults.items():
            liar = stack.enter_context(serving(evil_relay(origin_url, mangles[fault])))
            dest = tmp_path / fault
            shutil.copytree(held, dest / "v1")
            with pytest.raises(FetchError, match=match):  # alone: refused every time it lies
                fetch_policy(FetchSettings.over([liar], RUN, public_key=public, timeout=1.5), 2, dest)
            assert sorted(p.name for p in dest.iterdir() if not p.name.endswith(".partial")) == ["v1"], fault
            for partial in dest.glob(".*.partial"):  # kept for a later try to resume: no shard of the liar in it
                assert not (partial / ".shards").exists() or not (partial / ".shards").read_text(), fault
            report = {}
            path = fetch_policy(
                FetchSettings.over([liar, honest], RUN, public_key=public, timeout=30), 2, dest, report=report
            )
            assert same_as(path, sources[2]) and report["chain"] == [2], fault  # still only the delta
        assert all(n > 0 for n in served.values()), served

        # a base from another lineage (same version number, other bytes): refused before any download,
        # the worker starts again from the full version
        foreign = trained_versions(tmp_path / "foreign", 2, "bfloat16", seed=7)[1]
        dest = tmp_path / "foreign-base"
        shutil.copytree(foreign, dest / "v1")
        entries = local_entries(foreign)  # one shard per file
        files = [FileEntry(e.name, e.size, e.sha256, (Shard(0, e.size, e.sha256),) if e.size else ()) for e in entries]
        foreign_manifest = Manifest(RUN, 1, max(1, *(e.size for e in entries)), tuple(files))
        (dest / "v1" / MANIFEST_NAME).write_bytes(foreign_manifest.encode())
        (dest / "v1" / COMPLETE_MARKER).write_text("")
        report = {}
        path = fetch_policy(FetchSettings.over([honest], RUN, public_key=public), 2, dest, report=report)
        assert report["chain"] == [0, 1, 2] and "wrong base" in report["rejected"][0]
        assert same_as(path, sources[2]) and same_as(dest / "v1", sources[1])

        # a base damaged on disk after it was verified: the rebuilt bytes do not match the signed
        # manifest, the damaged base is discarded and the version rebuilt from the full one
        dest = tmp_path / "damaged-base"
        shutil.copytree(held, dest / "v1")
        blob = bytearray((dest / "v1" / "model.safetensors").read_bytes())
        blob[len(blob) // 2] ^= 0x40
        (dest / "v1" / "model.safetensors").write_bytes(bytes(blob))
        report = {}
        path = fetch_policy(FetchSettings.over([honest], RUN, public_key=public), 2, dest, report=report)
        assert report["chain"] == [0, 1, 2] and "damaged base" in report["rejected"][0]
        assert same_as(path, sources[2]) and same_as(dest / "v1", sources[1])
