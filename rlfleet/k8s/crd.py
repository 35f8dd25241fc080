"""CustomResourceDefinitions for RLRun, InferencePool and RelayTier, generated from the config models.

`rlfleet crds --out crds/` writes them; `crds/*.yaml` are checked in and a test fails when they
drift from this generator. The pydantic JSON schema (draft 2020-12) is made *structural*
(Kubernetes' OpenAPI v3 subset): `$ref`s inlined with their sibling description, `anyOf [X, null]`
-> X + `nullable: true`, `const` -> one-value `enum`, numeric `exclusiveMinimum: x` ->
`minimum: x, exclusiveMinimum: true`, a discriminated union -> one object whose tag is an enum,
`additionalProperties: false` dropped (the API server prunes or, with kubectl's default strict
field validation, rejects unknown fields; a map keeps its value schema), `title` dropped. Defaults stay, so the API server fills
them in and `kubectl get -o yaml` shows the values the components use. Cross-field rules that a
JSON schema cannot say are CEL rules (`x-kubernetes-validations`).
"""
from __future__ import annotations

from pathlib import Path
import typing
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter

from rlfleet.config import InferencePoolSpec, RelayTierSpec, RLRunSpec
from rlfleet.k8s import names

_DROP = {"title", "additionalProperties", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every $ref and rewrite each schema node into the structural subset."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[1]]
        node = {**target, **node}  # the field's own description wins over the model docstring
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    for key in ("anyOf", "oneOf"):  # null variants are already gone (_mark_nullable)
        if key in node:
            node = {**_merge_variants([_resolve(v, defs) for v in node.pop(key)]), **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"], node["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"], node["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if node.get("default", 0) is None:
        del node["default"]
    out = {k: v for k, v in node.items() if k not in _DROP and k != "$defs"}
    if "properties" in out:
        out["properties"] = {k: _resolve(v, defs) for k, v in node["properties"].items()}
    if "items" in out:
        out["items"] = _resolve(node["items"], defs)
    if isinstance(node.get("additionalProperties"), dict) and "properties" not in node:  # a map, e.g. dict[str, str]
        out["additionalProperties"] = _resolve(node["additionalProperties"], defs)
    return out


def _merge_variants(variants: list[dict]) -> dict:
    """One structural schema for the non-null variants of a union (objects: union of properties)."""
    if len(variants) == 1:
        return variants[0]
    if all(v.get("type") == "object" for v in variants):
        # A discriminated union: one object with every variant's fields, the tag an enum, and per-variant CEL
        # rules for what the merged schema loses (the variant's required fields, other variants' fields).
        tag = next(k for k, p in variants[0]["properties"].items() if len(p.get("enum", [])) == 1
                   and all(len(v["properties"].get(k, {}).get("enum", [])) == 1 for v in variants))
        props: dict[str, Any] = {}
        for v in variants:
            for k, p in v.get("properties", {}).items():
                props.setdefault(k, p)
        tags = [v["properties"][tag]["enum"][0] for v in variants]
        for k in props:  # the API server would fill a variant's default into every other variant
            if not all(v["properties"].get(k, {}).get("default") == props[k].get("default") for v in variants):
                props[k] = {key: val for key, val in props[k].items() if key != "default"}
        props[tag] = {"type": "string", "enum": tags,
                      "description": " ".join(f"`{t}`: {v['properties'][tag].get('description', '')}" for t, v in zip(tags, variants))}
        rules = []
        for t, v in zip(tags, variants):
            need = [k for k in v.get("required", []) if k != tag]
            foreign = [k for k in props if k not in v["properties"]]
            if need:
                rules.append({"rule": f"self.{tag} != '{t}' || ({' && '.join(f'has(self.{k})' for k in need)})",
                              "message": f"{tag} {t} requires {', '.join(need)}"})
            if foreign:
                rules.append({"rule": f"self.{tag} != '{t}' || !({' || '.join(f'has(self.{k})' for k in foreign)})",
                              "message": f"{tag} {t} takes none of: {', '.join(foreign)}"})
        return {"type": "object", "properties": props, "required": [tag], "x-kubernetes-validations": rules}
    raise ValueError(f"cannot express a union of {[v.get('type') for v in variants]} structurally")


def structural_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema in the structural OpenAPI v3 subset (see the module docstring)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    out = _structural(_mark_nullable(raw), raw.get("$defs", {}))
    _factory_defaults(model, out)
    return _tidy(out)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _factory_defaults(model: type[BaseModel], schema: dict) -> None:
    """pydantic leaves `default_factory` values out of the schema; put the non-object ones back."""
    for name, info in model.model_fields.items():
        prop = schema.get("properties", {}).get(info.alias or name)
        if prop is None:
            continue
        subs = _models_in(info.annotation)
        if len(subs) == 1:  # not into a union: one variant's default would apply to all (see _merge_variants)
            _factory_defaults(subs[0], prop)
        if info.default_factory is not None and "default" not in prop and prop.get("type") != "object":
            prop["default"] = TypeAdapter(info.annotation).dump_python(info.default_factory(), mode="json")


_ORDER = ("type", "description", "nullable", "default", "enum", "format", "pattern", "minimum", "exclusiveMinimum",
          "maximum", "exclusiveMaximum", "minItems", "maxLength", "required", "items", "properties")


def _tidy(node: Any) -> Any:
    """Stable, readable key order: type and description first, nested properties last."""
    if isinstance(node, list):
        return [_tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    keys = [k for k in _ORDER if k in node] + sorted(k for k in node if k not in _ORDER)
    out = {k: node[k] for k in keys}
    if "properties" in out:  # field order as declared in the model
        out["properties"] = {name: _tidy(prop) for name, prop in out["properties"].items()}
    if "items" in out:
        out["items"] = _tidy(out["items"])
    return out


def _mark_nullable(node: Any) -> Any:
    """`anyOf: [X, {type: null}]` -> `anyOf: [X]` plus nullable (before the refs are resolved)."""
    if isinstance(node, list):
        return [_mark_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _mark_nullable(v) for k, v in node.items()}
    for key in ("anyOf", "oneOf"):
        if key in node and any(v.get("type") == "null" for v in node[key]):
            node[key] = [v for v in node[key] if v.get("type") != "null"]
            node["nullable"] = True
    return node


def _structural(node: dict, defs: dict) -> dict:
    defs = {k: _mark_nullable(v) for k, v in defs.items()}
    out = _resolve(node, defs)
    _object_defaults(out)
    return out


def _object_defaults(node: dict) -> None:
    """An optional nested object defaults to `{}`, so the API server fills in its own defaults."""
    for name, prop in node.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop:
            _object_defaults(prop)
            if name not in node.get("required", []) and "default" not in prop and not prop.get("required"):
                prop["default"] = {}


# CEL rules for what one field's schema cannot say.
STORE_RULES = [{"rule": "!has(self.uri) || self.uri.startsWith('s3://') || self.uri.startsWith('file://')",
                "message": "uri must start with file:// or s3://", "fieldPath": ".uri"}]  # = StoreSpec._scheme
MAX_RUN_NAME = names.MAX_STATEFULSET_NAME - len(names.trainer(""))
RUN_RULES = [{"rule": f"size(self.metadata.name) <= {MAX_RUN_NAME}",
              "message": f"metadata.name: at most {MAX_RUN_NAME} characters on a cluster (the trainer StatefulSet is NAME-trainer, at most 52)"}]


def _status_schema(scalable: bool) -> dict:
    condition = {
        "type": "object",
        "description": "One observation of the object's state (Kubernetes condition conventions).",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string", "description": "Condition type: Ready, Progressing, Suspended."},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown."},
            "reason": {"type": "string", "description": "CamelCase reason, e.g. InvalidSpec, ChildrenApplied, RunNotFound."},
            "message": {"type": "string", "description": "Human-readable detail: for InvalidSpec the field path and the fix."},
            "lastTransitionTime": {"type": "string", "format": "date-time", "description": "When status last changed."},
            "observedGeneration": {"type": "integer", "format": "int64", "description": "metadata.generation this condition was computed from."},
        },
    }
    props = {
        "phase": {"type": "string", "description": "Pending, Running, Suspended, Failed or Succeeded."},
        "observedGeneration": {"type": "integer", "format": "int64", "description": "metadata.generation the operator last reconciled."},
        "conditions": {"type": "array", "description": "Latest observations; one per type.", "items": condition,
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "readyReplicas": {"type": "integer", "format": "int32", "description": "Pods of the main workload that are ready."},
    }
    if scalable:
        props["replicas"] = {"type": "integer", "format": "int32", "description": "Current replicas (scale subresource)."}
        props["selector"] = {"type": "string", "description": "Label selector of the pods (scale subresource, HPA)."}
    else:
        props.update({
            "step": {"type": "integer", "format": "int64", "description": "Trainer steps committed (each publishes one policy version)."},
            "policyVersion": {"type": "integer", "format": "int64", "description": "Newest policy version announced on the policy stream."},
            "reward": {"type": "number", "description": "Mean reward of the newest step, when the trainer announces it."},
            "accepted": {"type": "integer", "format": "int64", "description": "Rollout groups the verifier accepted."},
            "rejected": {"type": "integer", "format": "int64", "description": "Rollout groups the verifier rejected."},
        })
    return {"type": "object", "description": "Observed state, written by the operator.", "properties": props}


def _columns(kind: names.KindInfo) -> list[dict]:
    common_tail = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    phase = {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Pending, Running, Suspended, Failed, Succeeded."}
    if kind is names.RLRUN:
        return [phase,
                {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Trainer steps committed."},
                {"name": "Policy", "type": "integer", "jsonPath": ".status.policyVersion", "description": "Newest policy version."},
                {"name": "Reward", "type": "number", "jsonPath": ".status.reward", "description": "Mean reward of the newest step."},
                {"name": "Accepted", "type": "integer", "jsonPath": ".status.accepted", "priority": 1, "description": "Groups accepted by the verifier."},
                {"name": "Rejected", "type": "integer", "jsonPath": ".status.rejected", "priority": 1, "description": "Groups rejected by the verifier."},
                {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready trainer pods."},
                *common_tail]
    extra = [{"name": "Tier", "type": "integer", "jsonPath": ".spec.tier", "description": "Relay tier."}] if kind is names.RELAY_TIER else []
    return [{"name": "Run", "type": "string", "jsonPath": ".spec.run", "description": "The RLRun."}, *extra, phase,
            {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired pods."},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods."},
            *common_tail]


def build_crd(kind: names.KindInfo) -> dict:
    """One CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict."""
    spec_model = {"RLRun": RLRunSpec, "InferencePool": InferencePoolSpec, "RelayTier": RelayTierSpec}[kind.kind]
    description = {
        "RLRun": "Desired state of an asynchronous GRPO run: model, task, sampling, trainer, verifier, Redis and store.",
        "InferencePool": "A fleet of rollout workers generating for one RLRun.",
        "RelayTier": "One tier of the checkpoint relay tree of an RLRun.",
    }[kind.kind]
    spec = {"type": "object", "description": description, **structural_schema(spec_model)}
    if kind is names.RLRUN:
        spec["properties"]["store"]["x-kubernetes-validations"] = STORE_RULES
    scalable = kind is not names.RLRUN
    subresources: dict[str, Any] = {"status": {}}
    if scalable:
        subresources["scale"] = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                 "labelSelectorPath": ".status.selector"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name, "labels": {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/part-of": "rlfleet"}},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind.kind, "listKind": f"{kind.kind}List", "plural": kind.plural, "singular": kind.singular,
                      "shortNames": kind.short_names, "categories": [names.CATEGORY]},
            "versions": [{
                "name": names.VERSION,
                "served": True,
                "storage": True,
                "subresources": subresources,
                "additionalPrinterColumns": _columns(kind),
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    **({"x-kubernetes-validations": RUN_RULES} if kind is names.RLRUN else {}),
                    "description": f"{kind.kind} (rlfleet.io/v1alpha1): reconciled by `rlfleet operator`; the same document runs locally with `rlfleet run`.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string", "description": "Always rlfleet.io/v1alpha1."},
                        "kind": {"type": "string", "description": f"{kind.kind}."},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": _status_schema(scalable),
                    },
                }},
            }],
        },
    }


HEADER = "# Generated by `rlfleet crds --out crds/` from rlfleet/config.py; do not edit (tests/test_crds.py checks drift).\n"


def render_crd(kind: names.KindInfo) -> str:
    return HEADER + yaml.safe_dump(build_crd(kind), sort_keys=False, width=120)


def crd_files() -> dict[str, str]:
    """File name -> YAML text of every CRD."""
    return {f"{k.crd_name}.yaml": render_crd(k) for k in names.KINDS.values()}


def write_crds(out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in crd_files().items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
