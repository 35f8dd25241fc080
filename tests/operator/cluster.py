"""A Kubernetes API server in a box for the operator tests: kmock's emulator (the real HTTP protocol)
plus what a real API server does that the operator relies on.

kmock keeps objects as plain JSON and merge-patches them. `Cluster` adds:
- uid, resourceVersion, generation (moves only when spec changes) and creationTimestamp;
- garbage collection: deleting an object deletes the objects whose ownerReferences name its uid;
- server-side apply (`PATCH` with `application/apply-patch+yaml`): create-if-missing, and field
  ownership per field manager in `metadata.managedFields` (see `server_side_apply`);
- `metadata.generateName` on create, and `metadata.namespace` from the URL when the body has none;
- managedFields for creates and merge patches too (operation Update, manager from `?fieldManager=`
  or the User-Agent), so an apply keeps what another manager set;
- JSON patches: a new resourceVersion, and 422 when one does not apply (kopf removes its finalizer
  with a `test` of the resourceVersion and waits for the next event on 422; kmock answers 500,
  which kopf would retry with its error backoff, ~50 s, before the deleted object could go);
- label selectors on list requests;
- a record of every request (`calls`) for the RBAC replay, `forbidden` to answer chosen
  requests with 403 as an RBAC-limited server would, `refused` to answer chosen applies with 422
  as a validating admission webhook (or the server's own validation) would, and `late` to answer
  chosen deletes late (the object's watch events go out at once, as a loaded API server's may
  overtake its response).
It does not validate bodies against schemas (test_crds.py and kubernetes-validate do).

`EmulatedCluster` runs it in a thread with its own event loop and writes a kubeconfig for it, so
processes (`rlfleet operator`) log in to it the way they log in to any cluster.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts as kmock_dicts
from kmock._internal.enums import action

from rlfleet.operator import names, peering

APPLY = "application/apply-patch+yaml"

# Every resource the operator (and kopf) reads or writes: kind, namespaced, subresources.
RESOURCES = {
    "v1/namespaces": ("Namespace", False, set()),
    "v1/events": ("Event", True, set()),
    "events.k8s.io/v1/events": ("Event", True, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/services": ("Service", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "apps/v1/statefulsets": ("StatefulSet", True, {"status", "scale"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}),
    f"{names.API_VERSION}/{names.RLRUN.plural}": ("RLRun", True, {"status"}),
    f"{names.API_VERSION}/{names.INFERENCE_POOL.plural}": ("InferencePool", True, {"status", "scale"}),
    f"{names.API_VERSION}/{names.RELAY_TIER.plural}": ("RelayTier", True, {"status", "scale"}),
    # kopf's peering (`rlfleet operator --peering`); no status subresource, as in its CRD
    f"{peering.GROUP}/{peering.VERSION}/{peering.PLURAL}": (peering.KIND, False, set()),
}
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


@dataclass(frozen=True)
class ApiCall:
    """One request as RBAC sees it: verb, API group, resource (with subresource), namespace, name;
    `path` for a non-resource URL (discovery); `agent` the client's User-Agent; `token` its bearer
    token (which of several clients made it, when each logs in with its own)."""

    verb: str
    group: str | None
    resource: str | None
    namespace: str | None
    name: str | None
    path: str
    agent: str
    token: str = ""


def api_call(request) -> ApiCall:
    res = request.resource
    if res is None or res.plural is None:
        return ApiCall(
            request.method.value.lower(), None, None, None, None, request.url.path, _agent(request), _token(request)
        )
    method = request.method.value.upper()
    verb = {
        "GET": "watch" if request.params.get("watch") == "true" else ("get" if request.name else "list"),
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete" if request.name else "deletecollection",
    }.get(method, method.lower())
    resource = res.plural + (f"/{request.subresource}" if request.subresource else "")
    return ApiCall(
        verb, res.group, resource, request.namespace, request.name, request.url.path, _agent(request), _token(request)
    )


def _agent(request) -> str:
    return request.headers.get("User-Agent") or ""


def _token(request) -> str:
    return (request.headers.get("Authorization") or "").removeprefix("Bearer ")


# ---- field ownership (server-side apply) ---------------------------------------------------------

_NOT_OWNED = {
    ("apiVersion",),
    ("kind",),
    ("status",),
    ("metadata", "name"),
    ("metadata", "namespace"),
    ("metadata", "uid"),
    ("metadata", "resourceVersion"),
    ("metadata", "generation"),
    ("metadata", "creationTimestamp"),
    ("metadata", "managedFields"),
    ("metadata", "deletionTimestamp"),
}


def leaf_paths(obj: dict, prefix: tuple = ()) -> dict[tuple, object]:
    """Path -> value of every leaf: a scalar, a list (lists are atomic here) or an empty mapping."""
    out: dict[tuple, object] = {}
    for key, value in obj.items():
        path = (*prefix, key)
        if path in _NOT_OWNED or (not prefix and key == "status"):
            continue
        if isinstance(value, dict) and value:
            out.update(leaf_paths(value, path))
        else:
            out[path] = value
    return out


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[: len(b)] == b or b[: len(a)] == a


def _get(obj: dict, path: tuple):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return KeyError
        obj = obj[key]
    return obj


def _set(obj: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = copy.deepcopy(value)


def _remove(obj: dict, path: tuple) -> None:
    """Delete the leaf and every mapping above it that it leaves empty."""
    chain = [obj]
    for key in path[:-1]:
        if not isinstance(chain[-1].get(key), dict):
            return
        chain.append(chain[-1][key])
    chain[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if chain[depth]:
            break
        chain[depth - 1].pop(path[depth - 1], None)


def fields_v1(paths) -> dict:
    """Paths in the API server's FieldsV1 notation ({"f:spec": {"f:replicas": {}}})."""
    out: dict = {}
    for path in sorted(paths, key=len):
        node = out
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return out


