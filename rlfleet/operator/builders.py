"""Pure builders: an RLRun / InferencePool / RelayTier (parsed config models) -> Kubernetes manifests.

Every function here (and in pools.py, relays.py) is pure: no API calls, no clock; plain dicts that the
operator applies as they are and that `rlfleet render` prints; tests call them directly and validate
them against the Kubernetes JSON schemas. The processes in the pods are the `rlfleet <component>`
entrypoints with the local launcher's arguments (rlfleet/local/plan.py `plan()`), except that ports are
fixed (names.SHARDCAST_PORT, names.METRICS_PORT) and peers are Service DNS names.

    RLRun          -> ConfigMap (the run's YAML), trainer StatefulSet + headless Service + PodDisruptionBudget,
                      origin Deployment + Service, verifier Deployment + headless metrics Service,
                      with spec.ingest.tokens or a joining admission the ingest Deployment + Service; a
                      remote run: the ConfigMap
    InferencePool  -> pools.py: ConfigMap (run + pool YAML), rollout workload, Service, PodDisruptionBudget
    RelayTier      -> relays.py: relay Deployment + Service + PodDisruptionBudget
Every workload runs `replicas` pods while the run is `active` (neither finished nor failed) and not
suspended, else 0. Every pod is behind exactly one Service with a `metrics` port, so a ServiceMonitor
(or a PodMonitor) scrapes each pod once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.config import IngestSpec, RLRun
from rlfleet.config.workload import OriginSpec
from rlfleet.operator import kueue, names, podconfig
from rlfleet.operator.certificates import server_tls
from rlfleet.operator.overrides import merge_pod_template
from rlfleet.operator.pods import (
    ClusterDefaults,
    ContainerParts,
    Owner,
    build_container,
    deployment,
    disruption_budget,
    meta,
    pod_template,
    scale,
    secret_volume,
    service,
    statefulset,
)
from rlfleet.operator.pools import build_pool_children, build_pool_config_map, build_rollout_workload
from rlfleet.operator.relays import build_relay_children, resolve_pool_relays, resolve_upstream
from rlfleet.operator.resources import MissingDependency, SpecError, check_cluster_run, parse_as, parse_resource
from rlfleet.wire import env

__all__ = [
    "ClusterDefaults",
    "MissingDependency",
    "Owner",
    "SpecError",
    "build_pool_children",
    "build_pool_config_map",
    "build_relay_children",
    "build_rollout_workload",
    "check_cluster_run",
    "parse_as",
    "parse_resource",
    "resolve_pool_relays",
    "resolve_upstream",
]  # and the build_* below

DEFAULTS = ClusterDefaults()


def build_run_config_map(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS
) -> dict:
    r = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(names.run_config(r), namespace, names.labels("RLRun", r, "config", r), owner),
        "data": {names.CONFIG_FILE: podconfig.run_config_text(run, defaults.views)},
    }


def _run_pod(run: RLRun, component: str, container: dict, defaults: ClusterDefaults, override, volumes=None) -> dict:
    r = run.metadata.name
    return pod_template(
        names.labels("RLRun", r, component, r),
        container,
        names.run_config(r),
        podconfig.run_reader_hash(run, component, defaults.views),
        defaults,
        volumes=volumes,
        override=override,
    )


def build_trainer_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    """Headless: pod 0's DNS name is the torch rendezvous address; every rank's /metrics behind it."""
    r = run.metadata.name
    return service(
        names.trainer(r),
        namespace,
        names.labels("RLRun", r, names.TRAINER, r),
        names.selector("RLRun", r, names.TRAINER, r),
        owner,
        [("torch", names.TORCH_MASTER_PORT), ("metrics", names.METRICS_PORT)],
        headless=True,
    )


def build_trainer_statefulset(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS, active: bool = True
) -> dict:
    """GRPO trainer: one pod per replica, each running `rlfleet trainer --ranks N` (N = ranksPerReplica, one rank
    process per GPU, services/trainer/ranks.py). With a world (replicas x N) over 1 each pod gets the torchrun-style
    MASTER_ADDR/MASTER_PORT/WORLD_SIZE and GROUP_RANK = its ordinal, from which each rank takes
    RANK = GROUP_RANK x N + LOCAL_RANK; with N > 1 a memory-backed /dev/shm (`shm_volume`), which the ranks of
    one pod share (NCCL's intra-node transport; the container runtime's default is 64 MiB).
    `--hold-when-done`: after the last step the trainer waits to be scaled down instead of exiting (a
    StatefulSet would restart it)."""
    r, t = run.metadata.name, run.spec.trainer
    dist: list[dict] = []
    if t.world > 1:
        dist = [
            {"name": env.MASTER_ADDR, "value": names.trainer_master_addr(r, namespace)},
            {"name": env.MASTER_PORT, "value": str(names.TORCH_MASTER_PORT)},
            {"name": env.WORLD_SIZE, "value": str(t.world)},
            {
                "name": env.GROUP_RANK,
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
            },
        ]
    signing = run.spec.shardcast.signing_key_secret
    mounts = [{"name": "signing", "mountPath": names.SIGNING_DIR, "readOnly": True}] if signing else []
    if t.ranks > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    main = build_container(
        run,
        defaults,
        ContainerParts(
            names.TRAINER,
            ["--output-dir", f"{names.CACHE_DIR}/trainer", "--hold-when-done"]
            + (["--ranks", str(t.ranks)] if t.ranks > 1 else []),
            defaults.image_for(run, t.gpus),
            t.resources,
            gpus=t.gpus,
            gpu_resource=t.gpu_resource,
            extra_env=dist,
            mounts=mounts,
        ),
    )
    if t.world > 1:
        main["ports"].insert(0, {"name": "torch", "containerPort": names.TORCH_MASTER_PORT})
    volumes = [secret_volume("signing", signing, [names.SIGNING_KEY])] if signing else []
    if t.ranks > 1:
        volumes.append(shm_volume(t.ranks))
    labels = names.labels("RLRun", r, names.TRAINER, r)
    # The grace period is set before the podTemplate override is merged, so a podTemplate still decides it.
    grace = {"spec": {"terminationGracePeriodSeconds": t.termination_grace_period_seconds}}
    override = merge_pod_template(grace, t.pod_template) if t.pod_template else grace
    return statefulset(
        names.trainer(r),
        namespace,
        labels,
        names.selector("RLRun", r, names.TRAINER, r),
        scale(run, t.replicas, active),
        _run_pod(run, names.TRAINER, main, defaults, override, volumes or None),
        owner,
        names.trainer(r),
    )


def build_trainer_budget(run: RLRun, namespace: str, owner: Owner | None = None, active: bool = True) -> dict:
    """The trainer's PodDisruptionBudget. While the trainer runs, no voluntary eviction (a node drain, the
    cluster autoscaler) may take a trainer pod: `maxUnavailable: 0`, as losing one rank stops every rank and
    sends the run back to its last checkpoint. Once the run is suspended, finished or failed (0 replicas)
    the budget is `100%`, so a trainer pod still stopping never holds a drain; and a trainer pod that is not
    Ready (pending, crash-looping, still starting) is evictable whatever the budget
    (`unhealthyPodEvictionPolicy: AlwaysAllow`): a drain is only ever held by a trainer that is training."""
    r = run.metadata.name
    training = scale(run, run.spec.trainer.replicas, active) > 0
    budget = disruption_budget(
        names.trainer(r),
        namespace,
        names.labels("RLRun", r, names.TRAINER, r),
        names.selector("RLRun", r, names.TRAINER, r),
        0 if training else "100%",
        owner,
    )
    budget["spec"]["unhealthyPodEvictionPolicy"] = "AlwaysAllow"
    return budget


def shm_volume(ranks: int) -> dict:
    """/dev/shm for a pod of `ranks` rank processes: memory-backed (it counts against the pod's memory), 1 GiB a
    rank, enough for NCCL's per-peer buffers and torch's shared-memory tensors."""
    return {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}}


@dataclass(frozen=True)
class _Server:
    """A one-replica HTTP server of a run (origin, ingest) on the Shardcast port: its component, its
    Deployment's name, the run spec section with its resources and pod template, its own arguments after
    --host and --port, what it mounts, and `https`: it serves HTTPS only."""

    component: str
    name: str
    spec: OriginSpec | IngestSpec
    args: list[str] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    volumes: list[dict] | None = None
    https: bool = False


def _server_deployment(
    run: RLRun, server: _Server, namespace: str, owner: Owner | None, defaults: ClusterDefaults, active: bool
) -> dict:
    """The Deployment of `server`, one replica while the run is active."""
    r, component = run.metadata.name, server.component
    port = {"name": "http", "containerPort": names.SHARDCAST_PORT}
    args = ["--host", "0.0.0.0", "--port", str(names.SHARDCAST_PORT), *server.args]
    image = defaults.image_for(run, 0)
    parts = ContainerParts(
        component, args, image, server.spec.resources, ports=[port], mounts=server.mounts, https=server.https
    )
    return deployment(
        server.name,
        namespace,
        names.labels("RLRun", r, component, r),
        names.selector("RLRun", r, component, r),
        scale(run, 1, active),
        _run_pod(
            run, component, build_container(run, defaults, parts), defaults, server.spec.pod_template, server.volumes
        ),
        owner,
    )


def _run_service(run: RLRun, component: str, name: str, namespace: str, owner, http: bool = True, headless=False):
    r = run.metadata.name
    ports = [("http", names.SHARDCAST_PORT)] if http else []
    return service(
        name,
        namespace,
        names.labels("RLRun", r, component, r),
        names.selector("RLRun", r, component, r),
        owner,
        [*ports, ("metrics", names.METRICS_PORT)],
        headless=headless,
    )


def build_origin_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS, active: bool = True
) -> dict:
    """The origin serves the store: with the trainer, the pods that always get its credentials (credentials.py)."""
    origin = _Server(names.ORIGIN, names.origin(run.metadata.name), run.spec.origin)
    return _server_deployment(run, origin, namespace, owner, defaults, active)


def build_origin_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_service(run, names.ORIGIN, names.origin(run.metadata.name), namespace, owner)


def serves_ingest(run: RLRun) -> bool:
    """A run has an ingest when it names worker tokens or admits joins (spec.ingest.admission.mode)."""
    return bool(run.spec.ingest.tokens) or run.spec.ingest.admission.mode != "tokens"


def build_ingest_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS, active: bool = True
) -> dict:
    """Only when spec.ingest.tokens names the Secret of worker tokens, or spec.ingest.admission admits joins;
    the tokens Secret and, in mode invite, the invites Secret are mounted into this pod only; with
    spec.ingest.tls.secretName it serves HTTPS from that Secret (certificates.py)."""
    ingest = run.spec.ingest
    tokens, invites, mode = ingest.tokens, ingest.admission.invites, ingest.admission.mode
    if not serves_ingest(run):
        raise SpecError(["spec.ingest.tokens: name the Secret of worker tokens the ingest deployment mounts"])
    if mode == "invite" and not invites:
        raise SpecError(["spec.ingest.admission.invites: mode invite needs the Secret of invite codes (invites.yaml)"])
    args, mounts, volumes = [], [], []
    if tokens:
        args += ["--tokens-file", f"{names.INGEST_DIR}/{names.INGEST_TOKENS_KEY}"]
        mounts.append({"name": "ingest-tokens", "mountPath": names.INGEST_DIR, "readOnly": True})
        volumes.append(secret_volume("ingest-tokens", tokens, [names.INGEST_TOKENS_KEY]))
    if mode == "invite" and invites:
        args += ["--invites-file", f"{names.INGEST_INVITES_DIR}/{names.INGEST_INVITES_KEY}"]
        mounts.append({"name": "ingest-invites", "mountPath": names.INGEST_INVITES_DIR, "readOnly": True})
        volumes.append(secret_volume("ingest-invites", invites, [names.INGEST_INVITES_KEY]))
    tls_args, tls_mounts, tls_volumes = server_tls(ingest.tls)
    server = _Server(
        names.INGEST,
        names.ingest(run.metadata.name),
        ingest,
        args + tls_args,
        mounts=mounts + tls_mounts,
        volumes=volumes + tls_volumes,
        https=bool(tls_args),
    )
    return _server_deployment(run, server, namespace, owner, defaults, active)


def build_ingest_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    return _run_service(run, names.INGEST, names.ingest(run.metadata.name), namespace, owner)


def build_verifier_deployment(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS, active: bool = True
) -> dict:
    """The verifier reads checkpoints from the trusted origin, never from relays; with verifier.gpus its pods get
    the GPU image and resource as a pool's and the trainer's do (ClusterDefaults.image_for, build_container)."""
    r, v = run.metadata.name, run.spec.verifier
    args = [
        "--consumer",
        f"$({names.ENV_POD_NAME})",
        "--origin-url",
        names.service_url(names.origin(r), namespace),
        "--cache-dir",
        f"{names.CACHE_DIR}/verifier",
    ]
    main = build_container(
        run,
        defaults,
        ContainerParts(
            names.VERIFIER, args, defaults.image_for(run, v.gpus), v.resources, gpus=v.gpus, gpu_resource=v.gpu_resource
        ),
    )
    return deployment(
        names.verifier(r),
        namespace,
        names.labels("RLRun", r, names.VERIFIER, r),
        names.selector("RLRun", r, names.VERIFIER, r),
        scale(run, v.replicas, active),
        _run_pod(run, names.VERIFIER, main, defaults, v.pod_template),
        owner,
    )


def build_verifier_service(run: RLRun, namespace: str, owner: Owner | None = None) -> dict:
    """Headless, metrics only: what a ServiceMonitor scrapes the verifier pods through."""
    return _run_service(run, names.VERIFIER, names.verifier(run.metadata.name), namespace, owner, False, True)


def build_run_children(
    run: RLRun, namespace: str, owner: Owner | None = None, defaults: ClusterDefaults = DEFAULTS, active: bool = True
) -> list[dict]:
    """Every child of an RLRun, in apply order (config first, so pods find it)."""
    check_cluster_run(run)
    if run.spec.remote:  # trained in another cluster: only the config its relays read
        return [build_run_config_map(run, namespace, owner, defaults)]
    children = [
        build_run_config_map(run, namespace, owner, defaults),
        build_origin_service(run, namespace, owner),
        build_origin_deployment(run, namespace, owner, defaults, active),
        build_trainer_service(run, namespace, owner),
        build_trainer_statefulset(run, namespace, owner, defaults, active),
        build_trainer_budget(run, namespace, owner, active),
        build_verifier_service(run, namespace, owner),
        build_verifier_deployment(run, namespace, owner, defaults, active),
    ]
    if serves_ingest(run):
        children += [
            build_ingest_service(run, namespace, owner),
            build_ingest_deployment(run, namespace, owner, defaults, active),
        ]
    size = run.spec.trainer.replicas + run.spec.verifier.replicas + 1 + int(serves_ingest(run))  # at full scale
    return kueue.grouped(children, kueue.queue_of(run.metadata.labels), run.metadata.name, size)
