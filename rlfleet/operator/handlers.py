"""`rlfleet operator`: the kopf handlers, thin over reconcile.py, and their registration.

    RLRun          create / update of spec / resume -> reconcile_run (and prune unwanted children);
                   a timer every resync interval -> reconcile_run, then every pool and tier of the run;
                   delete -> delete its workloads, wait for its pods to go, then drop its Redis keys (bounded: after
                   STOP_TIMEOUT_S the keys go anyway, after a few failed tries the finalizer goes).
    InferencePool  create / update of spec / resume -> reconcile_scalable
    RelayTier      (no timer, hence no finalizer: the run's timer keeps them current)
A missing or invalid parent run, or a missing upstream tier, leaves a pool or tier Pending with that
reason until the run's timer finds it fixed; an invalid spec is reported on the object and not
retried until it changes; API errors (kube.ApiError) are retried by kopf with its backoff.

Nothing is read at import: `register(registry, options)` puts the handlers on a kopf registry with
the settings `rlfleet operator` read when it started (OperatorOptions); handlers reach the API
through `memo.kube` (one Kube adapter, made at start-up) and read the options from `memo.options`.
Only the RLRun holds a finalizer (`rlfleet.io/cleanup`), for its Redis keys.
Metrics (metrics.py): the reconciles count and time themselves; `--metrics-port` serves them, and with
--peering a task re-reads the peering object every LEADER_POLL_FRACTION of its lifetime to say whether
this replica is the one acting (metrics.ACTIVE).
"""

from __future__ import annotations

import asyncio
import datetime
import logging

import kopf

from rlfleet.config import RLRun
from rlfleet.operator import builders, metrics, names, peering, reconcile, secrets
from rlfleet.operator.applying import ApplyBackoff
from rlfleet.operator.kube import ApiError, Kube, connect
from rlfleet.operator.options import OperatorOptions, bound_kopf_requests
from rlfleet.operator.progress import REDIS_TIMEOUT_S, delete_run_keys
from rlfleet.wire.health import Health, serve

G, V = names.GROUP, names.VERSION
STOP_TIMEOUT_S = 60.0  # a deleted run's pods get this long to stop before its Redis keys go anyway
DELETE_RETRIES = 3  # tries at the Redis keys once the pods are gone; then the finalizer goes
DELETE_TIMEOUT_S = STOP_TIMEOUT_S + 30.0  # kopf's bound on the whole delete handler
# A run's finalizer goes only once its timer has exited, and the timer may be mid-call when the deletion
# is handled (waiting for the answer to its own DELETE of the run past its TTL, or reconciling when a user
# deletes it). kopf gives it 10 event-loop cycles, then looks again after `cancellation_polling` (60 s by
# default): a deleted run stayed a minute. It now waits up to this long, then looks again this often.
TIMER_EXIT_S = 2.0
LEADER_POLL_FRACTION = 0.25  # the leader gauge lags a failover by at most a quarter of the peering lifetime


def _ctx(memo) -> reconcile.Ctx:
    now = datetime.datetime.now(datetime.UTC)
    return reconcile.Ctx(memo.kube, memo.options.defaults, now, memo.backoff, memo.options.run_defaults)


def _write(outcome: reconcile.Outcome, patch) -> None:
    patch.status.update(outcome.status)
    if outcome.spec:  # the cluster's defaults the run now uses (rundefaults.py): written once, then in its spec
        patch.spec.update(outcome.spec)
    if outcome.metadata:
        patch.metadata.update(outcome.metadata)


# ---- start-up ----------------------------------------------------------------------------------


