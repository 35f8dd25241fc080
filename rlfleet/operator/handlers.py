"""`rlfleet operator`: kopf handlers that reconcile RLRun, InferencePool and RelayTier into workloads.

Reconcile (create / update of spec / resume, and a timer that re-applies so parent changes reach
pools and tiers): parse the body into the config model, build the children with the pure builders
(rlfleet/operator/builders.py), apply each one idempotently (merge-PATCH, or POST when it does not
exist), and write status: phase, conditions (Ready, Suspended), observedGeneration, replicas and
selector for the scale subresource. A spec the models reject sets Ready=False reason InvalidSpec
with the field path and the fix, posts a Warning Event, and raises kopf.PermanentError: no retry
and no crash loop until the spec changes. A missing parent run or upstream tier is a
TemporaryError (retried). Deletion: children go by ownerReferences (the cluster's garbage
collector); an RLRun additionally drops its Redis keys (RunKeys.all), best effort with a timeout.
Progress (step, policy version, accepted/rejected) is read from the run's Redis by a timer.

API access goes through kopf's own client (`kopf._cogs.clients.api`): the operator's login,
retries and re-authentication on 401. It is kopf's internal module, so it is used only in
`_request` below (pinned by kopf>=1.45; one place to change if kopf moves it).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os

import kopf
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import errors as kopf_errors

from rlfleet.config import RelayTier, RLRun
from rlfleet.operator import builders, conditions, names
from rlfleet.streams import RunKeys

IMAGE = os.environ.get("RLFLEET_IMAGE", names.DEFAULT_IMAGE)
RESYNC_INTERVAL_S = float(os.environ.get("RLFLEET_RESYNC_INTERVAL", "15"))  # re-apply + status timer
REDIS_TIMEOUT_S = 3.0
G, V = names.GROUP, names.VERSION

_COLLECTIONS = {
    "ConfigMap": "api/v1/namespaces/{ns}/configmaps",
    "Service": "api/v1/namespaces/{ns}/services",
    "Secret": "api/v1/namespaces/{ns}/secrets",
    "Deployment": "apis/apps/v1/namespaces/{ns}/deployments",
    "StatefulSet": "apis/apps/v1/namespaces/{ns}/statefulsets",
    **{k.kind: f"apis/{G}/{V}/namespaces/{{ns}}/{k.plural}" for k in names.KINDS.values()},
}
_MERGE = {"Content-Type": "application/merge-patch+json"}


# ---- API access (the one adapter to kopf's client) ---------------------------------------------


async def _request(method: str, url: str, settings, logger, payload=None, headers=None):
    fn = {"get": kopf_api.get, "post": kopf_api.post, "patch": kopf_api.patch}[method]
    return await fn(url, payload=payload, headers=headers, settings=settings, logger=logger)


async def get_object(kind: str, namespace: str, name: str, settings, logger) -> dict | None:
    try:
        return await _request("get", f"{_COLLECTIONS[kind].format(ns=namespace)}/{name}", settings, logger)
    except kopf_errors.APINotFoundError:
        return None


async def list_objects(kind: str, namespace: str, settings, logger) -> list[dict]:
    return (await _request("get", _COLLECTIONS[kind].format(ns=namespace), settings, logger)).get("items", [])


async def apply(obj: dict, settings, logger) -> dict:
    """Make the live object match `obj` (patch-or-create); returns the live object."""
    meta = obj["metadata"]
    collection = _COLLECTIONS[obj["kind"]].format(ns=meta["namespace"])
    try:
        return await _request("patch", f"{collection}/{meta['name']}", settings, logger, payload=obj, headers=_MERGE)
    except kopf_errors.APINotFoundError:
        pass
    try:
        return await _request("post", collection, settings, logger, payload=obj)
    except kopf_errors.APIConflictError:  # created meanwhile by a concurrent run of this handler
        raise kopf.TemporaryError(
            f"{obj['kind']} {meta['name']} appeared while being created; retrying", delay=1
        ) from None


# ---- shared handler steps ----------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owner(body) -> builders.Owner:
    return builders.Owner(body["kind"], body["metadata"]["name"], body["metadata"].get("uid", ""))


def _set_status(patch, status, meta, *, phase: str, ready: bool, reason: str, message: str, **fields) -> None:
    generation = meta.get("generation")
    previous = list(status.get("conditions") or [])
    merged = conditions.merge_conditions(
        previous, conditions.build_condition("Ready", ready, reason, message, generation, _now(), previous)
    )
    patch.status.update(phase=phase, conditions=merged, **fields)
    if generation is not None:
        patch.status["observedGeneration"] = generation


def _invalid(body, patch, status, meta, problems: list[str]) -> kopf.PermanentError:
    """Record an unusable spec on the object (condition + Event) and return the error that stops retries."""
    message = "; ".join(problems)
    _set_status(patch, status, meta, phase="Failed", ready=False, reason="InvalidSpec", message=message)
    kopf.warn(body, reason="InvalidSpec", message=message)
    return kopf.PermanentError(f"invalid spec: {message}")


async def _parent_run(namespace: str, run_name: str, settings, logger) -> RLRun:
    body = await get_object("RLRun", namespace, run_name, settings, logger)
    if body is None:
        raise kopf.TemporaryError(f"RLRun {run_name!r} not found in namespace {namespace!r}", delay=10)
    try:
        return builders.parse_resource(body)
    except builders.SpecError as exc:
        raise kopf.TemporaryError(
            f"RLRun {run_name!r} has an invalid spec ({exc}); waiting for it to be fixed", delay=30
        ) from None


async def _tiers(namespace: str, settings, logger) -> list[RelayTier]:
    tiers = []
    for body in await list_objects("RelayTier", namespace, settings, logger):
        try:
            tiers.append(builders.parse_resource(body))
        except builders.SpecError:
            continue  # that tier reports its own InvalidSpec
    return tiers


def _ready_count(live: dict) -> int:
    return int((live.get("status") or {}).get("readyReplicas") or 0)


# ---- RLRun -------------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    memo.settings = settings  # resource handlers get no `settings`; the operator memo is copied into each object's memo
    # Keep kopf's bookkeeping in annotations: the CRDs' status schema has no `kopf` field to store it in.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=G)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=G, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events only for what a user must act on
    settings.persistence.finalizer = f"{G}/cleanup"


@kopf.on.resume(G, V, names.RLRUN.plural)
@kopf.on.create(G, V, names.RLRUN.plural)
@kopf.on.update(G, V, names.RLRUN.plural, field="spec")
async def reconcile_run(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    settings = memo.settings
    try:
        run = builders.parse_resource(body)
        children = builders.build_run_children(run, namespace, _owner(body), IMAGE)
    except builders.SpecError as exc:
        raise _invalid(body, patch, status, meta, exc.problems) from None
    live = {c["kind"]: await apply(c, settings, logger) for c in children}
    if run.spec.suspend:
        _set_status(
            patch,
            status,
            meta,
            phase="Suspended",
            ready=False,
            reason="Suspended",
            message="spec.suspend is true: workloads scaled to 0",
        )
        return
    ready = _ready_count(live["StatefulSet"])
    _set_status(
        patch,
        status,
        meta,
        phase="Running" if ready >= run.spec.trainer.replicas else "Pending",
        ready=True,
        reason="ChildrenApplied",
        message=f"{len(children)} children applied",
        readyReplicas=ready,
    )


@kopf.timer(G, V, names.RLRUN.plural, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
async def observe_run(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    settings = memo.settings
    """Progress from Redis and readiness from the trainer; phase Succeeded once every step is committed."""
    try:
        run = builders.parse_resource(body)
        builders.check_cluster_run(run)
    except builders.SpecError:
        return  # reported by reconcile_run
    trainer = await get_object("StatefulSet", namespace, names.trainer(run.metadata.name), settings, logger) or {}
    fields = {"readyReplicas": _ready_count(trainer)}
    url = await _redis_url(run, namespace, settings, logger)
    try:
        fields.update(
            await asyncio.wait_for(asyncio.to_thread(read_progress, url, run.metadata.name), REDIS_TIMEOUT_S * 2)
        )
    except (OSError, TimeoutError, ConnectionError) as exc:
        logger.info(f"progress of {run.metadata.name} not readable from Redis: {exc}")
    except Exception as exc:  # redis.RedisError and friends: progress is optional, never fail the timer
        logger.info(f"progress of {run.metadata.name} not readable from Redis: {exc!r}")
    patch.status.update(fields)
    if run.spec.suspend:
        return
    if fields.get("step", 0) >= run.spec.trainer.steps:
        patch.status["phase"] = "Succeeded"
    elif status.get("phase") in ("Pending", "Running"):
        patch.status["phase"] = "Running" if fields["readyReplicas"] >= run.spec.trainer.replicas else "Pending"


async def _redis_url(run: RLRun, namespace: str, settings, logger) -> str | None:
    redis = run.spec.redis
    if not redis.url_secret:
        return redis.url
    secret = await get_object("Secret", namespace, redis.url_secret, settings, logger)
    data = (secret or {}).get("data") or {}
    return base64.b64decode(data[names.REDIS_URL_KEY]).decode() if names.REDIS_URL_KEY in data else None


def read_progress(url: str | None, run_name: str) -> dict:
    """step / policyVersion / reward from the policy stream, accepted / rejected from the stats hash (blocking)."""
    if not url:
        return {}
    import redis

    from rlfleet.runtime import latest_announced_version
    from rlfleet.streams import decode_json

    keys = RunKeys(run_name)
    client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        out: dict = {}
        version = latest_announced_version(client, keys)
        if version is not None:
            out.update(step=version, policyVersion=version)
            newest = decode_json(client.xrevrange(keys.policy, count=1)[0][1])
            if isinstance(newest.get("reward"), (int, float)):
                out["reward"] = float(newest["reward"])
        stats = {k.decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
        out.update(accepted=stats.get("accepted", 0), rejected=stats.get("rejected", 0))
        return out
    finally:
        client.close()


def delete_run_keys(url: str, run_name: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        return client.delete(*RunKeys(run_name).all())
    finally:
        client.close()


@kopf.on.delete(G, V, names.RLRUN.plural)
async def cleanup_run(body, namespace, memo, logger, **_) -> None:
    settings = memo.settings
    """Children go by ownerReferences; the run's Redis keys go here (best effort: never blocks deletion for long)."""
    try:
        run = builders.parse_resource(body)
    except builders.SpecError:
        return
    url = await _redis_url(run, namespace, settings, logger)
    if not url:
        return
    try:
        n = await asyncio.wait_for(asyncio.to_thread(delete_run_keys, url, run.metadata.name), REDIS_TIMEOUT_S * 2)
        logger.info(f"deleted {n} Redis keys of run {run.metadata.name}")
    except Exception as exc:  # best effort by design: an unreachable Redis must not keep the RLRun forever
        logger.warning(f"Redis keys of run {run.metadata.name} not deleted: {exc!r}")


