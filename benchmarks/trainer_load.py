"""Peak memory of each trainer rank while it loads its policy under FSDP, at a real model's shape cut in depth (#41).

The model: Qwen2.5-7B-Instruct's or QwQ-32B's configuration (the config.json fields below; untied heads, vocabulary
152,064), `--layers` decoder layers deep, random bf16 weights in one safetensors file, as a published checkpoint is.
For each world size N in `--ranks`, N gloo ranks on this machine's CPU run the trainer's load (main.py
`_load_policy`) in fp32, the load dtype of a bf16 run (fp32 master weights, precision.py):
- sharded: `load_sharded_policy` (sharding.py), the trainer's path under FSDP without LoRA: the model built on the meta
  device, each rank's dim-0 chunks allocated and read from the file alone;
- whole (`--whole`): `load_policy`, then `shard_policy`, the path before it: every rank loads the whole model first.
Each rank reports its peak resident set (VmHWM) less its resident set just before the load (torch and
transformers imported, the process group joined), and the load's seconds. The goal (issue #41): a rank's peak at
most 1.25 x (the weights in the load dtype / N) + 2 GiB (`bound`); `peak_over_bound` <= 1. The file's pages a rank
reads are in its resident set too (a memory-mapped read): its own rows, in bf16, half the bytes of its fp32 chunk.

Extrapolation to the full depth: every decoder layer is cut into N chunks like the embedding, so a rank's load peak
is its share of the weights plus a constant (the libraries, one tensor's cast); the full-depth prediction is
`predicted_full = measured - weights_cut / N + weights_full / N` (fp32 bytes), printed with the bound at full depth.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/trainer_load.py --json trainer_load.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/trainer_load.py --shape qwq-32b --layers 1 --ranks 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

GIB = 2**30
SHAPES = {  # published config.json fields (random weights; nothing is downloaded)
    "qwen2.5-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-06},
    "qwq-32b": {"hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
                "num_key_value_heads": 8, "vocab_size": 152064, "rms_norm_eps": 1e-05},
}  # fmt: skip


def config(shape: str, layers: int):
    from transformers import Qwen2Config

    fields = dict(SHAPES[shape], num_hidden_layers=layers)
    return Qwen2Config(**fields, tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=1e6)


def parameters(shape: str, layers: int) -> int:
    """Parameters of the shape at `layers` deep (Qwen2: biases on q, k, v; two norms a layer, one at the end)."""
    s = SHAPES[shape]
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    layer = h * h + 2 * h * kv + h * h + (h + 2 * kv) + 3 * h * i + 2 * h
    return 2 * v * h + layers * layer + h


def write_model(shape: str, layers: int, out: Path) -> None:
    """A checkpoint of the shape with random bf16 weights in one safetensors file (checks `parameters` on the way)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rlfleet.models.builtin import build_tokenizer

    cfg = config(shape, layers)
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16) for name, p in meta.named_parameters()
    }
    assert sum(t.numel() for t in tensors.values()) == parameters(shape, layers), "parameters() counts the model"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    build_tokenizer().save_pretrained(out)


def memory_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak) of this process. Not ru_maxrss: on Linux a spawned child starts from
    the parent's peak at the fork, here the parent that wrote the checkpoint."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def rank_main(rank: int, world: int, port: int, model_dir: str, mode: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlfleet.models.policy import load_policy
    from rlfleet.services.trainer.distributed import init_distributed
    from rlfleet.services.trainer.sharding import load_sharded_policy, shard_policy

    init_distributed()
    before = memory_bytes("VmRSS")
    t0 = time.monotonic()
    if mode == "sharded":
        model, _ = load_sharded_policy(model_dir, "float32", world, torch.device("cpu"))
    else:
        model, _ = load_policy(model_dir, "float32")
        shard_policy(model, world)
    seconds = time.monotonic() - t0
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak = memory_bytes("VmHWM")
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"peak": peak - before, "seconds": seconds, "held": held, "before": before})
    )
    dist.barrier()
    dist.destroy_process_group()


def measure(model_dir: Path, world: int, mode: str) -> list[dict]:
    import torch.multiprocessing as mp

    from rlfleet.wire.ports import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world, free_port(), str(model_dir), mode, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the cut model")
    parser.add_argument("--ranks", default="2,4", help="world sizes to measure")
    parser.add_argument("--whole", action="store_true", help="also the whole-model load (needs N x the weights)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    full_layers = SHAPES[args.shape]["num_hidden_layers"]
    cut_bytes = 4 * parameters(args.shape, args.layers)  # fp32, the load dtype
    full_bytes = 4 * parameters(args.shape, full_layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.monotonic()
        write_model(args.shape, args.layers, model_dir)
        print(f"{args.shape} at {args.layers} of {full_layers} layers: {cut_bytes / GIB:.2f} GiB in fp32 "
              f"(written in bf16 in {time.monotonic() - t0:.0f} s); full depth {full_bytes / GIB:.1f} GiB")  # fmt: skip
        for world in [int(n) for n in args.ranks.split(",")]:
            for mode in ["sharded"] + (["whole"] if args.whole else []):
                ranks = measure(model_dir, world, mode)
                peak = max(r["peak"] for r in ranks)
                bound = 1.25 * cut_bytes / world + 2 * GIB
                predicted = peak - cut_bytes / world + full_bytes / world
                rows.append(
                    {
                        "shape": args.shape, "layers": args.layers, "ranks": world, "mode": mode,
                        "weights_fp32_gib": cut_bytes / GIB, "peak_gib": peak / GIB, "bound_gib": bound / GIB,
                        "peak_over_bound": peak / bound, "held_gib": max(r["held"] for r in ranks) / GIB,
                        "seconds": max(r["seconds"] for r in ranks),
                        "predicted_full_gib": predicted / GIB,
                        "bound_full_gib": (1.25 * full_bytes / world + 2 * GIB) / GIB,
                    }
                )  # fmt: skip
    head = f"{'N':>3} {'mode':>8} {'held':>8} {'peak':>8} {'bound':>8} {'ratio':>6} {'s':>6}"
    print(f"{head} {'full pred':>10} {'full bd':>8}")
    for r in rows:
        print(
            f"{r['ranks']:>3} {r['mode']:>8} {r['held_gib']:>7.2f}G {r['peak_gib']:>7.2f}G {r['bound_gib']:>7.2f}G "
            f"{r['peak_over_bound']:>6.2f} {r['seconds']:>6.1f} {r['predicted_full_gib']:>9.1f}G "
            f"{r['bound_full_gib']:>7.1f}G"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
