"""Gate security benchmark (issue 16): how close honest rollouts come to the gate's thresholds, and how
many groups of each attack get through, 12 groups per attack by default.

Model and settings: the arithmetic example (`builtin://tiny-arithmetic`, warm-started; groupSize 8,
maxTokens 6, temperature 1), fp32 on CPU; the top-p attack uses topP 0.9. Each attack is built as a
cheating worker would (tests/toploc/attacks.py: logprobs and proofs recomputed by a real prefill
where the attack needs them) and judged by the gate's own `Checker.check` against a real Redis.

Table 1, honest margins: over groups drawn with other batch shapes (1, 2, 4, 8 rows) and 1 or 2
threads, the worst per-chunk TOPLOC errors, the largest |claimed - recomputed| logprob and the
largest replay miss (how far outside its CDF interval a replayed draw fell; 0 = exact), for an fp32
and a bf16 run, next to the calibrated defaults (rlfleet/services/toploc/calibration.py).
Table 2, detection: groups rejected of those submitted, per attack, (a) with the pre-issue-16 numeric
checks (the TOPLOC authors' thresholds, logprob tolerance 0.05, top-p slack of the old exp(-0.1)
factor, no seed replay) and (b) with the gate as it is now (calibrated fp32 defaults, seed replay,
stop checks, content digests). Replay and stop attacks exist only in (b): the issue measured 12/12
passing for them before.
Usage: .venv/bin/python benchmarks/gate_attacks.py [--groups 12]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import _paths  # noqa: F401  (the root first: the attack builders the gate tests use, tests.toploc.attacks)
import numpy as np
import redis
import torch

from rlfleet.config import parse_bundle
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.models.builtin import resolve_model_path
from rlfleet.models.policy import load_policy, score
from rlfleet.models.sampling import keep_mask, sample_seed, sample_uniforms
from rlfleet.services.rollout.engines.torch_engine import TorchEngine
from rlfleet.services.toploc.calibration import DEFAULTS
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.proof import verify_proofs
from rlfleet.wire.streams import RunKeys, encode_json
from tests.toploc import attacks

RUN = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: bench}}
spec:
  model: {{path: "builtin://tiny-arithmetic", dtype: {dtype}}}
  task: {{type: arithmetic, seed: 0, maxOperand: 20, operations: ["+"]}}
  sampling: {{groupSize: 8, maxTokens: 6, temperature: 1.0, topP: {top_p}}}
  trainer: {{batchSize: 16, learningRate: 1.0e-3, maxAsyncLevel: 2}}
  verifier: {verifier}
"""
PRE_16 = (
    "{engines: [torch, vllm], logprobTolerance: 0.05, topPTolerance: 0.095, "
    "toploc: {maxExpMismatches: 38, maxMantErrMean: 10, maxMantErrMedian: 8}}"
)


def spec_of(dtype: str = "float32", top_p: float = 1.0, verifier: str = "{}"):
    return parse_bundle(RUN.format(dtype=dtype, top_p=top_p, verifier=verifier)).run.spec


def margins(group, model, tokenizer, spec) -> dict[str, float]:
    """Worst TOPLOC chunk errors, |logprob diff| and replay miss of one honest group under `model`."""
    t, p, sp = spec.verifier.toploc, len(group.prompt_ids), group.sampling
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    with torch.inference_mode():
        scored = score(model, rows, sp.temperature, tokenizer.pad_token_id, want_hidden=True)
    out = {"exp": 0.0, "mean": 0.0, "median": 0.0, "logprob": 0.0, "replay": 0.0}
    for i, s in enumerate(group.samples):
        for r in verify_proofs(scored.hidden[i], s.proofs, p, t.decode_batching_size, t.topk):
            out["exp"] = max(out["exp"], r.exp_mismatches)
            out["mean"] = max(out["mean"], r.mant_err_mean)
            out["median"] = max(out["median"], r.mant_err_median)
        lp = scored.logprobs[i][p - 1 :]
        out["logprob"] = max(out["logprob"], float((lp - torch.tensor(s.logprobs)).abs().max()))
        with torch.inference_mode():
            logits = model.lm_head(scored.hidden[i][p - 1 : -1]).float() / sp.temperature  # (T, V)
        keep = keep_mask(logits, sp.top_p, sp.top_k)
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1).double()
        cdf = probs.cumsum(-1)
        tok = torch.tensor(s.completion_ids)[:, None]
        hi, lo = cdf.gather(-1, tok)[:, 0], (cdf.gather(-1, tok) - probs.gather(-1, tok))[:, 0]
        target = torch.from_numpy(sample_uniforms(sample_seed(sp.seed, i), len(s.completion_ids))) * cdf[:, -1]
        miss = torch.clamp(torch.maximum(lo - target, target - hi), min=0.0)
        out["replay"] = max(out["replay"], float(miss.max()))
    return out


