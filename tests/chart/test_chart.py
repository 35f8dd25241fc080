"""The Helm chart, rendered and linted by the real Helm SDK (helm-python-sdk: Helm's Go SDK through
ctypes, offline), every object checked against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict), the rlfleet resources against the CRDs and the config models.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support import REPO

helm = pytest.importorskip("helm_python")

ROOT = REPO
CHART = ROOT / "charts" / "rlfleet"
EXAMPLES = ROOT / "examples" / "multicluster"
# The chart's kubeVersion floor and the newest schema kubernetes-validate ships.
KUBE_FLOOR = re.search(r"kubeVersion: \">=([0-9.]+)", (CHART / "Chart.yaml").read_text()).group(1)
KUBE_VERSIONS = [KUBE_FLOOR, kubernetes_validate.latest_version()]
RELEASE, NAMESPACE = "rl", "rlfleet"
# Fields the multi-cluster example needs that the config tree does not have yet (see cluster-b-values.yaml).
PROPOSED_FIELDS: set[str] = set()  # fields an example may use before the config tree has them

VALUE_SETS = {
    "default": {},
    "everything-on": {
        "redis": {"enabled": True, "auth": {"existingSecret": "redis-pw"}},
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}],
        "exposeIngests": [{"run": "arithmetic", "type": "NodePort"}],
        "operator": {"watchNamespaces": ["team-a", "team-b"], "verbose": True, "replicas": 2},
    },
    "cluster-a": EXAMPLES / "cluster-a-values.yaml",
    "cluster-b": EXAMPLES / "cluster-b-values.yaml",
}


def values_of(key: str) -> dict:
    source = VALUE_SETS[key]
    return yaml.safe_load(source.read_text()) if isinstance(source, Path) else source


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, values: dict) -> list[dict]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def crd_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        docs[doc["spec"]["names"]["kind"]] = doc
    return docs


# ---- CRDs ----------------------------------------------------------------------------------------


def test_chart_crds_are_the_generated_ones():
    generated = {p.name: p.read_bytes() for p in sorted((ROOT / "crds").glob("*.yaml"))}
    shipped = {p.name: p.read_bytes() for p in sorted((CHART / "crds").glob("*.yaml"))}
    assert generated, "crds/*.yaml is empty: run `rlfleet crds --out crds/`"
    stale = sorted(n for n in generated.keys() | shipped.keys() if generated.get(n) != shipped.get(n))
    assert not stale, f"charts/rlfleet/crds differs from crds/ in {stale}: run `python charts/rlfleet/sync_crds.py`"


def test_helm_loads_the_crds(chart):
    loaded = {yaml.safe_load(c["data"])["metadata"]["name"] for c in chart.crds}
    assert loaded == {
        "rlruns.rlfleet.io",
        "inferencepools.rlfleet.io",
        "relaytiers.rlfleet.io",
        "clusterkopfpeerings.kopf.dev",
    }


# ---- lint, render, validate ----------------------------------------------------------------------


@pytest.mark.parametrize("key", VALUE_SETS)
def test_lint_is_clean(key):
    report = helm.lint(CHART, values_of(key), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_FLOOR}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def _check_monitor_shape(obj: dict) -> None:
    """monitoring.coreos.com/v1 kinds are not in the Kubernetes schemas: check what Prometheus Operator needs."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    spec = obj["spec"]
    assert spec["selector"]["matchLabels"], "a monitor without a selector scrapes nothing"
    endpoints = spec["podMetricsEndpoints" if obj["kind"] == "PodMonitor" else "endpoints"]
    assert endpoints and all(e["port"] and e["path"] == "/metrics" for e in endpoints)
    assert re.fullmatch(r"([0-9]+(ms|s|m|h))+", endpoints[0]["interval"])
    assert spec["namespaceSelector"].get("any") is True or spec["namespaceSelector"]["matchNames"]


