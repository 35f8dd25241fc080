"""The chart and the operator's objects together, as a cluster would use them: every rlfleet pod
scraped exactly once by the chart's monitors, the operator reading every setting the chart gives it,
NOTES that never hand out a Redis URL without its password, and run names the CRD accepts."""

from __future__ import annotations

import collections
import os

import pytest
import yaml

from rlfleet.config import parse_bundle
from rlfleet.operator import builders as b
from rlfleet.operator import names
from rlfleet.operator.crd import MAX_RUN_NAME
from tests.chart.test_chart import CHART, NAMESPACE, RELEASE, by_kind, helm, render

EXAMPLE = CHART.parent.parent / "examples" / "arithmetic" / "rlrun.yaml"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _operator_objects() -> list[dict]:
    """What the operator builds for the arithmetic example with an ingest and two trainer ranks."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"].update(
        redis={"url": "redis://redis:6379/0"},
        store={"uri": "s3://ckpt/runs"},
        shardcast={"signingKeySecret": "arithmetic-signing"},
        ingest={"tokens": "worker-tokens"},
        trainer={"replicas": 2},
    )
    bundle = parse_bundle(yaml.safe_dump_all(docs))
    run, pool, tier = bundle.run, bundle.pools[0], bundle.relays[0]
    return [
        *b.build_run_children(run, "ml"),
        *b.build_pool_children(run, pool, bundle.relays, "ml"),
        *b.build_relay_children(run, tier, bundle.relays, "ml"),
    ]


def _pods(objects: list[dict]) -> list[dict]:
    """One pod per replica of every workload: its name, labels and container ports."""
    pods = []
    for w in objects:
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = w["spec"]["template"]
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
        for i in range(max(1, w["spec"]["replicas"])):
            pods.append(
                {"name": f"{w['metadata']['name']}-{i}", "labels": template["metadata"]["labels"], "ports": ports}
            )
    return pods


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def _targets(monitor: dict, services: list[dict], pods: list[dict]) -> collections.Counter:
    """Scrape targets per pod, as Prometheus Operator discovers them."""
    spec, hits = monitor["spec"], collections.Counter()
    if monitor["kind"] == "PodMonitor":
        port_names = {e["port"] for e in spec["podMetricsEndpoints"]}
        for pod in pods:
            if _matches(spec["selector"]["matchLabels"], pod["labels"]):
                hits[pod["name"]] += sum(p.get("name") in port_names for p in pod["ports"])
        return hits
    port_names = {e["port"] for e in spec["endpoints"]}
    for service in services:
        if not _matches(spec["selector"]["matchLabels"], service["metadata"]["labels"]):
            continue
        for port in service["spec"]["ports"]:
            if port.get("name") not in port_names:
                continue
            for pod in pods:
                if _matches(service["spec"]["selector"], pod["labels"]) and any(
                    p["containerPort"] == port["targetPort"] or p.get("name") == port["targetPort"]
                    for p in pod["ports"]
                ):
                    hits[pod["name"]] += 1
    return hits


@pytest.mark.parametrize("kind", ["podMonitor", "serviceMonitor"])
def test_each_monitor_scrapes_every_rlfleet_pod_exactly_once(chart, kind):
    """Bug: with the ServiceMonitor the verifier and rollout pods (no Service) were never scraped, and
    with both monitors on trainer, relays and origin were scraped twice (every sum(rate()) doubled)."""
    [monitor] = [o for o in render(chart, {"monitoring": {kind: {"enabled": True}}}) if "Monitor" in o["kind"]]
    objects = _operator_objects()
    pods = _pods(objects)
    hits = _targets(monitor, by_kind(objects, "Service"), pods)
    assert {p["name"]: hits[p["name"]] for p in pods} == {p["name"]: 1 for p in pods}


def test_both_monitors_at_once_are_refused_by_name(chart):
    with pytest.raises(Exception, match="podMonitor.*serviceMonitor|serviceMonitor.*podMonitor"):
        render(chart, {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}})


def test_the_operator_reads_every_setting_the_chart_gives_it(chart, monkeypatch):
    """Bug: the chart set RLFLEET_GPU_IMAGE and RLFLEET_IMAGE_PULL_POLICY, which the operator never read."""
    from rlfleet.operator.options import OperatorOptions

    values = {"imagePullSecrets": [{"name": "regcred"}]}
    [deploy] = [d for d in by_kind(render(chart, values), "Deployment") if d["metadata"]["name"].endswith("operator")]
    given = {e["name"]: e["value"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    given = {k: v for k, v in given.items() if k.startswith("RLFLEET_")}
    read = set()

    class Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

    monkeypatch.setattr(os, "environ", Recording(given))
    options = OperatorOptions.from_env()
    assert set(given) <= read, f"set by the chart, never read by the operator: {sorted(set(given) - read)}"
    assert options.defaults.pull_secrets == ("regcred",)


def test_notes_never_print_a_redis_url_without_its_password(chart):
    """Bug: with redis.auth the NOTES told users to set spec.redis.url to a URL without the password."""
    values = {"redis": {"enabled": True, "auth": {"existingSecret": "redis-pw"}}}
    notes = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)["rlfleet/templates/NOTES.txt"]
    assert "urlSecret" in notes and "redis-pw" in notes
    assert "spec.redis.url of your RLRun to redis://" not in notes
    open_notes = chart.render({"redis": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    assert "redis://" in open_notes["rlfleet/templates/NOTES.txt"]


def test_the_chart_takes_exactly_the_run_names_the_crd_takes(chart):
    """Bug: values.schema.json allowed run names up to 50 characters; the CRD's rule stops at 44."""
    ok = {"name": "r" * MAX_RUN_NAME, "spec": {}}
    chart.validate_schema({"runs": [ok]})
    with pytest.raises(helm.HelmValuesError, match="/runs/0/name"):
        chart.validate_schema({"runs": [{"name": "r" * (MAX_RUN_NAME + 1), "spec": {}}]})
    assert len(names.trainer("r" * MAX_RUN_NAME)) == names.MAX_STATEFULSET_NAME


def test_run_pod_security_contexts_from_the_values_reach_the_operator(chart, monkeypatch):
    """The chart's runPods values are what the operator puts on run pods; a cluster's keys merge into the
    hardened defaults (null drops one)."""
    from rlfleet.operator import security
    from rlfleet.operator.options import OperatorOptions

    def operator_options(values):
        deployments = by_kind(render(chart, values), "Deployment")
        [deploy] = [d for d in deployments if d["metadata"]["name"].endswith("operator")]
        container = deploy["spec"]["template"]["spec"]["containers"][0]
        given = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("RLFLEET_") and "value" in e}
        monkeypatch.setattr(os, "environ", given)
        return OperatorOptions.from_env().defaults

    defaults = operator_options({})
    assert (defaults.pod_security, defaults.container_security) == (
        security.POD_SECURITY_CONTEXT,
        security.CONTAINER_SECURITY_CONTEXT,
    )
    values = {
        "runPods": {
            "podSecurityContext": {"runAsUser": 2000, "seccompProfile": None},
            "securityContext": {"readOnlyRootFilesystem": False},
        }
    }
    defaults = operator_options(values)
    assert defaults.pod_security == {"runAsNonRoot": True, "runAsUser": 2000}
    assert defaults.container_security == {**security.CONTAINER_SECURITY_CONTEXT, "readOnlyRootFilesystem": False}
