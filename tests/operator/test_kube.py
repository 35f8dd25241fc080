"""The API adapter (rlfleet/operator/kube.py) against the emulator: server-side apply keeps what other
field managers set and removes what the operator stopped applying; errors arrive typed."""

from __future__ import annotations

import asyncio

import pytest
import requests

from rlfleet.operator import kube as k
from rlfleet.operator import names

NS = "t-kube"


@pytest.fixture(scope="module")
def kube(emulator, tmp_path_factory):
    adapter = k.Kube(k.connect(str(emulator.kubeconfig(tmp_path_factory.mktemp("kube") / "config"))))
    yield adapter
    adapter.close()


def run(coro):
    return asyncio.run(coro)


def deployment(name: str, annotations: dict, replicas: int = 1) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }


def kubectl_merge_patch(emulator, name: str, body: dict) -> None:
    """What `kubectl patch --type merge` (or `kubectl label`) sends, with its field manager."""
    r = requests.patch(
        f"{emulator.url}/apis/apps/v1/namespaces/{NS}/deployments/{name}",
        json=body,
        params={"fieldManager": "kubectl-patch"},
        headers={"Content-Type": "application/merge-patch+json"},
        timeout=5,
    )
    assert r.status_code == 200, r.text


def test_apply_creates_then_removes_dropped_fields_and_keeps_other_managers_fields(kube, emulator):
    live, created = run(kube.apply(deployment("web", {"a": "1", "b": "2"})))
    assert created and live["metadata"]["annotations"] == {"a": "1", "b": "2"}
    assert live["metadata"]["name"] == "web" and live["metadata"]["uid"]
    assert [d["metadata"]["name"] for d in run(kube.list("Deployment", NS, label_selector="app=web"))] == ["web"]
    assert run(kube.list("Deployment", NS, label_selector="app=other")) == []
    kubectl_merge_patch(emulator, "web", {"metadata": {"labels": {"team": "ml"}}})

    live, created = run(kube.apply(deployment("web", {"a": "1"}, replicas=3)))
    assert not created
    assert live["metadata"]["annotations"] == {"a": "1"}, "a field the operator stopped applying is gone"
    assert live["metadata"]["labels"] == {"app": "web", "team": "ml"}, "kubectl's label survives the apply"
    assert live["spec"]["replicas"] == 3
    assert run(kube.get("Deployment", NS, "web")) == live
    managers = {(m["manager"], m["operation"]) for m in live["metadata"]["managedFields"]}
    assert managers == {(names.FIELD_MANAGER, "Apply"), ("kubectl-patch", "Update")}


def test_apply_takes_back_a_field_another_manager_changed(kube, emulator):
    run(kube.apply(deployment("api", {"owner": "rlfleet"})))
    kubectl_merge_patch(emulator, "api", {"metadata": {"annotations": {"owner": "someone"}}})
    live, _ = run(kube.apply(deployment("api", {"owner": "rlfleet"})))  # force=True, as controllers do
    assert live["metadata"]["annotations"] == {"owner": "rlfleet"}


def test_errors_are_typed(kube, emulator):
    with pytest.raises(k.NotFound):
        run(kube.get("Secret", NS, "absent"))
    assert run(kube.find("Secret", NS, "absent")) is None
    emulator.cluster.forbidden.add(("secrets", NS, "locked"))
    try:
        with pytest.raises(k.Forbidden) as err:
            run(kube.get("Secret", NS, "locked"))
        assert err.value.status == 403
    finally:
        emulator.cluster.forbidden.discard(("secrets", NS, "locked"))
    with pytest.raises(k.NotFound):
        run(kube.get("RLRun", NS, "absent"))


def test_an_unreachable_server_is_unavailable(tmp_path):
    from rlfleet.local.redis_server import free_port
    from tests.operator.cluster import write_kubeconfig

    nowhere = k.Kube(k.connect(str(write_kubeconfig(tmp_path / "config", f"http://127.0.0.1:{free_port()}"))))
    with pytest.raises(k.Unavailable):
        run(nowhere.list("ConfigMap", NS))