# ---- InferencePool and RelayTier ---------------------------------------------------------------


async def _reconcile_scalable(
    body, meta, status, patch, namespace, settings, logger, build, timer: bool = False
) -> None:
    try:
        obj = builders.parse_resource(body)
    except builders.SpecError as exc:
        if timer:
            return  # reported once by the create/update handler; no Event every interval
        raise _invalid(body, patch, status, meta, exc.problems) from None
    run = await _parent_run(namespace, obj.spec.run, settings, logger)
    try:
        children = build(run, obj, await _tiers(namespace, settings, logger), _owner(body))
    except builders.SpecError as exc:
        if isinstance(exc, builders.MissingDependency):
            raise kopf.TemporaryError(str(exc), delay=10) from None  # the other tier may appear
        if timer:
            return
        raise _invalid(body, patch, status, meta, exc.problems) from None
    live = [await apply(c, settings, logger) for c in children]
    workload = next(c for c in live if c["kind"] == "Deployment")
    desired = next(c for c in children if c["kind"] == "Deployment")
    fields = {
        "replicas": int((workload.get("status") or {}).get("replicas") or 0),
        "readyReplicas": _ready_count(workload),
        "selector": conditions.workload_selector(desired),
    }
    if run.spec.suspend:
        _set_status(
            patch,
            status,
            meta,
            phase="Suspended",
            ready=False,
            reason="Suspended",
            message=f"RLRun {run.metadata.name} is suspended",
            **fields,
        )
        return
    phase = "Running" if fields["readyReplicas"] >= obj.spec.replicas else "Pending"
    _set_status(
        patch,
        status,
        meta,
        phase=phase,
        ready=True,
        reason="ChildrenApplied",
        message=f"{obj.spec.replicas} replicas desired",
        **fields,
    )


