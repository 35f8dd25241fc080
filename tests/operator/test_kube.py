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
    from rlfleet.wire.ports import free_port
    from tests.operator.cluster import write_kubeconfig

    nowhere = k.Kube(k.connect(str(write_kubeconfig(tmp_path / "config", f"http://127.0.0.1:{free_port()}"))))
    with pytest.raises(k.Unavailable):
        run(nowhere.list("ConfigMap", NS))


@pytest.fixture
def silent_server():
    """An HTTP server on 127.0.0.1 that accepts connections and never answers (a hung API server)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stopped = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stopped.is_set():
            try:
                accepted.append(listener.accept()[0])  # read nothing, write nothing
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stopped.set()
    thread.join()
    for conn in accepted:  # a client still waiting (the bug) gets its connection closed and returns
        conn.close()
    listener.close()


def test_a_server_that_never_answers_fails_the_call_instead_of_hanging(silent_server, tmp_path):
    """Bug: no request timeout; a call to an API server that accepted the connection and never answered
    waited forever, wedging the handler that made it."""
    import threading

    from tests.operator.cluster import write_kubeconfig

    hung = k.Kube(k.connect(str(write_kubeconfig(tmp_path / "config", silent_server))), timeout_s=0.5)
    outcome: list[BaseException | None] = []

    def call():
        try:
            run(hung.get("ConfigMap", NS, "any"))
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(60)  # a generous guard: without a timeout the call never returns
    assert outcome, "the call to a silent API server never returned"
    assert isinstance(outcome[0], k.Unavailable), outcome[0]
    assert "timed out" in str(outcome[0]).lower()


def test_the_timeout_setting_bounds_kopf_requests_too(monkeypatch):
    import kopf

    from rlfleet.operator.options import OperatorOptions, bound_kopf_requests
    from rlfleet.wire import env

    monkeypatch.setenv(env.API_TIMEOUT, "4")
    options = OperatorOptions.from_env()
    assert options.api_timeout_s == 4
    settings = kopf.OperatorSettings()
    bound_kopf_requests(settings, options)
    assert (settings.networking.connect_timeout, settings.networking.request_timeout) == (4, 4)
    bound_kopf_requests(settings, OperatorOptions(api_timeout_s=60))
    assert (settings.networking.connect_timeout, settings.networking.request_timeout) == (k.CONNECT_TIMEOUT_S, 60)
    monkeypatch.setenv(env.API_TIMEOUT, "0")
    with pytest.raises(SystemExit, match=env.API_TIMEOUT):
        OperatorOptions.from_env()
