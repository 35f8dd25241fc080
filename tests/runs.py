"""The one builder of the RLRun bundles tests run on: `rlrun`, `pool` and `relay_tier` make one document each
(a dict, as YAML would load it), `bundle_yaml` joins documents into the text `parse_bundle` reads, `extended`
appends them to a bundle's text (an example's, say), and `write_rlrun` writes them to a file for `load_bundle`
or a CLI's --config.

Defaults are what the tests share: a run named "arithmetic" on the builtin tiny model and the arithmetic task.
Everything else is a spec field given by its YAML name (`sampling={"groupSize": 2}`, `lengthPenalty=...`), so a
document reads like the YAML it stands for and the parser under test sees exactly that. A test about the text
itself (parse errors, the messages for one specific YAML) keeps its text instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlfleet.config import API_VERSION

Doc = dict[str, Any]


def rlrun(
    name: str = "arithmetic",
    *,
    model: str | Path | dict = "builtin://tiny-arithmetic",
    task: dict | None = None,
    store: str | Path | None = None,
    **spec: Any,
) -> Doc:
    """An RLRun: `model` a path (or its whole mapping), `task` the arithmetic task's fields over its type (a
    `type` in it picks another task), `store` a directory (a file:// store) or a URI; `spec` any other field."""
    fields: dict[str, Any] = {"model": model if isinstance(model, dict) else {"path": str(model)}}
    fields["task"] = {"type": "arithmetic", **(task or {})}
    fields.update(spec)
    if store is not None:
        fields["store"] = {"uri": f"file://{store}" if isinstance(store, Path) else store}
    return _doc("RLRun", name, fields)


def pool(name: str = "pool", run: str = "arithmetic", **spec: Any) -> Doc:
    """An InferencePool of `run`; `spec` its other fields (replicas, maxPending, ingestUrl, engine, ...)."""
    return _doc("InferencePool", name, {"run": run, **spec})


def relay_tier(name: str, run: str = "arithmetic", tier: int = 0, **spec: Any) -> Doc:
    """A RelayTier of `run` at `tier`; `spec` its other fields (replicas, upstream, ...)."""
    return _doc("RelayTier", name, {"run": run, "tier": tier, **spec})


def bundle_yaml(*docs: Doc) -> str:
    """The documents as one YAML stream, keys in the order given (as a person would write them)."""
    return yaml.safe_dump_all(docs, sort_keys=False)


def extended(text: str, *docs: Doc) -> str:
    """A bundle's YAML `text` (an example's, say) with `docs` after it."""
    return text.rstrip("\n") + "\n---\n" + bundle_yaml(*docs)


def write_rlrun(path: Path, *docs: Doc) -> Path:
    """`bundle_yaml(*docs)` written to `path`; returns `path`."""
    path.write_text(bundle_yaml(*docs))
    return path


def _doc(kind: str, name: str, spec: dict[str, Any]) -> Doc:
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name}, "spec": spec}