def _build_pool(namespace):
    return lambda run, pool, tiers, owner: builders.build_pool_children(run, pool, tiers, namespace, owner, IMAGE)


def _build_tier(namespace):
    return lambda run, tier, tiers, owner: builders.build_relay_children(run, tier, tiers, namespace, owner, IMAGE)


@kopf.on.resume(G, V, names.INFERENCE_POOL.plural)
@kopf.on.create(G, V, names.INFERENCE_POOL.plural)
@kopf.on.update(G, V, names.INFERENCE_POOL.plural, field="spec")
async def reconcile_pool(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    settings = memo.settings
    await _reconcile_scalable(body, meta, status, patch, namespace, settings, logger, _build_pool(namespace))


@kopf.timer(G, V, names.INFERENCE_POOL.plural, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
async def resync_pool(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    """Re-apply, so a change of the parent RLRun (suspend, image, config) reaches this pool's pods."""
    settings = memo.settings
    await _reconcile_scalable(
        body, meta, status, patch, namespace, settings, logger, _build_pool(namespace), timer=True
    )


@kopf.on.resume(G, V, names.RELAY_TIER.plural)
@kopf.on.create(G, V, names.RELAY_TIER.plural)
@kopf.on.update(G, V, names.RELAY_TIER.plural, field="spec")
async def reconcile_tier(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    settings = memo.settings
    await _reconcile_scalable(body, meta, status, patch, namespace, settings, logger, _build_tier(namespace))


@kopf.timer(G, V, names.RELAY_TIER.plural, interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
async def resync_tier(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    """Re-apply, so a change of the parent RLRun (suspend, image, config) reaches this tier's pods."""
    settings = memo.settings
    await _reconcile_scalable(
        body, meta, status, patch, namespace, settings, logger, _build_tier(namespace), timer=True
    )


def run_operator(namespaces: list[str], liveness: str | None = None, verbose: bool = False) -> int:
    """`rlfleet operator`: run kopf with these handlers until SIGTERM."""
    kopf.configure(verbose=verbose)
    # standalone: one operator replica (the chart runs one); no KopfPeering CRD needed.
    kopf.run(clusterwide=not namespaces, namespaces=namespaces or None, liveness_endpoint=liveness, standalone=True)
    return 0
