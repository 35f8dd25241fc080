"""The Secrets a run's pods need, checked before the pods would fail on them.

A pod that names a missing Secret, or a key its Secret lacks, hangs in CreateContainerConfigError and
says little. The operator reads each Secret the spec names (RBAC: `get` on secrets, nothing else) and
reports the first problem as the run's (or pool's) Ready reason with the field to fix:
SecretNotFound, SecretKeyMissing, or SecretForbidden when its own RBAC does not let it look.
Only key names are looked at, except the Redis URL, which the operator itself uses to read progress.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from rlfleet.config import InferencePool, RLRun
from rlfleet.config.tracking import WANDB_API_KEY_KEY
from rlfleet.operator import names
from rlfleet.operator.credentials import HUB_TOKEN_KEY
from rlfleet.operator.kube import Forbidden, Kube, NotFound
from rlfleet.wire import tls


@dataclass(frozen=True)
class SecretNeed:
    name: str
    field: str  # the spec field that names it
    keys: tuple[str, ...]  # keys the pods read from it (empty: every key, as environment variables)


def run_secrets(run: RLRun) -> list[SecretNeed]:
    spec = run.spec
    ca = [SecretNeed(spec.tls.ca_secret, "spec.tls.caSecret", (tls.CA_KEY,))] if spec.tls.ca_secret else []
    if spec.remote:  # this cluster runs only relays and pools: the public key and the CA bundle at most
        needs = ca
        if spec.shardcast.signing_key_secret and not spec.shardcast.public_key:
            needs.append(
                SecretNeed(spec.shardcast.signing_key_secret, "spec.shardcast.signingKeySecret", ("public-key",))
            )
        return needs
    needs = []
    if spec.redis.url_secret:
        needs.append(SecretNeed(spec.redis.url_secret, "spec.redis.urlSecret", (names.REDIS_URL_KEY,)))
    if spec.shardcast.signing_key_secret:
        keys = (names.SIGNING_KEY,) + (() if spec.shardcast.public_key else (names.PUBLIC_KEY,))
        needs.append(SecretNeed(spec.shardcast.signing_key_secret, "spec.shardcast.signingKeySecret", keys))
    if spec.store.credentials_secret:
        needs.append(SecretNeed(spec.store.credentials_secret, "spec.store.credentialsSecret", ()))
    if spec.tracking.wandb and spec.tracking.wandb.api_key_secret:
        needs.append(
            SecretNeed(spec.tracking.wandb.api_key_secret, "spec.tracking.wandb.apiKeySecret", (WANDB_API_KEY_KEY,))
        )
    if spec.tracking.mlflow and spec.tracking.mlflow.credentials_secret:
        needs.append(SecretNeed(spec.tracking.mlflow.credentials_secret, "spec.tracking.mlflow.credentialsSecret", ()))
    if spec.ingest.tokens:
        needs.append(SecretNeed(spec.ingest.tokens, "spec.ingest.tokens", (names.INGEST_TOKENS_KEY,)))
    if spec.model.token_secret and spec.model.path.startswith("hf://"):
        needs.append(SecretNeed(spec.model.token_secret, "spec.model.tokenSecret", (HUB_TOKEN_KEY,)))
    admission = spec.ingest.admission
    if admission.mode == "invite" and admission.invites:
        field = "spec.ingest.admission.invites"
        needs.append(SecretNeed(admission.invites, field, (names.INGEST_INVITES_KEY,)))
    served = spec.ingest.tls.secret_name if spec.ingest.tokens or admission.mode != "tokens" else None
    if served:  # the ingest's certificate (a Deployment only when it serves, builders.serves_ingest)
        needs.append(SecretNeed(served, "spec.ingest.tls.secretName", (tls.TLS_CERT_KEY, tls.TLS_KEY_KEY)))
    return needs + ca


def pool_secrets(pool: InferencePool) -> list[SecretNeed]:
    needs = []
    if pool.spec.worker_tokens:
        pods = tuple(f"{names.rollout(pool.metadata.name)}-{i}" for i in range(pool.spec.replicas))
        needs.append(SecretNeed(pool.spec.worker_tokens, "spec.workerTokens", pods))
    if pool.spec.data_credentials_secret:
        needs.append(SecretNeed(pool.spec.data_credentials_secret, "spec.dataCredentialsSecret", ()))
    return needs


async def check_secrets(kube: Kube, namespace: str, needs: list[SecretNeed]) -> tuple[tuple[str, str] | None, dict]:
    """(the first problem as (reason, message), or None; name -> the data of each Secret read)."""
    found: dict[str, dict] = {}
    for need in needs:
        where = f"Secret {need.name} ({need.field})"
        try:
            body = await kube.get("Secret", namespace, need.name)
        except NotFound:
            return ("SecretNotFound", f"{where} does not exist in namespace {namespace}; create it"), found
        except Forbidden:
            return (
                "SecretForbidden",
                f"cannot read {where}: the operator's RBAC does not allow get on secrets in namespace {namespace} "
                "(the chart's RBAC grants it; with rbac.create false, grant it yourself)",
            ), found
        data = {**(body.get("data") or {}), **(body.get("stringData") or {})}
        found[need.name] = data
        missing = [k for k in need.keys if k not in data]
        if missing:
            return ("SecretKeyMissing", f"{where} has no key {', '.join(missing)}; add it"), found
    return None, found


def redis_url(run: RLRun, secrets: dict[str, dict]) -> str | None:
    """The run's Redis URL: spec.redis.url, or the `url` key of spec.redis.urlSecret (when it was read)."""
    spec = run.spec.redis
    if not spec.url_secret:
        return spec.url
    data = secrets.get(spec.url_secret) or {}
    return base64.b64decode(data[names.REDIS_URL_KEY]).decode() if names.REDIS_URL_KEY in data else None
