"""One device choice per process (rlfleet/models/device.py): the rule with the choice injected (env
RLFLEET_DEVICE, and what CUDA shows passed in as `Cuda`), the errors that name the fix, and the
trainer and the torch engine computing where the choice says (here: the CPU, the only device there is)."""

from __future__ import annotations

import logging

import pytest
import torch

from rlfleet.engines import make_engine
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.device import TORCH_CUDA, Cuda, DeviceError, choose_device, decide
from rlfleet.services.trainer.distributed import training_device
from rlfleet.wire import env
from tests.support import tiny_policy_dir

GPUS = 4
FAKE = Cuda(count=lambda: GPUS, describe=lambda i: f"Fake GPU {i}, 80.0 GiB")
NONE = Cuda(count=lambda: 0, describe=lambda i: pytest.fail("no GPU to describe"))


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(env.DEVICE, raising=False)


def test_without_an_override_a_process_takes_its_gpu_when_cuda_shows_one(no_override):
    assert choose_device(cuda=FAKE) == torch.device("cuda", 0)
    assert choose_device(rank=3, cuda=FAKE) == torch.device("cuda", 3), "a trainer rank takes its LOCAL_RANK's GPU"
    assert choose_device(cuda=NONE) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"asks for GPU 4, but torch sees 4 \(indices 0\.\.3\).*spec\.trainer\.gpus"):
        choose_device(rank=4, cuda=FAKE)


@pytest.mark.parametrize(
    ("override", "rank", "expected"),
    [("cpu", 0, "cpu"), ("CPU", 2, "cpu"), ("cuda", 2, "cuda:2"), ("cuda:1", 3, "cuda:1"), ("auto", 1, "cuda:1")],
)
def test_the_override_wins(monkeypatch, override, rank, expected):
    monkeypatch.setenv(env.DEVICE, override)
    assert choose_device(rank=rank, cuda=FAKE) == torch.device(expected)


def test_asking_for_a_gpu_that_is_not_there_names_the_setting_and_the_fix(monkeypatch):
    monkeypatch.setenv(env.DEVICE, "cuda")
    with pytest.raises(DeviceError) as caught:
        choose_device(cuda=NONE)
    message = str(caught.value)
    assert "RLFLEET_DEVICE=cuda asks for GPU 0, but torch sees no GPU" in message
    assert "unset RLFLEET_DEVICE or set it to cpu" in message and "CUDA build of torch" in message
    monkeypatch.setenv(env.DEVICE, "cuda:7")
    with pytest.raises(DeviceError, match=r"RLFLEET_DEVICE=cuda:7 asks for GPU 7, but torch sees 4"):
        choose_device(cuda=FAKE)
    monkeypatch.setenv(env.DEVICE, "gpu")
    with pytest.raises(DeviceError, match=r"RLFLEET_DEVICE='gpu' is not a device: write cpu, cuda, cuda:N or auto"):
        choose_device(cuda=FAKE)
    assert issubclass(DeviceError, SystemExit), "reported at the process edge without a traceback"


def test_on_this_machine_asking_for_cuda_is_the_clear_error(monkeypatch):
    if TORCH_CUDA.count():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv(env.DEVICE, "cuda")
    with pytest.raises(DeviceError, match=r"torch sees no GPU \(torch .*CUDA build: no\)"):
        choose_device()
    with pytest.raises(DeviceError, match=r"RLFLEET_DEVICE=cuda asks for GPU 0"):
        training_device()


def test_each_choice_is_logged_once_with_the_gpu_it_names(no_override, caplog):
    with caplog.at_level(logging.INFO, logger="rlfleet.device"):
        lucky = Cuda(count=lambda: 8, describe=lambda i: f"Logged GPU {i}, 141.0 GiB")
        for _ in range(3):
            choose_device(rank=7, cuda=lucky)
    assert [r.getMessage() for r in caplog.records] == ["device cuda:7 (Logged GPU 7, 141.0 GiB; automatic)"]


def test_decide_is_the_rule_alone():
    assert decide(None, 0, 0) == torch.device("cpu") and decide(None, 1, 2) == torch.device("cuda", 1)
    assert decide(" cpu ", 0, 8) == torch.device("cpu")


def test_the_trainer_and_the_torch_engine_compute_on_the_chosen_device(tmp_path, monkeypatch):
    monkeypatch.setenv(env.DEVICE, "cpu")
    monkeypatch.setenv(env.LOCAL_RANK, "3")  # a rank's GPU index; the CPU has no index
    assert training_device() == torch.device("cpu")
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    engine = make_engine("torch", policy, 0)
    assert isinstance(engine, TorchEngine)
    assert {p.device for p in engine.model.parameters()} == {torch.device("cpu")}
    monkeypatch.setenv(env.DEVICE, "cuda")
    if not TORCH_CUDA.count():
        with pytest.raises(DeviceError, match="RLFLEET_DEVICE=cuda asks for GPU 0"):
            make_engine("torch", policy, 0)
