"""The operator's one door to the Kubernetes API: the official `kubernetes` client, and the only module
that knows it.

What the handlers need and nothing more: get / find / list an object, server-side apply a built
child, patch a status, delete, post an Event. Objects go in and come out as plain dicts (the builders'
shape); responses are read raw (`_preload_content=False`) and parsed as JSON, so a child is never
squeezed through the client's typed models and back.

- Server-side apply with field manager `rlfleet-operator` and force=True, as controllers do: the API
  server keeps, per field manager, the fields each one last applied, so a field dropped from a built
  object is removed from the live one, and a field another manager set (a label from kubectl, replicas
  from an HPA on a Deployment we do not own) is kept.
- The client is synchronous: every call runs in a worker thread (asyncio.to_thread), never on the
  event loop kopf runs on.
- API errors become typed exceptions (NotFound, Forbidden, Conflict, Invalid, Unavailable, all
  ApiError): handlers choose by type, never by message text.
- Every request carries a timeout, (connect, read) seconds (`_request_timeout`): an API server that
  accepts a connection and never answers fails the call with Unavailable after `read` seconds, so a
  hung server never wedges a handler (kopf's own requests are bounded the same way: options.py).
- Login: the client's own configuration, in-cluster service account first, else the kubeconfig
  ($KUBECONFIG or ~/.kube/config); kopf logs in from the same source (kopf.login_via_client).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3

from rlfleet.operator import names
from rlfleet.wire import env

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the client sends the dict as JSON
MERGE_CONTENT_TYPE = "application/merge-patch+json"


class ApiError(Exception):
    """A request the API server refused or could not answer; `status` is the HTTP code (0: no answer)."""

    def __init__(self, status: int, reason: str, message: str):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"HTTP {status} {reason}: {message}")


class NotFound(ApiError):
    """404: the object (or its kind) does not exist."""


class Forbidden(ApiError):
    """403: the operator's RBAC does not allow the request."""


class Conflict(ApiError):
    """409: the object exists already, or changed meanwhile, or another manager owns a field."""


class Invalid(ApiError):
    """422 (or 400): the API server rejected the object; `message` names the field."""


class Unavailable(ApiError):
    """No usable answer: connection refused or reset, timeouts, 5xx."""


_BY_STATUS = {404: NotFound, 403: Forbidden, 409: Conflict, 422: Invalid, 400: Invalid}


def _error(exc: Exception) -> ApiError:
    if isinstance(exc, kubernetes.client.ApiException):
        try:
            body = json.loads(exc.body or "{}")
        except ValueError:
            body = {}
        message = body.get("message") or str(exc.reason or "")
        status = int(exc.status or 0)
        cls = _BY_STATUS.get(status, Unavailable if status == 0 or status >= 500 else ApiError)
        return cls(status, body.get("reason") or str(exc.reason or ""), message)
    return Unavailable(0, type(exc).__name__, str(exc))


@dataclass(frozen=True)
class _Typed:
    """A built-in kind: its API class and the suffix of its `*_namespaced_<suffix>` methods."""

    api: str
    suffix: str


_TYPED = {
    "ConfigMap": _Typed("CoreV1Api", "config_map"),
    "Service": _Typed("CoreV1Api", "service"),
    "Secret": _Typed("CoreV1Api", "secret"),
    "Event": _Typed("CoreV1Api", "event"),
    "Pod": _Typed("CoreV1Api", "pod"),
    "Deployment": _Typed("AppsV1Api", "deployment"),
    "StatefulSet": _Typed("AppsV1Api", "stateful_set"),
    "PodDisruptionBudget": _Typed("PolicyV1Api", "pod_disruption_budget"),
}


def connect(config_file: str | None = None) -> kubernetes.client.ApiClient:
    """An API client from the client library's own configuration: `config_file`, else the in-cluster
    service account, else the kubeconfig ($KUBECONFIG or ~/.kube/config). The same sources, in the
    same order, as kopf.login_via_client."""
    configuration = kubernetes.client.Configuration()
    if config_file is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return kubernetes.client.ApiClient(configuration)
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=config_file, client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


# A connection to the API server is made within this long, or the request fails (a read may take longer).
CONNECT_TIMEOUT_S = 10.0


def request_timeout(seconds: float) -> tuple[float, float]:
    """(connect, read) timeouts of a request bounded by `seconds`: the connection within
    min(seconds, CONNECT_TIMEOUT_S), then each read of the answer within `seconds`."""
    return min(seconds, CONNECT_TIMEOUT_S), seconds


