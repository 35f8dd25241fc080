"""Reconciling one object: the steps behind the kopf handlers (handlers.py), written against the API
adapter so the handlers stay thin. Each function returns what to write on the object (its status,
and for a pool or tier its metadata) and posts the Events of what changed.

RLRun: parse and check the spec (invalid: Ready False / Failed True, reason InvalidSpec, a Warning
Event, nothing applied); check the Secrets its pods need (secrets.py); read progress from its Redis;
decide its state (lifecycle.py); server-side apply its children (replicas 0 unless active); and, from
its timer, reconcile every pool and tier of the run, so a change of the run (suspend, completion,
image, config) reaches them within one resync interval and their status stays current without a
timer (and so a finalizer) of their own. A finished run past its TTL is deleted.

InferencePool / RelayTier: the same against the parent run. While the run is missing or invalid, or an
upstream tier it names is missing, the object waits in phase Pending (Ready False, reason RunNotFound,
RunNotValid or MissingDependency) and the run's timer reconciles it once that is fixed.

After a spec change, children the object no longer wants (an ingest whose tokens were removed, a
pool's Deployment after it became a StatefulSet) are deleted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from dataclasses import dataclass, field

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import builders, conditions, health, lifecycle, metrics, names, rundefaults, secrets
from rlfleet.operator.applying import ApplyBackoff
from rlfleet.operator.events import build_event
from rlfleet.operator.kube import ApiError, Kube
from rlfleet.operator.pods import ClusterDefaults, Owner
from rlfleet.operator.progress import REDIS_TIMEOUT_S, read_progress

log = logging.getLogger("rlfleet.operator")
CHILD_KINDS = ("ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget")
# Ready reasons that ask the user to act: a Warning Event when one appears (or its message changes).
PROBLEMS = {
    "InvalidSpec",
    "SecretNotFound",
    "SecretKeyMissing",
    "SecretForbidden",
    "DeadlineExceeded",
    "StartupDeadlineExceeded",
    "ModelUnavailable",
}
MAX_POD_EVENTS = 5  # Warning Events for new pod problems per reconcile (a pool of 100 crashing pods: not 100)


class MissingRun(Exception):
    """A pool's or tier's RLRun does not exist (yet), or cannot be reconciled; `reason` says which."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


@dataclass
class Outcome:
    status: dict = field(default_factory=dict)
    metadata: dict | None = None  # merged into the object's metadata
    spec: dict | None = None  # merged into the object's spec: the cluster's defaults it now uses (rundefaults.py)
    delete: bool = False  # the run's TTL is up


@dataclass
class Ctx:
    kube: Kube
    defaults: ClusterDefaults
    now: datetime.datetime
    backoff: ApplyBackoff = field(default_factory=ApplyBackoff)  # the operator's one, across reconciles
    run_defaults: rundefaults.RunDefaults = rundefaults.RunDefaults()  # Redis and store of runs naming none


def owner_of(body: dict) -> Owner:
    return Owner(body["kind"], body["metadata"]["name"], body["metadata"].get("uid", ""))


async def post(ctx: Ctx, body: dict, type_: str, reason: str, message: str) -> None:
    """Post an Event; a failure is logged, never fails the reconcile (Events are best effort)."""
    try:
        await ctx.kube.post_event(build_event(body, type_, reason, message, ctx.now))
    except ApiError as exc:
        log.warning(f"Event {reason} on {body['kind']} {body['metadata']['name']} not posted: {exc}")


