"""Kubernetes RBAC, evaluated as the API server's authorizer does, for the requests the emulator records
(cluster.ApiCall): which of them the Roles/ClusterRoles bound to a service account allow.

Used by test_rbac_replay.py (every request of the operator tests against the chart's rendered RBAC)
and by the cluster in a box (tests/cluster/), whose API server refuses a service account's request
that the RBAC objects stored in it do not allow.
"""

from __future__ import annotations

from tests.operator.cluster import ApiCall

# Discovery endpoints every authenticated client may read (the cluster's default system:discovery role).
DISCOVERY = ("/api", "/apis", "/version", "/openapi")


def _of(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o.get("kind") == kind]


def bound_rules(objects: list[dict], namespace: str, name: str) -> tuple[list[dict], dict[str, list[dict]]]:
    """(cluster-wide rules, namespace -> namespaced rules) granted to service account `namespace/name`
    by the RBAC objects among `objects`."""

    def binds(binding: dict) -> bool:
        return any(
            s["kind"] == "ServiceAccount" and s["name"] == name and s.get("namespace") == namespace
            for s in binding.get("subjects") or []
        )

    cluster_roles = {r["metadata"]["name"]: r for r in _of(objects, "ClusterRole")}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in _of(objects, "Role")}
    cluster_wide = [
        rule
        for binding in _of(objects, "ClusterRoleBinding")
        if binds(binding) and binding["roleRef"]["name"] in cluster_roles
        for rule in cluster_roles[binding["roleRef"]["name"]].get("rules") or []
    ]
    namespaced: dict[str, list[dict]] = {}
    for binding in _of(objects, "RoleBinding"):
        if not binds(binding):
            continue
        ns, ref = binding["metadata"]["namespace"], binding["roleRef"]
        role = cluster_roles.get(ref["name"]) if ref["kind"] == "ClusterRole" else roles.get((ns, ref["name"]))
        namespaced.setdefault(ns, []).extend((role or {}).get("rules") or [])
    return cluster_wide, namespaced


def allows(rule: dict, call: ApiCall) -> bool:
    return (
        (call.group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
        and (call.resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and (call.verb in rule["verbs"] or "*" in rule["verbs"])
        and (not rule.get("resourceNames") or call.name in rule["resourceNames"])
    )


def allowed(call: ApiCall, cluster_wide: list[dict], namespaced: dict[str, list[dict]]) -> bool:
    if call.resource is None:
        return call.path.startswith(DISCOVERY)
    rules = cluster_wide + (namespaced.get(call.namespace, []) if call.namespace else [])
    return any(allows(rule, call) for rule in rules)


def denied(calls: list[ApiCall], objects: list[dict]) -> list[ApiCall]:
    """The calls that the RBAC among `objects` denies to its one ServiceAccount (a rendered chart)."""
    [account] = _of(objects, "ServiceAccount")
    cluster_wide, namespaced = bound_rules(objects, account["metadata"]["namespace"], account["metadata"]["name"])
    return [call for call in calls if not allowed(call, cluster_wide, namespaced)]
