"""Delta benchmark: bytes on the wire per policy version, delta ÷ full, on real consecutive versions.

    PYTHONPATH=. .venv/bin/python benchmarks/delta.py [--steps 4] [--series builtin large builtin-lora large-lora]
                                                      [--dtypes float32 bfloat16] [--lrs 1e-3 1e-4 1e-6]
                                                      [--json PATH] [--workdir DIR]

Series: a model x a dtype x a learning rate, each `--steps` real GRPO steps from one starting policy:
  builtin   `builtin://tiny-arithmetic` from examples/arithmetic/rlrun.yaml (warm-started, cached), that
            file's GRPO settings (batch 16 groups of 8, its learning rate 1e-3 unless --lrs says more);
            rollouts sampled by the torch engine from the current version, rewards from the task's verifier
  large     the builtin architecture (Qwen2, the same character tokenizer) widened to hidden 1024 and
            deep enough that the checkpoint is >= 256 MiB at that dtype; 4 groups of 4 a step. It is not
            warm-started (hours on CPU), so it solves nothing and the task's rewards are all 0; its
            rewards are random 0/1 instead: Adam's step (about lr per weight) does not depend on what a
            reward means, which is what the bytes of a delta depend on
  *-lora    the same model trained with trainer.lora (LORA below: rank 8 on every linear layer, PEFT through
            the trainer's rlfleet/services/trainer/lora.py, its learning rate x LORA_LR): each version is the
            adapter, published whole with its adapter section (an adapter is never a delta). Its ratio is the
            wire bytes of a version ÷ the bytes of a whole version of that model (the base checkpoint), what
            a LoRA run sends instead of a whole version or a delta. The engine samples base + adapter
            (rlfleet/models/adapter.py Merger); no entropy bound (nothing is a delta).
Each step is `grpo_update` (the trainer's) with the file's TrainerSpec, then save_model_dir (the
trainer's publish path). The versions are published twice through the trainer's PolicyPublisher into
file stores: every version as a delta (fullEvery, maxRatio, maxChainRatio out of the way: the codec's
ratio), and with the default spec.shardcast.deltas (what a run sends). The first store is then served
by a real origin and relay on loopback and one client follows the versions with fetch_policy, holding
v-1 each time: the wire bytes are what it received (shards + manifest), with its rebuild time.
Reported per series: full bytes, wire bytes per version and their ratio (delta_bytes_ratio = mean over
versions 1..N), encode and rebuild seconds; under the default spec.shardcast.deltas, what a worker
holding the previous version downloads (the delta, also at versions published whole and as a delta)
and what a relay pulls (whole versions and their deltas included), both ÷ full; and the entropy
bound: the zeroth-order entropy of the per-element change in units of the last place (bit length
histogram + the uniform bits below the top one) over the 2- and 4-byte tensors, the fewest bits a
per-element lossless code of them needs; where a target is out of reach, this says why.
The WAN benchmark (benchmarks/broadcast.py --wan --delta, benchmarks/wan_delta.py) reuses `make_series`,
`publish_series` and `delta_client` (its client role: it follows the versions, holding v-1 each time).
This is a script, not a test (docs/code.md, "Benchmarks are scripts, not tests").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _paths import ROOT

RUN = "delta-bench"
EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
LARGE = {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 16}
MIN_LARGE_BYTES = 256 << 20
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "alpha": 16.0, "target_modules": LINEAR}
LORA_LR = 10.0  # adapters take a larger learning rate than full fine-tuning


def large_model(dest: Path, dtype: str, seed: int = 0) -> Path:
    """The builtin architecture widened, deep enough for >= 256 MiB of weights at `dtype`; random init."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlfleet.models.builtin import build_tokenizer
    from rlfleet.versions.checkpoint import save_model_dir

    tokenizer = build_tokenizer()
    width = 4 if dtype == "float32" else 2
    h, i = LARGE["hidden_size"], LARGE["intermediate_size"]
    per_layer = 4 * h * h + 3 * h + 3 * h * i + 2 * h  # attention (q, k, v with bias; o), MLP, two norms
    layers = math.ceil(MIN_LARGE_BYTES / (per_layer * width))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        num_hidden_layers=layers,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **LARGE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    save_model_dir(model, tokenizer, dest)
    return dest


