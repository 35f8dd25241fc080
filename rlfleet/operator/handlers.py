"""`rlfleet operator`: kopf handlers that reconcile RLRun, InferencePool and RelayTier into workloads.

Reconcile (create / update of spec / resume, and a timer that re-applies so parent changes reach
pools and tiers): parse the body into the config model, build the children with the pure builders
(rlfleet/operator/builders.py), server-side apply each one (rlfleet/operator/kube.py, field manager
`rlfleet-operator`), and write status: phase, conditions (Ready, Suspended), observedGeneration,
replicas and selector for the scale subresource. A spec the models reject sets Ready=False reason
InvalidSpec with the field path and the fix, posts a Warning Event, and raises kopf.PermanentError:
no retry and no crash loop until the spec changes. A missing parent run or upstream tier is a
TemporaryError (retried). Deletion: children go by ownerReferences (the cluster's garbage
collector); an RLRun additionally drops its Redis keys (RunKeys.all), best effort with a timeout.
Progress (step, policy version, accepted/rejected) is read from the run's Redis by a timer.

Nothing is read at import: `register(registry, options)` puts the handlers on a kopf registry with
the settings `rlfleet operator` read when it started (OperatorOptions); the handlers reach the API
through `memo.kube` (one Kube adapter, made at start-up) and read the options from `memo.options`.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging

import kopf

from rlfleet.config import RelayTier, RLRun
from rlfleet.operator import builders, conditions, names
from rlfleet.operator.kube import Conflict, Kube, connect
from rlfleet.operator.options import OperatorOptions
from rlfleet.streams import RunKeys

REDIS_TIMEOUT_S = 3.0
G, V = names.GROUP, names.VERSION


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


async def _apply_all(kube: Kube, children: list[dict]) -> list[dict]:
    """Server-side apply each child in order; the live objects."""
    live = []
    for child in children:
        try:
            live.append((await kube.apply(child))[0])
        except Conflict as exc:  # only without force, or a create race: the next attempt settles it
            raise kopf.TemporaryError(f"{child['kind']} {child['metadata']['name']}: {exc}", delay=1) from None
    return live


async def _parent_run(kube: Kube, namespace: str, run_name: str) -> RLRun:
    body = await kube.find("RLRun", namespace, run_name)
    if body is None:
        raise kopf.TemporaryError(f"RLRun {run_name!r} not found in namespace {namespace!r}", delay=10)
    try:
        return builders.parse_resource(body)
    except builders.SpecError as exc:
        raise kopf.TemporaryError(
            f"RLRun {run_name!r} has an invalid spec ({exc}); waiting for it to be fixed", delay=30
        ) from None


async def _tiers(kube: Kube, namespace: str) -> list[RelayTier]:
    tiers = []
    for body in await kube.list("RelayTier", namespace):
        try:
            tiers.append(builders.parse_resource(body))
        except builders.SpecError:
            continue  # that tier reports its own InvalidSpec
    return tiers


def _ready_count(live: dict) -> int:
    return int((live.get("status") or {}).get("readyReplicas") or 0)


# ---- start-up ----------------------------------------------------------------------------------


async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    """Connect the API adapter (the client's own config, as kopf's login) and set kopf's persistence."""
    memo.kube = Kube(connect())
    # Keep kopf's bookkeeping in annotations: the CRDs' status schema has no `kopf` field to store it in.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=G)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=G, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events only for what a user must act on
    settings.persistence.finalizer = f"{G}/cleanup"
    logger.info(f"rlfleet operator: image {memo.options.image}, resync every {memo.options.resync_interval_s} s")


async def stop(memo: kopf.Memo, **_) -> None:
    memo.kube.close()


# ---- RLRun -------------------------------------------------------------------------------------


