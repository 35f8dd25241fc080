"""The gate's acceptance thresholds for a group: what the run sets (`spec.verifier`), else the
calibration of (the group's engine, the run's worker device class `spec.verifier.workerDevice`, the
run's worker dtype `spec.verifier.workerDtype`, else `spec.model.dtype`; the verifier itself always
prefills in `spec.model.dtype`). The claimed engine and the device class only pick tolerances: every check runs on
every spot-checked group whatever it claims (checks.py), so a label can loosen a bound to at most
the loosest calibrated one of the engines the run admits, never skip a check.

Why per engine, device and dtype: the authors' TOPLOC thresholds (38 exponent mismatches, mantissa
error mean 10, median 8) and a logprob tolerance of 0.05 absorb bf16 GPU non-determinism on large
models (vLLM). A CPU engine recomputes far closer to its decode, and with those loose defaults an
fp32 run let through weights one optimizer step stale, bf16 or fp16 compute, and tokens outside
top-p. The CPU values below are set from measurements of honest rollouts, drawn with other batch
shapes (1, 2, 4, 8 rows) and 1 or 2 threads and verified by one padded prefill
(benchmarks/gate_attacks.py prints them next to the attacks; tests/toploc/test_gate_defaults.py holds
the attacks to them). Worst values seen (builtin tiny-arithmetic 48 groups per dtype; random Qwen2
hidden 256 x 4 layers and 512 x 8 layers, 16 groups each):

  fp32 honest:   exp mismatches 0, mantissa mean 0.008, median 0, |logprob diff| 2.4e-6, replay miss 0
  bf16 honest:   exp 2, mean 0.57, median 0, |logprob diff| 0.005, replay miss 0 (a bf16 gate)
  fp16 compute in an fp32 run (an attack): exp 2, mean up to 0.5, |logprob diff| 4.4e-4
  bf16 compute in an fp32 run (an attack): exp 1-4, mean 0.53-3.0, |logprob diff| 4e-3

vLLM on CPU in fp32 computes the same float32 math as the torch engine (honest vLLM-CPU logprobs
match the torch prefill to about 5e-6), so its fp32 row is the torch row: a label `vllm` buys nothing
in an fp32 CPU run (in bf16 it buys a looser logprob tolerance, below, and no skipped check).

Rare honest outliers: fp32 noise can push one value across a bf16 rounding edge at the top-k
boundary, so the recomputed top-k set differs by one element and the claimed polynomial evaluated
at the new index gives one garbage value (seen once in about 40,000 chunks of a 150-step run of the
arithmetic example: exp 0, mean 0.73, median 0). Such a chunk is honest, and the default ban policy
would ban its worker, so the TOPLOC thresholds tolerate a few outliers (exp mismatches, mean) and
rely on the median, which an outlier cannot move, for systematic drift; bf16 or fp16 compute, stale
weights and other models are caught as well by the logprob tolerance, which no tie can trip. So
fp32 allows 4 exponent mismatches, mean 4, median 0.5 and |logprob diff| 1e-4 (40x the honest
worst, below what fp16 compute produces); bf16 allows 12 / 5 / 3 and 0.05 (vLLM bf16: 0.2, below).

Replay (replay.py). The replay tolerance (probability mass and logit slack at the top-k/top-p
edges) is 1e-3 in every row: a mass slack is a hole, not a margin (at 0.02, groups drawn with topP
ignored replayed with 0 mismatches on a flat model, benchmarks/replay_calibration.py), so float
noise is absorbed by a share of mismatched positions instead. fp32 on CPU: honest draws replay
exactly (0 mismatches in 1,324 honest vLLM-CPU groups of a whole run and in every torch
measurement), so the share is 0: one token its seed does not draw rejects the group. bf16: a group
may have 5 % mismatched positions and a worker 2 % over its running total; measured with vLLM-CPU
bf16 workers and an fp32 verifier (48 groups of 8 x 16 tokens): honest share at most 0.011 (mean
0.0006), a temperature 0.8 lie at least 0.078, topP ignored at least 0.128 (margin 0.067); a whole run
of that pair (workerDtype bfloat16, benchmarks/honest_vllm_run.py): 1,371 groups, 0 rejected, running
share 0.0010; honest |logprob diff| 0.0049, TOPLOC exp 6, mean 2.75, median 1 under the fp32 verifier.
vLLM-CPU bf16 against a bf16 verifier: |logprob diff| up to 0.007 on a random Qwen2 and 0.057 on the
trained tiny-math (whole runs were banned at 0.05, then at 0.2 after 179 groups with 0.202: bf16
logits of a peaked model differ by their rounding quantum between two kernels), TOPLOC exp 4, mean
2.3, median 1: its logprob tolerance is 0.5. In bf16 the logprob check is a loose sanity bound; the
replay share and TOPLOC are what bind.

GPU rows (either engine, device class `gpu`) are NOT calibrated yet: no GPU was available. They keep
the authors' TOPLOC values and logprob tolerance, a replay tolerance of 1e-3, a top-p slack of 0.02,
and allow a small share of replay mismatches per group (0.05 in bf16, 0.02 in fp32: Token-DiFR
reports > 98 % exact matches for honest vLLM bf16 GPU workers under a shared seed) and a lower
running share per worker (`max_running_share`, rlfleet/fleet/reputation.py: an attacker who stays under the
per-group share on every group is banned once its running share, over `ban.minReplayPositions`
positions, exceeds it). benchmarks/replay_calibration.py measures them on the machine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlfleet.config import VerifierSpec
from rlfleet.proofs.toploc import Thresholds


@dataclass(frozen=True)
class Calibration:
    toploc: Thresholds
    logprob_tolerance: float  # largest |claimed - recomputed| logprob; the logit slack of possible_tokens
    top_p_tolerance: float  # mass above topP tolerated before a token is impossible
    replay_tolerance: float  # mass / logit slack of a replayed draw
    max_mismatch_share: float = 0.0  # replay mismatches / positions a group may have (0: exact replay)
    max_running_share: float = 0.0  # a worker's running mismatch share above which it is banned


AUTHORS = Calibration(Thresholds(38, 10.0, 8.0), logprob_tolerance=0.05, top_p_tolerance=0.05, replay_tolerance=0.05)
_CPU_FP32 = Calibration(Thresholds(4, 4.0, 0.5), logprob_tolerance=1e-4, top_p_tolerance=1e-3, replay_tolerance=1e-3)
_BF16_SHARE, _BF16_RUNNING = 0.05, 0.02  # replay mismatch shares of a bf16 group and of a worker's running total
_CPU_BF16 = Calibration(
    Thresholds(12, 5.0, 3.0),
    logprob_tolerance=0.05,
    top_p_tolerance=0.02,
    replay_tolerance=1e-3,
    max_mismatch_share=_BF16_SHARE,
    max_running_share=_BF16_RUNNING,
)
_GPU = replace(AUTHORS, top_p_tolerance=0.02, replay_tolerance=1e-3)  # uncalibrated: see the module docstring
DEFAULTS: dict[tuple[str, str, str], Calibration] = {
    ("torch", "cpu", "float32"): _CPU_FP32,
    ("torch", "cpu", "bfloat16"): _CPU_BF16,
    ("vllm", "cpu", "float32"): _CPU_FP32,
    ("vllm", "cpu", "bfloat16"): replace(_CPU_BF16, logprob_tolerance=0.5),
    ("torch", "gpu", "float32"): replace(_GPU, max_mismatch_share=0.02, max_running_share=0.01),
    ("torch", "gpu", "bfloat16"): replace(_GPU, max_mismatch_share=_BF16_SHARE, max_running_share=_BF16_RUNNING),
    ("vllm", "gpu", "float32"): replace(_GPU, max_mismatch_share=0.02, max_running_share=0.01),
    ("vllm", "gpu", "bfloat16"): replace(_GPU, max_mismatch_share=_BF16_SHARE, max_running_share=_BF16_RUNNING),
}


def calibration(v: VerifierSpec, engine: str, dtype: str) -> Calibration:
    """The thresholds for a group drawn by `engine` on the run's worker device class (`v.worker_device`) in
    `dtype` (the run's worker dtype, config.worker_dtype); fields set in `v` win."""
    base, t = DEFAULTS[(engine, v.worker_device, dtype)], v.toploc

    def pick(given, default):
        return default if given is None else given

    return Calibration(
        Thresholds(
            pick(t.max_exp_mismatches, base.toploc.max_exp_mismatches),
            pick(t.max_mant_err_mean, base.toploc.max_mant_err_mean),
            pick(t.max_mant_err_median, base.toploc.max_mant_err_median),
        ),
        logprob_tolerance=pick(v.logprob_tolerance, base.logprob_tolerance),
        top_p_tolerance=pick(v.top_p_tolerance, base.top_p_tolerance),
        replay_tolerance=pick(v.replay_tolerance, base.replay_tolerance),
        max_mismatch_share=pick(v.max_replay_mismatch_share, base.max_mismatch_share),
        max_running_share=pick(v.max_running_mismatch_share, base.max_running_share),
    )
