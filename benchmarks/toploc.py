"""TOPLOC gate benchmark: cost of proofs and verification, and detection per tamper class.

Measured on one machine with one randomly initialised Qwen2 policy (CPU, fp32), side by side in one
process, in `--rounds` interleaved rounds (medians; other processes' load moves single figures):
  - generation: the torch engine samples `--groups` groups of G completions of `--max-tokens` tokens
    (EOS ignored), as a rollout worker does; proof building: `build_proofs_many` per group, as the
    worker calls it, as % of the generation time;
  - verification: the gate's prefill checks (TOPLOC, logprobs, top-k/top-p) of the same groups as the
    gate runs them: `READ_BATCH` groups per batched prefill (batch.py); also one group per prefill,
    the path before batching. Throughput in completion tokens/s, next to generation's;
  - the light checks every group gets (envelope with Redis, prompt rebuilt from the task, reward);
  - per core: all of the above again with one torch thread. One worker core makes a group in
    gen + proofs seconds; one verifier core clears a group in f * prefill checks + light checks at
    spot-check fraction f, so it keeps up with (gen + proofs) / (f * prefill + light) worker cores;
    the ceiling of that figure: the prefill's matrix products alone (every linear layer of the model
    on as many positions), timed on one core, put in place of the prefill;
  - proof bytes per 32 generated tokens (prompt chunk included);
  - detection / false rejections per class, under the TOPLOC authors' thresholds and under the
    fp32-calibrated ones of tests/toploc/test_gate_tamper.py. The checks are the gate's own.
Usage: .venv/bin/python benchmarks/toploc.py [--hidden 256 --layers 4 --groups 16 --max-tokens 64
       --threads 0 --rounds 3 --json PATH --profile]   (--threads 0: torch's default)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (the checkout's rlfleet and tests, without PYTHONPATH)
import redis
import torch

from rlfleet.config import parse_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.local.redis_server import EmbeddedRedis
from rlfleet.models.builtin import build_tokenizer
from rlfleet.models.sampling import stop_token_ids
from rlfleet.proofs.toploc import build_proofs_many
from rlfleet.services.toploc.batch import prefill_verdicts
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.main import READ_BATCH
from rlfleet.tasks import make_run_task
from rlfleet.versions.checkpoint import save_model_dir
from rlfleet.wire.streams import RolloutGroup, RunKeys, Sample, SamplingParams, encode_json

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


def make_group(engine: TorchEngine, index: int, spec, timing: dict, ignore_eos: bool = True) -> RolloutGroup:
    """A group as a worker makes it, timed into `timing`. `ignore_eos` (as vLLM's): every completion has
    maxTokens tokens, so throughput compares like with like; such groups pass the prefill checks but
    not the light checks, which refuse tokens after a stop token."""
    s = spec.sampling
    engine.stop_ids = frozenset() if ignore_eos else stop_token_ids(engine.model, engine.tokenizer)
    prompt_ids = engine.tokenizer(make_run_task(spec).problem(f"arith-0-{index}").prompt)["input_ids"]
    params = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=index)
    t0 = time.perf_counter()
    gens = engine.generate(prompt_ids, params, s.group_size)
    t1 = time.perf_counter()
    proofs = build_proofs_many([g.hidden for g in gens], len(prompt_ids))
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
        samples=[Sample(g.completion_ids, g.logprobs, p, finish_reason=g.finish_reason) for g, p in zip(gens, proofs)],
    )


def batched(checker: Checker, model, tok, groups: list[RolloutGroup]) -> list[str | None]:
    """Rejection reasons of the prefill checks, `READ_BATCH` groups per batched prefill (as the gate)."""
    out = []
    for i in range(0, len(groups), READ_BATCH):
        verdicts = prefill_verdicts(checker, model, tok, groups[i : i + READ_BATCH])
        out += [r.reason if isinstance(r, Rejection) else None for r in verdicts]  # else: recomputed logprobs
    return out


def one_by_one(checker: Checker, model, tok, groups: list[RolloutGroup]) -> list[str | None]:
    out = []
    for g in groups:
        try:
            checker.prefill_checks(g, model, tok)
            out.append(None)
        except Rejection as exc:
            out.append(exc.reason)
    return out


def measure(engine: TorchEngine, spec, checker: Checker, n_groups: int, first_index: int) -> dict:
    """One round: generate + prove `n_groups` groups, then verify them (batched, one by one, light)."""
    model, tok = engine.model, engine.tokenizer
    timing = {"generate": 0.0, "proofs": 0.0, "tokens": 0}
    groups = [make_group(engine, first_index + i, spec, timing) for i in range(n_groups)]
    t0 = time.perf_counter()
    assert batched(checker, model, tok, groups) == [None] * n_groups, "an honest group was rejected"
    t1 = time.perf_counter()
    assert one_by_one(checker, model, tok, groups) == [None] * n_groups
    t_one = time.perf_counter()
    # the light checks, on groups that end where the policy stopped them (what the gate accepts)
    untimed = dict(timing)
    ended = [make_group(engine, first_index + n_groups + i, spec, untimed, ignore_eos=False) for i in range(n_groups)]
    t2 = time.perf_counter()
    for g in ended:
        checker.check(g, None, prefill=False)
    t3 = time.perf_counter()
    n = timing["tokens"]
    return {
        "gen_tps": n / timing["generate"],
        "proof_pct": 100 * timing["proofs"] / timing["generate"],
        "verify_tps": n / (t1 - t0),
        "verify_one_tps": n / (t_one - t1),
        "gen_s": timing["generate"] / n_groups,  # per group
        "proof_s": timing["proofs"] / n_groups,
        "prefill_s": (t1 - t0) / n_groups,
        "light_s": (t3 - t2) / n_groups,
        "groups": groups,
    }


def matmul_floor_s(model, groups: list[RolloutGroup]) -> float:
    """Seconds per group that the prefill's matrix products alone take on this core: every linear layer of
    the model (and the output head) applied to as many positions as the groups' rows hold, timed on
    its own (best of 3). No prefill of these rows can be faster than this with the same weights and
    dtype, so it bounds what any batching or Python-side saving can bring."""
    positions = sum(len(g.prompt_ids) + len(s.completion_ids) for g in groups for s in g.samples)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    best = float("inf")
    with torch.inference_mode():
        inputs = {m.in_features: torch.randn(positions, m.in_features) for m in linears}
        for _ in range(3):
            t0 = time.perf_counter()
            for m in linears:
                torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)
            best = min(best, time.perf_counter() - t0)
    return best / len(groups)


def profile_verification(checker: Checker, model, tok, groups: list[RolloutGroup]) -> str:
    prof = cProfile.Profile()
    prof.enable()
    batched(checker, model, tok, groups)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16, help="groups per class and per round")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    ap.add_argument("--profile", action="store_true", help="print a cProfile summary of the verification")
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    load_before = os.getloadavg()[0]
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
    with EmbeddedRedis(tmp / "redis") as url:
        client, keys = redis.Redis.from_url(url), RunKeys("bench")
        client.xadd(keys.policy, encode_json({"version": 0}))
        checker = Checker(spec, client, keys, policy=lambda v: (model, tok))
        rounds: dict[int, list[dict]] = {threads: [], 1: []}
        for r in range(args.rounds + 1):  # round 0 warms up both thread counts
            for t in rounds:
                torch.set_num_threads(t)
                m = measure(honest, spec, checker, args.groups, first_index=1000 * r)
                if r:
                    rounds[t].append(m)
        torch.set_num_threads(1)
        floor_s = matmul_floor_s(model, rounds[1][-1]["groups"])
        torch.set_num_threads(threads)
        groups = rounds[threads][-1]["groups"]
        profile = profile_verification(checker, model, tok, groups) if args.profile else ""
        client.close()

    def med(t: int, key: str) -> float:
        return statistics.median(m[key] for m in rounds[t])

    fraction = spec.verifier.spot_check_fraction
    gen_tps, verify_tps = med(threads, "gen_tps"), med(threads, "verify_tps")
    worker_s = med(1, "gen_s") + med(1, "proof_s")
    verifier_s = fraction * med(1, "prefill_s") + med(1, "light_s")
    cores = worker_s / verifier_s
    cores_ceiling = worker_s / (fraction * floor_s + med(1, "light_s"))  # prefill at its matmul floor
    proof_bytes = sum(len(p) for g in groups for s in g.samples for p in s.proofs)
    decode_bytes = sum(len(p) for g in groups for s in g.samples for p in s.proofs[1:])
    tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)

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
    n = args.groups
    classes = {
        "honest": groups,
        "other weights": [
            make_group(TorchEngine(random_policy(tmp / "other", args.hidden, args.layers, 1), 0), i, spec, scratch)
            for i in range(n)
        ],
        "bf16 compute": [make_group(TorchEngine(policy, 0, "bfloat16"), i, spec, scratch) for i in range(n)],
        "fp8 weights": [make_group(fp8(TorchEngine(policy, 0)), i, spec, scratch) for i in range(n)],
        "altered token": tampered(
            lambda g: g.samples[0].completion_ids.__setitem__(-1, (g.samples[0].completion_ids[-1] + 1) % len(tok))
        ),
        "logprobs +0.01": tampered(
            lambda g: setattr(g.samples[0], "logprobs", [x + 0.01 for x in g.samples[0].logprobs])
        ),
    }
    detection: dict[str, dict] = {}
    for name, gs in classes.items():
        detection[name] = {}
        for th, sp in specs.items():
            c = Checker(sp, None, None, policy=lambda v: (model, tok))
            reasons = batched(c, model, tok, gs)
            assert reasons == one_by_one(c, model, tok, gs), f"{name}: batched verdicts differ from one by one"
            detection[name][th] = {
                "rejected": sum(r is not None for r in reasons),
                "of": len(gs),
                "reasons": sorted({r for r in reasons if r}),
            }
    load_after = os.getloadavg()[0]

    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, fp32 CPU, {threads} threads (and 1 for per-core "
        f"figures); {n} groups x {args.group_size} samples x {args.max_tokens} tokens; {args.rounds} rounds, "
        f"medians; load average {load_before:.2f} -> {load_after:.2f} on {os.cpu_count()} CPUs"
    )
    print()
    print(f"| measure | {threads} threads | 1 thread |")
    print("|---|---|---|")
    print(f"| generation throughput | {gen_tps:,.0f} tok/s | {med(1, 'gen_tps'):,.0f} tok/s |")
    for label, key in (("batched, the gate's", "verify_tps"), ("one group per prefill", "verify_one_tps")):
        cells = [f"{med(t, key):,.0f} tok/s ({med(t, key) / med(t, 'gen_tps'):.1f}x generation)" for t in rounds]
        print(f"| verification throughput ({label}) | " + " | ".join(cells) + " |")
    print(
        "| proof building overhead | "
        + " | ".join(f"{med(t, 'proof_pct'):.2f} % of generation time" for t in rounds)
        + " |"
    )
    print(
        f"| per group: generation + proofs / prefill checks / light checks | - | {1e3 * med(1, 'gen_s'):.1f} + "
        f"{1e3 * med(1, 'proof_s'):.1f} / {1e3 * med(1, 'prefill_s'):.1f} / {1e3 * med(1, 'light_s'):.2f} ms |"
    )
    print(
        f"| one verifier core keeps up with (spotCheckFraction {fraction:g}, the default) | - | {cores:.1f} worker "
        f"cores |"
    )
    print(
        f"| ... if the prefill took only its matrix products ({1e3 * floor_s:.1f} ms a group, "
        f"{100 * floor_s / med(1, 'prefill_s'):.0f} % of it) | - | {cores_ceiling:.1f} worker cores (ceiling) |"
    )
    for f in (0.5, 0.25, 0.1):
        print(
            f"| ... at spotCheckFraction {f:g} | - | "
            f"{worker_s / (f * med(1, 'prefill_s') + med(1, 'light_s')):.1f} worker cores |"
        )
    print(
        f"| proof bytes per 32 generated tokens | {32 * decode_bytes / tokens:.0f} B decode chunks; "
        f"{32 * proof_bytes / tokens:.0f} B with the prompt chunk | |"
    )
    print()
    print("| class | " + " | ".join(f"rejected ({name} thresholds)" for name in specs) + " |")
    print("|---|" + "---|" * len(specs))
    for name, per in detection.items():
        cells = [
            f"{d['rejected']}/{d['of']}" + (f" ({','.join(d['reasons'])})" if d["reasons"] else "")
            for d in per.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if profile:
        print()
        print(f"cProfile of the batched verification of {len(groups)} groups ({threads} threads), by own time:")
        print(profile)
    if args.json:
        figures = {
            "verify_over_generate": verify_tps / gen_tps,
            "verify_over_generate_one_thread": med(1, "verify_tps") / med(1, "gen_tps"),
            "verify_one_group_per_prefill_over_generate": med(threads, "verify_one_tps") / gen_tps,
            "proof_overhead_pct": med(threads, "proof_pct"),
            "proof_overhead_pct_one_thread": med(1, "proof_pct"),
            "worker_cores_per_verifier_core": cores,
            "worker_cores_per_verifier_core_ceiling": cores_ceiling,
            "prefill_matmul_floor_s_per_group": floor_s,
            "spot_check_fraction": fraction,
            "generation_tok_s": gen_tps,
            "verification_tok_s": verify_tps,
            "threads": threads,
            "detection": detection,
            "load_average": [load_before, load_after],
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
