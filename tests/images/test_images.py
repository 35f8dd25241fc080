"""The images `make images` builds, run under podman as a cluster would run them: each entrypoint
starts, the operator image holds no torch, every path a pod the operator renders names exists in the
image or is one of the pod's volumes, and the CPU image trains the arithmetic example as its non-root
user on a read-only root filesystem, with only the writable volume the operator gives its pods and no
network (nothing is fetched at run time).

Marked `images`: they need root and podman (skipped, with the reason, otherwise) and the images
built by `make images`; with RLFLEET_IMAGES_REQUIRED=1 (set by .ci/run after it built them) a
missing image fails instead of skipping.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from rlfleet.operator import names
from tests.containers import CPU_IMAGE, OPERATOR_IMAGE, PodContainer, Volume, require, run_container
from tests.images.rendered import SECRETS, cluster_bundle, rendered_pods
from tests.support import REPO

pytestmark = pytest.mark.images

IMAGE_USER = 10001  # the Dockerfiles' USER
POD_CHECK = (Path(__file__).parent / "pod_check.py").read_text()
COMPONENTS = ["trainer", "rollout", "verifier", "origin", "relay", "ingest", "operator"]


def python_in(image: str, code: str, *args: str, **options):
    """Run Python code in the image (its venv's python3), as the image's user, read-only root."""
    return run_container(image, ["-c", code, *args], entrypoint=["python3"], **options)


def test_cpu_image_entrypoints_start():
    require(CPU_IMAGE)
    code = """
import importlib, os, subprocess, sys
from rlfleet.wire.components import COMPONENTS
for cmd in [["--help"], *[[c, "--help"] for c in sys.argv[1:]]]:
    out = subprocess.run(["rlfleet", *cmd], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: rlfleet" in out.stdout, (cmd, out.stdout, out.stderr)
for c in COMPONENTS.values():  # what each component imports once past its arguments
    getattr(importlib.import_module(c.module), c.options), getattr(importlib.import_module(c.module), c.main)
importlib.import_module("rlfleet.operator.handlers")
import torch
print(torch.__version__, os.getuid())
"""
    proc = python_in(CPU_IMAGE, code, *COMPONENTS, "run", "validate", "crds")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch_version, uid = proc.stdout.split()[-2:]
    assert torch_version.endswith("+cpu"), f"the CPU image must hold torch's CPU build, not {torch_version}"
    assert int(uid) == IMAGE_USER


def test_operator_image_starts_without_torch():
    require(OPERATOR_IMAGE)
    for args, usage in ((["--help"], "usage: rlfleet"), (["operator", "--help"], "usage: rlfleet operator")):
        proc = run_container(OPERATOR_IMAGE, args)
        assert proc.returncode == 0 and usage in proc.stdout, proc.stdout + proc.stderr
    code = """
import importlib, importlib.util, os
importlib.import_module("rlfleet.operator.handlers")  # kopf and the kubernetes client are there
print(",".join(m for m in ("torch", "transformers", "vllm") if importlib.util.find_spec(m)) or "-", os.getuid())
"""
    proc = python_in(OPERATOR_IMAGE, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["-", str(IMAGE_USER)], f"operator image holds: {proc.stdout}"
    # The CRDs it generates are the checked-in ones: the image holds the same config models.
    crds = run_container(OPERATOR_IMAGE, ["crds"])
    assert crds.returncode == 0, crds.stderr
    by_name = {d["metadata"]["name"]: d for d in yaml.safe_load_all(crds.stdout)}
    shipped = {
        d["metadata"]["name"]: d for d in map(yaml.safe_load, map(Path.read_text, (REPO / "crds").glob("*.yaml")))
    }
    assert by_name == shipped


# ---- every path a rendered pod names ------------------------------------------------------------


@pytest.mark.parametrize("example", ["arithmetic", "math"])
def test_every_path_a_rendered_pod_names_exists_or_is_mounted(example, tmp_path):
    require(CPU_IMAGE)
    pods, config_maps = rendered_pods(cluster_bundle(example))
    assert {n.rsplit("-", 1)[-1] for n, _ in pods} == {"origin", "trainer", "verifier", "ingest", "rollout", "relay"}
    failures = {}
    for name, template in pods:
        pod = PodContainer.from_pod(template, f"{name}-0", tmp_path / name, config_maps, SECRETS)
        assert pod.image == CPU_IMAGE, "the operator's default image is the one make images builds"
        proc = pod.run(command=["python3", "-c", POD_CHECK, json.dumps(pod.command)])
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["uid"] == IMAGE_USER and report["ok"], (name, report)
        if report["errors"]:
            failures[name] = report["errors"]
    assert not failures, json.dumps(failures, indent=1)


# ---- the whole system in the CPU image --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)  # mostly the builtin model's build: 3.5 to 4.5 minutes on 2 busy cores
def test_cpu_image_runs_the_example_read_only_without_network(tmp_path):
    """`rlfleet run examples/arithmetic/rlrun.yaml --steps 5` in the image: the builtin model is built
    in the container (nothing downloaded: no network), every write lands in the pods' cache volume."""
    require(CPU_IMAGE)
    [(_, template)] = [(n, t) for n, t in rendered_pods(cluster_bundle("arithmetic"))[0] if n.endswith("trainer")]
    writable = [
        m["mountPath"]
        for m in template["spec"]["containers"][0]["volumeMounts"]
        if any(v["name"] == m["name"] and "emptyDir" in v for v in template["spec"]["volumes"])
    ]
    assert writable == [names.CACHE_DIR, "/tmp"]
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    for volume in (cache, tmp):
        volume.mkdir()
        volume.chmod(0o777)  # an emptyDir
    home = next(e["value"] for e in template["spec"]["containers"][0]["env"] if e["name"] == "HOME")
    start = time.monotonic()
    run_dir = f"{names.CACHE_DIR}/run"
    proc = run_container(
        CPU_IMAGE,
        ["run", "examples/arithmetic/rlrun.yaml", "--steps", "5", "--run-dir", run_dir, "--no-progress"],
        volumes=[Volume(cache, names.CACHE_DIR), Volume(tmp, "/tmp")],
        env={"HOME": home},
        network="none",
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((cache / "run" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["accepted"] > 0, summary
    owners = {p.stat().st_uid for p in cache.rglob("*")}
    assert owners == {IMAGE_USER}, f"files written as {owners}, not the image's user"
    print(f"rlfleet run --steps 5 in {CPU_IMAGE}: {time.monotonic() - start:.0f} s")
