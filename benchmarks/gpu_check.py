"""The GPU check: what rlfleet does on an accelerator, measured in one run (docs/benchmarks.md, "GPU check").

Model: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query and 2 key/value heads, intermediate 4,864,
vocabulary 151,936, tied embeddings), random weights built in code, nothing downloaded; in the run's
dtype (bf16 by default). `--dry-run`: a 2-layer model of width 64 on the CPU in fp32, so CI runs every
step of this script where no GPU is (its figures mean nothing; that it runs and that no honest group
is rejected does).

Steps, one after the other in this process, on the device `rlfleet.models.device.choose_device` picks:
 1. generation: the torch engine samples groups of G completions of `--max-tokens` tokens (stop
    tokens ignored, as vLLM's `ignore_eos`, so every group costs the same) with 1, 4 and 16 groups
    in flight (`Engine.generate_groups`, as a worker with `maxGroupsInFlight` does): completion
    tokens/s, and the speedup of groups in flight over one at a time;
 2. verification: the verifier's model, loaded as the verifier loads it, on the device; the gate's
    prefill checks (TOPLOC, logprobs, seed replay) of the 16 groups, batched as the gate batches
    (`prefill_verdicts`): tokens/s, verify / generate, and how many worker GPUs one verifier GPU
    keeps up with at spotCheckFraction 1 (verify tokens/s / generate tokens/s); honest groups
    rejected (must be 0) and tampered groups rejected (a changed token; another model's groups);
 3. vLLM: the same with the vLLM engine (TOPLOC capture on) when vLLM's CUDA build is installed,
    its groups cross-checked by the verifier; else the reason it was skipped;
 4. weight swap: a perturbed version 1 is published and signed, served by a real origin and relay
    over 127.0.0.1; versions 1, 0, 1 are each downloaded afresh (hashes, signature), loaded in place
    and used for a 1-token group: swap / (download + load), the rollout benchmark's figure;
 5. episodes: multi-turn episodes on the torch engine, and on vLLM where step 3 runs
    (rlfleet/engines/episodes.py; the tests' Counter environment answers every turn, 3 model turns of
    max-tokens / 4 tokens each), all groups in one round per turn: the model's tokens/s, on vLLM the
    share of later turns' prompt tokens read from its prefix cache, and the gate's prefill checks of
    them on the device (TOPLOC over every position, logprobs and the seed replay over the model's):
    honest rejected must be 0;
 6. trainer: after one untimed warm-up step, one GRPO step (`grpo_update`, as the trainer takes it)
    on batches of 1, 4 and 16 of the groups: peak device memory and tokens/s, beside the model-state
    bound (weights + gradients + AdamW's two moments); a batch that does not fit says OOM.
Prints one table; `--json PATH` writes every figure. Run through scripts/gpu-check.sh.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _paths  # noqa: F401  (the checkout's rlfleet and tests, without PYTHONPATH)
import torch
from replay_calibration import replay_of

from rlfleet.config import parse_bundle
from rlfleet.engines import make_engine
from rlfleet.engines.base import GroupRequest
from rlfleet.models.builtin import build_tokenizer
from rlfleet.models.device import choose_device
from rlfleet.models.policy import load_policy
from rlfleet.models.sampling import stop_token_ids
from rlfleet.proofs.toploc import build_proofs_many
from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.client import FetchSettings, fetch_version
from rlfleet.services.toploc.batch import prefill_verdicts
from rlfleet.services.toploc.checks import Checker, Rejection
from rlfleet.services.toploc.main import READ_BATCH
from rlfleet.services.trainer.update import UpdateSettings, grpo_update
from rlfleet.tasks.arithmetic import ArithmeticTask
from rlfleet.versions.checkpoint import publish_version, save_model_dir
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from rlfleet.wire import env
from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams
from tests.runs import bundle_yaml, rlrun
from tests.support import serving

RUN = "gpucheck"
IN_FLIGHT = (1, 4, 16)
QWEN25_05B = {  # Qwen2.5-0.5B's config.json, less its tokenizer ids (ours is the builtin one)
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
DRY_RUN = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
DRY_RUN.update(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, vocab_size=512)


def build_policy(dest: Path, shape: dict, seed: int, device: torch.device) -> Path:
    """A random policy of `shape` saved as a model directory (initialised on `device`: a 0.5B model's
    random init takes most of a minute on a few CPU cores)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    config = Qwen2Config(
        **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(seed)
    with device:
        model = Qwen2ForCausalLM(config)
    save_model_dir(model, tok, dest)
    return dest


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_groups(engine, spec, first: int, n: int, in_flight: int, device) -> tuple[list[RolloutGroup], float, int]:
    """`n` groups, `in_flight` per `generate_groups` call, stop tokens ignored; (groups, seconds, tokens)."""
    s, task = spec.sampling, ArithmeticTask(seed=0)
    engine.stop_ids = frozenset()  # every completion runs to maxTokens, so rates compare like with like
    made, seconds, tokens = [], 0.0, 0
    for start in range(first, first + n, in_flight):
        ids = range(start, min(start + in_flight, first + n))
        prompts = [engine.tokenizer(task.problem(f"arith-0-{i}").prompt)["input_ids"] for i in ids]
        params = [SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=i) for i in ids]
        sync(device)
        t0 = time.perf_counter()
        batches = engine.generate_groups([GroupRequest(p, q, s.group_size) for p, q in zip(prompts, params)])
        sync(device)
        seconds += time.perf_counter() - t0
        for i, prompt, param, gens in zip(ids, prompts, params, batches):
            tokens += sum(len(g.completion_ids) for g in gens)
            proofs = build_proofs_many([g.hidden for g in gens], len(prompt))
            samples = [
                Sample(g.completion_ids, g.logprobs, p, finish_reason=g.finish_reason) for g, p in zip(gens, proofs)
            ]
            made.append(
                RolloutGroup(
                    task_id=f"arith-0-{i}",
                    worker_id="gpu-check",
                    policy_version=gens[0].version,
                    prompt_ids=prompt,
                    sampling=param,
                    samples=samples,
                    engine=engine.name,
                )
            )
    return made, seconds, tokens


