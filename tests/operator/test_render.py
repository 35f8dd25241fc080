"""`rlfleet render FILE`: every object the operator would create, as YAML; renders compare (scaling a pool
changes its workload's spec.replicas and nothing else), and every example renders objects that the
Kubernetes schemas accept at the oldest and newest supported versions."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from rlfleet.cli import main as cli_main
from rlfleet.config import ConfigError, parse_bundle
from rlfleet.operator.render import render_bundle, render_text
from tests.operator.test_builders import KUBE_VERSIONS
from tests.support import REPO

EXAMPLES = [REPO / "examples" / "arithmetic" / "rlrun.yaml", *sorted((REPO / "examples" / "math").glob("*.yaml"))]
CLUSTER = {
    "redis": {"urlSecret": "run-redis"},
    "store": {"uri": "s3://ckpt/runs", "credentialsSecret": "s3-creds"},
    "shardcast": {"signingKeySecret": "run-signing"},
}


def bundle_text(path, **pool_spec) -> str:
    """An example with what a cluster needs added (and `pool_spec` on its pools)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs[0]["spec"].update(CLUSTER)
    for doc in docs[1:]:
        if doc["kind"] == "InferencePool":
            doc["spec"].update(pool_spec)
    return yaml.safe_dump_all(docs)


def differences(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_objects_valid_at_the_oldest_and_newest_kubernetes(example):
    """Bug: the math examples could not run in a cluster (a dataset path relative to the repository, vLLM
    on CPU). With what a cluster needs added, every example renders, and every object is valid."""
    objects = render_bundle(parse_bundle(bundle_text(example)), "ml")
    assert {o["kind"] for o in objects} >= {"ConfigMap", "StatefulSet", "Deployment", "Service", "PodDisruptionBudget"}
    for obj in objects:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_scaling_a_pool_changes_only_its_replicas():
    two = render_bundle(parse_bundle(bundle_text(EXAMPLES[0], replicas=2)), "ml")
    three = render_bundle(parse_bundle(bundle_text(EXAMPLES[0], replicas=3)), "ml")
    changed = [(o["kind"], o["metadata"]["name"], differences(o, p)) for o, p in zip(two, three) if o != p]
    assert changed == [("Deployment", "arithmetic-cpu-rollout", [".spec.replicas"])]


def test_the_text_is_the_objects_and_the_cli_prints_it(tmp_path, capsys):
    source = tmp_path / "run.yaml"
    source.write_text(bundle_text(EXAMPLES[0]))
    bundle = parse_bundle(source.read_text())
    text = render_text(bundle, "ml")
    assert [d for d in yaml.safe_load_all(text) if d] == render_bundle(bundle, "ml")
    assert "  rlrun.yaml: |\n" in text, "config documents render as literal blocks, so diffs read line by line"
    assert cli_main(["render", str(source), "-n", "ml", "--pull-secret", "regcred"]) == 0
    printed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert len(printed) == len(render_bundle(bundle, "ml"))
    assert all(
        d["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        for d in printed
        if d["kind"] in ("Deployment", "StatefulSet")
    )


def test_what_a_cluster_would_refuse_is_an_error_naming_each_document(tmp_path, capsys):
    local = EXAMPLES[0]  # the local example as it is: no Redis URL, no store, no signing key
    assert cli_main(["render", str(local)]) == 2
    err = capsys.readouterr().err
    assert f"{local}: RLRun arithmetic: spec.redis.url: required on a cluster" in err
    with pytest.raises(ConfigError, match="InferencePool arithmetic-cpu: spec.workerTokens: required with ingestUrl"):
        render_bundle(parse_bundle(bundle_text(local, ingestUrl="https://ingest.example.org")), "ml")
