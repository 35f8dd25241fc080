"""Rollout engines side by side: generation tokens/s and weight-swap latency, torch vs vLLM.

One randomly initialised Qwen2 policy (builtin character tokenizer) is published as versions 0
and 1 to a file store, served by a real origin and one relay over 127.0.0.1 HTTP. For each engine,
in one process, one after the other on the same machine:
  - the engine starts on version 0 (downloaded through the relay) and warms up with one group;
  - throughput with K groups in flight, for each K of `--in-flight` (default 1,4,16): `--rounds`
    rounds of `--groups` groups of G completions of arithmetic prompts, K groups per `generate_groups`
    call as a worker with maxGroupsInFlight K makes them (same prompts and seeds for every K and both
    engines); completion tokens / wall time of the calls, median over rounds (TOPLOC proof building
    is not included: it is the same for both engines and every K). `inflight_speedup`: the best K's
    tokens/s / K=1's (goals on CPU: vLLM >= 2, torch >= 1.5);
  - swap, `--swaps` times (versions 1, 0, 1, ...): the version is "announced" (t0), downloaded
    through the relay with hash and signature checks into a fresh directory (download), loaded in
    place (load), and a 1-token group is generated with it (first token); the relay already holds
    both versions (fetched once before any engine runs), so download is the relay -> worker leg
    that every swap pays. Medians over the swaps; the goal is swap / (download + load) <= 1.2.
  - multi-turn (`--turns N`, default 4; 1 skips it): the same groups at the largest K as episodes of N model
    turns of max-tokens / N tokens each (rlfleet/engines/episodes.py), an environment answering every turn with
    `=123=` (5 tokens, `Relay`); the model's tokens / wall time of the calls, median over rounds, beside the
    single-turn figure at that K (`turns_ratio`: multi / single; the goal is >= 0.7). The random policy rarely
    samples EOS, so nearly every turn runs to its budget and both modes draw about as many model tokens.
    `turns_cached`: the share of the later turns' prompt tokens vLLM read from its prefix cache (each later turn
    reads its transcript's whole KV blocks, `--block-size` tokens each: spec.vllm.blockSize, empty for vLLM's
    default, 128 on CPU), the rest computed again; the torch engine prefills every turn whole.
Usage: .venv/bin/python benchmarks/rollout.py [--hidden 256 --layers 4 --groups 16 --group-size 8
       --max-tokens 64 --rounds 3 --in-flight 1,4,16 --turns 4 --swaps 5 --threads 0 --engines torch,vllm
       --block-size N --json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import _paths  # noqa: F401  (the checkout's rlfleet and tests, without PYTHONPATH)
import torch

from rlfleet.config import SamplingSpec, VLLMSpec
from rlfleet.engines import make_engine
from rlfleet.engines.base import GroupRequest
from rlfleet.engines.episodes import generate_episodes
from rlfleet.models.builtin import build_tokenizer
from rlfleet.services.shardcast import origin, relay
from rlfleet.services.shardcast.client import FetchSettings, fetch_version
from rlfleet.tasks import Problem, TaskSource
from rlfleet.tasks.arithmetic import ArithmeticTask
from rlfleet.tasks.turns import drawn_tokens, later_turn_prompt_tokens
from rlfleet.versions.checkpoint import publish_version, save_model_dir
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key
from rlfleet.versions.store import open_store
from rlfleet.wire.streams import SamplingParams
from tests.support import serving

RUN = "bench"


def random_policy(dest: Path, hidden: int, layers: int, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    heads = max(1, hidden // 64)  # head size 64: one that vLLM's CPU attention supports
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    save_model_dir(Qwen2ForCausalLM(config), tok, dest)
    return dest


def prompts(tokenizer, n: int) -> list[list[int]]:
    task = ArithmeticTask(seed=0)
    return [tokenizer(task.problem(f"arith-0-{i}").prompt)["input_ids"] for i in range(n)]


class Relay(TaskSource):
    """An environment that answers every model turn with `=123=` (the multi-turn measurement's)."""

    multi_turn = True

    def problem(self, task_id: str) -> Problem:
        return ArithmeticTask(seed=0).problem(task_id)

    def sample_id(self, rng) -> str:
        return "arith-0-0"

    def reward(self, problem: Problem, completion: str) -> float:
        return 0.0

    def respond(self, problem: Problem, turns: list[str]) -> str:
        return "=123="


def multi_turn_rate(engine, requests: list[GroupRequest], args) -> tuple[float, float | None]:
    """The model's tokens/s of `requests` sampled as episodes of `args.turns` turns, K groups a call (median round),
    and the share of the later turns' prompt tokens read from the prefix cache (None: the engine has none)."""
    sampling = SamplingSpec(max_tokens=args.max_tokens + 8 * args.turns, max_turns=args.turns,
                            max_tokens_per_turn=args.max_tokens // args.turns)  # fmt: skip
    task, k = Relay(), max(args.in_flight)
    problems = [task.problem(f"arith-0-{i}") for i in range(len(requests))]
    episodes = [GroupRequest(r.prompt_ids, replace(r.params, max_tokens=sampling.max_tokens), r.n) for r in requests]
    rates, later_prompts, cached_before = [], 0, getattr(engine, "prompt_tokens_cached", None)
    for _ in range(args.rounds):
        n, t0 = 0, time.monotonic()
        for at in range(0, len(episodes), k):
            made, _ = generate_episodes(engine, task, episodes[at : at + k], problems[at : at + k], sampling)
            n += sum(drawn_tokens(g.spans, len(g.completion_ids)) for gens in made if gens for g in gens)
            later_prompts += sum(
                later_turn_prompt_tokens(len(r.prompt_ids), g.spans)
                for r, gens in zip(episodes[at:], made)
                if gens
                for g in gens
            )
        rates.append(n / (time.monotonic() - t0))
    if cached_before is None:
        return statistics.median(rates), None
    return statistics.median(rates), (engine.prompt_tokens_cached - cached_before) / max(later_prompts, 1)


def bench_engine(kind: str, args, relay_url: str, work: Path, public_key) -> dict:
    t0 = time.monotonic()
    v0 = fetch_version(FetchSettings.over([relay_url], RUN, public_key=public_key), 0, work / kind)
    engine = make_engine(kind, v0, 0, settings=VLLMSpec(block_size=args.block_size))
    start_s = time.monotonic() - t0
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_tokens, seed=1000 + i)
        for i in range(args.groups)
    ]
    rows = prompts(engine.tokenizer, args.groups)
    requests = [GroupRequest(prompt, p, args.group_size) for prompt, p in zip(rows, params)]
    engine.generate_groups(requests[: max(args.in_flight)])  # warm-up, the largest batch
    in_flight = {}
    tokens, gen_s = 0, 0.0
    for k in args.in_flight:
        rates = []
        for _ in range(args.rounds):  # the median round damps other processes' load on a shared machine
            n, t0 = 0, time.monotonic()
            for at in range(0, len(requests), k):  # K groups per call, as a worker with maxGroupsInFlight K
                n += sum(len(g.completion_ids) for gens in engine.generate_groups(requests[at : at + k]) for g in gens)
            elapsed = time.monotonic() - t0
            rates.append(n / elapsed)
            tokens, gen_s = tokens + n, gen_s + elapsed
        in_flight[k] = {"tok_s": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates)}
    one = in_flight[min(args.in_flight)]
    turns, turns_cached = multi_turn_rate(engine, requests, args) if args.turns > 1 else (None, None)

    swaps = []
    for i in range(args.swaps):  # versions 1, 0, 1, ... each downloaded afresh, as every swap pays it
        version = 1 - i % 2
        announced = time.monotonic()
        path = fetch_version(
            FetchSettings.over([relay_url], RUN, public_key=public_key), version, work / kind / f"swap{i}"
        )
        downloaded = time.monotonic()
        engine.load_weights(path, 10 + i)
        loaded = time.monotonic()
        first = engine.generate(rows[i % len(rows)], SamplingParams(1.0, 1.0, 0, 1, seed=7 + i), args.group_size)
        first_token = time.monotonic()
        assert all(g.version == 10 + i for g in first)
        swaps.append((downloaded - announced, loaded - downloaded, first_token - loaded))
    engine.close()
    download_s, load_s, first_s = (statistics.median(s[j] for s in swaps) for j in range(3))
    return {
        "engine": kind,
        "start_s": start_s,
        "tokens": tokens,
        "gen_s": gen_s,
        "tok_s": one["tok_s"],  # the fewest groups in flight (1: one group per call)
        "tok_s_min": one["tok_s_min"],
        "tok_s_max": one["tok_s_max"],
        "in_flight": in_flight,
        "inflight_speedup": max(r["tok_s"] for r in in_flight.values()) / one["tok_s"],
        "turns_tok_s": turns,
        "turns_ratio": turns / in_flight[max(args.in_flight)]["tok_s"] if turns else None,
        "turns_cached": turns_cached,
        "download_s": download_s,
        "load_s": load_s,
        "first_s": first_s,
        "swap_s": download_s + load_s + first_s,
        "swap_ratio": statistics.median((d + lo + f) / (d + lo) for d, lo, f in swaps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="torch,vllm")
    ap.add_argument(
        "--in-flight",
        default="1,4,16",
        type=lambda v: sorted({int(k) for k in v.split(",")}),
        help="groups per engine call to measure (a worker's maxGroupsInFlight); the speedup is over the smallest",
    )
    ap.add_argument("--turns", type=int, default=4, help="model turns of the multi-turn measurement (1: skip it)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--block-size", type=int, help="vLLM's KV-cache block size (spec.vllm.blockSize; empty: vLLM's)")
    ap.add_argument("--swaps", type=int, default=5, help="weight swaps per engine (figures are medians)")
    ap.add_argument("--json", type=Path, help="write the figures to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = args.engines.split(",")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-rollout-") as tmp:
        work = Path(tmp)
        key_file, public = generate_keypair(work / "keys")
        signer = make_signer(load_private_key(key_file))
        store = open_store(f"file://{work}/store")
        for v in (0, 1):
            publish_version(
                store, RUN, v, random_policy(work / f"src-v{v}", args.hidden, args.layers, seed=v), signer=signer
            )
        size = sum(f.stat().st_size for f in (work / "src-v1").iterdir())
        public_key = parse_public_key(public)
        with (
            serving(origin.make_app(store, RUN)) as origin_url,
            serving(relay.make_app(relay.RelaySettings(origin_url, work / "relay", RUN, 3))) as relay_url,
        ):
            for v in (0, 1):  # the relay holds both versions before any engine is measured
                fetch_version(FetchSettings.over([relay_url], RUN, public_key=public_key), v, work / "prefetch")
            results = [bench_engine(kind, args, relay_url, work, public_key) for kind in engines]
    load.append(os.getloadavg()[0])
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, fp32, {size / 2**20:.1f} MiB checkpoint; "
        f"{args.groups} groups x G={args.group_size}, <= {args.max_tokens} tokens, temperature 1, "
        f"in flight {','.join(map(str, args.in_flight))}; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load average {load[0]:.2f} -> {load[1]:.2f}"
    )
    print(
        f"{'engine':<7} {'start s':>8} {'tokens':>7} {'gen s':>7} {'tokens/s':>9} {'min-max':>13} {'x torch':>8} | "
        f"{'download s':>10} {'load s':>7} {'1st tok s':>9} {'swap s':>7} {'swap/(dl+load)':>14}"
    )
    base = next((r["tok_s"] for r in results if r["engine"] == "torch"), None)
    for r in results:
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        spread = f"{r['tok_s_min']:.0f}-{r['tok_s_max']:.0f}"
        print(
            f"{r['engine']:<7} {r['start_s']:>8.1f} {r['tokens']:>7} {r['gen_s']:>7.2f} {r['tok_s']:>9.1f} "
            f"{spread:>13} {ratio:>8} | "
            f"{r['download_s']:>10.3f} {r['load_s']:>7.3f} {r['first_s']:>9.3f} {r['swap_s']:>7.3f} "
            f"{r['swap_ratio']:>14.2f}"
        )
    print(
        "tokens/s: median of --rounds rounds (min-max beside it) with the fewest groups in flight; "
        "start s: download v0 + engine start"
    )
    print(
        "swap s = version announced -> first token from it = download (relay -> worker, hashes, signature) + load + "
        f"1st tok; medians of {args.swaps} swaps, swap/(dl+load) the median of the swaps' ratios (goal <= 1.2)"
    )
    print()
    heads = " ".join(f"{f'{k} in flight':>14}" for k in args.in_flight)
    print(f"{'engine':<7} {heads} {'inflight_speedup':>17}   (tokens/s, median of --rounds; speedup: best / fewest)")
    for r in results:
        cells = " ".join(f"{r['in_flight'][k]['tok_s']:>14.1f}" for k in args.in_flight)
        print(f"{r['engine']:<7} {cells} {r['inflight_speedup']:>16.2f}x")
    print("goals on CPU: vllm >= 2x, torch >= 1.5x (issue 26)")
    if args.turns > 1:
        k = max(args.in_flight)
        print(f"\n{'engine':<7} {'single-turn':>12} {f'{args.turns} turns':>12} {'ratio':>7} {'cached':>7}   (model "
              f"tokens/s at {k} in flight, {args.max_tokens} model tokens a sample; goal >= 0.7)")  # fmt: skip
        for r in results:
            cached = "-" if r["turns_cached"] is None else f"{r['turns_cached']:.2f}"
            print(f"{r['engine']:<7} {r['in_flight'][k]['tok_s']:>12.1f} {r['turns_tok_s']:>12.1f} "
                  f"{r['turns_ratio']:>7.2f} {cached:>7}")  # fmt: skip
        print("cached: the share of later turns' prompt tokens read from vLLM's prefix cache")
    if args.json:
        args.json.write_text(json.dumps({"load_average": load, "engines": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