def paths_of(fields: dict, prefix: tuple = ()) -> set[tuple]:
    out = set()
    for key, sub in fields.items():
        path = (*prefix, key[2:])
        out |= paths_of(sub, path) if sub else {path}
    return out


def _owners(obj: dict | None) -> dict[tuple[str, str], set[tuple]]:
    """(manager, operation) -> paths it owns, from metadata.managedFields."""
    entries = ((obj or {}).get("metadata") or {}).get("managedFields") or []
    return {(e["manager"], e["operation"]): paths_of(e.get("fieldsV1") or {}) for e in entries}


def _managed_fields(owners: dict[tuple[str, str], set[tuple]], api_version: str) -> list[dict]:
    now = _now()
    return [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(paths),
        }
        for (manager, operation), paths in sorted(owners.items())
        if paths
    ]


class ApplyConflict(Exception):
    """Fields the apply would change that other managers own (only without force)."""

    def __init__(self, conflicts: list[str]):
        self.conflicts = conflicts
        super().__init__("; ".join(conflicts))


def server_side_apply(live: dict | None, applied: dict, manager: str, force: bool) -> dict:
    """The object after `manager` applies `applied` to `live` (None: create).

    Ownership is per leaf path (lists are atomic). The manager's applied set becomes exactly the
    leaves of `applied`; a leaf it owned before and no longer applies is removed unless another
    manager owns it too; a leaf another manager owns with a different value is a conflict, and
    with `force` it changes hands. Everything else on the live object stays."""
    new = copy.deepcopy(live) if live else {}
    owners = _owners(live)
    applied_leaves = leaf_paths(applied)
    mine = (manager, "Apply")
    previous = owners.get(mine, set())
    conflicts = []
    for path, value in applied_leaves.items():
        for owner, paths in owners.items():
            if owner == mine:
                continue
            clashing = {p for p in paths if _overlaps(p, path)}
            if clashing and _get(new, path) != value:
                if not force:
                    conflicts.append(f".{'.'.join(path)}: owned by {owner[0]} ({owner[1]})")
                paths -= clashing
    if conflicts:
        raise ApplyConflict(conflicts)
    still_owned = set().union(*(p for o, p in owners.items() if o != mine)) if owners else set()
    for path in previous - applied_leaves.keys():
        if not any(_overlaps(path, p) for p in still_owned):
            _remove(new, path)
    for path, value in applied_leaves.items():
        _set(new, path, value)
    owners[mine] = set(applied_leaves)
    meta = new.setdefault("metadata", {})
    meta["managedFields"] = _managed_fields(owners, applied.get("apiVersion", ""))
    meta["name"] = applied["metadata"]["name"]
    new["apiVersion"], new["kind"] = applied.get("apiVersion"), applied.get("kind")
    return new