def _unknown_fields(value, schema: dict, path: str) -> list[str]:
    """Fields the API server would prune (or reject under strict field validation)."""
    if isinstance(value, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out = [f"{path}.{k}".lstrip(".") for k in value if k not in schema["properties"]]
        for k, v in value.items():
            if k in schema["properties"]:
                out += _unknown_fields(v, schema["properties"][k], f"{path}.{k}")
        return out
    if isinstance(value, list) and "items" in schema:
        return [p for i, v in enumerate(value) for p in _unknown_fields(v, schema["items"], f"{path}[{i}]")]
    return []


def _check_rlfleet_resource(obj: dict, crds: dict[str, dict]) -> list[str]:
    from pydantic import ValidationError

    from rlfleet.config import KINDS

    schema = crds[obj["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    unknown = [f"{obj['kind']} {f}" for f in _unknown_fields({"spec": obj["spec"]}, schema, "")]
    if unknown:
        return unknown
    # OpenAPI 3.0 schemas are draft 4 (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(schema["properties"]["spec"]).validate(obj["spec"])
    try:
        KINDS[obj["kind"]].model_validate(obj)
    except ValidationError as exc:
        return [f"{obj['kind']} {obj['metadata']['name']}: {exc}"]
    return []


@pytest.mark.parametrize("key", VALUE_SETS)
def test_rendered_objects_are_valid(chart, key):
    objects = render(chart, values_of(key))
    crds = crd_docs()
    assert by_kind(objects, "Deployment"), "the operator Deployment is missing"
    problems = []
    for obj in objects + list(crds.values()):
        group = obj["apiVersion"].split("/")[0]
        if group == "monitoring.coreos.com":
            _check_monitor_shape(obj)
        elif group == "rlfleet.io":
            problems += _check_rlfleet_resource(obj, crds)
        else:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    if problems and set(problems) <= PROPOSED_FIELDS:
        pytest.xfail(f"the example uses fields proposed for the config tree: {sorted(problems)}")
    assert not problems, problems


# ---- values.schema.json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"operator": {"replicas": "two"}}, "/operator/replicas"),
        ({"operator": {"replicas": -1}}, "/operator/replicas"),
        ({"operator": {"replicas": 2, "peering": {"lifetime": 1}}}, "/operator/peering/lifetime"),
        ({"operater": {"replicas": 1}}, "operater"),
        ({"redis": {"service": {"type": "Ingress"}}}, "/redis/service/type"),
        ({"runs": [{"name": "Bad_Name", "spec": {}}]}, "/runs/0/name"),
    ],
)
def test_schema_rejects_bad_values(chart, bad, where):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(bad)
    assert where in str(err.value)
    report = helm.lint(CHART, bad, namespace=NAMESPACE)
    assert any(m["severity"] == 3 for m in report["messages"]) or report["errors"], report


def test_schema_accepts_every_example(chart):
    for key in VALUE_SETS:
        chart.validate_schema(values_of(key))


def test_every_default_value_is_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    # Every object in the schema is additionalProperties: false, so an undocumented key fails here.
    jsonschema.validate(defaults, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, "redis": {**defaults["redis"], "pasword": "x"}}, schema)


# ---- what the objects say ------------------------------------------------------------------------


