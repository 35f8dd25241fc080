"""What the operator tests do as kubectl would: plain HTTP against the API emulator, and waits."""

from __future__ import annotations

import requests
import yaml

from rlfleet.operator import names
from tests.support import REPO

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"
_GROUPS = {
    "ConfigMap": "api/v1",
    "Service": "api/v1",
    "Secret": "api/v1",
    "Event": "api/v1",
    "Pod": "api/v1",
    "Deployment": "apis/apps/v1",
    "StatefulSet": "apis/apps/v1",
    "PodDisruptionBudget": "apis/policy/v1",
}


def url_of(api: str, kind: str, ns: str, name: str | None = None, sub: str | None = None) -> str:
    group = _GROUPS.get(kind, f"apis/{names.API_VERSION}")
    plural = names.KINDS[kind].plural if kind in names.KINDS else kind.lower() + "s"
    return "/".join(p for p in (api, group, "namespaces", ns, plural, name, sub) if p)


def get(api, kind, ns, name):
    r = requests.get(url_of(api, kind, ns, name), timeout=5)
    return r.json() if r.status_code == 200 else None


def create(api, ns, body):
    body = {**body, "metadata": {**body["metadata"], "namespace": ns}}
    r = requests.post(url_of(api, body["kind"], ns), json=body, timeout=5)
    assert r.status_code in (200, 201), r.text


def patch(api, kind, ns, name, body, sub=None):
    r = requests.patch(
        url_of(api, kind, ns, name, sub), json=body, timeout=5, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert r.status_code == 200, r.text


def condition(obj, type_="Ready"):
    return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == type_), None)


def example(redis_url: str | None = None, **spec) -> list[dict]:
    """The arithmetic example's documents; with `redis_url`, the settings a cluster needs (`spec` wins)."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    if redis_url:
        docs[0]["spec"].update(
            redis={"url": redis_url},
            store={"uri": "s3://ckpt/runs"},
            shardcast={"signingKeySecret": "arithmetic-signing"},
        )
    docs[0]["spec"].update(spec)
    return docs


SIGNING_SECRET = {"signing-key": "-----BEGIN PRIVATE KEY-----\n...", "public-key": "ed25519:" + "A" * 43 + "="}


def apply_example(api, ns, redis_url, signing_secret: bool = True, **spec):
    """`kubectl apply -f` of the example (and, unless told otherwise, its signing key Secret first)."""
    if signing_secret and redis_url:
        secret(api, ns, "arithmetic-signing", SIGNING_SECRET)
    for doc in example(redis_url, **spec):
        create(api, ns, doc)


def redis_db(redis_url: str, db: int) -> str:
    """The same Redis, another database: runs of the same name in different tests keep apart."""
    return redis_url.rsplit("/", 1)[0] + f"/{db}"


def events(api, ns, reason: str | None = None) -> list[dict]:
    items = requests.get(url_of(api, "Event", ns), timeout=5).json()["items"]
    return [e for e in items if reason is None or e.get("reason") == reason]


def secret(api, ns, name: str, data: dict[str, str]) -> None:
    """`kubectl create secret generic NAME --from-literal=k=v ...`"""
    import base64

    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    create(api, ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": encoded})


def has_condition(api, kind, ns, name, type_: str, status: str, reason: str | None = None):
    """The object when its condition `type_` has `status` (and `reason`), else None (for wait_for)."""
    obj = get(api, kind, ns, name)
    c = condition(obj, type_)
    if c and c["status"] == status and (reason is None or c.get("reason") == reason):
        return obj
    return None


def unknown_status_fields(obj: dict) -> list[str]:
    """Status fields the CRD's schema lacks: a real API server prunes them (structural schemas)."""
    from rlfleet.operator.crd import build_crd

    schema = build_crd(names.KINDS[obj["kind"]])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    status_schema = schema["properties"]["status"]["properties"]
    condition_schema = status_schema["conditions"]["items"]["properties"]
    unknown = [f"status.{k}" for k in obj.get("status", {}) if k not in status_schema]
    for c in obj.get("status", {}).get("conditions", []):
        unknown += [f"status.conditions[{c.get('type')}].{k}" for k in c if k not in condition_schema]
    return unknown
