"""GPUs a cluster grants reach the processes: a pool's gpus become its workers' vLLM tensor parallelism
(in the config document they read), and a verifier with gpus gets the GPU image and the GPU resource."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.operator import names
from rlfleet.operator.pods import ClusterDefaults
from rlfleet.operator.render import render_bundle
from rlfleet.wire.views import VIEWS, view_bundle
from tests.operator.test_builders import EXAMPLE, K8S_VERSION, NS

DEFAULTS = ClusterDefaults(image="registry.test/rlfleet:1", gpu_image="registry.test/rlfleet-gpu:1")


def _bundle_text(pool: dict | None = None, verifier: dict | None = None) -> str:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    docs[0]["spec"].update(
        {
            "redis": {"url": "redis://redis:6379/0"},
            "store": {"uri": "s3://ckpt/runs"},
            "shardcast": {"signingKeySecret": "arithmetic-signing"},
        }
    )
    docs[0]["spec"]["verifier"].update({"engines": ["torch", "vllm"], **(verifier or {})})
    docs[1]["spec"].update(pool or {})
    return yaml.safe_dump_all(docs)


def _objects(text: str) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_bundle(parse_bundle(text), NS, DEFAULTS)}


def _worker_pool_document(objects) -> dict:
    data = objects[("ConfigMap", names.pool_config("arithmetic-cpu"))]["data"][names.CONFIG_FILE]
    return list(yaml.safe_load_all(data))[1]


def test_a_pool_with_two_gpus_renders_tensor_parallel_size_two_in_what_its_workers_read():
    objects = _objects(_bundle_text(pool={"engine": "vllm", "gpus": 2}))
    doc = _worker_pool_document(objects)
    assert doc["spec"]["vllm"] == {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.9}
    assert "gpus" not in doc["spec"], "gpus itself is the operator's (in no view)"
    # The worker parses that document (without gpus) and reads the setting through its view.
    data = objects[("ConfigMap", names.pool_config("arithmetic-cpu"))]["data"][names.CONFIG_FILE]
    worker = view_bundle(parse_bundle(data), VIEWS[names.ROLLOUT])
    assert worker.pool(None)[1].vllm.tensor_parallel_size == 2
    container = objects[("Deployment", names.rollout("arithmetic-cpu"))]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2 and container["image"] == DEFAULTS.gpu_image


def test_vllm_settings_are_rendered_as_written_and_default_to_one_gpu_without_gpus():
    doc = _worker_pool_document(_objects(_bundle_text()))
    assert doc["spec"]["vllm"]["tensorParallelSize"] == 1
    written = {"tensorParallelSize": 2, "gpuMemoryUtilization": 0.8, "maxModelLen": 4096, "enforceEager": True}
    doc = _worker_pool_document(_objects(_bundle_text(pool={"engine": "vllm", "gpus": 4, "vllm": written})))
    assert doc["spec"]["vllm"] == written


def test_more_tensor_parallel_ranks_than_gpus_is_refused_naming_both_fields():
    with pytest.raises(ConfigError, match=r"vllm\.tensorParallelSize \(4\) is more than gpus \(2\)"):
        parse_bundle(_bundle_text(pool={"engine": "vllm", "gpus": 2, "vllm": {"tensorParallelSize": 4}}))
    with pytest.raises(ConfigError, match=r"gpuMemoryUtilization"):
        parse_bundle(_bundle_text(pool={"vllm": {"gpuMemoryUtilization": 1.5}}))


def test_a_verifier_with_a_gpu_gets_the_gpu_image_and_the_gpu_resource():
    objects = _objects(_bundle_text(verifier={"gpus": 1}))
    dep = objects[("Deployment", names.verifier("arithmetic"))]
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == DEFAULTS.gpu_image
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    cpu = _objects(_bundle_text())[("Deployment", names.verifier("arithmetic"))]["spec"]["template"]["spec"]
    assert cpu["containers"][0]["image"] == DEFAULTS.image and "limits" not in cpu["containers"][0]["resources"]
    amd = _objects(_bundle_text(verifier={"gpus": 2, "gpuResource": "amd.com/gpu"}))
    limits = amd[("Deployment", names.verifier("arithmetic"))]["spec"]["template"]["spec"]["containers"][0]
    assert limits["resources"]["limits"] == {"amd.com/gpu": 2}


def test_verifier_gpus_are_the_operators_and_roll_no_config():
    """gpus is in no view: the verifier's config (and every pod's config hash) is the same with or without it."""
    with_gpu, without = _objects(_bundle_text(verifier={"gpus": 1})), _objects(_bundle_text())
    key = ("ConfigMap", names.run_config("arithmetic"))
    assert with_gpu[key] == without[key]