def honest_margins(policy: Path, dtype: str, groups: int) -> dict[str, float]:
    spec = spec_of(dtype)
    engine = TorchEngine(policy, 0, dtype)
    model, tokenizer = load_policy(policy, dtype)
    worst: dict[str, float] = {}
    threads = torch.get_num_threads()
    try:
        for i in range(groups):
            torch.set_num_threads(1 + i % 2)
            g = attacks.honest(engine, spec, 5000 + i, per_batch=(8, 4, 2, 1)[i % 4])
            for k, v in margins(g, model, tokenizer, spec).items():
                worst[k] = max(worst.get(k, 0.0), v)
    finally:
        torch.set_num_threads(threads)
    return worst


class Judge:
    """Checker.check against a real Redis, each attack class on a clean database (version 0 and 1 announced)."""

    def __init__(self, client: redis.Redis, spec, models: dict[int, tuple]):
        self.client, self.keys = client, RunKeys("bench")
        self.checker = Checker(spec, client, self.keys, policy=lambda v: models[v])
        self.n = 0

    def reset(self) -> None:
        self.client.flushdb()
        for v in (0, 1):
            self.client.xadd(self.keys.policy, encode_json({"version": v}))

    def verdict(self, group) -> str | None:
        self.n += 1
        try:
            self.checker.check(group, f"{self.n}-0".encode(), prefill=True)
        except Rejection as exc:
            return exc.reason
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=12, help="groups per attack")
    ap.add_argument("--honest-groups", type=int, default=48, help="honest groups per dtype for the margins")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = spec_of()
    policy = resolve_model_path(spec.model, spec.task, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-gate-bench-"))

    print(f"model {policy.name}; honest groups per dtype: {args.honest_groups}; attack groups: {args.groups}\n")
    print("| dtype | exp mismatches | mantissa mean | mantissa median | abs logprob diff | replay miss |")
    print("|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        w = honest_margins(policy, dtype, args.honest_groups)
        c = DEFAULTS[("torch", "cpu", dtype)]
        print(
            f"| {dtype} honest (worst) | {w['exp']:.0f} | {w['mean']:.3g} | {w['median']:.3g} | {w['logprob']:.2g} | "
            f"{w['replay']:.2g} |"
        )
        print(
            f"| {dtype} default | {c.toploc.max_exp_mismatches} | {c.toploc.max_mant_err_mean} | "
            f"{c.toploc.max_mant_err_median} | {c.logprob_tolerance} | {c.replay_tolerance} |"
        )
    print()

    engine = TorchEngine(policy, 0)
    model, tokenizer = engine.model, engine.tokenizer
    base = [attacks.honest(engine, spec, i) for i in range(args.groups)]
    stepped = attacks.one_step_later(policy, tmp / "v1", spec, base)
    models = {0: (model, tokenizer), 1: load_policy(stepped)}
    cheap = TorchEngine(policy, 0)
    with torch.no_grad():  # a cheaper draft model: the policy with its weights rounded to fp8 and noise added
        for p in cheap.model.parameters():
            p.copy_(p.to(torch.float8_e4m3fn).float() + 0.02 * torch.randn_like(p))
    top_p_spec = spec_of(top_p=0.9)

    def stale(i: int):
        g = copy.deepcopy(base[i])
        g.policy_version = 1  # drawn with version 0, claimed as version 1 (not stale by the version)
        return g

    classes = {
        "replay: new rollout_id": ("replay", lambda g: attacks.replay_new_rollout_id(g)),
        "replay: new worker_id": ("replay", lambda g: attacks.replay_new_worker(g)),
        "replay: new seed": ("replay", lambda g: attacks.replay_new_seed(g)),
        "replay: task id with the same prompt": ("replay", lambda g: attacks.replay_same_prompt_task(g, spec)),
        "replay: samples reordered": ("replay", lambda g: attacks.replay_reordered(g)),
        "dropped final EOS": ("new", lambda g: attacks.dropped_eos(g, model, tokenizer, spec)),
        "<eos> answer <eos>": ("new", lambda g: attacks.answer_after_eos(g, model, tokenizer, spec)),
        "temperature 0.5, logprobs recomputed": ("numeric", lambda g: attacks.temperature_lie(engine, g, spec)),
        "greedy decoding": ("numeric", lambda g: attacks.greedy(engine, g, spec)),
        "cherry-picked (best 8 of 24)": ("numeric", lambda g: attacks.cherry_picked(engine, g, spec)),
        "forced answers": ("numeric", lambda g: attacks.forced(g, model, tokenizer, spec)),
        "cheap-model drafts, one real prefill": ("numeric", lambda g: attacks.draft(cheap, g, model, tokenizer, spec)),
        "duplicated sample": ("numeric", lambda g: attacks.duplicated(g)),
        "weights one step stale": ("numeric", None),
        "bf16 compute": ("numeric", None),
        "fp16 compute": ("numeric", None),
        "tokens outside top-p 0.9": ("numeric", None),
    }
    made = {
        "weights one step stale": [stale(i) for i in range(args.groups)],
        "bf16 compute": [attacks.honest(TorchEngine(policy, 0, "bfloat16"), spec, 100 + i) for i in range(args.groups)],
        "fp16 compute": [attacks.honest(attacks.half_engine(policy), spec, 200 + i) for i in range(args.groups)],
        "tokens outside top-p 0.9": [
            attacks.outside_nucleus(engine, top_p_spec, 20_000 + 1000 * i) for i in range(args.groups)
        ],
    }
    print("| attack | pre-16 numeric checks: rejected | now: rejected (reasons) |")
    print("|---|---|---|")
    with EmbeddedRedis(tmp / "redis") as url:
        client = redis.Redis.from_url(url)
        for name, (kind, build) in classes.items():
            s = top_p_spec if name.startswith("tokens outside") else spec
            pre = Judge(client, spec_of(top_p=s.sampling.top_p, verifier=PRE_16), models)
            now = Judge(client, s, models)
            groups = made.get(name) or [build(g) for g in base]
            cells = []
            for judge in (pre, now):
                if judge is pre and kind != "numeric":
                    cells.append("n/a (issue: 12/12 passed)")
                    continue
                judge.reset()
                if kind == "replay":
                    for g in base:
                        assert judge.verdict(g) is None, "an honest original was rejected"
                reasons = []
                for g in groups:
                    g = copy.deepcopy(g)
                    if judge is pre:
                        g.engine = "vllm"  # no seed replay: the numeric checks alone
                    reasons.append(judge.verdict(g))
                n = sum(r is not None for r in reasons)
                kinds = ",".join(sorted({r for r in reasons if r}))
                cells.append(f"{n}/{len(groups)}" + (f" ({kinds})" if kinds else ""))
            print(f"| {name} | {cells[0]} | {cells[1]} |")
        now = Judge(client, spec, models)
        now.reset()
        honest_reasons = [now.verdict(attacks.honest(engine, spec, 300 + i)) for i in range(args.groups)]
        print(f"| (honest, for reference) | | {sum(r is not None for r in honest_reasons)}/{args.groups} |")

    # Item 5: what a logprob shift inside the old tolerance does to the trainer's ratios.
    shift = 0.045
    ratios = [np.exp(shift) - 1.0]
    print(
        f"\nlogprobs shifted by {shift} (inside the old 0.05 tolerance): every importance ratio off by "
        f"{100 * ratios[0]:.1f} % if trained on the worker's; 0 % on the gate's recomputed ones (spot-checked groups)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