async def reconcile_run(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    kube, options = memo.kube, memo.options
    try:
        run = builders.parse_resource(body)
        children = builders.build_run_children(run, namespace, _owner(body), options.image)
    except builders.SpecError as exc:
        raise _invalid(body, patch, status, meta, exc.problems) from None
    live = {c["kind"]: c for c in await _apply_all(kube, children)}
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


async def observe_run(body, meta, status, patch, namespace, memo, logger, **_) -> None:
    """Progress from Redis and readiness from the trainer; phase Succeeded once every step is committed."""
    kube = memo.kube
    try:
        run = builders.parse_resource(body)
        builders.check_cluster_run(run)
    except builders.SpecError:
        return  # reported by reconcile_run
    trainer = await kube.find("StatefulSet", namespace, names.trainer(run.metadata.name)) or {}
    fields = {"readyReplicas": _ready_count(trainer)}
    url = await _redis_url(kube, run, namespace)
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


async def _redis_url(kube: Kube, run: RLRun, namespace: str) -> str | None:
    redis = run.spec.redis
    if not redis.url_secret:
        return redis.url
    secret = await kube.find("Secret", namespace, redis.url_secret)
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


async def cleanup_run(body, namespace, memo, logger, **_) -> None:
    """Children go by ownerReferences; the run's Redis keys go here (best effort: never blocks deletion for long)."""
    try:
        run = builders.parse_resource(body)
    except builders.SpecError:
        return
    url = await _redis_url(memo.kube, run, namespace)
    if not url:
        return
    try:
        n = await asyncio.wait_for(asyncio.to_thread(delete_run_keys, url, run.metadata.name), REDIS_TIMEOUT_S * 2)
        logger.info(f"deleted {n} Redis keys of run {run.metadata.name}")
    except Exception as exc:  # best effort by design: an unreachable Redis must not keep the RLRun forever
        logger.warning(f"Redis keys of run {run.metadata.name} not deleted: {exc!r}")


# ---- InferencePool and RelayTier ---------------------------------------------------------------


async def _reconcile_scalable(body, meta, status, patch, namespace, memo, build, timer: bool = False) -> None:
    kube = memo.kube
    try:
        obj = builders.parse_resource(body)
    except builders.SpecError as exc:
        if timer:
            return  # reported once by the create/update handler; no Event every interval
        raise _invalid(body, patch, status, meta, exc.problems) from None
    run = await _parent_run(kube, namespace, obj.spec.run)
    try:
        children = build(run, obj, await _tiers(kube, namespace), _owner(body))
    except builders.SpecError as exc:
        if isinstance(exc, builders.MissingDependency):
            raise kopf.TemporaryError(str(exc), delay=10) from None  # the other tier may appear
        if timer:
            return
        raise _invalid(body, patch, status, meta, exc.problems) from None
    live = await _apply_all(kube, children)
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


def _build_pool(namespace, image):
    return lambda run, pool, tiers, owner: builders.build_pool_children(run, pool, tiers, namespace, owner, image)


def _build_tier(namespace, image):
    return lambda run, tier, tiers, owner: builders.build_relay_children(run, tier, tiers, namespace, owner, image)


async def reconcile_pool(body, meta, status, patch, namespace, memo, **_) -> None:
    build = _build_pool(namespace, memo.options.image)
    await _reconcile_scalable(body, meta, status, patch, namespace, memo, build)


async def resync_pool(body, meta, status, patch, namespace, memo, **_) -> None:
    """Re-apply, so a change of the parent RLRun (suspend, image, config) reaches this pool's pods."""
    build = _build_pool(namespace, memo.options.image)
    await _reconcile_scalable(body, meta, status, patch, namespace, memo, build, timer=True)


async def reconcile_tier(body, meta, status, patch, namespace, memo, **_) -> None:
    build = _build_tier(namespace, memo.options.image)
    await _reconcile_scalable(body, meta, status, patch, namespace, memo, build)


async def resync_tier(body, meta, status, patch, namespace, memo, **_) -> None:
    """Re-apply, so a change of the parent RLRun (suspend, image, config) reaches this tier's pods."""
    build = _build_tier(namespace, memo.options.image)
    await _reconcile_scalable(body, meta, status, patch, namespace, memo, build, timer=True)


# ---- registration and the process --------------------------------------------------------------


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> kopf.OperatorRegistry:
    """Put every handler on `registry`, with the intervals of `options`; kopf logs in through the
    `kubernetes` client's configuration (kopf.login_via_client), the same the Kube adapter uses."""
    every = {"interval": options.resync_interval_s, "initial_delay": options.resync_interval_s}
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(start)
    kopf.on.cleanup(registry=registry)(stop)
    for plural, reconcile, resync in (
        (names.RLRUN.plural, reconcile_run, observe_run),
        (names.INFERENCE_POOL.plural, reconcile_pool, resync_pool),
        (names.RELAY_TIER.plural, reconcile_tier, resync_tier),
    ):
        kopf.on.resume(G, V, plural, registry=registry)(reconcile)
        kopf.on.create(G, V, plural, registry=registry)(reconcile)
        kopf.on.update(G, V, plural, field="spec", registry=registry)(reconcile)
        kopf.timer(G, V, plural, registry=registry, **every)(resync)
    kopf.on.delete(G, V, names.RLRUN.plural, registry=registry)(cleanup_run)
    return registry


def run_operator(options: OperatorOptions) -> int:
    """`rlfleet operator`: run kopf with these handlers until SIGTERM."""
    kopf.configure(verbose=options.verbose)
    registry = register(kopf.OperatorRegistry(), options)
    # standalone: one operator replica (the chart runs one); no KopfPeering CRD needed.
    kopf.run(
        registry=registry,
        memo=kopf.Memo(options=options),
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        liveness_endpoint=options.liveness,
        standalone=True,
    )
    return 0