def test_operator_deployment(chart):
    objects = render(chart, {})
    [deploy] = by_kind(objects, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["rlfleet", "operator"]
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=8081"]
    assert container["livenessProbe"]["httpGet"]["port"] == "healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 8081}
    [service] = by_kind(objects, "Service")  # the operator's metrics, for a ServiceMonitor
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    [off] = by_kind(render(chart, {"operator": {"metrics": {"enabled": False}}}), "Deployment")
    assert not any(a.startswith("--metrics-port") for a in off["spec"]["template"]["spec"]["containers"][0]["args"])
    [sa] = by_kind(objects, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert set(spec["selector"]["matchLabels"].items()) <= set(spec["template"]["metadata"]["labels"].items())
    assert not by_kind(objects, "PodDisruptionBudget"), "one replica: nothing to keep up during a drain"


def test_operator_replicas_over_one_run_with_peering(chart):
    """operator.replicas: 3 -> kopf peering named after the release, the pod's name as its peer id, rolling
    updates (a new pod starts as a standby), a PDB keeping one up, and RBAC for the peering object."""
    objects = render(chart, {"operator": {"replicas": 3, "peering": {"lifetime": 30}}})
    [deploy] = by_kind(objects, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 3 and spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    [container] = spec["template"]["spec"]["containers"]
    assert container["args"][2:] == [f"--peering={deploy['metadata']['name']}", "--peering-lifetime=30"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    [pdb] = by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    granted = set().union(*(_rules(r) for r in by_kind(objects, "ClusterRole")))
    for verb in ("get", "list", "watch", "patch", "create"):
        assert ("kopf.dev", "clusterkopfpeerings", verb) in granted
    assert not any(r == "kopfpeerings" for _, r, _ in granted), "one cluster-wide peering object, never per namespace"
    assert "clusterkopfpeerings.kopf.dev" in {yaml.safe_load(c["data"])["metadata"]["name"] for c in chart.crds}


def test_default_images_are_the_dockerfiles_images(chart):
    from rlfleet.operator import names

    app_version = chart.metadata["appVersion"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert app_version == pyproject["project"]["version"]
    [operator] = by_kind(render(chart, {}), "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    for dockerfile, value_key, env_name in (
        ("Dockerfile.cpu", "image", "RLFLEET_IMAGE"),
        ("Dockerfile.gpu", "gpuImage", "RLFLEET_GPU_IMAGE"),
        ("Dockerfile.operator", "operatorImage", None),  # the operator's own container
    ):
        text = (ROOT / "docker" / dockerfile).read_text()
        [label] = re.findall(r'io\.rlfleet\.image="([^"]+)"', text)
        [version] = re.findall(r"^ARG VERSION=(\S+)$", text, re.M)
        assert chart.values[value_key]["repository"] == label, dockerfile
        assert version == app_version, dockerfile
        assert (env[env_name] if env_name else operator["image"]) == f"{label}:{app_version}"
    assert env["RLFLEET_IMAGE"] == names.DEFAULT_IMAGE, "the operator's fallback image differs from the chart's"
    torch_pin = next(d for d in pyproject["project"]["optional-dependencies"]["train"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in (ROOT / "docker" / "Dockerfile.cpu").read_text()


def _rules(role: dict) -> set[tuple[str, str, str]]:
    return {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }


def test_rbac_is_least_privilege_and_matches_the_crds(chart):
    objects = render(chart, {})
    roles = by_kind(objects, "ClusterRole")
    granted = set().union(*(_rules(r) for r in roles))
    assert not any("*" in part for rule in granted for part in rule), "no wildcards"
    assert not {r for _, r, _ in granted} & {"pods/exec", "roles", "rolebindings", "clusterroles"}
    # read by name, never listed or watched; created (a run's own signing key and Redis URL), never updated or deleted
    assert {v for _, r, v in granted if r == "secrets"} == {"get", "create"}, "Secrets: get and create only"
    crds = crd_docs()
    for kind, crd in crds.items():
        if crd["spec"]["group"] != "rlfleet.io":
            continue  # kopf's peering CRD: its rules come with operator.replicas > 1
        plural = crd["spec"]["names"]["plural"]
        subresources = crd["spec"]["versions"][0].get("subresources", {})
        for verb in ("get", "list", "watch", "patch"):
            assert ("rlfleet.io", plural, verb) in granted
        assert ("rlfleet.io", f"{plural}/status", "patch") in granted
        assert (("rlfleet.io", f"{plural}/scale", "patch") in granted) == ("scale" in subresources), kind
    for group, resource in (("", "configmaps"), ("", "services"), ("apps", "deployments"), ("apps", "statefulsets")):
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert (group, resource, verb) in granted
    assert ("", "events", "create") in granted
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in granted
    assert ("", "namespaces", "watch") in granted
    assert not any(g == "kopf.dev" for g, _, _ in granted), "peering rules only when operator.replicas > 1"
    [binding] = [b for b in by_kind(objects, "ClusterRoleBinding") if b["roleRef"]["name"].endswith("-operator")]
    assert binding["subjects"][0]["name"] == by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]


def test_watch_namespaces_gives_roles_not_a_cluster_role(chart):
    objects = render(chart, values_of("everything-on"))
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objects, "RoleBinding")) == ["team-a", "team-b"]
    cluster_rules = set().union(*(_rules(r) for r in by_kind(objects, "ClusterRole")))
    assert not any(g == "rlfleet.io" or r in ("configmaps", "deployments") for g, r, _ in cluster_rules)
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in cluster_rules, "peering is cluster-wide in every mode"
    args = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["--namespace=team-a", "--namespace=team-b"] and "--verbose" in args


def test_redis_is_optional_and_uses_the_official_image(chart):
    assert not [o for o in render(chart, {}) if "redis" in o["metadata"]["name"]]
    objects = render(chart, values_of("everything-on"))
    [redis] = [d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-redis")]
    [svc] = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-redis")]
    [container] = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("docker.io/library/redis:")
    assert container["args"][2:4] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "redis-pw", "key": "password"}
    assert svc["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == 6379


def test_monitors_are_toggles_that_select_the_operators_pods(chart):
    from rlfleet.operator import names

    assert not [o for o in render(chart, {}) if o["apiVersion"].startswith("monitoring.coreos.com")]
    objects = render(chart, values_of("everything-on"))
    [service_monitor] = by_kind(objects, "ServiceMonitor")
    on = {"monitoring": {"podMonitor": {"enabled": True}}, "operator": {"watchNamespaces": ["team-a", "team-b"]}}
    [pod_monitor] = by_kind(render(chart, on), "PodMonitor")
    child_labels = names.labels("InferencePool", "pool", names.ROLLOUT, "run")
    [operator_pod] = [
        d["spec"]["template"] for d in by_kind(objects, "Deployment") if "operator" in d["metadata"]["name"]
    ]
    [operator_service] = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-operator")]
    for monitor in (pod_monitor, service_monitor):
        assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(child_labels.items())
        # the runs' namespaces and the operator's own (its metrics)
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b", NAMESPACE]}
    assert set(pod_monitor["spec"]["selector"]["matchLabels"].items()) <= set(
        operator_pod["metadata"]["labels"].items()
    )
    assert "metrics" in {p["name"] for p in operator_pod["spec"]["containers"][0]["ports"]}
    selected = service_monitor["spec"]["selector"]["matchLabels"].items()
    assert set(selected) <= set(operator_service["metadata"]["labels"].items())
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert service_monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_dashboards_become_sidecar_config_maps(chart):
    files = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    maps = [c for c in by_kind(render(chart, {}), "ConfigMap") if "-dashboard-" in c["metadata"]["name"]]
    assert len(maps) == len(files) == 4
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        [(key, data)] = cm["data"].items()
        assert json.loads(data) == json.loads(files[key])
    custom = by_kind(
        render(chart, {"dashboards": {"label": "my_dash", "labelValue": "yes", "namespace": "monitoring"}}), "ConfigMap"
    )
    assert all(
        c["metadata"]["labels"]["my_dash"] == "yes" and c["metadata"]["namespace"] == "monitoring" for c in custom
    )
    assert not by_kind(render(chart, {"dashboards": {"enabled": False}}), "ConfigMap")


def test_multicluster_examples_wire_cluster_b_to_cluster_a(chart):
    a = render(chart, values_of("cluster-a"))
    b = render(chart, values_of("cluster-b"))
    [redis_svc] = [s for s in by_kind(a, "Service") if s["metadata"]["name"] == "rlfleet-redis"]
    [relay_svc] = [s for s in by_kind(a, "Service") if s["metadata"]["name"].endswith("-relay-external")]
    [ingest_svc] = [s for s in by_kind(a, "Service") if s["metadata"]["name"].endswith("-ingest-external")]
    assert redis_svc["spec"]["type"] == "ClusterIP", "Redis never leaves cluster A"
    assert relay_svc["spec"]["type"] == ingest_svc["spec"]["type"] == "LoadBalancer"
    assert {r["spec"]["tier"] for r in by_kind(a, "RelayTier")} == {0, 1}
    assert not by_kind(a, "InferencePool")
    # The exposed Service selects exactly the pods the operator builds for that tier.
    from rlfleet.operator import names

    tier = relay_svc["spec"]["selector"]["app.kubernetes.io/instance"]
    run = by_kind(a, "RLRun")[0]["metadata"]["name"]
    assert relay_svc["spec"]["selector"] == names.selector("RelayTier", tier, names.RELAY, run)
    [run_a] = by_kind(a, "RLRun")
    assert ingest_svc["spec"]["selector"] == names.selector("RLRun", run, names.INGEST, run)
    assert run_a["spec"]["ingest"]["tokens"], "cluster A runs the ingest"
    relay_host = relay_svc["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"]
    ingest_host = ingest_svc["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"]
    [pool] = by_kind(b, "InferencePool")
    [edge] = by_kind(b, "RelayTier")
    [run_b] = by_kind(b, "RLRun")
    assert pool["spec"]["relay"] == edge["metadata"]["name"] and pool["spec"]["gpus"] >= 1
    assert relay_host in edge["spec"]["upstreamUrl"]
    assert ingest_host in pool["spec"]["ingestUrl"] and pool["spec"]["workerTokens"]
    assert run_b["spec"]["remote"] and "redis" not in run_b["spec"], "cluster B's pods never see a Redis URL"
    # what crosses the WAN is HTTPS: A's ingest and exposed tier serve it, B's URLs say it and B trusts their CA
    exposed = [t for t in by_kind(a, "RelayTier") if t["metadata"]["name"] == tier]
    assert run_a["spec"]["ingest"]["tls"]["secretName"] and exposed[0]["spec"]["tls"]["secretName"]
    assert edge["spec"]["upstreamUrl"].startswith("https://") and pool["spec"]["ingestUrl"].startswith("https://")
    assert run_b["spec"]["tls"]["caSecret"]
    assert not [o for o in b if "redis" in o["metadata"]["name"]]


def _secret_commands(text: str, name: str) -> list[str]:
    """The `kubectl create secret generic NAME ...` commands in a text (continuation lines joined)."""
    joined = re.sub(r"\\\n#?\s*", " ", text)
    return [line for line in joined.splitlines() if f"create secret generic {name} " in line]


def test_every_signing_secret_command_gives_the_public_key():
    """Bug: the multi-cluster steps created the signing Secret without `public-key`, which origin,
    verifier and relay pods read: they failed with CreateContainerConfigError."""
    sources = [EXAMPLES / "cluster-a-values.yaml", EXAMPLES / "cluster-b-values.yaml", ROOT / "docs" / "kubernetes.md"]
    commands = {str(p): _secret_commands(p.read_text(), "arithmetic-signing") for p in sources}
    assert all(commands.values()), commands
    for source, found in commands.items():
        assert all("public-key=" in c for c in found), (source, found)
    assert all("signing-key=" in c for c in commands[str(EXAMPLES / "cluster-a-values.yaml")])
