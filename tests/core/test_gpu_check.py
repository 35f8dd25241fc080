"""scripts/gpu-check.sh --dry-run: every step of the GPU check on the CPU with a tiny model, as CI runs it.

The figures of a dry run mean nothing; what must hold anywhere is that every step runs, that the
verifier accepts every honest group the engine drew (several groups in flight) and refuses the
tampered ones, and that the JSON carries what docs/benchmarks.md reads from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["errors"] == {}
    assert report["machine"]["dry_run"] is True
    generation = report["generation_torch"]
    assert set(generation["tokens_per_s"]) == {"1", "4", "16"}
    assert all(rate > 0 for rate in generation["tokens_per_s"].values())
    verification = report["verification_torch"]
    assert verification["groups"] == 16
    assert verification["honest_rejected"] == 0, verification["honest_reasons"]
    assert verification["tampered_rejected"] == {"changed token": [16, 16], "another model's groups": [4, 4]}
    # fp32 on the CPU: the seed replay is exact for honest groups; each changed group misses at its changed token
    honest, changed = verification["replay_match"]["honest"], verification["replay_match"]["changed token"]
    assert honest["match_share"] == honest["worst_group"] == 1.0 and honest["positions"] > 0
    assert changed["worst_group"] < 1.0 and changed["match_share"] < 1.0
    assert report["weight_swap"]["checkpoint_mib"] > 0
    episodes = report["episodes_torch"]  # multi-turn, drawn and prefill-checked on the device
    assert episodes["honest_rejected"] == 0 and episodes["turns_per_sample"] > 1, episodes
    assert {step["groups"] for step in report["trainer"]["steps"].values()} == {1, 4, 16}
    assert "no GPU" in report["vllm_skipped"]
    table = (out / "gpu-check.log").read_text()
    assert "| inflight_speedup (best / 1 in flight) |" in table and "honest groups rejected | 0 of 16" in table