async def announce_changes(ctx: Ctx, body: dict, old: dict, new: dict) -> None:
    """Events for a new phase and for a Ready reason that asks the user to act."""
    before, after = old.get("phase"), new.get("phase")
    if after and after != before:
        kind = "Warning" if after == "Failed" else "Normal"
        await post(ctx, body, kind, "PhaseChanged", f"phase {before or '(none)'} -> {after}")
    old_ready: dict = next((c for c in old.get("conditions") or [] if c.get("type") == "Ready"), {})
    new_ready: dict = next((c for c in new.get("conditions") or [] if c.get("type") == "Ready"), {})
    reason = new_ready.get("reason")
    if reason in PROBLEMS and (reason, new_ready.get("message")) != (old_ready.get("reason"), old_ready.get("message")):
        await post(ctx, body, "Warning", reason, new_ready.get("message", ""))
    for type_ in ("Failed", "StateLost"):  # turned True for a reason the Ready Event above did not already name
        was, now = lifecycle.condition(old, type_), lifecycle.condition(new, type_)
        if now.get("status") == "True" and was.get("status") != "True" and now.get("reason") not in PROBLEMS:
            await post(ctx, body, "Warning", now.get("reason") or type_, now.get("message") or "")
    said = set(health.described(lifecycle.condition(old, "PodsHealthy")))
    fresh = [p for p in health.described(lifecycle.condition(new, "PodsHealthy")) if p not in said]
    for reason, message in fresh[:MAX_POD_EVENTS]:
        await post(ctx, body, "Warning", reason, message)


async def apply_children(ctx: Ctx, body: dict, children: list[dict]) -> tuple[dict[tuple[str, str], dict], list[str]]:
    """Server-side apply each child in order: (kind, name) -> live object, and a message per child the API
    refused (kind, name and the API's message). A refusal never stops the siblings; the refused child
    backs off (applying.py). A Normal Event per created child, a Warning per refusal."""
    live, refused = {}, []
    uid = body["metadata"].get("uid", "")
    for child in children:
        kind, meta = child["kind"], child["metadata"]
        key = (uid, kind, meta["namespace"], meta["name"])
        waiting = ctx.backoff.waiting(key, ctx.now)
        if waiting:
            refused.append(waiting)
            continue
        try:
            obj, created = await ctx.kube.apply(child)
        except ApiError as exc:
            if exc.status in (0, 403) or exc.status >= 500:  # the API, not the child: kopf retries the reconcile
                raise
            message = f"{kind} {meta['name']}: the API refused it: HTTP {exc.status} {exc.message}"
            delay, news = ctx.backoff.failed(key, ctx.now, message)
            metrics.error(body["kind"], "ApplyFailed")
            log.warning(f"{message} (next try in {delay:.0f} s)")
            if news:  # once per refusal, not per retry (and whatever Ready says meanwhile)
                await post(ctx, body, "Warning", "ApplyFailed", message)
            refused.append(message)
            continue
        ctx.backoff.succeeded(key)
        live[(kind, meta["name"])] = obj
        if created:
            await post(ctx, body, "Normal", "Created", f"created {kind} {meta['name']}")
    return live, refused


async def prune(ctx: Ctx, body: dict, children: list[dict]) -> None:
    """Delete children of `body` (by label and owner uid) that are not in `children`."""
    meta = body["metadata"]
    selector = (
        f"app.kubernetes.io/managed-by={names.FIELD_MANAGER},app.kubernetes.io/instance={meta['name']},"
        f"{names.GROUP}/kind={body['kind'].lower()}"
    )
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    for kind in CHILD_KINDS:
        for obj in await ctx.kube.list(kind, meta["namespace"], label_selector=selector):
            owned = any(r.get("uid") == meta.get("uid") for r in obj["metadata"].get("ownerReferences") or [])
            if owned and (kind, obj["metadata"]["name"]) not in wanted:
                await ctx.kube.delete(kind, meta["namespace"], obj["metadata"]["name"])
                await post(ctx, body, "Normal", "Deleted", f"deleted {kind} {obj['metadata']['name']}")


def _invalid_status(ctx: Ctx, body: dict, problems: list[str]) -> dict:
    status, message = body.get("status") or {}, "; ".join(problems)
    generation = body["metadata"].get("generation")
    return {
        "phase": "Failed",
        "conditions": lifecycle.invalid_conditions(status, generation, ctx.now, message),
        **({"observedGeneration": generation} if generation is not None else {}),
    }


def _ready(live: dict) -> int:
    return int((live.get("status") or {}).get("readyReplicas") or 0)