def verify(checker: Checker, model, tok, groups: list[RolloutGroup], device) -> tuple[list[str | None], float]:
    """The gate's batched prefill checks: (rejection reason or None per group, seconds)."""
    reasons: list[str | None] = []
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(groups), READ_BATCH):
        verdicts = prefill_verdicts(checker, model, tok, groups[i : i + READ_BATCH])
        reasons += [v.reason if isinstance(v, Rejection) else None for v in verdicts]
    sync(device)
    return reasons, time.perf_counter() - t0


def generation_rows(engine, spec, device, groups: int) -> tuple[dict, list[RolloutGroup]]:
    make_groups(engine, spec, 10_000, 1, 1, device)  # warm-up: kernels, allocator
    rates, kept = {}, []
    for k in IN_FLIGHT:
        n = max(k, groups // 4 if k == 1 else groups)  # one at a time is slow: a quarter as many groups
        made, seconds, tokens = make_groups(engine, spec, 0, n, k, device)
        rates[k] = tokens / seconds
        kept = made if len(made) >= len(kept) else kept
    return {
        "tokens_per_s": {str(k): r for k, r in rates.items()},
        "inflight_speedup": max(rates.values()) / rates[1],
    }, kept


def verification_rows(spec, model_dir: Path, dtype: str, device, groups, gen_tps: float, other) -> dict:
    model, tok = load_policy(model_dir, dtype, device)  # as the verifier loads a version (Gate.policy)
    checker = Checker(spec, None, None, policy=lambda v: (model, tok))
    verify(checker, model, tok, groups[:2], device)  # warm-up
    honest, seconds = verify(checker, model, tok, groups, device)
    tokens = sum(len(s.completion_ids) for g in groups for s in g.samples)
    changed = copy.deepcopy(groups)
    for g in changed:
        ids = g.samples[0].completion_ids
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % model.config.vocab_size
    tampered = {"changed token": verify(checker, model, tok, changed, device)[0]}
    if other:
        tampered["another model's groups"] = verify(checker, model, tok, other, device)[0]
    verify_tps = tokens / seconds
    return {
        "groups": len(groups),
        "honest_rejected": sum(r is not None for r in honest),
        "honest_reasons": sorted({r for r in honest if r}),
        "replay_match": {
            "honest": match_rates(checker, model, tok, groups),
            "changed token": match_rates(checker, model, tok, changed),
        },
        "tokens_per_s": verify_tps,
        "verify_over_generate": verify_tps / gen_tps,
        "worker_gpus_per_verifier_gpu": verify_tps / gen_tps,
        "tampered_rejected": {k: [sum(r is not None for r in v), len(v)] for k, v in tampered.items()},
    }


def match_rates(checker: Checker, model, tok, groups: list[RolloutGroup]) -> dict:
    """The seed replay's match rate (rlfleet/services/toploc/replay.py): the share of completion positions whose
    claimed token is the one the sample's seed draws from the verifier's logits, within the replay tolerance the
    gate uses for the group's (engine, device, dtype); over all groups and for the worst group."""
    positions = mismatches = 0
    worst = 1.0
    for group in groups:
        score = replay_of(group, model, tok, checker.calibration(group).replay_tolerance)
        positions, mismatches = positions + score.positions, mismatches + score.mismatches
        worst = min(worst, 1.0 - score.mismatches / max(1, score.positions))
    return {"positions": positions, "match_share": 1.0 - mismatches / max(1, positions), "worst_group": worst}


def swap_rows(engine, spec, work: Path, device, swaps: int = 3) -> dict:
    """Versions 1, 0, 1 ... through a real origin and relay, as benchmarks/rollout.py measures a swap."""
    key_file, public = generate_keypair(work / "keys")
    signer, public_key = make_signer(load_private_key(key_file)), parse_public_key(public)
    store = open_store(f"file://{work}/store")
    for v in (0, 1):
        publish_version(store, RUN, v, work / f"v{v}", signer=signer)
    size = sum(f.stat().st_size for f in (work / "v0").iterdir())
    rows = []
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(relay.make_app(relay.RelaySettings(origin_url, work / "relay", RUN, 3))) as relay_url,
    ):
        fetch = FetchSettings.over([relay_url], RUN, public_key=public_key)
        for v in (0, 1):  # the relay holds both before any swap is timed: the relay -> worker leg is measured
            fetch_version(fetch, v, work / "prefetch")
        prompt = engine.tokenizer("1+1=")["input_ids"]
        for i in range(swaps):
            announced = time.perf_counter()
            path = fetch_version(fetch, 1 - i % 2, work / f"swap{i}")
            downloaded = time.perf_counter()
            engine.load_weights(path, 10 + i)
            sync(device)
            loaded = time.perf_counter()
            gens = engine.generate(prompt, SamplingParams(1.0, 1.0, 0, 1, seed=i), spec.sampling.group_size)
            sync(device)
            first = time.perf_counter()
            assert all(g.version == 10 + i for g in gens)
            rows.append((downloaded - announced, loaded - downloaded, first - loaded))
    med = [statistics.median(r[j] for r in rows) for j in range(3)]
    return {
        "checkpoint_mib": size / 2**20,
        "download_s": med[0],
        "load_s": med[1],
        "first_token_s": med[2],
        "swap_ratio": statistics.median((d + lo + f) / (d + lo) for d, lo, f in rows),
    }


