"""The verifier's seed replay of one long group: peak memory and seconds, all rows at once against a chunk of rows at
a time (rlfleet/services/toploc/replay.py `GroupReplay`, as checks.py feeds it from the lm_head).

"whole" is the replay as it was before the chunks: the lm_head over every completion row of the group, then one
replay pass over the (rows, vocabulary) logits. "chunks" is the gate's path now: the lm_head and the replay
`logits_chunk_rows(vocabulary)` rows at a time. Both replay the same seeded draws and must give the same score
(checked: a mismatch is an error, not a row of the table).

Each measurement runs in a fresh process, which reports the growth of its peak resident memory (ru_maxrss) over what
it held before the replay (the hidden rows, the lm_head and the group's tokens: what the verifier holds anyway), so
one measurement's allocations never hide in another's high-water mark. Model shape: SmolLM2-135M's width and
vocabulary by default (576, 49,152); Qwen2.5-7B's is --hidden 3584 --vocab 152064. Random weights: the replay's
cost does not depend on what the weights say, only on the shapes.

Usage: .venv/bin/python benchmarks/replay_memory.py [--samples 16] [--tokens 512 2048] [--modes chunks whole]
[--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace

import _paths  # noqa: F401  (the repository root on the path)
import torch

from rlfleet.models.sampling import draw, keep_mask, sample_seed, sample_uniforms
from rlfleet.services.toploc.replay import GroupReplay, logits_chunk_rows

TOP_P, TOP_K, TOLERANCE = 0.95, 50, 1e-3  # a filtered draw: the replay's keep masks at each slack run too
SEED = 11


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def model(hidden: int, vocab: int) -> torch.nn.Linear:
    torch.manual_seed(0)  # the same head in every process
    return torch.nn.Linear(hidden, vocab, bias=False)


def hidden_rows(samples: int, tokens: int, hidden: int) -> torch.Tensor:
    return torch.randn(samples * tokens, hidden, generator=torch.Generator().manual_seed(1))


def draw_group(samples: int, tokens: int, hidden: int, vocab: int) -> list[list[int]]:
    """Each sample's tokens as its seed draws them from the head's logits (a chunk of rows at a time)."""
    head, rows, step = model(hidden, vocab), hidden_rows(samples, tokens, hidden), logits_chunk_rows(vocab)
    drawn: list[list[int]] = []
    with torch.inference_mode():
        for i in range(samples):
            u = torch.from_numpy(sample_uniforms(sample_seed(SEED, i), tokens))
            drawn.append([])
            for start in range(0, tokens, step):
                stop = min(start + step, tokens)
                logits = head(rows[i * tokens + start : i * tokens + stop])
                drawn[-1] += draw(logits, keep_mask(logits, TOP_P, TOP_K), u[start:stop]).tolist()
    return drawn


def measure(mode: str, tokens: list[list[int]], hidden: int, vocab: int) -> dict:
    """In this process: replay the group whose samples hold `tokens`; peak memory growth over what was held before."""
    samples, length = len(tokens), len(tokens[0])
    head, rows, step = model(hidden, vocab), hidden_rows(samples, length, hidden), logits_chunk_rows(vocab)
    sp = SimpleNamespace(seed=SEED, top_p=TOP_P, top_k=TOP_K)
    group = SimpleNamespace(sampling=sp, samples=[SimpleNamespace(completion_ids=t) for t in tokens])
    before = peak_bytes()
    started = time.perf_counter()
    replay = GroupReplay(group, TOLERANCE)
    with torch.inference_mode():
        if mode == "whole":
            replay.add(0, head(rows).float())
        else:
            for start in range(0, len(rows), step):
                replay.add(start, head(rows[start : start + step]).float())
    score = replay.score()
    return {
        "mode": mode,
        "samples": samples,
        "tokens": length,
        "vocab": vocab,
        "hidden": hidden,
        "chunk_rows": step if mode == "chunks" else len(rows),
        "logits_gib": len(rows) * vocab * 4 / 2**30,
        "peak_growth_gib": (peak_bytes() - before) / 2**30,
        "seconds": time.perf_counter() - started,
        "positions": score.positions,
        "mismatches": score.mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--modes", nargs="+", choices=["chunks", "whole"], default=["chunks", "whole"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each measurement")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a measurement's own process (mode); tokens on stdin
    parser.add_argument("--draw", type=int, help=argparse.SUPPRESS)  # a process drawing a group of this length
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one, json.load(sys.stdin), args.hidden, args.vocab)))
        return
    if args.draw:
        print(json.dumps(draw_group(args.samples, args.draw, args.hidden, args.vocab)))
        return
    # Each in a process of its own, this one staying small: a child's ru_maxrss starts from its parent's resident
    # memory at the fork (Linux carries it over the exec), so a parent that had drawn the group would raise the
    # "before" of every measurement.
    shape = ["--samples", str(args.samples), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    shape += ["--threads", str(args.threads)]
    results = []
    for tokens in args.tokens:
        drawn = subprocess.run(
            [sys.executable, __file__, "--draw", str(tokens), *shape], capture_output=True, text=True
        )
        if drawn.returncode != 0:
            raise SystemExit(drawn.stderr)
        for mode in args.modes:
            argv = [sys.executable, __file__, "--one", mode, *shape]
            out = subprocess.run(argv, input=drawn.stdout, capture_output=True, text=True)
            if out.returncode != 0:  # e.g. killed for memory: reported, the other measurements go on
                results.append({"mode": mode, "samples": args.samples, "tokens": tokens, "error": out.stderr[-300:]})
                continue
            result = json.loads(out.stdout)
            if result["mismatches"]:
                raise SystemExit(f"honest draws replayed with {result['mismatches']} mismatches: {result}")
            results.append(result)
    print(f"{'rows':>12} {'mode':>7} {'chunk rows':>10} {'logits GiB':>10} {'peak +GiB':>9} {'x logits':>8} {'s':>7}")
    for r in results:
        rows = f"{r['samples']} x {r['tokens']}"
        if "error" in r:
            print(f"{rows:>12} {r['mode']:>7} failed: {r['error'].strip().splitlines()[-1:]}")
            continue
        ratio = r["peak_growth_gib"] / r["logits_gib"]
        print(f"{rows:>12} {r['mode']:>7} {r['chunk_rows']:>10} {r['logits_gib']:>10.2f} {r['peak_growth_gib']:>9.2f} "
              f"{ratio:>8.2f} {r['seconds']:>7.1f}")  # fmt: skip
    chunks = {r["tokens"]: r["peak_growth_gib"] for r in results if r.get("mode") == "chunks" and "error" not in r}
    if len(chunks) > 1:
        lo, hi = min(chunks), max(chunks)
        print(f"chunks: peak at {hi} tokens / at {lo} tokens = {chunks[hi] / chunks[lo]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
