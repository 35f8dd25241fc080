"""`rlfleet run` of the arithmetic example from its model given three ways: a local HF directory, an s3://
prefix (moto's server) and an hf:// id (tests/hub_server.py, a local server speaking the hub's file API).
The model is the example's own warm-started build, saved and served. Each run takes a few steps; in the hub
run the server's log shows that only the launcher fetched the model (the components read its download), and
the workers started from version 0 as the relays served it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest

from rlfleet.config import load_bundle
from rlfleet.models.sources import resolve_model_path
from tests.hub_server import Hub
from tests.support import REPO, serving

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def example_model(tmp_path_factory) -> Path:
    """The example's builtin model (its shipped build), saved as a plain HF directory."""
    spec = load_bundle(str(EXAMPLE)).run.spec
    build = resolve_model_path(spec.model, spec.task, seed=spec.trainer.seed)
    return Path(shutil.copytree(build, tmp_path_factory.mktemp("model") / "tiny-arithmetic"))


def run_from(model: str, tmp_path: Path, extra_env: dict[str, str]) -> Path:
    """`rlfleet run` of the example with spec.model.path = `model` for STEPS steps; returns the run directory."""
    config = tmp_path / "rlrun.yaml"
    text = EXAMPLE.read_text()
    assert "path: builtin://tiny-arithmetic" in text
    config.write_text(text.replace("path: builtin://tiny-arithmetic", f"path: {model}", 1))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
        + ["--steps", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **extra_env},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"rlfleet: model {model} ready at" in done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["accepted"] > 0 for r in records), "the gate accepted the workers' groups at every step"
    return run_dir


@pytest.mark.slow
def test_a_run_starts_from_a_local_model_directory(example_model, tmp_path):
    run_from(str(example_model), tmp_path, {})


@pytest.mark.slow
def test_a_run_starts_from_a_model_on_s3(example_model, tmp_path, s3_env):
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=s3_env)
    client.create_bucket(Bucket=bucket)
    for file in example_model.iterdir():
        client.upload_file(str(file), bucket, f"base/tiny/{file.name}")
    cache = tmp_path / "cache"
    run_from(f"s3://{bucket}/base/tiny", tmp_path, {"AWS_ENDPOINT_URL": s3_env, "RLFLEET_CACHE": str(cache)})
    (copy,) = (cache / "s3").iterdir()  # the launcher's download; the trainer found it in the cache
    assert (copy / "model.safetensors").read_bytes() == (example_model / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_a_run_starts_from_a_hub_model_and_only_the_trusted_side_fetches_it(example_model, tmp_path):
    hub = Hub()
    hub.add("acme/tiny-arithmetic", example_model)
    with serving(hub.app()) as url:
        run_dir = run_from(
            "hf://acme/tiny-arithmetic@main", tmp_path, {"HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf")}
        )
    # The launcher downloads; every component runs with HF_HUB_OFFLINE=1 (launcher.py) and reads its cache, the
    # trainer included; workers never resolve an hf:// model at all (sources.local_model_path). The one other
    # request is huggingface_hub's own daily look-up of its client registry, not the model.
    model_requests = [r for r in hub.requests if r["path"] not in ("/healthz", "/api/agent-harnesses")]
    assert {r["agent"].rsplit("rlfleet/", 1)[-1] for r in model_requests} == {"launcher"}, hub.requests
    files = [r["path"] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert len(files) == len(set(files)) == len(list(example_model.iterdir())), "each file downloaded once"
    worker_log = (run_dir / "logs" / "rollout-arithmetic-cpu-0.log").read_text()
    assert "now generating with version" in worker_log