def trainer_rows(spec, model_dir: Path, dtype: str, device, groups: list[RolloutGroup]) -> dict:
    model, tok = load_policy(model_dir, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = params * 4 * model.dtype.itemsize  # weights, gradients and AdamW's two moments, in the weights' dtype
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rewards = torch.Generator().manual_seed(0)
    for g in groups:  # rewards that differ within a group, so every row has an advantage
        for s in g.samples:
            s.reward = float(torch.rand((), generator=rewards))
    # Warm-up, untimed: kernels, cuBLAS handles and the allocator's pools, and AdamW's moments, which
    # exist from the first step on, so every measured step sees the steady state a trainer runs in.
    settings = UpdateSettings.of(spec.trainer, spec.sampling.temperature, tok.pad_token_id)
    grpo_update(model, optimizer, groups[:1], settings)
    out: dict[str, dict] = {}
    for k in (1, 4, 16):
        batch = groups[:k]
        if len(batch) < k:
            continue
        tokens = sum(len(g.prompt_ids) + len(s.completion_ids) for g in batch for s in g.samples)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            sync(device)
            t0 = time.perf_counter()
            grpo_update(model, optimizer, batch, settings)
            sync(device)
            seconds = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError:
            out[str(k)] = {"groups": k, "tokens": tokens, "oom": True}
            optimizer.zero_grad(set_to_none=True)
            continue
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out[str(k)] = {"groups": k, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        if peak is not None:
            out[str(k)].update(peak_gib=peak / 2**30, peak_over_state=peak / state_bytes)
    return {"params": params, "state_gib": state_bytes / 2**30, "steps": out}


def vllm_skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "no GPU (a dry run exercises the torch engine only)"
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM's CUDA build is not installed on this machine, and scripts/gpu-check.sh installs it only where "
            "PyPI is reachable"
        )
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: every step, no figure that counts")
    ap.add_argument("--groups", type=int, default=16, help="groups per measurement (16 in flight at most)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 in a dry run (default)")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    args = ap.parse_args()
    if args.dry_run:
        args.groups, args.group_size, args.max_tokens = min(args.groups, 16), min(args.group_size, 4), 16
    if args.dry_run:
        os.environ[env.DEVICE] = "cpu"  # also where a GPU is: the dry run is CI's
    device = choose_device()  # the engines and the verifier's model land where the project's one rule says
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    shape = DRY_RUN if args.dry_run else QWEN25_05B
    report: dict = {
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "dry_run": args.dry_run,
        },
        "model": {**shape, "dtype": dtype},
        "work": {"groups": args.groups, "group_size": args.group_size, "max_tokens": args.max_tokens},
    }
    t_start = time.perf_counter()
    errors: dict[str, str] = {}

    def step(name: str, fn, *a):
        """Run one step; a failure is recorded (the JSON's `errors`) and the later steps still run,
        so one run on a lent GPU reports everything it can."""
        t0 = time.perf_counter()
        try:
            result = fn(*a)
        except Exception:  # noqa: BLE001 (reported, and the exit status says so)
            errors[name] = traceback.format_exc(limit=-8)
            print(f"{name}: FAILED\n{errors[name]}", file=sys.stderr)
            return None
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return result

    with tempfile.TemporaryDirectory(prefix="rlfleet-gpu-check-") as tmp:
        work = Path(tmp)
        v0 = build_policy(work / "v0", shape, 0, device)
        build_policy(work / "v1", shape, 1, device)  # another model: its groups must be refused; a swap target
        run = rlrun(
            RUN,
            model={"path": str(v0), "dtype": dtype},
            sampling={"groupSize": args.group_size, "maxTokens": args.max_tokens},
            verifier={"engines": ["torch", "vllm"]},
        )
        spec = parse_bundle(bundle_yaml(run)).run.spec
        engine = make_engine("torch", v0, 0, dtype)
        made = step("generation_torch", generation_rows, engine, spec, device, args.groups)
        groups: list[RolloutGroup] = []
        if made:
            report["generation_torch"], groups = made
            other = step("other_model_groups", other_groups, work / "v1", spec, dtype, device)
            gen_tps = max(report["generation_torch"]["tokens_per_s"].values())
            report["verification_torch"] = step(
                "verification_torch", verification_rows, spec, v0, dtype, device, groups, gen_tps, other
            )
        engine.stop_ids = stop_token_ids(engine.model, engine.tokenizer)  # generation_rows ignored them
        report["episodes_torch"] = step("episodes_torch", episode_rows, engine, spec, v0, dtype, device, args.groups)
        report["weight_swap"] = step("weight_swap", swap_rows, engine, spec, work, device)  # leaves other weights
        engine.close()
        del engine
        skip = vllm_skip_reason(device)
        if skip is None:
            vmade = step("generation_vllm", vllm_generation, v0, dtype, spec, device, args.groups)
            if vmade:
                report["generation_vllm"], vgroups, vepisodes = vmade
                vtps = max(report["generation_vllm"]["tokens_per_s"].values())
                report["verification_vllm"] = step(
                    "verification_vllm", verification_rows, spec, v0, dtype, device, vgroups, vtps, None
                )
                report["episodes_vllm"] = step("episodes_vllm", check_episodes, spec, v0, dtype, device, *vepisodes)
        else:
            report["vllm_skipped"] = skip
        if groups:
            report["trainer"] = step("trainer", trainer_rows, spec, v0, dtype, device, groups)
    report = {k: v for k, v in report.items() if v is not None}
    report["errors"] = errors
    report["wall_s"] = time.perf_counter() - t_start
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    checked = ("verification_torch", "verification_vllm", "episodes_torch", "episodes_vllm")
    rejected = [k for k in checked if report.get(k, {}).get("honest_rejected")]
    return 1 if rejected or errors else 0