async def _progress(url: str | None, run: str) -> dict | None:
    if not url:
        return None
    try:
        return await asyncio.wait_for(asyncio.to_thread(read_progress, url, run), REDIS_TIMEOUT_S * 2)
    except Exception as exc:  # redis.RedisError, OSError, timeouts: progress is optional, never fail a reconcile
        log.info(f"progress of run {run} not readable from Redis: {exc!r}")
        return None


# ---- RLRun -------------------------------------------------------------------------------------


@metrics.observed
async def reconcile_run(ctx: Ctx, body: dict, spec_changed: bool = False) -> Outcome:
    old = body.get("status") or {}
    try:
        run, filled = rundefaults.fill(body, builders.parse_as(body, RLRun), ctx.run_defaults)
        builders.check_cluster_run(run)
    except builders.SpecError as exc:
        status = _invalid_status(ctx, body, exc.problems)
        await announce_changes(ctx, body, old, status)
        return Outcome(status=status)

    namespace, generation = body["metadata"]["namespace"], body["metadata"].get("generation")
    unmade = await rundefaults.make_secrets(ctx.kube, body, filled, ctx.run_defaults) if filled else None
    blocked, secret_data = await secrets.check_secrets(ctx.kube, namespace, secrets.run_secrets(run))
    blocked = unmade or blocked  # a Secret the operator could not make says why before one it cannot find
    progress = None if run.spec.remote else await _progress(secrets.redis_url(run, secret_data), run.metadata.name)
    trainer, pods = {}, []
    if not run.spec.remote:
        trainer = await ctx.kube.find("StatefulSet", namespace, names.trainer(run.metadata.name)) or {}
        pods = await ctx.kube.list("Pod", namespace, label_selector=_run_pods(run.metadata.name))
    if spec_changed:
        ctx.backoff.forget(body["metadata"].get("uid", ""))

    seen = lifecycle.Observation(
        now=ctx.now,
        created=lifecycle.parse_time(body["metadata"].get("creationTimestamp")),
        step=None if progress is None else progress.get("step", 0),
        trainer_ready=_ready(trainer),
        blocked=blocked,
        failure=None if progress is None else progress.pop("failure", None),
        status=old,
        problems=tuple(health.pod_problems(pods)),
    )
    state = lifecycle.run_state(run, generation, seen)
    children = builders.build_run_children(run, namespace, owner_of(body), ctx.defaults, state.active)
    _live, refused = await apply_children(ctx, body, children)
    if refused and not (seen.blocked or not state.active):  # a child refused: say so where Ready says why
        seen = dataclasses.replace(seen, blocked=("ApplyFailed", "; ".join(refused)))
        state = lifecycle.run_state(run, generation, seen)
    if spec_changed:
        await prune(ctx, body, children)

    status = {"phase": state.phase, "conditions": state.conditions, "readyReplicas": _ready(trainer)}
    if progress and (state.active or progress.get("step", 0) >= int(old.get("step") or 0)):
        status.update(progress)  # a finished run keeps its recorded progress when Redis comes back with less
    if state.finished_at:
        status["completionTime"] = state.finished_at
    if state.suspended_seconds:  # with the Suspended condition, in one patch (lifecycle.suspended_seconds)
        status["suspendedSeconds"] = state.suspended_seconds
    if generation is not None:
        status["observedGeneration"] = generation
    await announce_changes(ctx, body, old, status)
    return Outcome(status=status, delete=state.expired, spec=filled if filled and not unmade else None)


async def stop_run_pods(kube: Kube, namespace: str, run: str) -> int:
    """Delete every workload of a run being deleted (its own and its pools' and tiers', by the run label)
    and return how many of its pods are still there: its Redis keys may go only once none is, or a
    worker's XADD or the trainer's consumer group would make them again."""
    selector = f"{names.RUN_LABEL}={run},app.kubernetes.io/managed-by={names.FIELD_MANAGER}"
    for kind in ("Deployment", "StatefulSet"):
        for obj in await kube.list(kind, namespace, label_selector=selector):
            await kube.delete(kind, namespace, obj["metadata"]["name"])
    return len(await kube.list("Pod", namespace, label_selector=f"{names.RUN_LABEL}={run}"))


def _run_pods(run: str) -> str:
    return f"{names.RUN_LABEL}={run},app.kubernetes.io/managed-by={names.FIELD_MANAGER}"


