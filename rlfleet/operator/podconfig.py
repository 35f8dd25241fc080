"""The config documents pods read, and the hash on each pod template that rolls the pods when (and only
when) what they read changes.

A component reads its RLRun YAML (and a worker its InferencePool document) from a ConfigMap. What goes
in, and what is hashed, is a projection of the documents:
  ORCHESTRATION  fields no process reads (replicas, gpus, images, Secret names, resources, podTemplate,
                 suspend, deadlines...): left out of every document, so `kubectl scale`, an HPA or KEDA,
                 or a scheduling change never changes a config or a config hash (the pod template
                 changes by itself where such a field matters to it);
  other readers  every component but the trainer reads only `trainer.maxAsyncLevel`, `trainer.batchSize`
                 (a worker sizes the queue it keeps for the trainer by it) and `trainer.seed` (a worker
                 starts its engine from the builtin build of that seed) of spec.trainer
                 (tests/operator/test_pod_config.py keeps this true), so their hash leaves out the rest:
                 `trainer.steps` restarts the trainer alone;
  servers        relays, the origin and the ingest read only a few sections of spec (SERVER_READS; the
                 same test file keeps it true), so sampling, the task or the model roll the pods that
                 generate, verify and train, never the ones that move bytes;
  UNTRUSTED      workers that post to an ingest, and every pod of a run trained in another cluster, get
                 neither the Redis URL nor the store nor the ingest's settings.
Invariant: for each pod, hash = sha256(the exact projection it reads); the run's ConfigMap holds the
trainer's projection (the widest), which every other reader's projection is a sub-document of.
"""

from __future__ import annotations

import copy
import hashlib

import yaml

from rlfleet.config import InferencePool, RelayTier, RLRun
from rlfleet.operator import names

# Paths (camelCase, under the document) that no component process reads.
ORCHESTRATION = {
    "RLRun": [
        ("spec", "suspend"),
        ("spec", "remote"),
        ("spec", "image"),
        ("spec", "origin"),
        ("spec", "activeDeadlineSeconds"),
        ("spec", "ttlSecondsAfterFinished"),
        ("spec", "redis", "urlSecret"),
        ("spec", "store", "credentialsSecret"),
        ("spec", "shardcast", "signingKeySecret"),
        ("spec", "ingest", "tokens"),
        ("spec", "ingest", "resources"),
        ("spec", "ingest", "podTemplate"),
        *(("spec", "trainer", f) for f in ("replicas", "gpus", "gpuResource", "resources", "podTemplate")),
        *(("spec", "verifier", f) for f in ("replicas", "resources", "podTemplate")),
    ],
    "InferencePool": [
        ("spec", f)
        for f in (
            "replicas",
            "gpus",
            "gpuResource",
            "image",
            "relay",
            "workerTokens",
            "resources",
            "podTemplate",
            "maxUnavailable",
        )
    ],
}
UNTRUSTED = [("spec", "redis", "url"), ("spec", "store"), ("spec", "ingest")]
TRAINER_FIELDS_OTHERS_READ = ("maxAsyncLevel", "batchSize", "seed")
# The spec sections each server component reads (with apiVersion, kind and metadata).
SERVER_READS = {
    names.RELAY: ("redis", "shardcast"),
    names.ORIGIN: ("redis", "store"),
    names.INGEST: ("redis", "ingest"),
}


def _drop(doc: dict, paths) -> dict:
    doc = copy.deepcopy(doc)
    for path in paths:
        node: dict | None = doc
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return doc


def document(obj: RLRun | InferencePool | RelayTier) -> dict:
    """A config model as the YAML document its readers get: orchestration fields and cluster-only
    metadata left out (see ORCHESTRATION)."""
    doc = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["metadata"] = {"name": obj.metadata.name}
    return _drop(doc, ORCHESTRATION.get(obj.kind, []))


def untrusted(doc: dict) -> dict:
    """A run document for pods that must not reach Redis, the store or the ingest's settings."""
    return _drop(doc, UNTRUSTED)


def for_others(doc: dict) -> dict:
    """A run document as every component but the trainer reads it (spec.trainer cut to what they read)."""
    doc = copy.deepcopy(doc)
    trainer = doc["spec"].get("trainer") or {}
    doc["spec"]["trainer"] = {k: v for k, v in trainer.items() if k in TRAINER_FIELDS_OTHERS_READ}
    return doc


def run_document(run: RLRun) -> dict:
    """The run's ConfigMap document (the trainer's projection, the widest)."""
    doc = document(run)
    return untrusted(doc) if run.spec.remote else doc


def text(*docs: dict) -> str:
    return yaml.safe_dump_all(list(docs), sort_keys=False)


def run_config_text(run: RLRun) -> str:
    return text(run_document(run))


def pool_config_text(run: RLRun, pool: InferencePool) -> str:
    """The pool's ConfigMap: the run as a worker reads it, then the pool."""
    doc = for_others(run_document(run))
    if pool.spec.ingest_url:
        doc = untrusted(doc)
    return text(doc, document(pool))


def config_hash(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()[:16]


def for_server(doc: dict, component: str) -> dict:
    """The part of a run document a relay, the origin or the ingest reads (SERVER_READS)."""
    spec = {k: v for k, v in doc["spec"].items() if k in SERVER_READS[component]}
    return {**{k: v for k, v in doc.items() if k != "spec"}, "spec": copy.deepcopy(spec)}


def run_reader_hash(run: RLRun, component: str) -> str:
    """Hash of what `component` reads from the run's ConfigMap."""
    doc = run_document(run)
    if component in SERVER_READS:
        return config_hash(text(for_server(doc, component)))
    return config_hash(text(doc if component == names.TRAINER else for_others(doc)))
