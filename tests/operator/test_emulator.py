"""The API emulator (cluster.py) answers as an API server where kopf depends on the answer."""

from __future__ import annotations

import json

import requests

NS = "t-emulator"


def _json_patch(url: str, ops: list) -> requests.Response:
    return requests.patch(
        url, data=json.dumps(ops), headers={"Content-Type": "application/json-patch+json"}, timeout=10
    )


def test_a_stale_finalizer_removal_gets_422_and_a_fresh_one_deletes(emulator):
    """kopf removes its finalizer with a JSON patch that tests the resourceVersion it last saw. A write
    in between must fail it with 422 (kopf then waits for that write's event and tries again); a 500
    would make kopf retry the stale patch with its error backoff (~50 s) while the deleted object stays."""
    base = f"{emulator.url}/api/v1/namespaces/{NS}/configmaps"
    created = requests.post(
        base, json={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "held", "finalizers": ["x.io/f"]}}
    ).json()
    seen = created["metadata"]["resourceVersion"]
    url = f"{base}/held"
    assert requests.delete(url, timeout=10).json()["metadata"]["deletionTimestamp"]
    patched = requests.patch(
        url,
        data=json.dumps({"metadata": {"annotations": {"written": "meanwhile"}}}),
        headers={"Content-Type": "application/merge-patch+json"},
        timeout=10,
    ).json()
    remove = [{"op": "remove", "path": "/metadata/finalizers/0"}]

    stale = _json_patch(url, [{"op": "test", "path": "/metadata/resourceVersion", "value": seen}, *remove])
    assert stale.status_code == 422, stale.text
    assert requests.get(url, timeout=10).json()["metadata"]["finalizers"] == ["x.io/f"]  # nothing applied

    fresh = patched["metadata"]["resourceVersion"]
    done = _json_patch(url, [{"op": "test", "path": "/metadata/resourceVersion", "value": fresh}, *remove])
    assert done.status_code == 200, done.text
    assert done.json()["metadata"]["resourceVersion"] != fresh  # a write moves the version
    assert requests.get(url, timeout=10).status_code == 404  # no finalizer left: deleted


def test_a_json_patch_moves_the_resource_version(emulator):
    base = f"{emulator.url}/api/v1/namespaces/{NS}/configmaps"
    before = requests.post(base, json={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "plain"}}).json()
    after = _json_patch(f"{base}/plain", [{"op": "add", "path": "/data", "value": {"k": "v"}}])
    assert after.status_code == 200 and after.json()["data"] == {"k": "v"}
    assert int(after.json()["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])
