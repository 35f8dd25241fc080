"""The TOPLOC verification gate (`spec.verifier`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfleet.config.base import Spec
from rlfleet.config.workload import ResourcesSpec, gpu_resource, pod_template, resources


class ToplocSpec(Spec):
    topk: int = Field(
        default=128, ge=1, le=4096, description="Top-k values per proof chunk (258 bytes per chunk at k=128)."
    )
    decode_batching_size: int = Field(default=32, ge=1, description="Generated tokens per proof chunk.")
    max_exp_mismatches: int | None = Field(
        default=None,
        ge=0,
        description="Reject a chunk with more exponent mismatches than this among its top-k. Empty: calibrated for "
        "the group's engine and the run's dtype (rlfleet/services/toploc/calibration.py): 38 = 128 - TEXP for vllm "
        "(TEXP = 90 matches; Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`, bf16 GPU "
        "non-determinism), tight values measured on honest runs for the torch engine.",
    )
    max_mant_err_mean: float | None = Field(
        default=None,
        ge=0.0,
        description="Reject a chunk whose mean mantissa error (over exponent-matched values) exceeds this. Empty: "
        "calibrated for the group's engine and the run's dtype (TMEAN = 10 for vllm; Ong et al., arXiv:2501.16007).",
    )
    max_mant_err_median: float | None = Field(
        default=None,
        ge=0.0,
        description="Reject a chunk whose median mantissa error exceeds this. Empty: calibrated for the group's engine "
        "and the run's dtype (TMEDIAN = 8 for vllm; Ong et al., arXiv:2501.16007).",
    )


# Why the gate refuses a group; each check of the gate has its own (rlfleet/services/toploc/checks.py).
RejectionReason = Literal[
    "malformed",
    "schema_version",
    "size",
    "sampling_params",
    "unknown_version",
    "stale_version",
    "banned",
    "replay",
    "prompt_mismatch",
    "toploc",
    "logprob_mismatch",
    "impossible_token",
    "completion_end",
    "seed_replay",
    "assignment",
]


class BanPolicySpec(Spec):
    ban_on: list[RejectionReason] = Field(
        default_factory=lambda: list[RejectionReason](
            ["toploc", "logprob_mismatch", "impossible_token", "completion_end", "seed_replay"]
        ),
        description="Reasons that ban a worker at their first occurrence (default: the checks an honest worker "
        "with the claimed weights cannot fail: proof, logprob, sampling, where a completion stops, seed replay).",
    )
    max_rejections: int = Field(
        default=0,
        ge=0,
        description="Ban a worker once it has this many rejections, not counting the forgiven reasons (0 = never).",
    )
    forgiven: list[RejectionReason] = Field(
        default_factory=lambda: list[RejectionReason](["stale_version", "replay"]),
        description="Reasons that never count toward maxRejections (default: stale_version, which an honest worker "
        "behind a slow link hits when its group outlives maxAsyncLevel, and replay, which two honest groups of one "
        "prompt with the same completions also get). banOn still applies to them.",
    )


class VerifierSpec(Spec):
    replicas: int = Field(default=1, ge=1, le=1024, description="Verifier replicas in one consumer group.")
    toploc: ToplocSpec = Field(
        default_factory=ToplocSpec, description="TOPLOC proof parameters and acceptance thresholds."
    )
    engines: list[Literal["torch", "vllm"]] = Field(
        default_factory=lambda: list[Literal["torch", "vllm"]](["torch"]),
        min_length=1,
        description="Engines whose groups the gate admits (a group records the engine that drew it). torch groups "
        "are replayed from their seeds on spot-check; vllm groups cannot be (vLLM's own sampler, not bit-reproducible "
        "on a GPU), so they get the proof, logprob and top-k/top-p checks alone, with the looser vllm thresholds: list "
        "vllm only when a pool runs it.",
    )
    logprob_tolerance: float | None = Field(
        default=None,
        gt=0.0,
        description="Largest accepted |claimed - recomputed| token logprob; also the logit slack of the top-k "
        "possibility check. Empty: calibrated for the group's engine and the run's dtype.",
    )
    top_p_tolerance: float | None = Field(
        default=None,
        ge=0.0,
        description="vllm groups: a token is impossible when the probability mass certainly ranked above it exceeds "
        "topP by more than this. Empty: calibrated for the engine and dtype.",
    )
    replay_tolerance: float | None = Field(
        default=None,
        ge=0.0,
        description="torch groups: slack, in probability mass and in logits at the top-k/top-p boundaries, within "
        "which a replayed draw may differ from the worker's (float noise of another batch shape or thread count). "
        "Empty: calibrated for the dtype.",
    )
    spot_check_fraction: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Fraction of groups (drawn at random, unpredictably) that get the prefill checks (TOPLOC, "
        "logprobs, sampling); the others still get the envelope, prompt and reward checks.",
    )
    claim_idle_ms: int = Field(
        default=30_000,
        ge=10,
        description="An inbox message pending this long at a replica is taken over by another (XAUTOCLAIM); longer "
        "than the slowest group's verification.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=100,
        description="An inbox message whose handling failed this many times (an exception in the gate, or a "
        "verifier that died while on it) goes to the dead-letter stream and is acknowledged, so one poison message "
        "cannot stop the run; it is retried after claimIdleMs until then.",
    )
    max_message_bytes: int = Field(
        default=32 * 2**20,
        ge=1024,
        description="Inbox messages larger than this are rejected with reason `size` before decoding.",
    )
    ban: BanPolicySpec = Field(
        default_factory=BanPolicySpec,
        description="When a worker is banned; bans are enforced by the gate (reason `banned`) and the ingest.",
    )
    gpus: int = Field(
        default=0,
        ge=0,
        le=64,
        description="GPUs per verifier replica (cluster only): its prefill then runs on its first GPU, in "
        "spec.model.dtype, and its pods get the GPU image.",
    )
    gpu_resource: str = gpu_resource()
    resources: ResourcesSpec = resources("1", "2Gi")
    pod_template: dict[str, Any] | None = pod_template()