def episode_rows(engine, spec, model_dir: Path, dtype: str, device, groups: int) -> dict:
    """Step 5 (module docstring): multi-turn episodes drawn and checked on the device."""
    return check_episodes(spec, model_dir, dtype, device, *draw_episodes(engine, spec, groups, device))


def draw_episodes(engine, spec, groups: int, device) -> tuple[list[RolloutGroup], dict]:
    """Step 5's episodes, all groups in one round per turn, and their figures: the model's tokens/s, turns a sample
    and, on vLLM, the share of later turns' prompt tokens read from the prefix cache."""
    from rlfleet.engines.episodes import generate_episodes
    from rlfleet.tasks.turns import drawn_tokens, later_turn_prompt_tokens
    from tests.core.turn_envs import Counter

    task, s = Counter(), spec.sampling
    sampling = s.model_copy(update={"max_turns": 3, "max_tokens_per_turn": max(1, s.max_tokens // 4)})
    problems = [task.problem(f"turns-ok-{i}") for i in range(groups)]
    prompts = [engine.tokenizer(p.prompt)["input_ids"] for p in problems]
    params = [SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, seed=i) for i in range(groups)]
    requests = [GroupRequest(p, q, s.group_size) for p, q in zip(prompts, params)]
    cached_before = getattr(engine, "prompt_tokens_cached", None)
    sync(device)
    t0 = time.perf_counter()
    made, failures = generate_episodes(engine, task, requests, problems, sampling)
    sync(device)
    seconds = time.perf_counter() - t0
    assert not failures, failures
    episodes, tokens, turns, later_prompts = [], 0, 0, 0
    for problem, prompt, param, gens in zip(problems, prompts, params, made):
        assert gens is not None
        proofs = build_proofs_many([g.hidden for g in gens], len(prompt))
        samples = [Sample(g.completion_ids, g.logprobs, p, 0.0, g.finish_reason, g.spans) for g, p in zip(gens, proofs)]
        tokens += sum(drawn_tokens(g.spans, len(g.completion_ids)) for g in gens)
        turns += sum((len(g.spans or [0]) + 1) // 2 for g in gens)
        # each later model turn's prompt: the prompt and the transcript before it
        later_prompts += sum(later_turn_prompt_tokens(len(prompt), g.spans) for g in gens)
        episodes.append(RolloutGroup(problem.task_id, "gpu-check", gens[0].version, prompt, param, samples,
                                     engine=engine.name))  # fmt: skip
    figures = {"model_tokens_per_s": tokens / seconds, "turns_per_sample": turns / (groups * s.group_size)}
    if cached_before is not None:
        figures["prompt_cached_share"] = (engine.prompt_tokens_cached - cached_before) / max(later_prompts, 1)
    return episodes, figures


def check_episodes(spec, model_dir: Path, dtype: str, device, episodes: list[RolloutGroup], figures: dict) -> dict:
    """Step 5's gate: the prefill checks of the episodes on the device (honest rejected must be 0)."""
    model, tok = load_policy(model_dir, dtype, device)  # as the verifier loads a version (Gate.policy)
    checker = Checker(spec, None, None, policy=lambda v: (model, tok))
    reasons, verify_s = verify(checker, model, tok, episodes, device)
    return {
        **figures,
        "verify_s": verify_s,
        "honest_rejected": sum(r is not None for r in reasons),
        "reasons": sorted({r for r in reasons if r}),
    }


def other_groups(model_dir: Path, spec, dtype: str, device) -> list[RolloutGroup]:
    """Groups another model drew, claiming the checked one's version: each must be refused."""
    engine = make_engine("torch", model_dir, 0, dtype)
    made, _, _ = make_groups(engine, spec, 0, 4, 4, device)
    engine.close()
    return made


def vllm_generation(model_dir: Path, dtype: str, spec, device, groups: int):
    """Steps 3 and 5 on the vLLM engine: (its generation figures, its groups, its episodes and their figures), all
    drawn before the engine closes; main checks them after, when vLLM's share of the GPU memory is free. The
    episodes' later turns read vLLM's prefix cache (rlfleet/engines/episodes.py)."""
    engine = make_engine("vllm", model_dir, 0, dtype)
    try:
        stops = engine.stop_ids
        rows, groups_made = generation_rows(engine, spec, device, groups)
        engine.stop_ids = stops  # generation_rows ignored them; episodes end turns at them
        return rows, groups_made, draw_episodes(engine, spec, groups, device)
    finally:
        engine.close()


def print_table(r: dict) -> None:
    """One markdown table of every figure; a step that failed or was skipped says so in its cells."""
    m, w = r["model"], r["work"]
    print(
        f"device: {r['machine']['device']} (torch {r['machine']['torch']}); model: Qwen2 hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, vocabulary {m['vocab_size']}, {m['dtype']}; groups of "
        f"{w['group_size']} x {w['max_tokens']} tokens; {r['wall_s']:.0f} s"
    )
    print("| measure | torch engine | vLLM engine |")
    print("|---|---|---|")

    def cell(section: str, fmt) -> str:
        if section in r:
            return fmt(r[section])
        if section in r["errors"]:
            return "failed"
        return "skipped" if section.endswith("vllm") and "vllm_skipped" in r else "-"

    def row(label: str, section: str, fmt) -> None:
        print(f"| {label} | " + " | ".join(cell(f"{section}_{e}", fmt) for e in ("torch", "vllm")) + " |")

    for k in IN_FLIGHT:
        row(
            f"generation tokens/s, {k} group(s) in flight",
            "generation",
            lambda s, k=k: f"{s['tokens_per_s'][str(k)]:,.0f}",
        )
    row("inflight_speedup (best / 1 in flight)", "generation", lambda s: f"{s['inflight_speedup']:.2f}x")
    row("verification tokens/s (the gate's batched prefill)", "verification", lambda s: f"{s['tokens_per_s']:,.0f}")
    row("verify / generate", "verification", lambda s: f"{s['verify_over_generate']:.1f}x")
    row(
        "worker GPUs one verifier GPU keeps up with (spotCheckFraction 1)",
        "verification",
        lambda s: f"{s['worker_gpus_per_verifier_gpu']:.1f}",
    )
    row("honest groups rejected", "verification", lambda s: f"{s['honest_rejected']} of {s['groups']}")
    for name in r.get("verification_torch", {}).get("tampered_rejected", {}):
        row(
            f"tampered groups rejected: {name}",
            "verification",
            lambda s, name=name: "{} of {}".format(*s["tampered_rejected"][name]) if name in s["tampered_rejected"]
            else "-",
        )  # fmt: skip
    for kind in ("honest", "changed token"):
        row(
            f"seed replay match share, {kind} groups (worst group)",
            "verification",
            lambda s, kind=kind: (
                f"{s['replay_match'][kind]['match_share']:.4f} ({s['replay_match'][kind]['worst_group']:.4f})"
            ),
        )
    if "weight_swap" in r:
        s = r["weight_swap"]
        print(
            f"| weight swap ({s['checkpoint_mib']:.0f} MiB): download / load / 1st token s; swap/(dl+load) | "
            f"{s['download_s']:.2f} / {s['load_s']:.2f} / {s['first_token_s']:.3f}; {s['swap_ratio']:.2f} | - |"
        )
    row(
        "multi-turn episodes: turns a sample; model tok/s; honest rejected",
        "episodes",
        lambda e: (
            f"{e['turns_per_sample']:.1f}; {e['model_tokens_per_s']:,.0f}; {e['honest_rejected']} {e['reasons'] or ''}"
        ),
    )
    row(
        "multi-turn episodes: later turns' prompt tokens read from the prefix cache",
        "episodes",
        lambda e: f"{e['prompt_cached_share']:.2f}" if "prompt_cached_share" in e else "-",
    )
    t = r.get("trainer", {"steps": {}})
    for k, step in t["steps"].items():
        figure = "OOM" if step.get("oom") else f"{step['tokens_per_s']:,.0f} tok/s"
        if "peak_gib" in step:
            figure += f", peak {step['peak_gib']:.1f} GiB = {step['peak_over_state']:.1f}x model state"
        print(
            f"| trainer GRPO step, {k} group(s), {step['tokens']} tokens (model state {t['state_gib']:.1f} GiB) "
            f"| {figure} | - |"
        )
    if "vllm_skipped" in r:
        print(f"vLLM: skipped: {r['vllm_skipped']}")
    for name in r["errors"]:
        print(f"{name}: FAILED (the JSON's errors hold the traceback)")


if __name__ == "__main__":
    sys.exit(main())
