"""`helm install` into a cluster of the box: the chart rendered by the real Helm SDK (helm-python-sdk, as
tests/chart does), its crds/ applied first, the release namespace made, then every rendered object
created in Helm's install order (kinds it does not know, such as custom resources, last).
`create` and `kubectl_apply` are what kubectl does with a manifest: the `kubernetes` client's create calls.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes
import yaml

from rlfleet.operator import names

from .images import REPO

CHART = REPO / "charts" / "rlfleet"
# helm/pkg/release/util/kind_sorter.go InstallOrder (the kinds this chart can render, in that order)
INSTALL_ORDER = [
    "Namespace",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "Pod",
    "Deployment",
    "StatefulSet",
]
BUILTIN = {  # kind -> (apiVersion path, plural, namespaced)
    "Namespace": ("api/v1", "namespaces", False),
    "ServiceAccount": ("api/v1", "serviceaccounts", True),
    "Secret": ("api/v1", "secrets", True),
    "ConfigMap": ("api/v1", "configmaps", True),
    "Service": ("api/v1", "services", True),
    "Pod": ("api/v1", "pods", True),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets", True),
    "NetworkPolicy": ("apis/networking.k8s.io/v1", "networkpolicies", True),
    "CustomResourceDefinition": ("apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "ClusterRole": ("apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "Deployment": ("apis/apps/v1", "deployments", True),
    "StatefulSet": ("apis/apps/v1", "statefulsets", True),
    "PodMonitor": ("apis/monitoring.coreos.com/v1", "podmonitors", True),
    "ServiceMonitor": ("apis/monitoring.coreos.com/v1", "servicemonitors", True),
    **{k.kind: (f"apis/{names.API_VERSION}", k.plural, True) for k in names.KINDS.values()},
}


def render(values: dict, release: str, namespace: str) -> list[dict]:
    """Every object the chart renders (helm template), with the real Helm SDK."""
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=release, namespace=namespace, is_install=True)
    objects = []
    for path, text in sorted(rendered.items()):
        if not path.endswith(".txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def hooks(objects: list[dict], event: str) -> list[dict]:
    """The objects Helm runs as `event` hooks (pre-delete, ...): never created by an install."""
    return [o for o in objects if event in ((o["metadata"].get("annotations") or {}).get("helm.sh/hook") or "")]


def chart_crds() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted((CHART / "crds").glob("*.yaml"))]


def create(client: kubernetes.client.ApiClient, obj: dict) -> dict:
    """POST one object as kubectl create does (the client's generic call: any kind in BUILTIN). A Namespace
    is taken as made: every namespace exists in the emulator (kmock parses /api/v1/namespaces as a prefix)."""
    if obj["kind"] == "Namespace":
        return obj
    prefix, plural, namespaced = BUILTIN[obj["kind"]]
    ns = obj["metadata"].get("namespace") if namespaced else None
    path = "/" + "/".join(p for p in (prefix, *(("namespaces", ns) if ns else ()), plural) if p)
    response = client.call_api(
        path,
        "POST",
        body=obj,
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        auth_settings=["BearerToken"],
        _preload_content=False,
    )
    return yaml.safe_load(response.data)


def install(cluster, values: dict, release: str = "rlfleet", namespace: str = "rlfleet") -> list[dict]:
    """`helm install RELEASE charts/rlfleet -n NAMESPACE --create-namespace -f values`; the rendered objects."""
    objects = render(values, release, namespace)
    client = cluster.client()
    try:
        for crd in chart_crds():
            create(client, crd)
        create(client, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        rank = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
        installed = [o for o in objects if "helm.sh/hook" not in (o["metadata"].get("annotations") or {})]
        for obj in sorted(installed, key=lambda o: rank.get(o["kind"], len(rank))):
            if BUILTIN[obj["kind"]][2]:
                obj["metadata"].setdefault("namespace", namespace)
            create(client, obj)
    finally:
        client.close()
    return objects


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())
