"""Several operator replicas, one active: kopf's peering, as `rlfleet operator --peering NAME` runs it.

kopf keeps a ClusterKopfPeering object (group kopf.dev) whose status maps each running operator's id
to its priority and the time it last said it was alive. Every operator re-writes its own entry every
`lifetime - (5..10)` seconds (at least every second); an entry older than its lifetime is a dead
operator's. An operator pauses (stops its watches, timers and handlers) while a live peer has a
higher priority, and resumes when none has. A peer of equal priority pauses everyone, so priorities
must differ: `priority()` makes them distinct and ordered by start time.

Invariants:
- Cluster-wide peering always (one object, even for an operator watching a few namespaces), named
  after the release, so two releases of the chart never pause each other.
- The oldest live replica acts: a replica started later (a restarted pod, a rolling update's new pod)
  stands by instead of taking over, so the active one only changes when it stops.
- Failover: a replica that exits cleanly removes its entry on the way out, and a standby resumes at
  once; one that is killed leaves its entry, and a standby resumes when it expires, within
  `lifetime` seconds of the killed one's last keep-alive.
- kopf only patches the object; `ensure_peering_object` creates it when missing (the operator's
  own Deployment needs nothing made by hand) and names the missing CRD when that is what is absent.
"""

from __future__ import annotations

import datetime
import time

import kubernetes

GROUP, VERSION, PLURAL, KIND = "kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering"
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
DEFAULT_LIFETIME_S = 20  # keep-alives every 10-15 s; a killed leader is replaced within 20 s
MIN_LIFETIME_S = 2  # kopf re-writes its entry at most once a second; one missed write must not kill it


def priority(now_ns: int | None = None) -> int:
    """Minus the start time in microseconds: the older a replica, the higher its priority, and two
    replicas tie only if started in the same microsecond. It stays within a JSON-safe integer (< 2**53)."""
    return -((time.time_ns() if now_ns is None else now_ns) // 1000)


def leads(peers: dict, own_priority: int, now: datetime.datetime) -> bool:
    """Whether the replica of `own_priority` acts, by kopf's rule, from the peering object's status (peer
    id -> {priority, lifetime, lastseen}): its own entry is live and no other live entry has a priority as
    high (a higher one pauses it, an equal one pauses both). An entry is live until lastseen + lifetime."""
    live = []
    for entry in peers.values():
        if not isinstance(entry, dict) or "lastseen" not in entry:
            continue
        try:
            seen = datetime.datetime.fromisoformat(str(entry["lastseen"]).replace("Z", "+00:00"))
            lifetime = datetime.timedelta(seconds=int(entry.get("lifetime", 60)))
        except (TypeError, ValueError):  # an entry kopf would not have written: not a live peer
            continue
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        if seen + lifetime > now:
            live.append(int(entry.get("priority", 0)))
    return live.count(own_priority) == 1 and not [p for p in live if p > own_priority]


def peering_crd() -> dict:
    """kopf's ClusterKopfPeering CRD: an object per peering group, its status the peers' entries."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower()},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "kopf's peering: operators of one group see each other here, and only "
                            "the one with the highest priority acts (used by `rlfleet operator --peering`).",
                            "properties": {
                                "status": {
                                    "type": "object",
                                    "description": "Operator id -> priority, lifetime and last keep-alive.",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    },
                }
            ],
        },
    }


def ensure_peering_object(api_client: kubernetes.client.ApiClient, name: str) -> bool:
    """Create the ClusterKopfPeering `name` unless it exists; True when this call created it.
    A missing CRD or a refused request ends the operator with what to do about it."""
    api = kubernetes.client.CustomObjectsApi(api_client)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name}}
    try:
        api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
    except kubernetes.client.ApiException as exc:
        if exc.status == 409:  # another replica (or a previous run) made it
            return False
        if exc.status == 404:
            raise SystemExit(
                f"--peering {name}: the cluster has no {CRD_NAME} CRD; install it with the chart's CRDs "
                f"(charts/rlfleet/crds/{CRD_FILE}, or `rlfleet crds --out DIR`) or run without --peering"
            ) from None
        if exc.status == 403:
            raise SystemExit(
                f"--peering {name}: creating {KIND} {name} is forbidden; grant create, get, list, watch and "
                f"patch on {PLURAL}.{GROUP} (the chart does when operator.replicas > 1)"
            ) from None
        raise
    return True