def make_series(kind: str, dtype: str, lr: float, steps: int, work: Path, lora: bool = False) -> list[Path]:
    """`steps` + 1 consecutive versions work/v0 .. work/v{steps} made by real GRPO steps (module docstring). With
    `lora`, each version is the adapter, and work/base links to the base model it applies to."""
    import torch

    from rlfleet.config import load_bundle
    from rlfleet.config.training import LoraSpec
    from rlfleet.engines import make_engine
    from rlfleet.models.policy import load_policy
    from rlfleet.models.sources import resolve_model_path
    from rlfleet.services.trainer.lora import attach
    from rlfleet.services.trainer.update import UpdateSettings, grpo_update
    from rlfleet.tasks import make_run_task
    from rlfleet.versions.checkpoint import save_model_dir
    from rlfleet.wire.streams import RolloutGroup, Sample, SamplingParams

    spec = load_bundle(EXAMPLE).run.spec
    trainer = spec.trainer.model_copy(update={"learning_rate": lr})
    if kind == "builtin":
        start, groups, group_size = resolve_model_path(spec.model, spec.task, seed=trainer.seed), trainer.batch_size, 8
    else:
        start, groups, group_size = large_model(work / "init", dtype), 4, 4
    model, tokenizer = load_policy(start, dtype)
    model.train()
    adapters = attach(model, LoraSpec(**LORA) if lora else None, start, str(start))
    if adapters is not None:
        lr *= LORA_LR
        work.mkdir(parents=True, exist_ok=True)
        (work / "base").symlink_to(Path(start).resolve())

    def save(dest: Path) -> None:
        if adapters is not None:
            adapters.save(model.state_dict(), dest)
        else:
            save_model_dir(model, tokenizer, dest)

    trained = adapters.parameters() if adapters is not None else model.parameters()
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=trainer.weight_decay)
    task, rng = make_run_task(spec), np.random.default_rng(0)
    paths = [work / "v0"]
    save(paths[0])
    engine = make_engine("torch", start if adapters is not None else paths[0], 0, dtype)
    s = spec.sampling
    for v in range(1, steps + 1):
        batch = []
        for g in range(groups):
            problem = task.problem(task.sample_id(rng))
            prompt = tokenizer(problem.prompt)["input_ids"]
            params = SamplingParams(s.temperature, s.top_p, s.top_k, s.max_tokens, int(rng.integers(2**31)))
            gens = engine.generate(prompt, params, group_size)
            text = [tokenizer.decode(x.completion_ids, skip_special_tokens=True) for x in gens]
            rewards = [task.score(problem, t, len(x.completion_ids)) for t, x in zip(text, gens)]
            if kind == "large":
                rewards = [float(r) for r in rng.integers(0, 2, len(gens))]
            samples = [Sample(x.completion_ids, x.logprobs, [], r, x.finish_reason) for x, r in zip(gens, rewards)]
            batch.append(RolloutGroup(problem.task_id, "bench", v - 1, prompt, params, samples, rollout_id=f"{v}-{g}"))
        grpo_update(model, optimizer, batch, UpdateSettings.of(trainer, s.temperature, tokenizer.pad_token_id))
        paths.append(work / f"v{v}")
        save(paths[-1])
        if adapters is not None:  # no manifest here to check the base by: the engine's merge itself
            engine.adapters.merger.apply(paths[-1])  # type: ignore[attr-defined]
        else:
            engine.load_weights(paths[-1], v)
    engine.close()
    return paths


def publish_series(
    paths: list[Path], store_dir: Path, deltas, signer, shard_size: int | None = None, adapter=None
) -> list[dict]:
    """Publish the versions in order through the trainer's PolicyPublisher (adapter versions when `adapter`, the
    manifest's adapter section, is given); per version its `last` record."""
    from rlfleet.versions.checkpoint import DEFAULT_SHARD_SIZE
    from rlfleet.versions.publish import PolicyPublisher
    from rlfleet.versions.store import open_store

    store = open_store(f"file://{store_dir}")
    publisher = PolicyPublisher(store, RUN, deltas, signer, shard_size or DEFAULT_SHARD_SIZE)
    records = []
    for v, path in enumerate(paths):
        copy = store_dir.parent / f".publish-{store_dir.name}-v{v}"
        shutil.copytree(path, copy)  # the publisher moves files out of what it publishes
        publisher.publish(v, copy, adapter)
        shutil.rmtree(copy, ignore_errors=True)
        records.append(dict(publisher.last))
    publisher.close()
    return records


