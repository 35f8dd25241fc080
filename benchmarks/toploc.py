"""TOPLOC gate benchmark: cost of proofs and verification, and detection per tamper class.

Measured on one machine with one randomly initialised Qwen2 policy (CPU, fp32 unless --dtype):
  - proof overhead: time of `build_proofs` over the completions, as % of the generation time;
  - verification throughput: completion tokens/s of the gate's prefill checks (one batched prefill,
    TOPLOC, logprobs, top-k/top-p) next to generation tokens/s of the same model;
  - proof bytes per 32 generated tokens (prompt chunk included);
  - detection / false rejections per class, under the TOPLOC authors' thresholds and under the
    fp32-calibrated ones of tests/toploc/test_gate_tamper.py. The checks are the gate's own (checks.py).
Usage: .venv/bin/python benchmarks/toploc.py [--hidden 256 --layers 4 --groups 16 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlfleet.checkpoint import save_model_dir
from rlfleet.config import parse_bundle
from rlfleet.models.builtin import build_tokenizer
from rlfleet.services.rollout.engines.torch_engine import TorchEngine
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.proof import build_proofs
from rlfleet.streams import RolloutGroup, Sample, SamplingParams

RUN = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: bench}}
spec:
  model: {{path: "{model}"}}
  task: {{type: arithmetic}}
  sampling: {{groupSize: {g}, maxTokens: {t}, topK: {k}}}
  verifier: {verifier}
"""
THRESHOLDS = {
    "authors": "{logprobTolerance: 0.05, toploc: {maxExpMismatches: 38, maxMantErrMean: 10, maxMantErrMedian: 8}}",
    "fp32": "{logprobTolerance: 1.0e-4, toploc: {maxExpMismatches: 2, maxMantErrMean: 0.25, maxMantErrMedian: 0.5}}",
}


def random_policy(dest: Path, hidden: int, layers: int, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    save_model_dir(Qwen2ForCausalLM(config), tok, dest)
    return dest


def make_group(engine: TorchEngine, index: int, spec, timing: dict) -> RolloutGroup:
    s = spec.sampling
    engine.stop_ids = frozenset()  # ignore EOS (as vLLM's ignore_eos): every completion has maxTokens tokens
    prompt_ids = engine.tokenizer(f"{index % 97}+{index % 89}=")["input_ids"]
    params = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=index)
    t0 = time.perf_counter()
    gens = engine.generate(prompt_ids, params, s.group_size)
    t1 = time.perf_counter()
    samples = [Sample(g.completion_ids, g.logprobs, build_proofs(g.hidden, len(prompt_ids))) for g in gens]
    t2 = time.perf_counter()
    timing["generate"] += t1 - t0
    timing["proofs"] += t2 - t1
    timing["tokens"] += sum(len(g.completion_ids) for g in gens)
    return RolloutGroup(
        task_id=f"arith-0-{index}",
        worker_id="bench",
        policy_version=0,
        prompt_ids=prompt_ids,
        sampling=params,
        samples=samples,
    )


def rejected(checker: Checker, model, tok, group: RolloutGroup) -> str | None:
    try:
        checker.prefill_checks(group, model, tok)
    except Rejection as exc:
        return exc.reason
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16, help="groups per class")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="rlfleet-bench-"))
    policy = random_policy(tmp / "policy", args.hidden, args.layers, seed=0)
    specs = {
        name: parse_bundle(
            RUN.format(model=policy, g=args.group_size, t=args.max_tokens, k=args.top_k, verifier=v)
        ).run.spec
        for name, v in THRESHOLDS.items()
    }
    spec = specs["authors"]
    honest = TorchEngine(policy, 0)
    model, tok = honest.model, honest.tokenizer
    make_group(honest, 10_000, spec, {"generate": 0.0, "proofs": 0.0, "tokens": 0})  # warm-up

    timing = {"generate": 0.0, "proofs": 0.0, "tokens": 0}
    groups = [make_group(honest, i, spec, timing) for i in range(args.groups)]
    checker = Checker(spec, None, None, policy=lambda v: (model, tok))
    t0 = time.perf_counter()
    for g in groups:
        assert rejected(checker, model, tok, g) is None
    verify_s = time.perf_counter() - t0
    proof_bytes = sum(len(p) for g in groups for s in g.samples for p in s.proofs)
    decode_bytes = sum(len(p) for g in groups for s in g.samples for p in s.proofs[1:])

    def fp8(engine):
        with torch.no_grad():
            for p in engine.model.parameters():
                p.copy_(p.to(torch.float8_e4m3fn).float())
        return engine

    def tampered(fn):
        out = []
        for g in groups:
            g = copy.deepcopy(g)
            fn(g)
            out.append(g)
        return out

    scratch = {"generate": 0.0, "proofs": 0.0, "tokens": 0}
    classes = {
        "honest": groups,
        "other weights": [
            make_group(TorchEngine(random_policy(tmp / "other", args.hidden, args.layers, 1), 0), i, spec, scratch)
            for i in range(args.groups)
        ],
        "bf16 compute": [make_group(TorchEngine(policy, 0, "bfloat16"), i, spec, scratch) for i in range(args.groups)],
        "fp8 weights": [make_group(fp8(TorchEngine(policy, 0)), i, spec, scratch) for i in range(args.groups)],
        "altered token": tampered(
            lambda g: g.samples[0].completion_ids.__setitem__(-1, (g.samples[0].completion_ids[-1] + 1) % len(tok))
        ),
        "logprobs +0.01": tampered(
            lambda g: setattr(g.samples[0], "logprobs", [x + 0.01 for x in g.samples[0].logprobs])
        ),
    }
    gen_tps = timing["tokens"] / timing["generate"]
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, fp32 CPU, {torch.get_num_threads()} threads; "
        f"{args.groups} groups x {args.group_size} samples x <= {args.max_tokens} tokens"
    )
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| generation throughput | {gen_tps:,.0f} tok/s |")
    print(
        f"| verification throughput (prefill checks) | {timing['tokens'] / verify_s:,.0f} tok/s "
        f"({timing['tokens'] / verify_s / gen_tps:.1f}x generation) |"
    )
    print(f"| proof building overhead | {100 * timing['proofs'] / timing['generate']:.1f} % of generation time |")
    print(
        f"| proof bytes per 32 generated tokens | {32 * decode_bytes / timing['tokens']:.0f} B decode chunks; "
        f"{32 * proof_bytes / timing['tokens']:.0f} B with the prompt chunk |"
    )
    print()
    print("| class | " + " | ".join(f"rejected ({name} thresholds)" for name in specs) + " |")
    print("|---|" + "---|" * len(specs))
    for name, gs in classes.items():
        cells = []
        for sp in specs.values():
            c = Checker(sp, None, None, policy=lambda v: (model, tok))
            reasons = [rejected(c, model, tok, g) for g in gs]
            n = sum(r is not None for r in reasons)
            kinds = ",".join(sorted({r for r in reasons if r}))
            cells.append(f"{n}/{len(gs)}" + (f" ({kinds})" if kinds else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
