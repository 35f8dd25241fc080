"""What each component process reads of the config: its view, declared apart from the code that reads it.

A view lists field paths (camelCase, dotted, under `spec`) of the RLRun and, for a rollout worker, of its
InferencePool. A path names a whole section (`sampling`) or one field of a section (`trainer.seed`).
apiVersion, kind and metadata.name are in every view. Two things are derived from a view, and nothing
else says what a component reads:
  - the process gets its config through it: `view_bundle` cuts each document of the loaded bundle to the
    view, as typed objects that hold only the view's fields; reading any other field of the spec raises
    ViewError naming the field and this file (`component_context` does this for every component);
  - the operator writes into each pod's config document, and hashes onto its pod template, exactly
    `project(document, paths)` (rlfleet/operator/podconfig.py).
So a field added to a component's view rolls that component's pods and no others', and a field in no
view (replicas, gpus, images, Secret names, resources, podTemplate, suspend, deadlines...) is in no
document and no hash: `kubectl scale`, an HPA or a scheduling change never restarts a process.
Invariants: every path names a field of its model (checked when a View is made); a path cuts into a
section only where the section is a config model; a projection keeps the document's key order, so the
same view over the same spec gives the same text (and hash).
"""

from __future__ import annotations

import copy
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, create_model

from rlfleet.config import Bundle
from rlfleet.config.resources import InferencePool, InferencePoolSpec, RLRun, RLRunSpec
from rlfleet.wire import components

__all__ = ["PUBLIC", "VIEWS", "View", "ViewError", "project", "union", "view_bundle"]


class ViewError(Exception):
    """A process read a config field outside its component's view."""


# --- paths as trees -------------------------------------------------------------------------------------
# A tree maps a field (python name) to None (the whole field) or to the tree of the fields read inside it.


