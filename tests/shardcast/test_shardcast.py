"""Shardcast end to end on real servers: store -> origin -> relay -> client, over 127.0.0.1 HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import boto3
import pytest
import requests
from aiohttp import web
from prometheus_client import REGISTRY

from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.client import FetchError, FetchSettings, fetch_version, wait_for_version
from rlfleet.services.shardcast.protocol import file_path, latest_path
from rlfleet.services.shardcast.protocol import healthz as origin_healthz
from rlfleet.versions.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_NAME,
    publish_version,
    save_model_dir,
    verify_dir,
    version_key,
)
from rlfleet.versions.store import open_store
from rlfleet.wire.streams import RunKeys, encode_json
from tests.support import serving, wait_for

RUN = "demo"


def proxy_app(upstream: str, mangle) -> web.Application:
    """An upstream that forwards to `upstream` and lets `mangle(request, name, response)` answer files."""

    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k == "Range"}
        r = await asyncio.to_thread(requests.get, upstream + request.path, headers=headers, timeout=10)
        name = request.match_info.get("name")
        if name is not None and r.status_code in (200, 206):
            return await mangle(request, name, r)
        return web.Response(status=r.status_code, body=r.content, content_type=r.headers.get("Content-Type"))

    app = web.Application()
    app.router.add_get("/healthz", origin_healthz)
    app.router.add_get("/v1/{run}/latest", forward)
    app.router.add_get(r"/v1/{run}/v{version:\d+}/{name:.+}", forward)
    return app


def latest_version(base_url: str, run: str) -> int:
    """What a server's `latest` answers (HTTP 200 expected)."""
    r = requests.get(base_url + latest_path(run), timeout=10)
    r.raise_for_status()
    return int(r.json()["version"])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    path = tmp_path_factory.mktemp("model")
    save_model_dir(Qwen2ForCausalLM(config), None, path)
    return path


def small_version(path: Path, seed: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(f'{{"seed": {seed}}}')
    (path / "model.safetensors").write_bytes(os.urandom(300_000))
    return path


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    endpoint = request.getfixturevalue("s3_env")
    bucket = f"shardcast-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/ckpt", endpoint_url=endpoint)


def test_origin_relay_client_delivers_a_model(store, model_dir, tmp_path):
    from transformers import Qwen2ForCausalLM

    manifest = publish_version(store, RUN, 1, model_dir)
    blob = (model_dir / "model.safetensors").read_bytes()
    out_before = metric("rlfleet_relay_bytes_out_total")
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3))) as relay_url,
    ):
        assert latest_version(origin_url, RUN) == 1
        path = fetch_version(FetchSettings.over([relay_url], RUN, timeout=30), 1, tmp_path / "worker")
        assert latest_version(relay_url, RUN) == 1
        for url in (origin_url, relay_url):  # HTTP Range, on the origin (store) and the relay (disk)
            file_url = url + file_path(RUN, 1, "model.safetensors")
            r = requests.get(file_url, headers={"Range": "bytes=10-19"}, timeout=10)
            assert r.status_code == 206 and r.content == blob[10:20]
            assert r.headers["Content-Range"] == f"bytes 10-19/{len(blob)}"
            assert requests.get(file_url, headers={"Range": "bytes=-5"}, timeout=10).content == blob[-5:]
            assert requests.get(file_url, headers={"Range": f"bytes={len(blob)}-"}, timeout=10).status_code == 416
            assert requests.get(file_url, timeout=10).content == blob
    assert path == tmp_path / "worker" / "v1" and (path / COMPLETE_MARKER).exists()
    for source in model_dir.iterdir():
        assert sha256(path / source.name) == sha256(source), source.name
    verify_dir(path, manifest)
    assert (tmp_path / "relay" / RUN / "v1" / COMPLETE_MARKER).exists()
    assert metric("rlfleet_relay_bytes_out_total") - out_before >= len(blob)
    loaded = Qwen2ForCausalLM.from_pretrained(path).state_dict()
    original = Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()
    assert loaded.keys() == original.keys() and all((loaded[k] == original[k]).all() for k in loaded)


def test_partial_versions_are_never_served(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    publish_version(store, RUN, 1, small_version(tmp_path / "v1", 1))
    v2 = small_version(tmp_path / "v2", 2)
    store.put_file(version_key(RUN, 2, "model.safetensors"), v2 / "model.safetensors")  # no manifest yet
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3))) as relay_url,
    ):
        for url in (origin_url, relay_url):
            assert requests.get(url + file_path(RUN, 2, "model.safetensors"), timeout=10).status_code == 404
            assert requests.get(url + file_path(RUN, 2, MANIFEST_NAME), timeout=10).status_code == 404
            assert requests.get(url + file_path(RUN, 1, "not-listed.bin"), timeout=10).status_code == 404
            assert requests.get(url + "/v1/other-run/latest", timeout=10).status_code == 404
            assert latest_version(url, RUN) == 1
        # a client asking for v2 early keeps retrying until it is published
        result = {}
        waiter = threading.Thread(
            target=lambda: result.update(
                path=fetch_version(FetchSettings.over([relay_url], RUN, timeout=20), 2, tmp_path / "worker")
            )
        )
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()
        publish_version(store, RUN, 2, v2)
        waiter.join(20)
    assert sha256(result["path"] / "model.safetensors") == sha256(v2 / "model.safetensors")


