"""The chart's NetworkPolicies (templates/networkpolicies.yaml) select exactly the pods they mean. No emulator
or CNI here enforces a policy, so the test evaluates each policy as an enforcing CNI would (label selectors,
namespace selectors, ports) against the pods the operator's own builders make for the example's run, the
operator's pod as the chart renders it, and strangers that must stay out."""

from __future__ import annotations

import copy

import pytest

from rlfleet.config import RelayTier, RLRun
from rlfleet.operator import builders, names
from rlfleet.operator.relays import build_relay_children
from tests.chart.test_chart import CHART, NAMESPACE, by_kind, render, values_of

helm = pytest.importorskip("helm_python")


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels; {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def pod(namespace: str, labels: dict, ports: dict | None = None) -> dict:
    return {"namespace": namespace, "labels": labels, "ports": ports or {}}


def admits(policy: dict, source: dict, target: dict, port: int | str) -> bool:
    """Whether `policy` lets `source` open a connection to `target` on `port` (a number, or the name of one of
    target's container ports), as an enforcing CNI reads it; True when the policy does not select `target`."""
    spec, policy_ns = policy["spec"], policy["metadata"]["namespace"]
    if target["namespace"] != policy_ns or not selects(spec["podSelector"], target["labels"]):
        return True
    number = target["ports"].get(port, port)
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports")
        # a named port in the policy means the target's container port of that name
        if ports and not any(target["ports"].get(p["port"], p["port"]) == number for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source["namespace"]})
            else:
                in_namespace = source["namespace"] == policy_ns
            if in_namespace and selects(peer.get("podSelector") or {}, source["labels"]):
                return True
    return False


def run_pods(objects: list[dict], namespace: str, rename: str | None = None) -> dict[str, dict]:
    """component -> a pod the operator's builders make for the chart's run (and its tiers), as its
    workload's controller would create it; `rename`: the same run under another name."""
    [body] = by_kind(objects, "RLRun")
    body = copy.deepcopy(body)
    if rename:
        body["metadata"]["name"] = rename
    run = builders.parse_as(body, RLRun)
    tiers = [builders.parse_as(t, RelayTier) for t in by_kind(objects, "RelayTier")]
    for tier in tiers:
        tier.spec.run = run.metadata.name
    children = builders.build_run_children(run, namespace)
    children += build_relay_children(run, tiers[0], tiers, namespace)
    out = {}
    for child in children:
        if child["kind"] in ("Deployment", "StatefulSet"):
            template = child["spec"]["template"]
            ports = {
                p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports") or []
            }
            out[template["metadata"]["labels"]["app.kubernetes.io/component"]] = pod(
                namespace, template["metadata"]["labels"], ports
            )
    return out


def test_network_policies_are_off_by_default(chart):
    assert not by_kind(render(chart, {"redis": {"enabled": True}}), "NetworkPolicy")


def test_redis_admits_run_pods_and_the_operator_only(chart):
    objects = render(chart, values_of("cluster-a"))  # networkPolicy on, Redis in the chart, one watched namespace
    [policy] = [p for p in by_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == "rlfleet-redis"]
    [redis] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "rlfleet-redis"]
    [operator] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"] == "rlfleet-operator"]
    redis_pod = pod(NAMESPACE, redis["spec"]["template"]["metadata"]["labels"])
    port = values_of("cluster-a").get("redis", {}).get("service", {}).get("port", 6379)
    assert selects(policy["spec"]["podSelector"], redis_pod["labels"]), "the policy must select the Redis pod"
    pods = run_pods(objects, NAMESPACE)
    assert {"trainer", "verifier", "origin", "relay", "ingest"} <= pods.keys()
    for component, source in pods.items():
        assert admits(policy, source, redis_pod, port), f"the run's {component} pod cannot reach Redis"
    assert admits(policy, pod(NAMESPACE, operator["spec"]["template"]["metadata"]["labels"]), redis_pod, port)
    strangers = {
        "an unlabelled pod beside Redis": pod(NAMESPACE, {"app": "curl"}),
        "a pod that copies rlfleet's part-of label": pod(NAMESPACE, {"app.kubernetes.io/part-of": "rlfleet"}),
        "a run pod of a namespace the operator does not watch": pod("elsewhere", pods["trainer"]["labels"]),
        "an operator pod of another namespace": pod("elsewhere", operator["spec"]["template"]["metadata"]["labels"]),
    }
    for what, stranger in strangers.items():
        assert not admits(policy, stranger, redis_pod, port), f"{what} reaches Redis"
    assert not admits(policy, pods["trainer"], redis_pod, 22), "only the Redis port"


def test_a_verifier_admits_its_own_runs_pods_and_metrics_scrapes_only(chart):
    objects = render(chart, values_of("cluster-a"))
    [run] = by_kind(objects, "RLRun")
    [policy] = [
        p for p in by_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == f"{run['metadata']['name']}-verifier"
    ]
    pods = run_pods(objects, NAMESPACE)
    verifier = pods["verifier"]
    selected = {c for c, p in pods.items() if selects(policy["spec"]["podSelector"], p["labels"])}
    assert selected == {"verifier"}, f"the verifier policy selects {selected}"
    api_port = 8000  # a port the verifier might serve (`--api-port` through its podTemplate)
    for component, source in pods.items():
        assert admits(policy, source, verifier, api_port), f"the run's {component} pod cannot reach its verifier"
    other_run = run_pods(objects, NAMESPACE, rename="other")
    assert not admits(policy, other_run["trainer"], verifier, api_port), "another run's pod reaches the verifier"
    assert not admits(policy, pod(NAMESPACE, {"app": "curl"}), verifier, api_port)
    prometheus = pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    assert admits(policy, prometheus, verifier, "metrics"), "Prometheus must still scrape the verifier"
    assert admits(policy, prometheus, verifier, names.METRICS_PORT)
    assert not [p for p in by_kind(render(chart, values_of("cluster-b")), "NetworkPolicy")], (
        "cluster B: no Redis, remote run"
    )