async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    """Connect the API adapter (the client's own config, as kopf's login) and set kopf's persistence."""
    memo.kube = Kube(connect(), timeout_s=memo.options.api_timeout_s)
    bound_kopf_requests(settings, memo.options)  # kopf's own requests: the same bound as ours
    memo.backoff = ApplyBackoff()  # children the API refused, retried with back-off (applying.py)
    # Keep kopf's bookkeeping in annotations: the CRDs' status schema has no `kopf` field to store it in.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=G)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=G, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # kopf's own Events: failures only; ours come from reconcile.py
    settings.persistence.finalizer = f"{G}/cleanup"
    settings.background.instant_exit_timeout = TIMER_EXIT_S
    settings.background.cancellation_polling = TIMER_EXIT_S
    # kopf takes its peering scope from the operator's (KopfPeering per watched namespace); one
    # ClusterKopfPeering instead, in every mode: one object for the operator to make (peering.py).
    settings.peering.clusterwide = True
    settings.peering.lifetime = memo.options.peering_lifetime_s
    if memo.options.peering_name:
        memo.leader_task = asyncio.create_task(watch_leadership(memo.kube, memo.options, memo.priority, logger))
    else:
        metrics.ACTIVE.set(1)
    options = memo.options
    logger.info(
        f"rlfleet operator: {options.defaults}, {options.run_defaults}, resync every {options.resync_interval_s} s"
    )


async def stop(memo: kopf.Memo, **_) -> None:
    task = memo.get("leader_task")
    if task:
        task.cancel()
    metrics.ACTIVE.set(0)
    memo.kube.close()


async def watch_leadership(kube: Kube, options: OperatorOptions, priority: int, logger) -> None:
    """Keep metrics.ACTIVE at whether this replica acts, by kopf's rule (peering.leads) on the peering
    object's status; a failed read keeps the last value (kopf keeps its last decision too)."""
    every, name = max(1.0, options.peering_lifetime_s * LEADER_POLL_FRACTION), options.peering_name or ""
    while True:
        try:
            body = await kube.get_cluster_object(peering.GROUP, peering.VERSION, peering.PLURAL, name)
            now = datetime.datetime.now(datetime.UTC)
            metrics.ACTIVE.set(1 if peering.leads((body or {}).get("status") or {}, priority, now) else 0)
        except ApiError as exc:
            logger.info(f"peering object {name} not read: {exc}")
        await asyncio.sleep(every)


# ---- RLRun -------------------------------------------------------------------------------------


async def run_changed(body, patch, memo, **_) -> None:
    outcome = await reconcile.reconcile_run(_ctx(memo), dict(body), spec_changed=True)
    _write(outcome, patch)


async def run_resync(body, patch, memo, logger, **_) -> None:
    """Re-apply and observe the run, then its pools and tiers; delete it when its TTL is up. An API error
    on the run is logged, not raised: the timer comes back within one interval anyway (raised, kopf
    would wait 60 s), and the run's pools and tiers are reconciled all the same."""
    ctx = _ctx(memo)
    try:
        outcome = await reconcile.reconcile_run(ctx, dict(body))
    except ApiError as exc:
        logger.warning(f"run {body['metadata']['name']} not reconciled, its pools and tiers are: {exc}")
        await reconcile.reconcile_run_members(ctx, dict(body))
        return
    if outcome.delete:
        await ctx.kube.delete("RLRun", body["metadata"]["namespace"], body["metadata"]["name"])
        return
    _write(outcome, patch)
    await reconcile.reconcile_run_members(ctx, dict(body))


async def run_deleted(body, namespace, memo, logger, retry, runtime, **_) -> None:
    """Children go by ownerReferences; here the run's workloads are deleted first and its Redis keys go
    once its pods are gone (a pod still running would make them again). Bounded: after STOP_TIMEOUT_S
    the keys go whatever still runs; DELETE_RETRIES failed tries at them, and the finalizer goes."""
    try:
        run = builders.parse_as(dict(body), RLRun)
    except builders.SpecError:
        return
    name, uid = run.metadata.name, body["metadata"].get("uid")
    metrics.run_phase(uid or "", None)
    waits = memo.setdefault("stop_waits", {})  # tries spent waiting for pods, per run uid
    left = await reconcile.stop_run_pods(memo.kube, namespace, name)
    if left and runtime.total_seconds() < STOP_TIMEOUT_S:
        waits[uid] = waits.get(uid, 0) + 1
        raise kopf.TemporaryError(f"{left} pods of run {name} still stopping; its Redis keys go after them", delay=2)
    if left:
        logger.warning(f"{left} pods of run {name} still there after {STOP_TIMEOUT_S:.0f}s; deleting its keys anyway")
    tries = retry - waits.get(uid, 0)
    _blocked, found = await secrets.check_secrets(memo.kube, namespace, secrets.run_secrets(run))
    url = secrets.redis_url(run, found)
    if not url:
        waits.pop(uid, None)
        logger.warning(f"Redis keys of run {name} not deleted: no readable Redis URL")
        return
    try:
        n = await asyncio.wait_for(asyncio.to_thread(delete_run_keys, url, name), REDIS_TIMEOUT_S * 2)
    except Exception as exc:  # redis errors, timeouts: retried by kopf, within DELETE_RETRIES
        if tries + 1 >= DELETE_RETRIES:
            waits.pop(uid, None)
            logger.warning(f"Redis keys of run {name} not deleted after {tries + 1} tries: {exc!r}")
            return
        raise kopf.TemporaryError(f"Redis keys of run {name} not deleted yet: {exc!r}", delay=2) from None
    waits.pop(uid, None)
    logger.info(f"deleted {n} Redis keys of run {name}")


