"""What the operator fills into an RLRun that leaves it out, so that `kubectl apply -f examples/arithmetic/rlrun.yaml`
runs as it is on a cluster whose Helm release installed Redis and names a store (values `redis.enabled`,
`defaults.store`; the chart hands them over as RLFLEET_DEFAULT_REDIS_URL, RLFLEET_DEFAULT_REDIS_PASSWORD and
RLFLEET_DEFAULT_STORE).

    spec.redis      neither url nor urlSecret, and the operator knows the chart's Redis: a Secret RUN-redis-url
                    (key `url`, the password included) and spec.redis.urlSecret naming it
    spec.store      no uri, and the chart names a store: its uri, and its endpointUrl and credentialsSecret
                    where the run sets none (the credentials Secret must exist in the run's namespace)
    spec.shardcast  requireSignatures and no signingKeySecret: a fresh ed25519 key pair in a Secret
                    RUN-signing-key (keys signing-key and public-key) and signingKeySecret naming it
A remote run (trained in another cluster) gets nothing: its key and its Redis are the other cluster's.

The operator makes each missing Secret (RBAC: `create` on secrets, never update or delete) with the run as its
controller owner, so the garbage collector deletes it with the run; a Secret of that name made beforehand is
used as it is. Then it writes what it filled into the run's spec with one merge patch (reconcile.py): what a run
uses shows on it (`kubectl get rlrun -o yaml`), and a later change of the chart's defaults never moves a running
run to another store or Redis. Secrets first, the patch second: a failure between the two leaves Secrets that
the next reconcile finds and uses. From there the builders treat them as any named Secret: the private key is
mounted into the trainer alone, every other pod gets the public key (pods.signing_env).
"""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from rlfleet.config import RLRun, validation_problems
from rlfleet.config.infra import StoreSpec
from rlfleet.operator import names
from rlfleet.operator.kube import Conflict, Forbidden, Kube
from rlfleet.operator.pods import Owner
from rlfleet.operator.resources import parse_as
from rlfleet.versions.signing import public_key_text
from rlfleet.wire import env


@dataclass(frozen=True)
class RunDefaults:
    """The cluster's Redis and store for runs that name none (None: the run must name its own)."""

    redis_url: str | None = field(default=None, repr=False)  # the password is in it: never logged
    store: dict | None = None  # spec.store fields, camelCase as in the CRD

    @classmethod
    def from_env(cls) -> RunDefaults:
        """From the RLFLEET_DEFAULT_* variables; SystemExit naming the variable and the chart value to fix."""
        url, password = env.get(env.DEFAULT_REDIS_URL), env.get(env.DEFAULT_REDIS_PASSWORD)
        if url and not url.startswith(("redis://", "rediss://")):
            raise SystemExit(f"environment variable {env.DEFAULT_REDIS_URL}={url!r} must be a redis:// URL")
        if url and password:
            url = with_password(url, password)
        return cls(redis_url=url, store=_store_from(env.get(env.DEFAULT_STORE)))

    def __repr__(self) -> str:
        redis = "the chart's Redis" if self.redis_url else "none"
        return f"RunDefaults(redis={redis}, store={(self.store or {}).get('uri')})"


def _store_from(text: str | None) -> dict | None:
    if not text:
        return None
    where = f"environment variable {env.DEFAULT_STORE} (the chart's defaults.store)"
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{where}: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise SystemExit(f"{where}: must be an object with uri, endpointUrl, credentialsSecret")
    fields = {k: v for k, v in fields.items() if v not in (None, "")}
    if not fields:
        return None
    try:
        store = StoreSpec.model_validate(fields)
    except ValidationError as exc:
        raise SystemExit(f"{where}: {'; '.join(validation_problems(exc))}") from None
    if not (store.uri or "").startswith("s3://"):
        raise SystemExit(f"{where}: uri must be s3://bucket/prefix (every pod of a run must reach the store)")
    return store.model_dump(by_alias=True, exclude_none=True)


def with_password(url: str, password: str) -> str:
    """`url` with `password` as the default user's (percent-encoded: any character of a password survives)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f":{urllib.parse.quote(password, safe='')}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def missing(run: RLRun, defaults: RunDefaults) -> dict:
    """The spec patch (camelCase) of what `run` leaves out and the cluster has a default for; {} when nothing."""
    spec, name = run.spec, run.metadata.name
    if spec.remote:
        return {}
    patch: dict = {}
    if not spec.redis.url and not spec.redis.url_secret and defaults.redis_url:
        patch["redis"] = {"urlSecret": names.redis_secret(name)}
    if not spec.store.uri and defaults.store:
        own = spec.store.model_dump(by_alias=True, exclude_none=True)
        patch["store"] = {k: v for k, v in defaults.store.items() if k == "uri" or k not in own}
    if spec.shardcast.require_signatures and not spec.shardcast.signing_key_secret:
        patch["shardcast"] = {"signingKeySecret": names.signing_secret(name)}
    return patch


def fill(body: dict, run: RLRun, defaults: RunDefaults) -> tuple[RLRun, dict]:
    """(the run as it is once `missing` is written into its spec, that patch). Pure."""
    patch = missing(run, defaults)
    if not patch:
        return run, {}
    spec = dict(body.get("spec") or {})
    for key, value in patch.items():
        spec[key] = {**(spec.get(key) or {}), **value}
    return parse_as({**body, "spec": spec}, RLRun), patch


def signing_key_pair() -> dict[str, str]:
    """A fresh ed25519 pair as the signing Secret holds it: `signing-key` PEM (PKCS#8), `public-key` ed25519:<b64>."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return {names.SIGNING_KEY: pem.decode(), names.PUBLIC_KEY: public_key_text(key)}


def _secret(body: dict, name: str, component: str, data: dict[str, str]) -> dict:
    run = body["metadata"]["name"]
    owner = Owner("RLRun", run, body["metadata"].get("uid", ""))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": body["metadata"]["namespace"],
            "labels": names.labels("RLRun", run, component, run),
            "ownerReferences": [owner.reference()],
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


async def make_secrets(kube: Kube, body: dict, patch: dict, defaults: RunDefaults) -> tuple[str, str] | None:
    """Create the Secrets `patch` names that do not exist yet; None, or (reason, message) when the API refuses."""
    namespace, run = body["metadata"]["namespace"], body["metadata"]["name"]
    wanted: list[tuple[str, str, Callable[[], dict[str, str]]]] = []
    url = defaults.redis_url
    if "redis" in patch and url:
        wanted.append((patch["redis"]["urlSecret"], "redis-url", lambda: {names.REDIS_URL_KEY: url}))
    if "signingKeySecret" in patch.get("shardcast", {}):
        wanted.append((patch["shardcast"]["signingKeySecret"], "signing-key", signing_key_pair))
    for name, component, data in wanted:
        if await kube.find("Secret", namespace, name) is not None:
            continue  # made by an earlier reconcile whose spec patch failed, or by the user: used as it is
        try:
            await kube.create(_secret(body, name, component, data()))
        except Conflict:
            continue  # made meanwhile
        except Forbidden:
            return (
                "SecretForbidden",
                f"cannot create Secret {name} for RLRun {run}: the operator's RBAC does not allow create on secrets "
                f"in namespace {namespace} (the chart's RBAC grants it; with rbac.create false, grant it yourself, "
                "or name your own Secrets in spec.redis.urlSecret and spec.shardcast.signingKeySecret)",
            )
    return None
