"""The trainer's background publishing (rlfleet/services/trainer/publishing.py), on a real file store and Redis:
a handed-off version is stored and announced beside the caller, in order, one at a time; a failure surfaces in the
caller's thread naming the version; the files handed off are deleted either way."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlfleet.config import parse_bundle
from rlfleet.fleet.window import AsyncWindow
from rlfleet.services.trainer.publishing import PublishFailed, VersionPublishing
from rlfleet.services.trainer.split import StepSplit
from rlfleet.versions.checkpoint import list_versions
from rlfleet.versions.store import FileStore
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys, decode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.support import redis_from_url, trainer_run_config


class HeldStore(FileStore):
    """A file store whose uploads wait until `release` is set (a slow store: a 65 GB version over a WAN)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.release = threading.Event()
        self.release.set()

    def put_file(self, key: str, path: Path) -> None:
        assert self.release.wait(30), "the test never released the store"
        super().put_file(key, path)


def version_files(path: Path, version: int) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(bytes([version]) * 4096)
    return path


@pytest.fixture
def publishing(tmp_path, redis_url):
    bundle = parse_bundle(trainer_run_config(tmp_path / "model", tmp_path / "store", "{batchSize: 2, steps: 4}"))
    client = redis_from_url(redis_url)
    ctx = Context(
        bundle=view_bundle(bundle, VIEWS["trainer"]), redis=client, keys=RunKeys("tr"), stop=threading.Event()
    )
    store = HeldStore(tmp_path / "store")
    split = StepSplit()
    yield VersionPublishing(ctx, store, AsyncWindow.of(bundle.run.spec), split), store, split, client
    client.close()


def announced(client) -> list[dict]:
    return [decode_json(fields) for _, fields in client.xrange(RunKeys("tr").policy)]


def test_a_version_is_published_beside_the_caller_in_order_and_announced(publishing, tmp_path):
    publisher, store, split, client = publishing
    split.begin()
    store.release.clear()  # the store is slow: v0's upload waits
    v0 = version_files(tmp_path / "v0", 0)
    publisher.hand_off(0, v0, None, {"version": 0, "step": 0})
    assert list_versions(store, "tr") == [] and announced(client) == [], "hand_off returned while v0 was uploading"

    v1 = version_files(tmp_path / "v1", 1)
    threading.Timer(0.3, store.release.set).start()
    publisher.hand_off(1, v1, None, {"version": 1, "step": 1, "reward": 0.5})  # waits for v0 first
    publisher.wait()
    assert list_versions(store, "tr") == [0, 1]
    assert [(a["version"], a["step"]) for a in announced(client)] == [(0, 0), (1, 1)]
    assert announced(client)[1]["reward"] == 0.5 and all("time" in a for a in announced(client))
    assert not v0.exists() and not v1.exists(), "the files handed off are the publisher's, deleted once stored"

    record = split.end()
    assert record["split"]["publish_wait"] >= 0.2, "handing off v1 waited for v0's publish"
    assert record["background_split"]["publish_store"] > 0 and record["background_split"]["announce"] > 0
    assert "publish_store" not in record["split"], "the store writes are off the step's path"


def test_a_failed_publish_is_raised_in_the_callers_thread_naming_the_version(publishing, tmp_path):
    publisher, store, _, client = publishing
    store.root.mkdir(parents=True)
    (store.root / "tr").write_text("a file where the run's directory goes: every write fails")
    v3 = version_files(tmp_path / "v3", 3)
    publisher.hand_off(3, v3, None, {"version": 3, "step": 3})  # returns: the failure comes later
    with pytest.raises(PublishFailed, match="publishing version 3 failed") as failed:
        publisher.wait()
    assert isinstance(failed.value.__cause__, OSError)
    assert not v3.exists() and announced(client) == [], "nothing announced for a version not stored"

    v4 = version_files(tmp_path / "v4", 4)
    with pytest.raises(PublishFailed, match="version 3"):  # the next hand-off raises it too, and keeps nothing
        publisher.hand_off(4, v4, None, {"version": 4, "step": 4})
    assert not v4.exists() and announced(client) == []
