"""A cluster's API server in the box: tests/operator/cluster.py's emulator (kmock plus uids, generations,
garbage collection and server-side apply) with what the pods of a cluster need from one.

- Where: plain HTTP on 127.0.0.1 for the test and the pod runner (they act as the cluster admin), and
  HTTPS on the cluster's bridge (a testbed host of its own, port 443) for the pods, with a CA that
  every pod's service-account volume holds, so `load_incluster_config` (the operator's own login)
  works unchanged.
- Who: a bearer token the pod runner mounted as a service-account token is that account
  (system:serviceaccount:NS:NAME); a request without a token is the admin's.
- May they: a service account's request is checked against the Roles, ClusterRoles and bindings
  stored in the emulator (the chart's, once applied) by tests/operator/rbac.py, and refused with 403
  when none allows it. Every request is recorded with its user and the verdict (`audit`).
- Kinds: service accounts, RBAC, the Prometheus monitors and NetworkPolicies (stored, not enforced)
  besides what the operator uses; the rlfleet kinds and kopf's ClusterKopfPeering are served (and
  discoverable, which is how kopf finds them) only once their CustomResourceDefinitions are applied,
  from the CRDs' own names, scope and subresources.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import secrets
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import aiohttp.web
import kmock
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlfleet.operator import names, peering
from testbed import Host
from tests.operator.cluster import RESOURCES, VERBS, ApiCall, Cluster, api_call, write_kubeconfig
from tests.operator.rbac import allowed, bound_rules

from . import netns

ADMIN = "admin"
API_PORT = 443
EXTRA_RESOURCES = {
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False, set()),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False, set()),
    "monitoring.coreos.com/v1/podmonitors": ("PodMonitor", True, set()),
    # stored, not enforced (the box's pod network has no CNI policy engine; tests/chart checks their selectors)
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "monitoring.coreos.com/v1/servicemonitors": ("ServiceMonitor", True, set()),
}
RBAC_KINDS = {"roles", "rolebindings", "clusterroles", "clusterrolebindings"}
CRDS = "customresourcedefinitions"
NAMESPACES = "/api/v1/namespaces"


@dataclass(frozen=True)
class Audited:
    user: str  # "admin" or system:serviceaccount:NS:NAME
    call: ApiCall
    allowed: bool


class BoxCluster(Cluster):
    """The emulator with users, RBAC and CRD-driven kinds (see the module docstring)."""

    tokens: dict[str, str]  # bearer token -> user
    audit: list[Audited]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.tokens, self.audit = {"emulator-token": ADMIN}, []  # the admin kubeconfig's (cluster.write_kubeconfig)
        for res, (kind, namespaced, subresources) in EXTRA_RESOURCES.items():
            self.resources[res] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, subresources=subresources, verbs=VERBS
            )
        for res in [r for r in RESOURCES if r.startswith((names.API_VERSION, f"{peering.GROUP}/"))]:
            del self.resources[res]  # served once their CRDs are applied (kopf's peering CRD too)

    def _user(self, request) -> str:
        auth = request.headers.get("Authorization") or ""
        if not auth:
            return ADMIN
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or token.strip() not in self.tokens:
            raise kmock.KubernetesError(401, "Unauthorized", "unknown bearer token")
        return self.tokens[token.strip()]

    async def __call__(self, raw_request):
        """kmock parses `/api/v1/namespaces` as a namespace prefix and fails: the Namespace list and watch
        (kopf's namespace observer, when the operator watches named namespaces) are served here."""
        if raw_request.method == "GET" and raw_request.path.rstrip("/") == NAMESPACES:
            return await self._namespaces(raw_request)
        return await super().__call__(raw_request)

    async def _namespaces(self, raw_request) -> aiohttp.web.StreamResponse:
        """Every namespace an object is in, and `default` (each exists, as helm.create takes them); a
        watch sees no change and ends after its timeoutSeconds."""
        watch = raw_request.query.get("watch") == "true"
        agent = raw_request.headers.get("User-Agent") or ""
        call = ApiCall("watch" if watch else "list", "", "namespaces", None, None, raw_request.path, agent)
        try:
            user = self._user(raw_request)
        except kmock.KubernetesError:
            return aiohttp.web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        ok = user == ADMIN or allowed(call, *bound_rules(self._rbac_objects(), *user.split(":")[2:]))
        self.audit.append(Audited(user, call, ok))
        if not ok:
            return aiohttp.web.json_response({"kind": "Status", "code": 403, "reason": "Forbidden"}, status=403)
        if watch:
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(raw_request)
            await asyncio.sleep(min(float(raw_request.query.get("timeoutSeconds") or 60), 60))
            return response
        found = {ns for (_, ns, _), o in list(self._objects.items()) if ns and not o.deleted} | {"default"}
        items = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "resourceVersion": "1"},
             "status": {"phase": "Active"}}
            for ns in sorted(found)
        ]  # fmt: skip
        body = {"apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": items}
        return aiohttp.web.json_response(body)

    def _rbac_objects(self) -> list[dict]:
        return [
            o.raw
            for (res, _, _), o in list(self._objects.items())
            if not o.deleted and res.plural in RBAC_KINDS and res.group == "rbac.authorization.k8s.io"
        ]

    async def _handle(self, request):
        user = self._user(request)
        call = api_call(request)
        ok = True
        if user != ADMIN:
            _, _, ns, account = user.split(":")
            ok = allowed(call, *bound_rules(self._rbac_objects(), ns, account))
        self.audit.append(Audited(user, call, ok))
        if call.resource == "secrets" and isinstance(request.data, dict) and "stringData" in request.data:
            data = request.data.setdefault("data", {}) or {}
            for key, value in request.data.pop("stringData").items():  # what the API server stores
                data[key] = base64.b64encode(value.encode()).decode()
            request.data["data"] = data
        if not ok:
            raise kmock.KubernetesError(
                403, "Forbidden", f'{user} cannot {call.verb} resource "{call.resource}" in API group "{call.group}"'
            )
        response = await super()._handle(request)
        if call.resource == CRDS and call.verb in ("create", "patch", "update") and request.name is not None:
            self._serve_crd(request.name)
        elif call.resource == CRDS and call.verb == "create" and isinstance(request.data, dict):
            self._serve_crd(request.data["metadata"]["name"])
        return response

    def _serve_crd(self, name: str) -> None:
        crd = next(
            (o.raw for (res, _, n), o in self._objects.items() if res.plural == CRDS and n == name and not o.deleted),
            None,
        )
        if crd is None:
            return
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            subresources = set(version.get("subresources") or {})
            self.resources[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = kmock.ResourceInfo(
                kind=spec["names"]["kind"],
                namespaced=spec["scope"] == "Namespaced",
                subresources=subresources,
                verbs=VERBS,
                shortnames=set(spec["names"].get("shortNames") or []),
                categories=set(spec["names"].get("categories") or []),
                singular=spec["names"].get("singular"),
            )


def _certificates(directory: Path, ip: str) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA and a server certificate for `ip` and kubernetes.default.svc."""
    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, issuer, key, signer, **extensions) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for ext, critical in extensions.values():
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inabox-ca")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, basic=(x509.BasicConstraints(ca=True, path_length=None), True))
    dns = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"]
    alt = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)), *map(x509.DNSName, dns)])
    server = cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]), ca_name, key, ca_key, alt=(alt, False)
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


class ApiServer:
    """A BoxCluster served from a thread: `url` (127.0.0.1, admin), and for pods `host`:443 over TLS
    with `ca_path`; `issue_token(namespace, account)` is what the pod runner mounts for a pod."""

    def __init__(self, directory: Path, host: Host):
        self.directory, self.host = directory, host
        self.url = ""
        self.cluster: BoxCluster | None = None
        self.ca_path, cert, key = _certificates(directory / "pki", host.ip)
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ssl.load_cert_chain(cert, key)
        self._started, self._error = threading.Event(), None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"apiserver-{host.name}")

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__ (or lost at teardown, when nobody waits)
            self._error = exc
            self._started.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with BoxCluster() as cluster, kmock.Server(cluster) as local:
            runner = aiohttp.web.ServerRunner(aiohttp.web.Server(cluster), handle_signals=False)
            await runner.setup()
            site = aiohttp.web.SockSite(
                runner, netns.listen(self.host.netns, self.host.ip, API_PORT), ssl_context=self._ssl
            )
            await site.start()
            self.url, self.cluster = str(local.url).rstrip("/"), cluster
            self._started.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

    def __enter__(self) -> ApiServer:
        self._thread.start()
        assert self._started.wait(30), "the API server did not start"
        if self._error is not None:
            raise RuntimeError(f"the API server did not start: {self._error!r}") from self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def issue_token(self, namespace: str, account: str) -> str:
        token = secrets.token_urlsafe(24)
        self.cluster.tokens[token] = f"system:serviceaccount:{namespace}:{account}"
        return token

    def kubeconfig(self, path: Path) -> Path:
        """An admin kubeconfig for the loopback address (what `kubectl` on the test's side uses)."""
        return write_kubeconfig(path, self.url)

    def calls_of(self, user: str) -> list[Audited]:
        return [a for a in self.cluster.audit if a.user == user]