def _section_model(annotation) -> type[BaseModel] | None:
    """The config model of a section field (`X` or `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _section_model(models[0])
    return None


def _by_alias(model: type[BaseModel]) -> dict[str, str]:
    return {(f.alias or n): n for n, f in model.model_fields.items()}


def _tree(model: type[BaseModel], paths, where: str) -> dict:
    tree: dict = {}
    for path in paths:
        node, current = tree, model
        keys = path.split(".")
        for i, key in enumerate(keys):
            name = _by_alias(current).get(key)
            if name is None:
                raise ValueError(f"{where}: {path!r}: {current.__name__} has no field {key!r} (paths are camelCase)")
            if i == len(keys) - 1:
                node[name] = None
                break
            sub = _section_model(current.model_fields[name].annotation)
            if sub is None:
                raise ValueError(f"{where}: {path!r}: {key} is not a section; name it whole")
            if name in node and node[name] is None:
                break  # the whole section is already read
            node, current = node.setdefault(name, {}), sub
    return tree


@dataclass(frozen=True)
class View:
    """The fields of the RLRun spec (`run`) and of the InferencePool spec (`pool`) one component reads."""

    component: str
    run: tuple[str, ...]
    pool: tuple[str, ...] = ()

    def __post_init__(self):
        _tree(RLRunSpec, self.run, f"{self.component} view, run")
        _tree(InferencePoolSpec, self.pool, f"{self.component} view, pool")

    def paths(self, kind: str) -> tuple[str, ...]:
        return {"RLRun": self.run, "InferencePool": self.pool}.get(kind, ())

    def with_paths(self, run: tuple[str, ...] = (), pool: tuple[str, ...] = ()) -> View:
        """This view with more paths (a test's view set, a component learning to read a field)."""
        return View(self.component, (*self.run, *run), (*self.pool, *pool))


def _fields(section_and_fields: str) -> tuple[str, ...]:
    """'section: a b c' -> ('section.a', 'section.b', 'section.c')."""
    section, fields = section_and_fields.split(":")
    return tuple(f"{section}.{f}" for f in fields.split())


# Sections every component that generates, verifies or trains reads whole.
_POLICY = ("model", "task", "lengthPenalty", "sampling")
# spec.trainer as the trainer reads it (its replicas, gpus, resources and pod template are the operator's).
_TRAINER = _fields(
    "trainer: steps batchSize learningRate weightDecay epsLow epsHigh delta maxGradNorm epochs maxAsyncLevel"
    " normalization entropyCoef klCoef warmupSteps lrSchedule skipZeroAdvantageGroups seed sharding lora"
    " microBatchTokens logprobChunk activationCheckpointing masterWeights offPolicy checkpointEvery"
    " collectiveTimeoutSeconds"
)
# spec.trainer as the others read it: a worker sizes the queue it keeps for the trainer by batchSize, starts
# its engine from the builtin build of seed and holds back the groups skipZeroAdvantageGroups would drop;
# everyone bounds staleness by maxAsyncLevel.
_TRAINER_OTHERS = _fields("trainer: maxAsyncLevel batchSize seed skipZeroAdvantageGroups")
_VERIFIER = _fields(
    "verifier: toploc engines workerDevice workerDtype logprobTolerance topPTolerance replayTolerance"
    " maxReplayMismatchShare maxRunningMismatchShare spotCheckFraction claimIdleMs"
    " maxAttempts maxMessageBytes ban"
)
_REDIS = _fields("redis: url streamMaxLen roleUrls")
# What only the verifier reads of the verifier and redis sections (a change rolls no worker).
_VERIFIER_ONLY = ("verifier.residentVersions", "redis.auditStreamMaxBytes")
_STORE = _fields("store: uri endpointUrl")
_SHARDCAST = _fields(
    "shardcast: keepVersions requireSignatures publicKey shardSizeBytes relayMaxDiskBytes deltas minRateBytesPerSecond"
)
_INGEST = _fields(
    "ingest: tokensFile maxBodyBytes ratePerMinute maxBacklog maxBufferedBytes requestTimeoutSeconds"
    " maxConnections redisTimeoutSeconds"
)
# What the ingest tells a joining worker (the public run document, rlfleet/services/ingest/door.py).
PUBLIC = (*_POLICY, *_TRAINER_OTHERS, *_VERIFIER, *_SHARDCAST)
_GENERATORS = (*_POLICY, *_TRAINER_OTHERS, *_VERIFIER, *_REDIS, *_STORE, *_SHARDCAST, *_INGEST)

VIEWS: dict[str, View] = {
    v.component: v
    for v in (
        # spec.tracking: the trainer alone logs to the run's trackers; eval: the held-out evaluation runs in the
        # trainer (rlfleet/services/trainer/evaluation.py)
        View(
            components.TRAINER,
            (*_POLICY, *_TRAINER, *_VERIFIER, *_REDIS, *_STORE, *_SHARDCAST, *_INGEST, "tracking", "eval"),
        ),
        View(components.VERIFIER, (*_GENERATORS, "ingest.admission.probationGroups", *_VERIFIER_ONLY)),
        View(
            components.ROLLOUT,
            _GENERATORS,
            pool=("run", "engine", "dtype", "maxPending", "maxGroupsInFlight", "ingestUrl", "vllm"),
        ),
        # Relays and the origin move bytes: sampling, the task or the model never roll them. The ingest serves
        # the run document, so what a worker must know of the run rolls it.
        View(components.RELAY, (*_REDIS, *_SHARDCAST)),
        View(components.ORIGIN, (*_REDIS, *_STORE)),
        View(components.INGEST, (*_REDIS, *_INGEST, "ingest.admission", *PUBLIC)),
    )
}


def union(views, kind: str = "RLRun") -> tuple[str, ...]:
    """The paths of `kind` any of `views` reads (a document every one of them can read)."""
    return tuple(dict.fromkeys(p for v in views for p in v.paths(kind)))


# --- the dict projection (what the operator writes and hashes) ------------------------------------------


def _cut_dict(doc: dict, model: type[BaseModel], tree: dict) -> dict:
    aliases, out = _by_alias(model), {}
    for key, value in doc.items():  # the document's order, so the text is stable
        name = aliases.get(key)
        if name is None or name not in tree:
            continue
        sub = tree[name]
        if sub is None or not isinstance(value, dict):
            out[key] = copy.deepcopy(value)
        else:
            section = _section_model(model.model_fields[name].annotation)
            assert section is not None  # _tree descends only into fields whose type is a config model
            out[key] = _cut_dict(value, section, sub)
    return out


_SPECS: dict[str, type[BaseModel]] = {"RLRun": RLRunSpec, "InferencePool": InferencePoolSpec}


def project(doc: dict, paths) -> dict:
    """A document (camelCase, as dumped by alias) cut to apiVersion, kind, metadata.name and `paths` of
    its spec."""
    model = _SPECS[doc["kind"]]
    out = {k: copy.deepcopy(v) for k, v in doc.items() if k not in ("metadata", "spec")}
    out["metadata"] = {"name": doc["metadata"]["name"]}
    out["spec"] = _cut_dict(doc.get("spec") or {}, model, _tree(model, paths, doc["kind"]))
    return out


# --- the typed projection (what a process reads) --------------------------------------------------------


class _ViewModel(BaseModel):
    """Base of the generated view classes: a field of the full model outside the view raises ViewError."""

    full: ClassVar[type[BaseModel] | None] = None
    where: ClassVar[str] = ""

    def __getattr__(self, name: str) -> Any:
        full = type(self).full
        if full is not None and name in full.model_fields:
            alias = full.model_fields[name].alias or name
            raise ViewError(
                f"{type(self).where}.{alias} is not in this component's view: add it to the view in "
                "rlfleet/wire/views.py, so the operator rolls this component's pods when it changes"
            )
        # pydantic defines BaseModel.__getattr__ (private attributes, else AttributeError) only outside
        # TYPE_CHECKING, so that checkers flag unknown attributes: its stubs do not show the method.
        return super().__getattr__(name)  # type: ignore[misc]


@cache
def _view_class(model: type[BaseModel], paths: tuple[str, ...], where: str) -> type[BaseModel]:
    return _class_of(model, _freeze(_tree(model, paths, where)), where)


def _freeze(tree: dict):
    return tuple((k, None if v is None else _freeze(v)) for k, v in tree.items())


@cache
def _class_of(model: type[BaseModel], tree: tuple, where: str) -> type[BaseModel]:
    # name -> (annotation, FieldInfo or default). Any, not tuple[Any, Any]: a **dict spread into create_model
    # must also fit its named parameters (__base__, __module__...) as far as a type checker can tell.
    fields: dict[str, Any] = {}
    for name, sub in tree:
        info = model.model_fields[name]
        if sub is None:
            fields[name] = (info.annotation, copy.copy(info))
        else:
            section = _section_model(info.annotation)
            section_cls = _class_of(section, sub, f"{where}.{info.alias or name}")
            optional = section is not info.annotation
            fields[name] = (section_cls | None if optional else section_cls, None if optional else ...)
    cls = create_model(f"{model.__name__}View", __base__=_ViewModel, **fields)
    cls.full, cls.where = model, where
    return cls


def _cut(obj: BaseModel | None, cls: type[BaseModel]):
    if obj is None:
        return None
    values = {}
    for name in cls.model_fields:
        value, section = getattr(obj, name), _section_model(cls.model_fields[name].annotation)
        values[name] = _cut(value, section) if section is not None and issubclass(section, _ViewModel) else value
    return cls.model_construct(**values)


_Doc = TypeVar("_Doc", RLRun, InferencePool)


def _view_document(doc: _Doc, spec_cls: type[BaseModel]) -> _Doc:
    # No re-validation: the document was validated whole; the view only hides fields.
    return doc.model_copy(update={"spec": _cut(doc.spec, spec_cls)})


def view_bundle(bundle: Bundle, view: View) -> Bundle:
    """The bundle as `view.component` reads it: each run and pool spec cut to the view (reading a field
    outside it raises ViewError); the relay tiers, which only the operator and the launcher read, dropped."""
    run_cls = _view_class(RLRunSpec, view.run, f"{view.component}: RLRun spec")
    pool_cls = _view_class(InferencePoolSpec, view.pool, f"{view.component}: InferencePool spec")
    run: RLRun = _view_document(bundle.run, run_cls)
    pools: list[InferencePool] = [_view_document(p, pool_cls) for p in bundle.pools] if view.pool else []
    return Bundle(run=run, pools=pools)
