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
        "the group's engine, verifier.workerDevice and verifier.workerDtype (rlfleet/services/toploc/calibration.py): "
        "38 = 128 - TEXP on gpu (TEXP = 90 matches; Ong et al., arXiv:2501.16007; toploc-experiments "
        "`vllm_validate_poly.py`, bf16 GPU non-determinism), tight values measured on honest runs on cpu.",
    )
    max_mant_err_mean: float | None = Field(
        default=None,
        ge=0.0,
        description="Reject a chunk whose mean mantissa error (over exponent-matched values) exceeds this. Empty: "
        "calibrated (TMEAN = 10 on gpu; Ong et al., arXiv:2501.16007; tight on cpu).",
    )
    max_mant_err_median: float | None = Field(
        default=None,
        ge=0.0,
        description="Reject a chunk whose median mantissa error exceeds this. Empty: calibrated (TMEDIAN = 8 on "
        "gpu; Ong et al., arXiv:2501.16007; tight on cpu).",
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
    "environment",  # a user environment (spec.task type python) raised, hung or returned a non-number
    "transcript",  # a multi-turn sample's environment turns are not what the environment answers (tasks/turns.py)
]


class BanPolicySpec(Spec):
    ban_on: list[RejectionReason] = Field(
        default_factory=lambda: list[RejectionReason](
            ["toploc", "logprob_mismatch", "impossible_token", "completion_end", "seed_replay", "transcript"]
        ),
        description="Reasons that ban a worker at their first occurrence (default: the checks an honest worker "
        "with the claimed weights cannot fail: proof, logprob, sampling, where a completion stops, seed replay, and a "
        "multi-turn transcript whose environment turns the environment does not give).",
    )
    max_rejections: int = Field(
        default=0,
        ge=0,
        description="Ban a worker once it has this many rejections, not counting the forgiven reasons (0 = never).",
    )
    forgiven: list[RejectionReason] = Field(
        default_factory=lambda: list[RejectionReason](["stale_version", "replay", "environment"]),
        description="Reasons that never count toward maxRejections (default: stale_version, which an honest worker "
        "behind a slow link hits when its group outlives maxAsyncLevel, and replay, which two honest groups of one "
        "prompt with the same completions also get), and environment, a user environment's failure that an honest "
        "worker gets too. banOn still applies to them.",
    )
    min_replay_positions: int = Field(
        default=4096,
        ge=1,
        description="Replayed positions a worker must have before its running replay mismatch share can ban it "
        "(verifier.maxRunningMismatchShare).",
    )
    max_dropped_ticket_share: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Runs that assign work (spec.sampling.assignment: run): ban a worker once the tickets before its "
        "latest accepted one that never got a group accepted exceed droppedTicketAllowance plus this share of "
        "those tickets (rule `droppedTickets`; rlfleet/fleet/assignment.py). A worker that drops the tickets "
        "whose groups it does not like (low reward) would pick what the trainer sees, as grinding seeds would; an "
        "honest worker drops only groups that went stale or that a restart lost. 1: never.",
    )
    dropped_ticket_allowance: int = Field(
        default=64,
        ge=0,
        description="Tickets before a worker's latest accepted one that may lack an accepted group before the "
        "dropped-ticket rule counts them (maxDroppedTicketShare): groups overtaken by later ones at several gate "
        "replicas, and a few stale or rejected ones.",
    )


class VerifierSpec(Spec):
    replicas: int = Field(default=1, ge=1, le=1024, description="Verifier replicas in one consumer group.")
    toploc: ToplocSpec = Field(
        default_factory=ToplocSpec, description="TOPLOC proof parameters and acceptance thresholds."
    )
    engines: list[Literal["torch", "vllm"]] = Field(
        default_factory=lambda: list[Literal["torch", "vllm"]](["torch"]),
        min_length=1,
        description="Engines whose groups the gate admits (a group records the engine that drew it). Both draw by "
        "rlfleet's seeded rule (rlfleet/models/sampling.py), so every spot-checked group is replayed from its seeds "
        "whatever engine it claims; the claimed engine only picks calibrated tolerances (with workerDevice and "
        "workerDtype), it never skips a check.",
    )
    worker_device: Literal["cpu", "gpu"] = Field(
        default="cpu",
        description="Device class the run's workers compute on; with the group's engine and workerDtype it "
        "picks the calibrated tolerances (rlfleet/services/toploc/calibration.py). cpu: tight (exact seed replay; "
        "vLLM on CPU in fp32 as tight as torch). gpu: loose, the TOPLOC authors' values and a small share of "
        "replay mismatches per group, not yet calibrated on a GPU. Set by the run, never by a worker.",
    )
    worker_dtype: Literal["float32", "bfloat16"] | None = Field(
        default=None,
        description="Dtype the run's workers compute in; with the group's engine and workerDevice it picks the "
        "calibrated tolerances, and every InferencePool's spec.dtype must be it. The verifier still prefills in "
        "spec.model.dtype, so bfloat16 workers beside a float32 model get the bf16 rows against an fp32 verifier. "
        "Empty: spec.model.dtype. Set by the run, never by a worker.",
    )
    logprob_tolerance: float | None = Field(
        default=None,
        gt=0.0,
        description="Largest accepted |claimed - recomputed| token logprob; also the logit slack of the top-k "
        "possibility check. Empty: calibrated for the group's engine, workerDevice and workerDtype.",
    )
    top_p_tolerance: float | None = Field(
        default=None,
        ge=0.0,
        description="A token is impossible when the probability mass certainly ranked above it exceeds topP by more "
        "than this (checked on every spot-checked group with topP < 1 or topK > 0). Empty: calibrated.",
    )
    replay_tolerance: float | None = Field(
        default=None,
        ge=0.0,
        description="Slack, in probability mass and in logits at the top-k/top-p boundaries, within which a replayed "
        "draw may differ from the worker's (float noise of another batch shape, thread count, engine or device). "
        "Empty: calibrated for the engine, workerDevice and workerDtype.",
    )
    max_replay_mismatch_share: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Reject a group (seed_replay) when more than this share of its positions hold a token its seed "
        "does not draw, beyond replayTolerance. Empty: calibrated (0 on CPU: exact replay; a small share on GPU).",
    )
    max_running_mismatch_share: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Ban a worker whose replay mismatches over all its replayed positions (at least "
        "ban.minReplayPositions) exceed this share (0 = never). Empty: calibrated (0 on CPU, where one mismatch "
        "already rejects and bans; below the per-group share on GPU).",
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
    resident_versions: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Policy versions a verifier replica holds in memory (each a whole model on its device). A "
        "group of another version waits for its load: when the bound is reached, its weights are loaded in place "
        "into the least recently used version's model. 2 serves the newest version and the one before it from "
        "memory; raise it when groups of many versions arrive mixed and memory allows.",
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