# ---- InferencePool and RelayTier ---------------------------------------------------------------


async def member_changed(body, patch, memo, **_) -> None:
    _write(await reconcile.reconcile_scalable(_ctx(memo), dict(body), spec_changed=True), patch)


async def tier_changed(body, patch, memo, logger, **_) -> None:
    """The tier, then its run's pools, whose relay URLs follow the tiers (reconcile.reconcile_run_pools). An
    API error on a pool is logged: the run's timer re-applies the pools within one interval anyway."""
    ctx = _ctx(memo)
    _write(await reconcile.reconcile_scalable(ctx, dict(body), spec_changed=True), patch)
    run_name = (body.get("spec") or {}).get("run")
    if isinstance(run_name, str) and run_name:
        try:
            await reconcile.reconcile_run_pools(ctx, body["metadata"]["namespace"], run_name)
        except ApiError as exc:
            tier = body["metadata"]["name"]
            logger.warning(f"the pools of run {run_name} not re-applied after RelayTier {tier} changed: {exc}")


# ---- registration and the process --------------------------------------------------------------


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> kopf.OperatorRegistry:
    """Put every handler on `registry`, with the intervals of `options`; kopf logs in through the
    `kubernetes` client's configuration (kopf.login_via_client), the same the Kube adapter uses."""
    kopf.on.login(registry=registry)(kopf.login_via_client)
    kopf.on.startup(registry=registry)(start)
    kopf.on.cleanup(registry=registry)(stop)
    for plural, changed in (
        (names.RLRUN.plural, run_changed),
        (names.INFERENCE_POOL.plural, member_changed),
        (names.RELAY_TIER.plural, tier_changed),
    ):
        kopf.on.resume(G, V, plural, registry=registry)(changed)
        kopf.on.create(G, V, plural, registry=registry)(changed)
        kopf.on.update(G, V, plural, field="spec", registry=registry)(changed)
    every = options.resync_interval_s
    kopf.timer(G, V, names.RLRUN.plural, interval=every, initial_delay=every, registry=registry)(run_resync)
    kopf.on.delete(G, V, names.RLRUN.plural, timeout=DELETE_TIMEOUT_S, registry=registry)(run_deleted)
    return registry


def run_operator(options: OperatorOptions) -> int:
    """`rlfleet operator`: run kopf with these handlers until SIGTERM."""
    kopf.configure(verbose=options.verbose)
    registry = register(kopf.OperatorRegistry(), options)
    if options.metrics_port:
        try:
            serve(options.metrics_port, "0.0.0.0", Health())  # /metrics; its /healthz: the process serves
        except OSError as exc:
            raise SystemExit(f"--metrics-port={options.metrics_port}: cannot serve /metrics there: {exc}") from None
    priority = peering.priority() if options.peering_name else None  # kopf's and the leader gauge's
    # Without --peering: standalone, one replica, no kopf.dev CRD needed. With it: mandatory peering (kopf
    # pauses until it has seen the peers), the oldest replica acting (peering.py).
    if options.peering_name:
        client = connect()
        try:
            peering.ensure_peering_object(client, options.peering_name)
        finally:
            client.close()
    kopf.run(
        registry=registry,
        memo=kopf.Memo(options=options, priority=priority),
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        liveness_endpoint=options.liveness,
        standalone=not options.peering_name,
        peering_name=options.peering_name,
        priority=priority,
    )
    return 0