def record_update(live: dict | None, patch: dict, manager: str, api_version: str) -> list[dict]:
    """managedFields after `manager` created or merge-patched the object with `patch` (operation
    Update): it owns the leaves it set, which other managers lose; leaves it nulled are nobody's."""
    owners = _owners(live)
    set_leaves = {p for p, v in leaf_paths(patch).items() if v is not None}
    nulled = {p for p, v in leaf_paths(patch).items() if v is None}
    for owner, paths in owners.items():
        owners[owner] = {p for p in paths if not any(_overlaps(p, q) for q in set_leaves | nulled)}
    key = (manager, "Update")
    owners[key] = owners.get(key, set()) | set_leaves
    return _managed_fields(owners, api_version)


# ---- the emulator --------------------------------------------------------------------------------

_versions = itertools.count(1)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selects(selector: str | None, labels: dict) -> bool:
    """An equality-based label selector (`a=b,c!=d,e,!f`), as list requests take it."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.split("=", 1)
            ok = labels.get(key.strip().rstrip("=")) == value.strip()
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _manager(request) -> str:
    return request.params.get("fieldManager") or (request.headers.get("User-Agent") or "unknown").split("/")[0]


class Cluster(kmock.KubernetesEmulator):
    """kmock plus uid/resourceVersion/generation/creationTimestamp, garbage collection, server-side
    apply and managedFields, a request record and chosen 403s (see the module docstring)."""

    calls: list[ApiCall]
    forbidden: set[tuple[str, str | None, str | None]]  # (resource, namespace, name) answered 403
    refused: dict[tuple[str, str | None, str | None], str]  # (resource, namespace, name) -> 422 message on apply
    late: dict[tuple[str, str | None, str | None], float]  # (resource, namespace, name) -> seconds a DELETE waits

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls, self.forbidden, self.late, self.refused = [], set(), {}, {}
        for res, (kind, namespaced, subresources) in RESOURCES.items():
            self.resources[res] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, subresources=subresources, verbs=VERBS
            )

    async def _handle(self, request):
        # kmock records every request and re-filters that record on each new one (O(n) per request);
        # a long-running operator makes thousands, so keep only the recent ones (tests assert on objects).
        if len(self._requests) > 20:
            del self._requests[:-10]
            for payload in self._payloads:
                del payload._requests[:-10]
        call = api_call(request)
        self.calls.append(call)
        if call.resource and (call.resource.split("/")[0], call.namespace, call.name) in self.forbidden:
            raise kmock.KubernetesError(403, "Forbidden", f"{call.verb} {call.resource} {call.name} is forbidden")
        if request.method.value.upper() == "PATCH" and request.headers.get("Content-Type", "").startswith(APPLY):
            refusal = self.refused.get((call.resource or "", call.namespace, call.name))
            if refusal:  # what an admission webhook or the API server's own validation answers
                raise kmock.KubernetesError(422, "Invalid", refusal)
            return await self._apply(request)
        key = (request.resource, request.namespace, request.name) if request.resource is not None else None
        existing = (
            self._objects[key]
            if key and request.name and key in self._objects and not self._objects[key].deleted
            else None
        )
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            api_version = request.data.get("apiVersion") or "/".join(
                p for p in (request.resource.group, request.resource.version) if p
            )
            if request.action == action.CREATE:
                if not meta.get("name") and meta.get("generateName"):  # kopf names its Events this way
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                if request.namespace:  # a body may leave it out: the URL says it (kubectl's create does)
                    if meta.setdefault("namespace", request.namespace) != request.namespace:
                        raise kmock.KubernetesError(
                            400, "BadRequest", "the namespace of the object does not match the URL"
                        )
                meta.update(
                    uid=str(uuid.uuid4()),
                    generation=1,
                    resourceVersion=str(next(_versions)),
                    creationTimestamp=_now(),
                    managedFields=record_update(None, request.data, _manager(request), api_version),
                )
            elif request.action == action.UPDATE and existing is not None:
                meta["resourceVersion"] = str(next(_versions))
                meta["managedFields"] = record_update(existing.raw, request.data, _manager(request), api_version)
                after = kmock_dicts.patch_dict(copy.deepcopy(existing.raw), request.data)
                if request.subresource != "status" and after.get("spec") != existing.raw.get("spec"):
                    meta["generation"] = existing.raw["metadata"].get("generation", 1) + 1
        if request.action == action.UPDATE and existing is not None and isinstance(request.data, list):
            try:  # the same check kmock makes next, with the API server's status for its failure
                jsonpatch.apply_patch(existing.raw, request.data)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": str(next(_versions))})
        uid = existing.raw["metadata"].get("uid") if existing is not None else None
        response = await super()._handle(request)
        if call.verb == "delete" and (delay := self.late.get((call.resource, call.namespace, call.name))):
            await asyncio.sleep(delay)  # the deletion's watch event went out in super()._handle
        if uid and self._objects[key].deleted:
            await self._collect(uid)
        return response

    async def _serve_list(self, request):
        listed = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:  # kmock lists everything; the API server filters by the selector
            listed["items"] = [o for o in listed["items"] if selects(selector, o["metadata"].get("labels") or {})]
        return listed

    async def _apply(self, request) -> aiohttp.web.Response:
        """Server-side apply: create-if-missing, field ownership per manager (server_side_apply)."""
        if not request.name or not isinstance(request.data, dict):
            raise kmock.KubernetesError(400, "BadRequest", "apply needs an object name and a body")
        if "fieldManager" not in request.params:
            raise kmock.KubernetesError(400, "BadRequest", "fieldManager is required for apply requests")
        body = request.data
        if (body.get("metadata") or {}).get("name") != request.name:
            raise kmock.KubernetesError(400, "BadRequest", "the name in the body does not match the URL")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            live = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
            try:
                new = server_side_apply(
                    live, body, request.params["fieldManager"], request.params.get("force", "").lower() in ("true", "1")
                )
            except ApplyConflict as exc:
                raise kmock.KubernetesError(409, "Conflict", f"Apply failed with conflicts: {exc}") from None
            meta = new["metadata"]
            meta["resourceVersion"] = str(next(_versions))
            if live is None:
                meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now(), namespace=request.namespace)
                self._objects[key] = new
                event = "ADDED"
            else:
                if new.get("spec") != live.get("spec"):
                    meta["generation"] = live["metadata"].get("generation", 1) + 1
                self._objects[key].create(new)
                event = "MODIFIED"
            await self._buses[request.resource].put({"type": event, "object": new})
        return aiohttp.web.json_response(new, status=201 if live is None else 200)

    async def _collect(self, uid: str) -> None:
        async with self._lock:
            doomed = [
                (k, o)
                for k, o in self._objects.items()
                if not o.deleted
                and any(r.get("uid") == uid for r in o.raw.get("metadata", {}).get("ownerReferences", []))
            ]
            for k, o in doomed:
                raw = o.raw
                o.delete()
                await self._buses[k[0]].put({"type": "DELETED", "object": raw})
        for _, o in doomed:
            await self._collect(o.last.raw["metadata"]["uid"])


def write_kubeconfig(path: Path, server: str, namespace: str = "default", token: str = "emulator-token") -> Path:
    """A kubeconfig whose current context is `server` (a bearer token, as a service account would use)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "rlfleet-operator", "user": {"token": token}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "rlfleet-operator", "namespace": namespace}}
        ],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class EmulatedCluster:
    """`Cluster` served on 127.0.0.1 from a background thread; `url`, `cluster` and `kubeconfig(path)`."""

    def __init__(self):
        self.url: str = ""
        self.cluster: Cluster | None = None
        self._started, self._stop = threading.Event(), None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True, name="emulator")

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with Cluster() as cluster, kmock.Server(cluster) as server:
            self.url, self.cluster = str(server.url).rstrip("/"), cluster
            self._started.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        assert self._started.wait(10), "the API emulator did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def kubeconfig(self, path: Path, token: str = "emulator-token") -> Path:
        return write_kubeconfig(path, self.url, token=token)
