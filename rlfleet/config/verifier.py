"""The TOPLOC verification gate (`spec.verifier`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlfleet.config.base import Spec
from rlfleet.config.workload import ResourcesSpec, pod_template, resources


class ToplocSpec(Spec):
    topk: int = Field(
        default=128, ge=1, le=4096, description="Top-k values per proof chunk (258 bytes per chunk at k=128)."
    )
    decode_batching_size: int = Field(default=32, ge=1, description="Generated tokens per proof chunk.")
    max_exp_mismatches: int = Field(
        default=38,
        ge=0,
        description="Reject a chunk with more exponent mismatches than this among its top-k: 38 = 128 - TEXP (TEXP = "
        "90 matches; Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`). "
        "Calibrated for bf16 GPU non-determinism; an fp32 CPU run can use 2 (see "
        "tests/toploc/test_gate_tamper.py).",
    )
    max_mant_err_mean: float = Field(
        default=10.0,
        ge=0.0,
        description="Reject a chunk whose mean mantissa error (over exponent-matched values) exceeds this: TMEAN = 10 "
        "(Ong et al., arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`).",
    )
    max_mant_err_median: float = Field(
        default=8.0,
        ge=0.0,
        description="Reject a chunk whose median mantissa error exceeds this: TMEDIAN = 8 (Ong et al., "
        "arXiv:2501.16007; toploc-experiments `vllm_validate_poly.py`).",
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
]


class BanPolicySpec(Spec):
    ban_on: list[RejectionReason] = Field(
        default_factory=lambda: ["toploc", "logprob_mismatch", "impossible_token"],
        description="Reasons that ban a worker at their first occurrence (default: the checks an honest worker "
        "with the claimed weights cannot fail: proof, logprob and sampling).",
    )
    max_rejections: int = Field(
        default=0,
        ge=0,
        description="Ban a worker once it has this many rejections, not counting the forgiven reasons (0 = never).",
    )
    forgiven: list[RejectionReason] = Field(
        default_factory=lambda: ["stale_version"],
        description="Reasons that never count toward maxRejections (default: stale_version, which an honest worker "
        "behind a slow link hits when its group outlives maxAsyncLevel). banOn still applies to them.",
    )


class VerifierSpec(Spec):
    replicas: int = Field(default=1, ge=1, le=1024, description="Verifier replicas in one consumer group.")
    toploc: ToplocSpec = Field(
        default_factory=ToplocSpec, description="TOPLOC proof parameters and acceptance thresholds."
    )
    logprob_tolerance: float = Field(
        default=0.05,
        gt=0.0,
        description="Largest accepted |claimed - recomputed| token logprob; also the slack of the top-p/top-k "
        "possibility check.",
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
    max_message_bytes: int = Field(
        default=32 * 2**20,
        ge=1024,
        description="Inbox messages larger than this are rejected with reason `size` before decoding.",
    )
    ban: BanPolicySpec = Field(
        default_factory=BanPolicySpec,
        description="When a worker is banned; bans are enforced by the gate (reason `banned`) and the ingest.",
    )
    resources: ResourcesSpec = resources("1", "2Gi")
    pod_template: dict[str, Any] | None = pod_template()