def run_is_active(run_body: dict) -> bool:
    """Whether a run's workloads run, from its status: neither Complete nor Failed (past a deadline, or for a
    failure a component reported); an invalid spec (InvalidSpec) stops nothing: its members wait for it to be fixed."""
    for c in (run_body.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and (
            c.get("type") == "Complete" or (c.get("type") == "Failed" and c.get("reason") != "InvalidSpec")
        ):
            return False
    return True


# ---- InferencePool and RelayTier ---------------------------------------------------------------


async def parent_run(ctx: Ctx, namespace: str, name: str) -> tuple[dict, RLRun]:
    body = await ctx.kube.find("RLRun", namespace, name)
    if body is None:
        raise MissingRun("RunNotFound", f"RLRun {name!r} does not exist in namespace {namespace!r} (yet)")
    try:
        run, _ = rundefaults.fill(body, builders.parse_as(body, RLRun), ctx.run_defaults)
        builders.check_cluster_run(run)
    except builders.SpecError:
        raise MissingRun("RunNotValid", f"RLRun {name!r} has an invalid spec; waiting for it to be fixed") from None
    return body, run


async def run_tiers(ctx: Ctx, namespace: str) -> list[RelayTier]:
    tiers = []
    for body in await ctx.kube.list("RelayTier", namespace):
        try:
            tiers.append(builders.parse_as(body, RelayTier))
        except builders.SpecError:
            continue  # that tier reports its own InvalidSpec
    return tiers


def tie_to_run(body: dict, run_body: dict) -> dict | None:
    """The metadata that ties a pool or tier to its run (a non-controller owner reference and the run
    label), or None when it has both: deleting the run deletes them, and `-l rlfleet.io/run=NAME` lists them."""
    meta = body["metadata"]
    refs = list(meta.get("ownerReferences") or [])
    run_uid = run_body["metadata"].get("uid")
    labels = meta.get("labels") or {}
    has_ref = any(r.get("uid") == run_uid for r in refs)
    if has_ref and labels.get(names.RUN_LABEL) == run_body["metadata"]["name"]:
        return None
    if not has_ref:
        refs.append(owner_of(run_body).reference(controller=False))
    return {"ownerReferences": refs, "labels": {names.RUN_LABEL: run_body["metadata"]["name"]}}


def _waiting(ctx: Ctx, body: dict, reason: str, message: str) -> Outcome:
    old, generation = body.get("status") or {}, body["metadata"].get("generation")
    status = {
        "phase": "Pending",
        "conditions": lifecycle.scalable_conditions(old, generation, ctx.now, False, reason, message),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return Outcome(status=status)


@metrics.observed
async def reconcile_scalable(
    ctx: Ctx, body: dict, run_pair: tuple[dict, RLRun] | None = None, tiers=None, spec_changed: bool = False
) -> Outcome:
    """A pool or a tier; `run_pair` and `tiers` when the caller already has them (the run's timer)."""
    old = body.get("status") or {}
    try:
        obj = builders.parse_resource(body)
        if isinstance(obj, RLRun):
            raise builders.SpecError(["kind: RLRun where InferencePool or RelayTier is expected"])
    except builders.SpecError as exc:
        status = _invalid_status(ctx, body, exc.problems)
        await announce_changes(ctx, body, old, status)
        return Outcome(status=status)

    namespace, generation = body["metadata"]["namespace"], body["metadata"].get("generation")
    try:
        run_body, run = run_pair or await parent_run(ctx, namespace, obj.spec.run)
    except MissingRun as exc:
        return _waiting(ctx, body, exc.reason, str(exc))
    tiers = await run_tiers(ctx, namespace) if tiers is None else tiers
    active = run_is_active(run_body)

    try:
        if isinstance(obj, InferencePool):
            children = builders.build_pool_children(run, obj, tiers, namespace, owner_of(body), ctx.defaults, active)
            blocked, _ = await secrets.check_secrets(ctx.kube, namespace, secrets.pool_secrets(obj))
        else:
            children = builders.build_relay_children(run, obj, tiers, namespace, owner_of(body), ctx.defaults, active)
            blocked = None
    except builders.MissingDependency as exc:  # the tier it names may appear: the run's timer tries again
        outcome = _waiting(ctx, body, "MissingDependency", str(exc))
        return Outcome(status=outcome.status, metadata=tie_to_run(body, run_body))
    except builders.SpecError as exc:
        status = _invalid_status(ctx, body, exc.problems)
        await announce_changes(ctx, body, old, status)
        return Outcome(status=status, metadata=tie_to_run(body, run_body))

    if spec_changed:
        ctx.backoff.forget(body["metadata"].get("uid", ""))
    live, refused = await apply_children(ctx, body, children)
    if spec_changed:
        await prune(ctx, body, children)
    desired = next(c for c in children if c["kind"] in ("Deployment", "StatefulSet"))
    key = (desired["kind"], desired["metadata"]["name"])
    workload = live.get(key) or await ctx.kube.find(key[0], namespace, key[1]) or {}  # {}: refused, not made yet
    ready = _ready(workload)

    if refused:
        phase, reason, message = "Pending", "ApplyFailed", "; ".join(refused)
    elif run.spec.suspend:
        phase, reason, message = "Suspended", "Suspended", f"RLRun {run.metadata.name} is suspended"
    elif not active:
        phase, reason, message = "Complete", "RunFinished", f"RLRun {run.metadata.name} has finished"
    elif blocked:
        phase, (reason, message) = "Pending", blocked
    elif ready >= obj.spec.replicas:
        phase, reason, message = "Running", "Running", f"{ready} of {obj.spec.replicas} pods ready"
    else:
        phase, reason, message = "Pending", "Pending", f"{ready} of {obj.spec.replicas} pods ready"
    status = {
        "phase": phase,
        "conditions": lifecycle.scalable_conditions(old, generation, ctx.now, phase == "Running", reason, message),
        "replicas": int((workload.get("status") or {}).get("replicas") or 0),
        "readyReplicas": ready,
        "selector": conditions.workload_selector(desired),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    await announce_changes(ctx, body, old, status)
    return Outcome(status=status, metadata=tie_to_run(body, run_body))


async def reconcile_run_members(
    ctx: Ctx, run_body: dict, kinds: tuple[str, ...] = ("RelayTier", "InferencePool")
) -> None:
    """Every pool and tier of the run (those of `kinds`): apply their children, write their status and run
    tie (the run's timer calls this; pools and tiers have no timer of their own)."""
    namespace, run_name = run_body["metadata"]["namespace"], run_body["metadata"]["name"]
    try:
        run, _ = rundefaults.fill(run_body, builders.parse_as(run_body, RLRun), ctx.run_defaults)
        builders.check_cluster_run(run)
    except builders.SpecError:
        return  # the members wait for their run to be fixed
    tiers = await run_tiers(ctx, namespace)
    for kind in kinds:
        for body in await ctx.kube.list(kind, namespace):
            if (body.get("spec") or {}).get("run") != run_name:
                continue
            try:  # one member's error (the API down for it, a conflict) never keeps the others stale
                outcome = await reconcile_scalable(ctx, body, (run_body, run), tiers)
                await ctx.kube.patch_status(kind, namespace, body["metadata"]["name"], outcome.status)
                if outcome.metadata:
                    await ctx.kube.patch(kind, namespace, body["metadata"]["name"], {"metadata": outcome.metadata})
            except ApiError as exc:
                log.warning(f"{kind} {body['metadata']['name']} of run {run_name} not reconciled: {exc}")


async def reconcile_run_pools(ctx: Ctx, namespace: str, run_name: str) -> None:
    """A tier of run `run_name` was created or changed: the run's pools download from its top tier (or the
    one they name), so their workloads are re-applied now, not on the run's next timer. Applied in file order
    (run, pool, tier), a pool is first built before its tier exists and points at the origin; without this its
    workers would start there and restart one resync interval later."""
    run_body = await ctx.kube.find("RLRun", namespace, run_name)
    if run_body is not None:
        await reconcile_run_members(ctx, run_body, kinds=("InferencePool",))
