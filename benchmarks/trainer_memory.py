"""Peak memory and tokens/s of one GRPO optimizer step at real widths, lever by lever.

The model has Qwen2.5-0.5B's widths and vocabulary (hidden 896, intermediate 4864, 14 heads, 2 KV
heads, vocabulary 151,936, tied embeddings), built in code at reduced depth (`--layers`, default 2:
about 166 M parameters, 82 % of them the embedding). One step is `grpo_update` (update.py) with
AdamW on synthetic groups: rows of `seq` tokens (a 64-token prompt and the rest completion), fp32.

Series:
- batches of 1x, 4x and 16x the micro-batch (`--multiples`) at the first sequence length, every
  lever on: the peak should not grow with the batch (`peak_ratio_16x` = peak at 16x / peak at 1x);
- sequence lengths 512, 1,024, 2,048 (`--seqs`) at 1x, every lever on;
- the levers one after another at 2x the micro-batch of the first length (`--levers-at`): none (the whole batch in
  one forward, its logits in one piece), + micro-batches, + chunked logprobs (1,024 positions), +
  activation checkpointing.
A micro-batch is `--micro-rows` rows (default 1; `microBatchTokens` = rows x seq), so 16x is 16 rows:
the default sizes keep the whole benchmark to about 10 minutes on 2 CPU cores; on a GPU use e.g.
`--micro-rows 4`. A batch of one row has advantage 0 (one completion per group), which changes no
memory or compute (the graph and its backward are the same).

Memory. CUDA: `torch.cuda.max_memory_allocated()` over the step (reset before it), parameters
included. CPU: each configuration runs in a subprocess of its own and reports its peak resident set
(`ru_maxrss`) minus the resident set at the subprocess's start, before torch is imported: everything
the step held at its worst, model state included, as the operating system saw it, plus torch's and
transformers' own code and data (about 0.4 GiB here). glibc returns large freed blocks to the system,
so the figure follows live tensors; with the libraries and allocator slack it is an upper bound of
live bytes. On CPU AdamW runs per parameter (torch's default off CUDA), and its temporaries for the
embedding (136 M of the parameters) come on top of the model state at the step's end.
Beside it: the model-state bound, params + grads + AdamW's two moments = 16 bytes per fp32
parameter, and an estimate of one micro-batch's activations with the levers on (T tokens, H, I, L
layers, V, C chunk positions, 4-byte floats): the checkpointed layer inputs L*T*H, one layer's
recomputed activations T*(12H + 3I), the final hidden states and their gradient 3*T*H, and the
head's chunk, logits, log-softmax and their gradients, 4*C*V. `peak_over_bound` is the measured
peak / (model state + that estimate); the goal is <= 1.5.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/trainer_memory.py --json trainer_memory.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/trainer_memory.py --micro-rows 4 --json gpu.json   # a GPU
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import _paths  # noqa: F401  (puts the repository root on sys.path)

QWEN = {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2, "vocab": 151_936}
PROMPT = 64
CHUNK = 1024
LEVERS = {  # name -> (micro-batched, chunked logprobs, activation checkpointing)
    "none": (False, False, False),
    "+micro-batches": (True, False, False),
    "+chunked logprobs": (True, True, False),
    "+checkpointing": (True, True, True),
}


def build(layers: int, device):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=QWEN["vocab"],
        hidden_size=QWEN["hidden"],
        intermediate_size=QWEN["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=QWEN["heads"],
        num_key_value_heads=QWEN["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def groups(rows: int, seq: int):
    import torch

    from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams

    gen = torch.Generator().manual_seed(0)
    n = seq - PROMPT
    out = []
    for g in range(0, rows, 2):  # groups of two completions (one when a single row is asked)
        size = min(2, rows - g)
        prompt = torch.randint(3, QWEN["vocab"], (PROMPT,), generator=gen).tolist()
        samples = [
            Sample(torch.randint(3, QWEN["vocab"], (n,), generator=gen).tolist(), [-1.0] * n, [], float(i))
            for i in range(size)
        ]
        out.append(RolloutGroup(f"g{g}", "w", 0, prompt, SamplingParams(1.0, 1.0, 0, n, 0), samples))
    return out


def child(cfg: dict) -> dict:
    """One configuration, measured in this process."""
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    import torch

    from rlfleet.config import TrainerSpec
    from rlfleet.models.device import choose_device
    from rlfleet.models.policy import Prefill
    from rlfleet.services.trainer.precision import prepare_for_training
    from rlfleet.services.trainer.update import UpdateSettings, grpo_update

    device = choose_device()
    micro, chunked, checkpointing = LEVERS[cfg["lever"]]
    rows, seq = cfg["rows"], cfg["seq"]
    spec = TrainerSpec(
        micro_batch_tokens=cfg["micro_rows"] * seq if micro else 16_777_216,
        logprob_chunk=CHUNK if chunked else 1_048_576,  # one chunk: the micro-batch's logits in one piece
        activation_checkpointing=checkpointing,
        learning_rate=1e-6,
    )
    model = build(cfg["layers"], device)
    prepare_for_training(model, spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate)
    params = sum(p.numel() for p in model.parameters())
    batch = groups(rows, seq)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    grpo_update(Prefill(model), optimizer, batch, UpdateSettings.of(spec, 1.0, 0))
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start
    seconds = time.perf_counter() - t0
    return {**cfg, "device": str(device), "params": params, "peak_bytes": peak, "seconds": seconds}


def bounds(r: dict, chunked: bool, checkpointing: bool) -> dict:
    """The model-state bound and the one-micro-batch activation estimate of the module docstring."""
    h, i, v = QWEN["hidden"], QWEN["intermediate"], QWEN["vocab"]
    t = r["micro_rows"] * r["seq"] if LEVERS[r["lever"]][0] else r["rows"] * r["seq"]
    layers = r["layers"]
    per_layer = t * (12 * h + 3 * i)
    acts = (layers * t * h + per_layer if checkpointing else layers * per_layer) + 3 * t * h
    acts += 4 * min(CHUNK if chunked else t, t) * v
    state = 16 * r["params"]
    return {"model_state_bytes": state, "activation_estimate_bytes": 4 * acts, "bound_bytes": state + 4 * acts}


def measure(cfg: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True)
    if out.returncode != 0:
        return {**cfg, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    _, chunked, checkpointing = LEVERS[cfg["lever"]]
    r.update(bounds(r, chunked, checkpointing))
    r["tokens_per_s"] = r["rows"] * r["seq"] / r["seconds"]
    r["peak_over_bound"] = r["peak_bytes"] / r["bound_bytes"]
    return r


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seqs", default="512,1024,2048")
    parser.add_argument("--multiples", default="1,4,16")
    parser.add_argument("--micro-rows", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--levers-at", type=int, default=2, help="batch (x micro-batch) of the lever series")
    parser.add_argument("--series", default="batch,seq,lever", help="which series to run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    seqs = [int(s) for s in args.seqs.split(",")]
    multiples = [int(m) for m in args.multiples.split(",")]
    base = {"layers": args.layers, "micro_rows": args.micro_rows}
    plan = [
        ("batch", {**base, "lever": "+checkpointing", "seq": seqs[0], "rows": m * args.micro_rows}) for m in multiples
    ]
    plan += [("seq", {**base, "lever": "+checkpointing", "seq": s, "rows": args.micro_rows}) for s in seqs[1:]]
    plan += [("lever", {**base, "lever": k, "seq": seqs[0], "rows": args.levers_at * args.micro_rows}) for k in LEVERS]
    plan = [(series, cfg) for series, cfg in plan if series in args.series.split(",")]
    results = []
    print(
        f"{'series':<7}{'lever':<19}{'seq':>6}{'rows':>6}{'peak GiB':>10}{'state GiB':>10}{'bound GiB':>10}"
        f"{'peak/bound':>11}{'tok/s':>8}"
    )
    for series, cfg in plan:
        r = {"series": series, **measure(cfg)}
        results.append(r)
        if "error" in r:
            print(f"{series:<7}{cfg['lever']:<19}{cfg['seq']:>6}{cfg['rows']:>6}  failed: {r['error']}")
            continue
        print(
            f"{series:<7}{r['lever']:<19}{r['seq']:>6}{r['rows']:>6}{gib(r['peak_bytes']):>10}"
            f"{gib(r['model_state_bytes']):>10}{gib(r['bound_bytes']):>10}{r['peak_over_bound']:>11.2f}"
            f"{r['tokens_per_s']:>8.0f}",
            flush=True,
        )
    batch = {r["rows"] // args.micro_rows: r for r in results if r["series"] == "batch" and "error" not in r}
    summary = {
        "device": results[0].get("device") if results else None,
        "peak_ratio_16x": batch[16]["peak_bytes"] / batch[1]["peak_bytes"] if 16 in batch and 1 in batch else None,
        "peak_over_bound_max": max(
            (r["peak_over_bound"] for r in results if r["lever"] == "+checkpointing" and "error" not in r), default=None
        ),
        "results": results,
    }
    print(
        f"\npeak_ratio_16x {summary['peak_ratio_16x']}, peak / bound (all levers) at most "
        f"{summary['peak_over_bound_max']}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
