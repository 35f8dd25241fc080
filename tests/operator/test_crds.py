"""The checked-in CRDs are the generator's output, structural, valid, and agree with the config models."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rlfleet.cli import main as cli_main
from rlfleet.config import KINDS, ConfigError, parse_bundle
from rlfleet.operator import crd, names
from tests.support import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "arithmetic" / "rlrun.yaml"
K8S_VERSION = "1.30"  # oldest Kubernetes we support; kubernetes-validate ships 1.25 .. 1.37


def test_checked_in_crds_match_the_generator():
    for name, text in crd.crd_files().items():
        path = ROOT / "crds" / name
        assert path.exists(), f"{path} missing: run `rlfleet crds --out crds/`"
        assert path.read_text() == text, f"{path} drifted from rlfleet/config/: run `rlfleet crds --out crds/`"
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(crd.crd_files())


def test_crds_command_writes_the_files(tmp_path, capsys):
    assert cli_main(["crds", "--out", str(tmp_path)]) == 0
    for name, text in crd.crd_files().items():
        assert (tmp_path / name).read_text() == text
    capsys.readouterr()
    assert cli_main(["crds"]) == 0
    assert [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)] == ["CustomResourceDefinition"] * 4


@pytest.mark.parametrize("kind", list(names.KINDS.values()), ids=list(names.KINDS))
def test_crd_is_a_valid_kubernetes_object(kind):
    kubernetes_validate.validate(crd.build_crd(kind), K8S_VERSION, strict=True)


def _walk(schema: dict, path: str = ""):
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


@pytest.mark.parametrize("kind", list(names.KINDS.values()), ids=list(names.KINDS))
def test_schema_is_structural_and_explained(kind):
    root = crd.build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        if path == ".metadata":
            continue
        # int-or-string (a quantity, a pod count or percentage) is the one typeless node a structural schema allows
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path}: no type (not structural)"
        assert "description" in node or path.endswith("[]"), f"{path}: no description (kubectl explain shows nothing)"
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title"):
            assert banned not in node, f"{path}: {banned}"
        assert not ("properties" in node and "additionalProperties" in node), (
            f"{path}: properties with additionalProperties"
        )
        assert node.get("default", 0) is not None, f"{path}: null default"


def test_crd_names_subresources_and_columns():
    pool = crd.build_crd(names.INFERENCE_POOL)["spec"]
    assert "rlpool" in pool["names"]["shortNames"] and "inferencepool" not in pool["names"]["shortNames"]
    for kind in (names.INFERENCE_POOL, names.RELAY_TIER):
        sub = crd.build_crd(kind)["spec"]["versions"][0]["subresources"]
        assert sub["scale"] == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    run = crd.build_crd(names.RLRUN)["spec"]
    assert run["names"]["categories"] == ["rlfleet"]
    assert "scale" not in run["versions"][0]["subresources"] and "status" in run["versions"][0]["subresources"]
    columns = [c["name"] for c in run["versions"][0]["additionalPrinterColumns"]]
    assert columns[:4] == ["Phase", "Step", "Policy", "Reward"] and columns[-1] == "Age" and "Ready" in columns


def _validator(kind_name: str) -> jsonschema.Validator:
    """jsonschema for the CRD's OpenAPI v3.0 subset: Draft 4 semantics plus `nullable`."""
    schema = copy.deepcopy(crd.build_crd(names.KINDS[kind_name])["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    for _, node in _walk(schema):
        if node.pop("nullable", False):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"].append(None)
    return jsonschema.Draft4Validator(schema)


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_example_crs_validate_against_the_crds():
    docs = _docs(EXAMPLE.read_text())
    assert {d["kind"] for d in docs} == set(KINDS)
    for doc in docs:
        errors = [e.message for e in _validator(doc["kind"]).iter_errors(doc)]
        assert errors == [], f"{doc['kind']}: {errors}"


@pytest.mark.parametrize(
    "path,value",
    [
        ("sampling.groupSize", 1),  # minimum 2
        ("sampling.temperature", 0.0),  # exclusiveMinimum
        ("trainer.epsLow", 1.0),  # exclusiveMaximum
        ("trainer.stepz", 5),  # unknown field
        ("model.dtype", "float16"),  # enum
        ("task.type", "chess"),  # discriminator tag
        ("redis.url", None),  # nullable: fine in both
        ("verifier.toploc.topk", 0),  # nested model, minimum 1
        ("task.operations", []),  # minItems
    ],
)
def test_crd_schema_and_config_models_agree(path, value):
    """A spec the models reject is rejected by the CRD schema too, and vice versa."""
    text = EXAMPLE.read_text()
    docs = _docs(text)
    node = docs[0]["spec"]
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    try:
        parse_bundle(yaml.safe_dump_all(docs))
        model_ok = True
    except ConfigError:
        model_ok = False
    schema_errors = list(_validator("RLRun").iter_errors(docs[0]))
    unknown_field = leaf == "stepz"  # the API server rejects these by strict field validation, not by the schema
    assert model_ok == (not schema_errors and not unknown_field), (model_ok, [e.message for e in schema_errors])


def _spec_schema(kind) -> dict:
    return crd.build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_store_uri_rule_takes_only_what_the_operator_takes():
    """Bug: the CRD took file:// stores, which the operator then refused (pods on other nodes cannot read a
    directory): `kubectl apply` succeeded and the run went Failed. The model still takes file:// (for
    `rlfleet run`) and refuses other schemes."""
    [rule] = _spec_schema(names.RLRUN)["properties"]["store"]["x-kubernetes-validations"]
    assert "s3://" in rule["rule"] and "file://" not in rule["rule"] and "s3://" in rule["message"]
    with pytest.raises(ConfigError, match="file:// or s3://"):
        docs = _docs(EXAMPLE.read_text())
        docs[0]["spec"]["store"] = {"uri": "gs://bucket"}
        parse_bundle(yaml.safe_dump_all(docs))


@pytest.mark.parametrize("kind", [names.INFERENCE_POOL, names.RELAY_TIER], ids=lambda k: k.kind)
def test_a_members_run_is_immutable(kind):
    [rule] = _spec_schema(kind)["properties"]["run"]["x-kubernetes-validations"]
    assert rule["rule"] == "self == oldSelf" and "spec.run is immutable" in rule["message"]


@pytest.mark.parametrize("quantity,ok", [("500m", True), ("4Gi", True), (2, True), ("1e3", True), ("lots", False)])
def test_quantities_are_checked_at_apply_time(quantity, ok):
    """Bug: `trainer.resources.requests.cpu: lots` passed the CRD and `rlfleet validate`; the API server
    refused the trainer's StatefulSet later (a 422 the run's status never showed)."""
    docs = _docs(EXAMPLE.read_text())
    docs[0]["spec"]["trainer"]["resources"] = {"requests": {"cpu": quantity}}
    errors = [e.message for e in _validator("RLRun").iter_errors(docs[0])]
    assert (errors == []) == ok, errors
    if ok:
        parse_bundle(yaml.safe_dump_all(docs))
    else:
        with pytest.raises(ConfigError, match=r"trainer\.resources\.requests\.cpu.*not a Kubernetes quantity"):
            parse_bundle(yaml.safe_dump_all(docs))


def test_task_union_keeps_each_variant_apart():
    """Merged into one structural object, a variant's defaults must not leak into another variant."""
    from typing import get_args

    from rlfleet.config import TaskSpec

    variants = get_args(get_args(TaskSpec)[0])
    task = crd.build_crd(names.RLRUN)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["task"]
    assert task["properties"]["type"]["enum"] == [v.model_fields["type"].annotation.__args__[0] for v in variants]
    for name, prop in task["properties"].items():
        if "default" in prop:
            assert all(any((f.alias or n) == name for n, f in v.model_fields.items()) for v in variants), name
    if len(variants) > 1:
        assert any("takes none of" in r["message"] for r in task["x-kubernetes-validations"])