def test_corrupted_upstream_is_never_served(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    src = small_version(tmp_path / "v1", 1)
    publish_version(store, RUN, 1, src)
    seen = []

    async def corrupt(request, name, r):
        body = bytearray(r.content)
        if name == "model.safetensors":
            seen.append(name)
            body[len(body) // 2] ^= 0x01
        return web.Response(status=r.status_code, body=bytes(body))

    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(proxy_app(origin_url, corrupt)) as bad_url,
        serving(
            relay.make_app(relay.RelaySettings(bad_url, tmp_path / "relay", RUN, 3, fetch_timeout=0.5))
        ) as relay_url,
    ):
        # the relay passes bytes on as they arrive, but cuts off every response holding the shard
        # that failed its check (or answers 502 once its pull gave up): none ever completes
        with pytest.raises(FetchError, match="HTTP 502|truncated body"):
            fetch_version(FetchSettings.over([relay_url], RUN, timeout=2.5), 1, tmp_path / "via-relay")
        assert seen, "the relay never asked the corrupting upstream"
        assert not (tmp_path / "relay" / RUN / "v1").exists()
        for _ in range(3):
            try:
                r = requests.get(relay_url + file_path(RUN, 1, "model.safetensors"), timeout=10)
            except requests.exceptions.ChunkedEncodingError:  # cut off before its end
                continue
            assert r.status_code == 502, f"HTTP {r.status_code} with {len(r.content)} bytes"
        assert not (tmp_path / "via-relay" / "v1").exists()

        with pytest.raises(FetchError, match="sha256"):
            fetch_version(FetchSettings.over([bad_url], RUN, timeout=0.5), 1, tmp_path / "direct")
        # no version dir; the partial one kept for a later try to resume holds no shard of the corrupted file
        partial = tmp_path / "direct" / ".v1.partial"
        assert [p.name for p in (tmp_path / "direct").iterdir()] == [partial.name]
        files = [f["name"] for f in json.loads((partial / MANIFEST_NAME).read_text())["files"]]
        journaled = {files[int(line.split()[0])] for line in (partial / ".shards").read_text().splitlines()}
        assert "model.safetensors" not in journaled, journaled

        path = fetch_version(FetchSettings.over([bad_url, origin_url], RUN, timeout=10), 1, tmp_path / "two-urls")
    assert sha256(path / "model.safetensors") == sha256(src / "model.safetensors")


def test_client_resumes_a_broken_download(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    src = small_version(tmp_path / "v1", 1)
    publish_version(store, RUN, 1, src)
    ranges = []

    async def cut_first(request, name, r):
        if name == "model.safetensors":
            ranges.append(request.headers.get("Range"))
        if name == "model.safetensors" and len(ranges) == 1:  # send half, then drop the connection
            resp = web.StreamResponse(status=200)
            resp.content_length = len(r.content)
            await resp.prepare(request)
            await resp.write(r.content[: len(r.content) // 2])
            request.transport.close()
            return resp
        headers = {k: v for k, v in r.headers.items() if k == "Content-Range"}
        return web.Response(status=r.status_code, body=r.content, headers=headers)

    with serving(origin.make_app(store, RUN)) as origin_url, serving(proxy_app(origin_url, cut_first)) as flaky:
        path = fetch_version(FetchSettings.over([flaky], RUN, timeout=10), 1, tmp_path / "worker")
    half = (src / "model.safetensors").stat().st_size // 2
    assert ranges[0] is None and len(ranges) == 2 and ranges[1].startswith("bytes=")
    resumed_at = int(ranges[1][len("bytes=") : -1])
    assert 0 < resumed_at <= half  # the second request asked only for what was missing
    assert sha256(path / "model.safetensors") == sha256(src / "model.safetensors")


def test_relay_prefetches_announced_versions(tmp_path, redis_client):
    store = open_store(f"file://{tmp_path}/store")
    policy = RunKeys(RUN).policy
    publish_version(store, RUN, 1, small_version(tmp_path / "v1", 1))
    redis_client.xadd(policy, encode_json({"version": 1}))  # announced before the relay starts
    in_before = metric("rlfleet_relay_bytes_in_total")
    held = tmp_path / "relay" / RUN
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3), redis_client=redis_client)),
    ):
        wait_for(
            "prefetch of the newest announced v1", lambda: (held / "v1" / COMPLETE_MARKER).exists(), 10, every=0.05
        )
        publish_version(store, RUN, 2, small_version(tmp_path / "v2", 2))
        redis_client.xadd(policy, {b"m": b"not json"})  # a bad message is skipped, not fatal
        redis_client.xadd(policy, encode_json({"version": 2, "step": 2}))
        wait_for("prefetch of v2", lambda: (held / "v2" / COMPLETE_MARKER).exists(), 10, every=0.05)
    assert metric("rlfleet_relay_bytes_in_total") - in_before >= 600_000  # no client ever asked