def follow(store_dir: Path, count: int, dest: Path, public_key) -> list[dict]:
    """Serve the store through an origin and a relay on loopback; one client fetches v0 .. v{count-1}
    in order with fetch_policy; per version the bytes it received and the seconds it took."""
    from rlfleet.services.shardcast import origin, relay
    from rlfleet.services.shardcast.assemble import fetch_policy
    from rlfleet.services.shardcast.client import FetchSettings
    from rlfleet.versions.store import open_store
    from tests.support import serving

    store, rows = open_store(f"file://{store_dir}"), []
    with (
        serving(origin.make_app(store, RUN)) as origin_url,
        serving(
            relay.make_app(relay.RelaySettings(origin_url, dest / "relay", RUN, 3, public_key=public_key))
        ) as relay_url,
    ):
        for v in range(count):
            got, report = [], {}
            started = time.monotonic()
            fetch_policy(
                FetchSettings.over([relay_url], RUN, public_key=public_key, on_bytes=got.append),
                v,
                dest / "client",
                report=report,
            )
            manifest = len(store.get_bytes(f"{RUN}/policy/v{v}/manifest.json"))
            rows.append({"wire_bytes": sum(got) + manifest, "seconds": time.monotonic() - started, **report})
            if v >= 2:
                shutil.rmtree(dest / "client" / f"v{v - 2}")
    return rows


def delta_client(urls: list[str], dest: str, public_key: str, versions: list[int], timeout: float = 3600) -> None:
    """The client role of `benchmarks/broadcast.py --wan --delta` (one process per client host): for each of
    `versions` in turn it waits for that version to be announced, fetches it with fetch_policy (its delta against
    the version held here, rebuilt and checked against the signed manifest, or the whole version when it holds no
    base) and prints one JSON line: version, done (monotonic time the version was installed, verified), first
    and last byte (monotonic), bytes received and the plan (fetch_policy's report). It then drops the version
    before the one it holds. "waiting" is printed once the process is ready."""
    from rlfleet.services.shardcast.assemble import fetch_policy
    from rlfleet.services.shardcast.client import FetchSettings, wait_for_version
    from rlfleet.services.shardcast.sources import Sources
    from rlfleet.versions.signing import parse_public_key

    key, sources, dest = parse_public_key(public_key), Sources(urls), Path(dest)
    print("waiting", flush=True)
    for version in versions:
        wait_for_version(urls, RUN, version - 1, timeout=timeout)
        got = {"bytes": 0, "first": None, "last": None}

        def on_bytes(n: int) -> None:
            now = time.monotonic()
            got["first"] = got["first"] or now
            got["bytes"], got["last"] = got["bytes"] + n, now

        report: dict = {}
        fetch_policy(
            FetchSettings(sources, RUN, timeout=timeout, public_key=key, on_bytes=on_bytes),
            version,
            dest,
            report=report,
        )
        done = time.monotonic()
        print(json.dumps({"version": version, "done": done, **got, "report": report}), flush=True)
        shutil.rmtree(dest / f"v{version - 2}", ignore_errors=True)


def entropy_bound(base: Path, new: Path) -> float:
    """Bits per byte any per-element lossless code of new-vs-base needs (zeroth order, module docstring)."""
    from rlfleet.versions.codec import UINT, tensor_layout

    head, tensors = tensor_layout(new)
    _, base_tensors = tensor_layout(base)
    bits, total = 0.0, 0
    a, b = np.fromfile(base, np.uint8), np.fromfile(new, np.uint8)
    for name, (width, start, end) in tensors.items():
        if width not in (2, 4) or name not in base_tensors:
            continue
        bs = base_tensors[name][1]
        x = a[bs : bs + end - start].view(UINT[width]).astype(np.int64)
        y = b[start:end].view(UINT[width]).astype(np.int64)
        d = ((y - x + (1 << (8 * width - 1))) % (1 << (8 * width))) - (1 << (8 * width - 1))  # signed ulps
        z = np.abs(2 * d) - (d < 0)  # zigzag
        length = np.where(z > 0, np.floor(np.log2(np.maximum(z, 1))).astype(np.int64) + 1, 0)
        _, counts = np.unique(length, return_counts=True)
        p = counts / counts.sum()
        bits += float(-(p * np.log2(p)).sum()) * len(z) + float(np.maximum(length - 1, 0).sum())
        total += end - start
    return bits / 8 / max(total, 1)


