"""The config documents pods read, and the hash on each pod template that rolls the pods when (and only
when) what they read changes.

Both are derived from the components' views (rlfleet/wire/views.py), the same views the processes
read their config through:
  each pod       hash = sha256(the run document projected through its component's view; for a worker,
                 then its pool document projected through the pool part of the view). A field no view
                 names (replicas, gpus, images, Secret names, resources, podTemplate, suspend,
                 deadlines...) is in no document and no hash, so `kubectl scale`, an HPA or KEDA, or a
                 scheduling change never changes a config or a config hash (the pod template changes by
                 itself where such a field matters to it);
  run ConfigMap  the widest projection, the union of the views of the components that mount it
                 (trainer, verifier, origin, ingest, relays): each of them cuts its own view from it;
  pool ConfigMap the run and the pool as the rollout view reads them;
  UNTRUSTED      workers that post to an ingest, and every pod of a run trained in another cluster, get
                 neither the Redis URL nor the store nor the ingest's settings (cut after the view).
The views are a parameter of every function here (default: VIEWS), so a test can add a field to one
view and see which pods roll.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping

import yaml

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import names
from rlfleet.wire.views import VIEWS, View, project, union

Views = Mapping[str, View]
# What an untrusted pod's document leaves out (dotted paths, as views name fields).
UNTRUSTED = [tuple(path.split(".")) for path in ("spec.redis.url", "spec.store", "spec.ingest")]
# The components whose pods mount the run's ConfigMap (workers mount their pool's).
RUN_READERS = (names.TRAINER, names.VERIFIER, names.ORIGIN, names.INGEST, names.RELAY)


def _drop(doc: dict, paths) -> dict:
    doc = copy.deepcopy(doc)
    for path in paths:
        node: dict | None = doc
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return doc


def _dump(obj: RLRun | InferencePool | RelayTier) -> dict:
    return obj.model_dump(mode="json", by_alias=True, exclude_none=True)


def document(obj: RLRun | InferencePool | RelayTier, views: Views = VIEWS) -> dict:
    """A config model as the widest document its readers get: the union of the views of its kind."""
    return project(_dump(obj), union(views.values(), obj.kind))


def untrusted(doc: dict) -> dict:
    """A run document for pods that must not reach Redis, the store or the ingest's settings."""
    return _drop(doc, UNTRUSTED)


def _run_doc(run: RLRun, paths) -> dict:
    doc = project(_dump(run), paths)
    return untrusted(doc) if run.spec.remote else doc


def run_document(run: RLRun, views: Views = VIEWS) -> dict:
    """The run's ConfigMap document (the union of its readers' views)."""
    return _run_doc(run, union([views[c] for c in RUN_READERS]))


def text(*docs: dict) -> str:
    return yaml.safe_dump_all(list(docs), sort_keys=False)


def run_config_text(run: RLRun, views: Views = VIEWS) -> str:
    return text(run_document(run, views))


def pool_config_text(run: RLRun, pool: InferencePool, views: Views = VIEWS) -> str:
    """The pool's ConfigMap: the run as a worker reads it, then the pool."""
    view = views[names.ROLLOUT]
    doc = _run_doc(run, view.run)
    if pool.spec.ingest_url:
        doc = untrusted(doc)
    return text(doc, project(_dump(pool), view.pool))


def config_hash(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()[:16]


def run_reader_hash(run: RLRun, component: str, views: Views = VIEWS) -> str:
    """Hash of what `component` reads from the run's ConfigMap: its view of the run."""
    return config_hash(text(_run_doc(run, views[component].run)))
