"""A fetch's deadline grows with its bytes (`FetchSettings.min_rate`, the run's
shardcast.minRateBytesPerSecond): a link slower than the fixed deadline allows still gets its version; one that
runs out of time keeps the shards it verified, and the next try downloads only the others. A worker's follower
tries a failed fetch again instead of dying (rlfleet/services/rollout/follower.py). Against the real origin,
behind a relay that serves each shard late (a slow link) or not at all (a relay that is down)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from rlfleet.config import parse_bundle
from rlfleet.services.rollout import follower as follower_module
from rlfleet.services.rollout.follower import VersionFollower
from rlfleet.services.shardcast import origin
from rlfleet.services.shardcast.client import FetchError, FetchSettings, fetch_version
from rlfleet.versions.checkpoint import COMPLETE_MARKER, publish_version
from rlfleet.versions.store import open_store
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, encode_json
from tests.runs import bundle_yaml, rlrun
from tests.shardcast.test_shardcast_faults import RUN, SHARD, evil_relay, keys, make_version, same_files  # noqa: F401
from tests.support import redis_from_url, serving, wait_for

SIZE = 1_000_000  # 16 shards of SHARD
PER_SHARD_S = 0.4  # the slow link: 16 shards one after another take 6.4 s
DEADLINE_S = 2.0  # the fixed deadline: a third of what the slow link needs


def slow_link(served: list[int]):
    """A relay's mangle that serves model shards PER_SHARD_S late and counts their bytes in `served`."""

    async def late(request, name, body, status, headers):
        if name == "model.safetensors":
            await asyncio.sleep(PER_SHARD_S)
            served.append(len(body))
        return web.Response(status=status, body=body, headers=headers)

    return late


def test_a_link_slower_than_the_deadline_gets_the_version_at_the_floor_rate(tmp_path, keys):  # noqa: F811
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=SIZE)
    publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    served: list[int] = []
    with serving(origin.make_app(store, RUN)) as origin_url, serving(evil_relay(origin_url, slow_link(served))) as slow:
        # the version needs 3x the fixed deadline on this link; 100 kB/s is a floor it stays above
        settings = FetchSettings.over([slow], RUN, public_key=public, parallel=1, timeout=DEADLINE_S, min_rate=100_000)
        path = fetch_version(settings, 1, tmp_path / "w")
    assert same_files(path, src) and (path / COMPLETE_MARKER).exists()
    assert sum(served) == SIZE


def test_a_fetch_out_of_time_keeps_its_verified_shards_and_the_next_try_resumes(tmp_path, keys):  # noqa: F811
    signer, public, _ = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=SIZE)
    manifest = publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    served: list[int] = []
    with serving(origin.make_app(store, RUN)) as origin_url, serving(evil_relay(origin_url, slow_link(served))) as slow:
        with pytest.raises(FetchError, match="not fetched and verified within"):
            settings = FetchSettings.over([slow], RUN, public_key=public, parallel=1, timeout=DEADLINE_S)
            fetch_version(settings, 1, tmp_path / "w")
        journal = (tmp_path / "w" / ".v1.partial" / ".shards").read_text().splitlines()
        model = manifest.files.index(manifest.file("model.safetensors"))
        kept = sum(1 for line in journal if int(line.split()[0]) == model)
        assert 0 < kept < len(manifest.file("model.safetensors").shards), "some shards verified, and kept"
        got: list[int] = []
        again = FetchSettings.over([slow], RUN, public_key=public, parallel=1, on_bytes=got.append)
        path = fetch_version(again, 1, tmp_path / "w")
    assert same_files(path, src)
    assert sum(got) == SIZE - kept * SHARD, "the second try received only the shards not kept"
    assert sum(served) <= SIZE + SHARD, "no byte served twice beyond the one shard in flight at the deadline"


def test_a_follower_whose_fetch_fails_tries_again_and_gets_the_version(tmp_path, keys, redis_url, monkeypatch):  # noqa: F811
    """Bug: the follower thread survived only a version the relays dropped; any other failed fetch (every
    relay down past the deadline) ended it, and the worker with it."""
    signer, public, public_text = keys
    store = open_store(f"file://{tmp_path}/store")
    src = make_version(tmp_path / "v1", 1, size=SIZE)
    publish_version(store, RUN, 1, src, signer=signer, shard_size=SHARD)
    down = threading.Event()
    down.set()

    async def maybe_down(request, name, body, status, headers):
        if down.is_set():
            return web.Response(status=503, text="relay restarting")
        return web.Response(status=status, body=body, headers=headers)

    monkeypatch.setattr(follower_module, "FETCH_RETRY_FIRST_S", 0.1)
    bundle = parse_bundle(bundle_yaml(rlrun(RUN, shardcast={"publicKey": public_text})))
    client = redis_from_url(redis_url)
    ctx = Context(bundle=bundle, redis=client, keys=RunKeys(RUN), stop=threading.Event())
    failures = follower_module.FETCH_FAILURES._value.get()
    with serving(origin.make_app(store, RUN)) as origin_url, serving(evil_relay(origin_url, maybe_down)) as relay:
        follower = VersionFollower(ctx, [relay], tmp_path / "cache", keep=2, reader=client)
        follower.fetch = FetchSettings.over([relay], RUN, public_key=public, timeout=0.5, stop=ctx.stop)
        follower.start()
        try:
            client.xadd(ctx.keys.policy, encode_json({"version": 1}))
            wait_for("a failed fetch", lambda: follower_module.FETCH_FAILURES._value.get() > failures, 30)
            assert follower.is_alive() and follower.error is None and follower.take(-1) is None
            down.clear()
            ready = wait_for("v1 after the relay came back", lambda: follower.take(-1), 30)
        finally:
            ctx.stop.set()
            follower.join(30)
    assert ready[0] == 1 and same_files(ready[1], src) and follower.error is None
