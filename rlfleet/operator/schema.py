"""Pydantic models -> the *structural* OpenAPI v3 schemas Kubernetes takes in a CRD.

The pydantic JSON schema (draft 2020-12) is rewritten: `$ref`s inlined with their sibling
description, `anyOf [X, null]` -> X + `nullable: true`, `const` -> one-value `enum`, numeric
`exclusiveMinimum: x` -> `minimum: x, exclusiveMinimum: true`, a discriminated union -> one object
whose tag is an enum, `additionalProperties: false` dropped (the API server prunes or, with
kubectl's default strict field validation, rejects unknown fields; a map keeps its value schema),
`title` dropped. Defaults stay, so the API server fills them in and `kubectl get -o yaml` shows
the values the components use.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter

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
        tag = next(
            k
            for k, p in variants[0]["properties"].items()
            if len(p.get("enum", [])) == 1
            and all(len(v["properties"].get(k, {}).get("enum", [])) == 1 for v in variants)
        )
        props: dict[str, Any] = {}
        for v in variants:
            for k, p in v.get("properties", {}).items():
                props.setdefault(k, p)
        tags = [v["properties"][tag]["enum"][0] for v in variants]
        for k in props:  # the API server would fill a variant's default into every other variant
            if not all(v["properties"].get(k, {}).get("default") == props[k].get("default") for v in variants):
                props[k] = {key: val for key, val in props[k].items() if key != "default"}
        props[tag] = {
            "type": "string",
            "enum": tags,
            "description": " ".join(
                f"`{t}`: {v['properties'][tag].get('description', '')}" for t, v in zip(tags, variants)
            ),
        }
        rules = []
        for t, v in zip(tags, variants):
            need = [k for k in v.get("required", []) if k != tag]
            foreign = [k for k in props if k not in v["properties"]]
            if need:
                rules.append(
                    {
                        "rule": f"self.{tag} != '{t}' || ({' && '.join(f'has(self.{k})' for k in need)})",
                        "message": f"{tag} {t} requires {', '.join(need)}",
                    }
                )
            if foreign:
                rules.append(
                    {
                        "rule": f"self.{tag} != '{t}' || !({' || '.join(f'has(self.{k})' for k in foreign)})",
                        "message": f"{tag} {t} takes none of: {', '.join(foreign)}",
                    }
                )
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
            default = info.get_default(call_default_factory=True)
            adapter = TypeAdapter(info.annotation or Any)  # `annotation` is None only on a field pydantic rejects
            prop["default"] = adapter.dump_python(default, mode="json")


_ORDER = (
    "type",
    "description",
    "nullable",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minItems",
    "maxLength",
    "required",
    "items",
    "properties",
)


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
