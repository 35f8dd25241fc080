"""Helpers shared by tests: real HTTP servers on loopback and small real models."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.services.shardcast.protocol import serving  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parent.parent  # the repository root


def wait_for(what: str, fn, timeout: float = 10.0, every: float = 0.1):
    """fn() until it returns something true, and that value; AssertionError naming `what` and fn's last
    answer after `timeout` seconds. A KeyError, IndexError or TypeError from fn counts as not yet (a
    status or object that is not there yet) and is its last answer."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            last = fn()
        except (KeyError, IndexError, TypeError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(every)


def tiny_policy_dir(
    dest: Path, seed: int, hidden_size: int = 64, num_attention_heads: int = 4, num_key_value_heads: int = 2
) -> Path:
    """A randomly initialised Qwen2 policy with the builtin tokenizer, saved in HF format.

    The default head size 16 is the builtin tiny-arithmetic's; vLLM's CPU attention needs 32 or more
    (e.g. `num_attention_heads=2, num_key_value_heads=1`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlfleet.checkpoint import save_model_dir
    from rlfleet.models.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    save_model_dir(Qwen2ForCausalLM(config), tokenizer, dest)
    return dest


TRAINER_RUN = """
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata: {{name: tr}}
spec:
  model: {{path: "{model}"}}
  task: {{type: arithmetic, maxOperand: 20}}
  sampling: {{groupSize: 2, maxTokens: 4}}
  trainer: {trainer}
  store: {{uri: "file://{store}"}}
  shardcast: {{requireSignatures: false}}
"""


def trainer_run_config(model: Path, store: Path, trainer: str) -> str:
    """The RLRun YAML the trainer tests use: tiny groups of the arithmetic task, `trainer` as given (a flow mapping)."""
    return TRAINER_RUN.format(model=model, store=store, trainer=trainer)


def start_trainer(
    config: Path, redis_url: str, out: Path, *extra: str, log: str = "trainer.log", env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`rlfleet trainer` as its own process (one torch thread, `env` added), metrics.jsonl in `out`,
    its output appended to `out/log`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "trainer",
            "--config",
            str(config),
            "--redis-url",
            redis_url,
            "--output-dir",
            str(out),
            *extra,
        ],
        stdout=open(out / log, "ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "RLFLEET_TORCH_THREADS": "1", **(env or {})},
    )


CHART = REPO / "charts" / "rlfleet"


def render_chart(chart, values: dict, release: str = "rl", namespace: str = "rlfleet") -> list[dict]:
    """Every object the chart renders with `values` (the real Helm SDK: `chart` from helm_python.Chart.load)."""
    import yaml

    objects = []
    for path, text in sorted(chart.render(values, name=release, namespace=namespace, is_install=True).items()):
        if not path.endswith(".txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def trained_versions(dest: Path, count: int, dtype: str = "float32", lr: float = 1e-4, seed: int = 0) -> list[Path]:
    """`count` consecutive policy versions dest/v0, dest/v1, ... (HF directories): a tiny Qwen2 policy, then
    one AdamW step per version on the next-token loss of random sequences weighted by random advantages,
    which moves every weight like a GRPO step does (Adam's update is about lr per element, whatever the loss)."""
    import torch

    from rlfleet.checkpoint import save_model_dir
    from rlfleet.policy import load_policy

    first = tiny_policy_dir(dest / "init", seed=seed)
    model, tokenizer = load_policy(first, dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for v in range(count):
        if v:
            ids = torch.randint(3, len(tokenizer), (4, 12), generator=generator)
            logp = model(input_ids=ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
            loss = -(logp.squeeze(-1) * torch.randn(4, 1, generator=generator)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        paths.append(dest / f"v{v}")
        save_model_dir(model, tokenizer, paths[-1])
    return paths
