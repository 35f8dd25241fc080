"""The rollout worker's version cache (rlfleet/services/rollout/follower.py)."""

from __future__ import annotations

import threading

from rlfleet.config import parse_bundle
from rlfleet.services.rollout.follower import VersionFollower
from rlfleet.versions.checkpoint import version_dir_name
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import trainer_run_config


def test_pruning_never_removes_the_version_the_engine_took(tmp_path, redis_client):
    """Newer versions may arrive while the engine still loads the one it took; that one stays on disk
    (it was deleted under the loader once: the worker died with 'Repo id must be in the form ...')."""
    bundle = parse_bundle(trainer_run_config("builtin://tiny-arithmetic", tmp_path / "store", "{}"))
    ctx = Context(
        bundle=view_bundle(bundle, VIEWS["rollout"]), redis=redis_client, keys=RunKeys("tr"), stop=threading.Event()
    )
    cache = tmp_path / "cache"
    follower = VersionFollower(ctx, ["http://127.0.0.1:9"], cache, keep=3)
    for v in range(1, 11):
        (cache / version_dir_name(v)).mkdir(parents=True)
    follower.ready = (4, cache / version_dir_name(4), 0.0)
    assert follower.take(newer_than=0)[0] == 4  # the engine starts loading v4
    with follower._lock:
        follower._prune(newest=10)  # v5..v10 arrived meanwhile
    kept = sorted(int(p.name[1:]) for p in cache.iterdir())
    assert kept == [4, 5, 6, 7, 8, 9, 10], kept
    follower.ready = (10, cache / version_dir_name(10), 0.0)
    assert follower.take(newer_than=4)[0] == 10  # swapped to v10: v4 may go now
    with follower._lock:
        follower._prune(newest=10)
    assert sorted(int(p.name[1:]) for p in cache.iterdir()) == [8, 9, 10]