def run_series(kind: str, dtype: str, lr: float, args, work: Path, keys) -> dict:
    from rlfleet.config import DeltaSpec
    from rlfleet.versions.adapter import adapter_section

    signer, public = keys
    print(f"{kind} {dtype} lr {lr:g}: training {args.steps} steps (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    started = time.monotonic()
    lora = kind.endswith("-lora")
    paths = make_series(kind.removesuffix("-lora"), dtype, lr, args.steps, work / "versions", lora)
    train_s = time.monotonic() - started
    base = (work / "versions" / "base").resolve() if lora else None
    adapter = adapter_section(base, str(base)) if base is not None else None
    every = DeltaSpec(full_every=10**6, max_ratio=1.0, max_chain_ratio=100.0)
    forced = publish_series(paths, work / "store-delta", every, signer, adapter=adapter)
    default = publish_series(paths, work / "store-default", DeltaSpec(), signer, adapter=adapter)
    rows = follow(work / "store-delta", len(paths), work / "follow", public)
    # A whole version's bytes: the base checkpoint for a LoRA series (what it would send without adapters).
    whole = [sum(p.stat().st_size for p in base.iterdir() if p.is_file())] * len(paths) if base else None
    full_of = [whole[v] if whole else forced[v]["full_bytes"] for v in range(len(paths))]
    full = full_of[0]
    versions = []
    for v in range(1, len(paths)):
        model_file = "adapter_model.safetensors" if lora else "model.safetensors"
        versions.append(
            {
                "version": v,
                "full_bytes": full_of[v],
                "wire_bytes": rows[v]["wire_bytes"],
                "ratio": rows[v]["wire_bytes"] / full_of[v],
                "ops": forced[v].get("ops", {}),
                "encode_seconds": forced[v].get("encode_seconds", 0.0),
                "rebuild_seconds": rows[v]["seconds"],
                "default_kind": default[v]["kind"],
                "default_bytes": default[v]["sent_bytes"],
                "default_relay_bytes": default[v]["relay_bytes"],
                "entropy_bound": math.nan if lora else entropy_bound(paths[v - 1] / model_file, paths[v] / model_file),
            }
        )
    shutil.rmtree(work, ignore_errors=True)
    return {
        "series": f"{kind}-{dtype}-lr{lr * (LORA_LR if lora else 1):g}",
        "model": kind,
        "dtype": dtype,
        "learning_rate": lr,
        "full_bytes": full,
        "train_seconds": train_s,
        "delta_bytes_ratio": float(np.mean([r["ratio"] for r in versions])),
        "adapter_bytes": forced[-1]["full_bytes"] if lora else None,
        "default_bytes_ratio": float(np.mean([r["default_bytes"] / r["full_bytes"] for r in versions])),
        "default_relay_bytes_ratio": float(np.mean([r["default_relay_bytes"] / r["full_bytes"] for r in versions])),
        "default_kinds": [default[v]["kind"] for v in range(len(paths))],
        "entropy_bound": float(np.mean([r["entropy_bound"] for r in versions])),
        "versions": versions,
    }


SERIES = ["builtin", "large", "builtin-lora", "large-lora"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per series (versions = steps + 1)")
    ap.add_argument("--series", nargs="*", default=["builtin", "large"], choices=SERIES)
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--lrs", type=float, nargs="*", default=[1e-3], help="learning rates (the example's is 1e-3)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, deleted after)")
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")

    from rlfleet.models.policy import configure_torch_threads
    from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer, parse_public_key

    configure_torch_threads()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlfleet-delta-bench-"))
    private, public = generate_keypair(work / "keys")
    keys = (make_signer(load_private_key(private)), parse_public_key(public))
    results = []
    try:
        for kind in args.series:
            for dtype in args.dtypes:
                for lr in args.lrs:
                    results.append(run_series(kind, dtype, lr, args, work / f"{kind}-{dtype}-{lr:g}", keys))
                    report(results[-1:], header=not results[:-1])
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nmachine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1))
    return 0


def report(results: list[dict], header: bool = True) -> None:
    if header:
        print(
            f"{'series':<28} {'full MiB':>9} {'wire MiB / version':>20} {'delta ÷ full':>13} {'entropy bound':>14}"
            f" {'default: worker ÷ full':>23} {'relay ÷ full':>13} {'encode s':>9} {'rebuild s':>10}"
        )
    for r in results:
        wire = [v["wire_bytes"] / 2**20 for v in r["versions"]]
        print(
            f"{r['series']:<28} {r['full_bytes'] / 2**20:>9.2f} {' '.join(f'{w:.2f}' for w in wire):>20} "
            f"{r['delta_bytes_ratio']:>13.3f} {r['entropy_bound']:>14.3f} {r['default_bytes_ratio']:>23.3f} "
            f"{r['default_relay_bytes_ratio']:>13.3f} "
            f"{np.mean([v['encode_seconds'] for v in r['versions']]):>9.2f} "
            f"{np.mean([v['rebuild_seconds'] for v in r['versions']]):>10.2f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