def test_relay_keeps_only_k_versions(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    for v in (1, 2, 3):
        publish_version(store, RUN, v, small_version(tmp_path / f"v{v}", v))
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 2))) as relay_url,
    ):
        for v in (1, 2, 3):
            fetch_version(FetchSettings.over([relay_url], RUN, timeout=20), v, tmp_path / "worker")
        assert sorted(p.name for p in (tmp_path / "relay" / RUN).iterdir()) == ["v2", "v3"]

        # set by the retention pass right after v3's rename, which may trail the fetch's last byte
        def counted_two() -> bool:
            return REGISTRY.get_sample_value("rlfleet_relay_versions_held") == 2

        wait_for("the gauge to count two versions held", counted_two, 5, every=0.02)
        r = requests.get(relay_url + file_path(RUN, 1, MANIFEST_NAME), timeout=10)
        assert r.status_code == 410 and "older" in r.text  # dropped by retention: gone, not "not yet"


def test_client_is_idempotent_and_replaces_leftovers(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    publish_version(store, RUN, 1, small_version(tmp_path / "v1", 1))
    publish_version(store, RUN, 2, small_version(tmp_path / "v2", 2))
    dest = tmp_path / "worker"
    (dest / "v2").mkdir(parents=True)
    (dest / "v2" / "model.safetensors").write_bytes(b"leftover of a crashed copy")  # no .complete
    with serving(origin.make_app(store, RUN)) as origin_url:
        first = fetch_version(FetchSettings.over([origin_url], RUN, timeout=10), 1, dest)
        fetch_version(FetchSettings.over([origin_url], RUN, timeout=10), 2, dest)
    assert sha256(dest / "v2" / "model.safetensors") == sha256(tmp_path / "v2" / "model.safetensors")
    started = time.monotonic()
    assert (
        fetch_version(FetchSettings.over(["http://127.0.0.1:9"], RUN, timeout=5), 1, dest) == first
    )  # nothing is contacted
    assert time.monotonic() - started < 0.5
    with pytest.raises(FetchError, match="within 0.5 s"):
        fetch_version(FetchSettings.over(["http://127.0.0.1:9"], RUN, timeout=0.5), 3, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["v1", "v2"]


def test_versions_are_announced_by_long_poll_through_origin_and_relay(tmp_path, redis_client):
    """No policy stream at the relay: it learns of v1 by long-polling the origin, and a client
    long-polling the relay is answered when v1 is published, not on a timer of its own."""
    store = open_store(f"file://{tmp_path}/store")
    held = tmp_path / "relay" / RUN
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 3))) as relay_url,
    ):
        for url in (origin_url, relay_url):
            r = requests.get(url + latest_path(RUN), params={"after": 0, "wait": 0.2}, timeout=10)
            assert r.status_code == 204  # nothing newer within the wait
            r = requests.get(url + latest_path(RUN), params={"after": "latest"}, timeout=10)
            assert r.status_code == 400 and "'after' must be an integer" in r.text
            r = requests.get(url + latest_path(RUN), params={"after": 0, "wait": 9999}, timeout=10)
            assert r.status_code == 400 and "'wait' must be between" in r.text
        answers: dict[str, int | None] = {}
        waiters = [
            threading.Thread(target=lambda u=u: answers.__setitem__(u, wait_for_version([u], RUN, 0, timeout=30)))
            for u in (origin_url, relay_url)
        ]
        for t in waiters:
            t.start()
        time.sleep(0.3)  # both are hanging in their long-poll now
        assert not answers
        publish_version(store, RUN, 1, small_version(tmp_path / "v1", 1))
        for t in waiters:
            t.join(30)
        assert answers == {origin_url: 1, relay_url: 1}
        wait_for("the relay's prefetch of v1", lambda: (held / "v1" / COMPLETE_MARKER).exists(), 20, every=0.05)
        assert wait_for_version([relay_url], RUN, 1, timeout=0.5) is None  # nothing newer than v1
        assert wait_for_version([relay_url], RUN, 0, timeout=5) == 1  # answered at once

    # with the policy stream, the origin answers on the announcement
    with serving(origin.make_app(store, RUN, redis_client)) as origin_url:
        got = []
        waiter = threading.Thread(target=lambda: got.append(wait_for_version([origin_url], RUN, 1, timeout=30)))
        waiter.start()
        publish_version(store, RUN, 2, small_version(tmp_path / "v2", 2))
        redis_client.xadd(RunKeys(RUN).policy, encode_json({"version": 2}))
        waiter.join(30)
        assert got == [2]
