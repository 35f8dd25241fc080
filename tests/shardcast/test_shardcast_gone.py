"""Versions dropped by retention are 410 Gone, and a client moves on (protocol.py): a 404 means "not here yet"
and is retried until the fetch's deadline, so a worker whose announced version a relay had already dropped
(versions arriving faster than the relay keeps them, on a busy machine) used to sit paused at version_lag
for the whole deadline while the run trained on without it. Real origin, relays and Redis over 127.0.0.1."""

from __future__ import annotations

import threading

import pytest
import requests
from prometheus_client import REGISTRY

from rlfleet.config import parse_bundle
from rlfleet.services.rollout.follower import VersionFollower
from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.assemble import fetch_policy
from rlfleet.services.shardcast.client import FetchSettings, VersionGone, fetch_version
from rlfleet.services.shardcast.protocol import file_path, latest_path
from rlfleet.versions.checkpoint import (
    COMPLETE_MARKER,
    MANIFEST_NAME,
    prune_versions,
    publish_version,
    version_dir_name,
)
from rlfleet.versions.store import open_store
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.shardcast.test_shardcast import small_version
from tests.support import serving, trainer_run_config, wait_for

RUN = "tr"  # the run of tests.support.trainer_run_config, which the follower's context reads


def published(tmp_path, count: int):
    store = open_store(f"file://{tmp_path}/store")
    for v in range(1, count + 1):
        publish_version(store, RUN, v, small_version(tmp_path / f"src-v{v}", v))
    return store


def relay_dropped_v1(relay_url: str, tmp_path) -> None:
    """Through a relay that keeps 2 versions, v1..v3 are fetched: it holds v2 and v3 and has dropped v1."""
    for v in (1, 2, 3):
        fetch_version(FetchSettings.over([relay_url], RUN, timeout=20), v, tmp_path / "warm")
    # The client can have all of v3 before the relay's own pull of it is complete (the relay streams what it
    # pulls); until then the relay holds only v2 and would pull v1 again for anyone who asked.
    cache = tmp_path / "relay" / RUN
    settled = lambda: (cache / "v3" / COMPLETE_MARKER).exists() and not (cache / "v1").exists()  # noqa: E731
    wait_for("the relay's retention", settled, 10, every=0.05)


def test_a_dropped_version_is_410_and_a_client_is_told_at_once_unless_another_source_keeps_it(tmp_path):
    store = published(tmp_path, 3)
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 2))) as relay_url,
    ):
        relay_dropped_v1(relay_url, tmp_path)
        for name in (MANIFEST_NAME, "model.safetensors"):
            r = requests.get(relay_url + file_path(RUN, 1, name), timeout=10)
            assert r.status_code == 410 and "older than the newest 2" in r.text, (r.status_code, r.text)
        assert requests.get(relay_url + file_path(RUN, 4, MANIFEST_NAME), timeout=10).status_code == 404  # not yet
        # Every source dropped it: VersionGone (a FetchError) naming the version, not a wait for the deadline.
        for fetch in (fetch_version, fetch_policy):
            with pytest.raises(VersionGone, match="no source keeps it any more") as gone:
                fetch(FetchSettings.over([relay_url], RUN, timeout=120), 1, tmp_path / f"late-{fetch.__name__}")
            assert gone.value.version == 1
        # One source still keeps it (the origin's store was not pruned): fetched from there.
        path = fetch_version(FetchSettings.over([relay_url, origin_url], RUN, timeout=30), 1, tmp_path / "both")
        assert (path / "model.safetensors").read_bytes() == (tmp_path / "src-v1" / "model.safetensors").read_bytes()


def test_the_origin_answers_410_for_a_version_pruned_from_its_store_and_404_for_one_not_yet_published(tmp_path):
    store = published(tmp_path, 3)
    prune_versions(store, RUN, keep=2)
    with serving(origin.make_app(store, RUN)) as origin_url:
        assert requests.get(origin_url + latest_path(RUN), timeout=10).json() == {"version": 3}
        r = requests.get(origin_url + file_path(RUN, 1, MANIFEST_NAME), timeout=10)
        assert r.status_code == 410 and "pruned" in r.text, (r.status_code, r.text)
        assert requests.get(origin_url + file_path(RUN, 4, MANIFEST_NAME), timeout=10).status_code == 404
        with pytest.raises(VersionGone):
            fetch_policy(FetchSettings.over([origin_url], RUN, timeout=120), 1, tmp_path / "late")


def test_a_relay_passes_on_410_from_its_upstream(tmp_path):
    """A tier-1 relay that never held v1 asks its upstream relay, which dropped it: 410 down the tree too."""
    store = published(tmp_path, 3)
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 2))) as tier0,
        serving(relay.make_app(relay.RelaySettings(tier0, tmp_path / "tier1", RUN, 3))) as tier1,
    ):
        relay_dropped_v1(tier0, tmp_path)
        r = requests.get(tier1 + file_path(RUN, 1, MANIFEST_NAME), timeout=10)
        assert r.status_code == 410 and "no longer keeps v1" in r.text, (r.status_code, r.text)
        with pytest.raises(VersionGone):
            fetch_policy(FetchSettings.over([tier1], RUN, timeout=120), 1, tmp_path / "late")


def test_a_worker_whose_announced_version_was_dropped_fetches_the_next_one(tmp_path, redis_client):
    """The policy stream announces v1, which the relay no longer keeps: the follower skips it (counted) and
    takes v3 when it is announced, instead of failing or waiting out its deadline on v1."""
    store = published(tmp_path, 3)
    bundle = parse_bundle(trainer_run_config("builtin://tiny-arithmetic", tmp_path / "store", "{}"))
    keys = RunKeys(RUN)
    ctx = Context(bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event())
    skipped = REGISTRY.get_sample_value("rlfleet_rollout_versions_skipped_total") or 0.0
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, tmp_path / "relay", RUN, 2))) as relay_url,
    ):
        relay_dropped_v1(relay_url, tmp_path)
        redis_client.xadd(keys.policy, encode_json({"version": 1}))
        follower = VersionFollower(ctx, [relay_url], tmp_path / "cache", keep=3, reader=redis_client)
        follower.start()
        try:
            wait_for(
                "v1 skipped",
                lambda: REGISTRY.get_sample_value("rlfleet_rollout_versions_skipped_total") == skipped + 1,
                30,
            )
            assert follower.error is None and follower.take(-1) is None
            redis_client.xadd(keys.policy, encode_json({"version": 3}))
            ready = wait_for("v3 fetched", lambda: follower.take(-1), 30)
            assert ready[0] == 3 and ready[1] == tmp_path / "cache" / version_dir_name(3)
            assert follower.error is None
        finally:
            ctx.stop.set()
            follower.join(10)
