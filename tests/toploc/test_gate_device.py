"""The verifier prefills on its process's device (rlfleet/models/device.py), in the run's dtype, and its
checks compare there: on this machine the CPU; asking it for a GPU that is not there is the clear error."""

from __future__ import annotations

import pytest
import torch

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.models.device import TORCH_CUDA, DeviceError
from rlfleet.models.policy import DTYPES
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.main import Gate
from rlfleet.wire import env
from tests.toploc.test_gate import as_, gate_system, honest_group


def test_the_verifier_model_lives_on_the_chosen_device_and_accepts_honest_groups(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv(env.DEVICE, raising=False)
    with gate_system(tmp_path, redis_url) as (ctx, policy, origin_url, tmp):
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        expected = torch.device("cuda", 0) if TORCH_CUDA.count() else torch.device("cpu")
        assert gate.device == expected
        model, _ = gate.policy(0)
        params = list(model.parameters())
        assert {p.device for p in params} == {expected}
        assert {p.dtype for p in params} == {DTYPES[ctx.bundle.run.spec.model.dtype]}
        group = honest_group(TorchEngine(policy, 0), ctx, 1)
        got, outcome = gate.verify(group.encode())
        assert got is not None and not isinstance(outcome, Exception), outcome
        assert outcome.prefill_checked and len(outcome.logprobs) == len(group.samples)

        monkeypatch.setenv(env.DEVICE, "cuda")
        if not TORCH_CUDA.count():
            with pytest.raises(DeviceError, match=r"RLFLEET_DEVICE=cuda asks for GPU 0, but torch sees no GPU"):
                Gate(as_(ctx, VERIFIER), "verifier-1", origin_url, tmp / "cache-1")
