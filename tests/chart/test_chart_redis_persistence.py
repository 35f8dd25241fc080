"""The chart's Redis keeps an append-only file (issue 16 item 9, the chart's side): rendered by the real
Helm SDK, valid for Kubernetes, optionally on a PersistentVolumeClaim, and the rendered redis-server
arguments keep a real redis-server's streams across a SIGKILL."""

from __future__ import annotations

import signal
import time

import kubernetes_validate
import pytest

from rlfleet.wire.streams import RunKeys
from tests.chart.test_chart import KUBE_VERSIONS, by_kind, render
from tests.support import redis_client, start_rendered_redis

helm = pytest.importorskip("helm_python")

ON = {"redis": {"enabled": True, "auth": {"enabled": False}}}  # the password has its tests (test_chart_redis_auth.py)


@pytest.fixture(scope="module")
def chart():
    from tests.chart.test_chart import CHART

    with helm.Chart.load(CHART) as loaded:
        yield loaded


def redis_objects(chart, values: dict) -> tuple[dict, list[dict]]:
    """The Redis Deployment and the chart's PersistentVolumeClaims, each valid for every Kubernetes version."""
    objects = render(chart, values)
    [deploy] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-redis")]
    claims = by_kind(objects, "PersistentVolumeClaim")
    for obj in (deploy, *claims):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    return deploy, claims


def option(args: list[str], flag: str) -> str:
    """The value redis-server takes for `flag`: the last one given."""
    return [args[i + 1] for i, a in enumerate(args) if a == flag][-1]


def test_the_default_is_an_append_only_file_fsynced_every_second(chart):
    deploy, claims = redis_objects(chart, ON)
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert (option(args, "--appendonly"), option(args, "--appendfsync"), option(args, "--dir")) == (
        "yes",
        "everysec",
        "/data",
    )
    assert option(args, "--save") == ""  # no RDB snapshots besides the file
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert deploy["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert claims == [] and deploy["spec"]["strategy"]["type"] == "Recreate"


def test_a_volume_holds_the_file_when_asked(chart):
    volume = {"enabled": True, "size": "20Gi", "storageClass": "fast-ssd"}
    deploy, [claim] = redis_objects(chart, {"redis": {"enabled": True, "persistence": {"volume": volume}}})
    assert claim["metadata"]["name"] == "rl-rlfleet-redis-data"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "fast-ssd",
        "resources": {"requests": {"storage": "20Gi"}},
    }
    [data] = deploy["spec"]["template"]["spec"]["volumes"]
    assert data == {"name": "data", "persistentVolumeClaim": {"claimName": "rl-rlfleet-redis-data"}}

    existing = {"enabled": True, "existingClaim": "kept-redis"}
    deploy, claims = redis_objects(chart, {"redis": {"enabled": True, "persistence": {"volume": existing}}})
    assert claims == []
    assert deploy["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "kept-redis"}


def test_persistence_values_are_checked_by_the_schema(chart):
    chart.validate_schema({"redis": {"enabled": True, "persistence": {"appendfsync": "always"}}})
    for bad in ({"appendfsync": "sometimes"}, {"appendonly": "yes"}, {"volume": {"size": "lots"}}, {"aof": True}):
        with pytest.raises(helm.HelmValuesError, match="persistence"):
            chart.validate_schema({"redis": {"enabled": True, "persistence": bad}})
    deploy, _ = redis_objects(chart, {"redis": {"enabled": True, "persistence": {"appendonly": False}}})
    assert option(deploy["spec"]["template"]["spec"]["containers"][0]["args"], "--appendonly") == "no"


def test_the_rendered_arguments_keep_the_queue_across_a_kill(chart, tmp_path):
    """What the container runs, on a real redis-server: SIGKILLed after the writes, restarted on the same
    directory (a pod's container restart with its /data), every stream entry is back."""
    deploy, _ = redis_objects(chart, ON)
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    keys = RunKeys("arithmetic")
    proc, port = start_rendered_redis(args, tmp_path)
    try:
        client = redis_client(port)
        ids = [client.xadd(keys.verified, {b"m": f"group {i}".encode()}) for i in range(50)]
        time.sleep(0.3)  # the file is written at once; everysec fsyncs within the second
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    proc, port = start_rendered_redis(args, tmp_path)
    try:
        entries = redis_client(port).xrange(keys.verified)
        assert [e[0] for e in entries] == ids and entries[-1][1] == {b"m": b"group 49"}
    finally:
        proc.terminate()
        proc.wait(10)
