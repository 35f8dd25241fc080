"""Where a process computes: one choice per process, made here and logged once.

Rule (`decide`): the override `RLFLEET_DEVICE` (rlfleet/wire/env.py) wins when set: `cpu`, `cuda`
(GPU `rank`, else 0) or `cuda:N`; asking for a GPU that torch does not see is an error naming the
fix, never a silent fall back to the CPU. Unset (or `auto`): the GPU of `rank` when torch sees any
GPU, else the CPU. `rank` is the process's GPU index among the pod's GPUs: LOCAL_RANK for trainer
ranks (torchrun-style), 0 for everything else (a rollout worker or a verifier uses its first GPU;
vLLM spreads tensor-parallel ranks over the others itself).

Who asks: the trainer (`training_device`, rlfleet/services/trainer/distributed.py), the rollout engines
(`make_engine`, rlfleet/engines/__init__.py: the torch engine's model lives there;
vLLM must agree with it) and the verifier (its prefill, rlfleet/services/toploc/main.py). Nothing
else calls torch.cuda to decide.

What torch sees of CUDA is a parameter (`Cuda`), so a test on a machine without a GPU exercises the
GPU branch by passing a fake one; the default reads torch.cuda.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlfleet.wire import env

log = logging.getLogger("rlfleet.device")

AUTO = "auto"
GPU_FIX = (
    "install the CUDA build of torch (the GPU image, docker/Dockerfile.gpu) on a machine with a GPU "
    "and give the pod GPUs (the component's `gpus` field)"
)


class DeviceError(SystemExit):
    """The device asked for does not exist here; the message names the setting and the fix. A SystemExit:
    it is a setting to change, reported at the process edge without a traceback."""


def _torch_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_describe(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Cuda:
    """What this process sees of CUDA: the number of GPUs and a description of one (name, memory)."""

    count: Callable[[], int] = _torch_count
    describe: Callable[[int], str] = _torch_describe


TORCH_CUDA = Cuda()


def decide(override: str | None, rank: int, gpus: int) -> torch.device:
    """The device for GPU index `rank` given the override's value and the number of visible GPUs (module docstring)."""
    text = (override or AUTO).strip().lower()
    if text == AUTO:
        if gpus == 0:
            return torch.device("cpu")
        text = "cuda"
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda":
        index = rank
    elif text.startswith("cuda:") and text[5:].isdigit():
        index = int(text[5:])
    else:
        raise DeviceError(f"{env.DEVICE}={override!r} is not a device: write cpu, cuda, cuda:N or auto (or unset it)")
    asked = f"{env.DEVICE}={override}" if override and override.strip().lower() != AUTO else "this process"
    if gpus == 0:
        raise DeviceError(
            f"{asked} asks for GPU {index}, but torch sees no GPU (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda or 'no'}); unset {env.DEVICE} or set it to cpu to run on the CPU, or {GPU_FIX}"
        )
    if index >= gpus:
        raise DeviceError(
            f"{asked} asks for GPU {index}, but torch sees {gpus} (indices 0..{gpus - 1}); give the pod one GPU per "
            f"rank (spec.trainer.gpus = ranks per pod) or set {env.DEVICE} to an index below {gpus}"
        )
    return torch.device("cuda", index)


_logged: set[str] = set()


def choose_device(rank: int = 0, cuda: Cuda = TORCH_CUDA) -> torch.device:
    """This process's device (module docstring): `decide` on env RLFLEET_DEVICE and what `cuda` sees,
    logged the first time each choice is made."""
    override = env.get(env.DEVICE)
    device = decide(override, rank, cuda.count())
    if str(device) not in _logged:
        _logged.add(str(device))
        why = f"{env.DEVICE}={override}" if override else "automatic"
        what = cuda.describe(device.index or 0) if device.type == "cuda" else "no GPU asked for or visible"
        log.info("device %s (%s; %s)", device, what, why)
    return device