class Kube:
    """Async get / list / apply / patch status / delete / events over one ApiClient (see the module docstring);
    `timeout_s` bounds every request (request_timeout)."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        field_manager: str = names.FIELD_MANAGER,
        timeout_s: float = env.DEFAULT_API_TIMEOUT_S,
    ):
        self.api_client = api_client
        self.field_manager = field_manager
        self.timeout = request_timeout(timeout_s)
        self._apis: dict[str, Any] = {}

    def _api(self, name: str):
        if name not in self._apis:
            self._apis[name] = getattr(kubernetes.client, name)(self.api_client)
        return self._apis[name]

    async def _call(self, fn, *args, **kwargs) -> tuple[dict, int]:
        """Run one client call in a thread; (parsed JSON body, HTTP status), or a typed ApiError."""

        def call():
            response = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
            return (json.loads(response.data) if response.data else {}), response.status

        try:
            return await asyncio.to_thread(call)
        except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _error(exc) from None

    def _method(self, kind: str, verb: str, namespace: str, name: str | None = None):
        """The client function for `verb` (read, list, create, patch, delete) on `kind`, and its leading
        arguments: (name, namespace) or (namespace,) for a built-in kind; group, version, namespace,
        plural (and name) for a custom kind, which goes through CustomObjectsApi."""
        if kind in _TYPED:
            typed = _TYPED[kind]
            fn = getattr(self._api(typed.api), f"{verb}_namespaced_{typed.suffix}")
            return fn, ((name, namespace) if name else (namespace,))
        verb = {"read": "get"}.get(verb, verb)
        fn = getattr(self._api("CustomObjectsApi"), f"{verb}_namespaced_custom_object")
        head = (names.GROUP, names.VERSION, namespace, names.KINDS[kind].plural)
        return fn, ((*head, name) if name else head)

    async def get(self, kind: str, namespace: str, name: str) -> dict:
        """The live object; NotFound when there is none."""
        fn, target = self._method(kind, "read", namespace, name)
        return (await self._call(fn, *target))[0]

    async def find(self, kind: str, namespace: str, name: str) -> dict | None:
        """The live object, or None when there is none."""
        try:
            return await self.get(kind, namespace, name)
        except NotFound:
            return None

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict]:
        fn, target = self._method(kind, "list", namespace)
        selector = {"label_selector": label_selector} if label_selector else {}
        return (await self._call(fn, *target, **selector))[0].get("items") or []

    async def apply(self, obj: dict) -> tuple[dict, bool]:
        """Server-side apply `obj` (create it when missing); (the live object, whether it was created)."""
        fn, target = self._method(obj["kind"], "patch", obj["metadata"]["namespace"], obj["metadata"]["name"])
        body, status = await self._call(
            fn, *target, obj, field_manager=self.field_manager, force=True, _content_type=APPLY_CONTENT_TYPE
        )
        return body, status == 201

    async def create(self, obj: dict) -> dict:
        """Create `obj` (a Secret the operator makes once: `create` alone, no apply); Conflict when it exists."""
        fn, target = self._method(obj["kind"], "create", obj["metadata"]["namespace"])
        return (await self._call(fn, *target, obj))[0]

    async def patch(self, kind: str, namespace: str, name: str, body: dict) -> dict:
        """Merge-patch an object (for a custom resource's metadata: a pool's owner reference and labels)."""
        fn, target = self._method(kind, "patch", namespace, name)
        return (await self._call(fn, *target, body, _content_type=MERGE_CONTENT_TYPE))[0]

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict) -> dict:
        """Merge-patch the status subresource of a custom resource."""
        fn = self._api("CustomObjectsApi").patch_namespaced_custom_object_status
        head = (names.GROUP, names.VERSION, namespace, names.KINDS[kind].plural, name)
        return (await self._call(fn, *head, {"status": status}, _content_type=MERGE_CONTENT_TYPE))[0]

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete an object (its dependents follow by the garbage collector); a missing one is fine."""
        fn, target = self._method(kind, "delete", namespace, name)
        try:
            await self._call(fn, *target)
        except NotFound:
            pass

    async def get_cluster_object(self, group: str, version: str, plural: str, name: str) -> dict | None:
        """A cluster-scoped custom object (kopf's ClusterKopfPeering), or None when there is none."""
        try:
            return (
                await self._call(self._api("CustomObjectsApi").get_cluster_custom_object, group, version, plural, name)
            )[0]
        except NotFound:
            return None

    async def post_event(self, event: dict) -> None:
        """Create an Event (a core/v1 Event body)."""
        fn, target = self._method("Event", "create", event["metadata"]["namespace"])
        await self._call(fn, *target, event)

    def close(self) -> None:
        self.api_client.close()
