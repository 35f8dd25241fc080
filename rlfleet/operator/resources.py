"""Custom resources as the operator reads them: a body from the API server -> its config model, and
what a cluster needs spelled out that `rlfleet run` fills in by itself. Errors say what is wrong and the fix."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from rlfleet.config import KINDS, RLRun, validation_problems
from rlfleet.operator import names


class SpecError(ValueError):
    """A custom resource that cannot be reconciled; `problems` are `field.path: what is wrong and the fix`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


class MissingDependency(SpecError):
    """The resource names another one that does not exist (yet): worth retrying, not a bad spec."""


def parse_resource(body: dict) -> BaseModel:
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


def check_cluster_run(run: RLRun) -> None:
    """What `rlfleet run` fills in by itself but a cluster needs spelled out; raises SpecError."""
    spec, problems = run.spec, []
    if not spec.redis.url and not spec.redis.url_secret:
        problems.append(
            "spec.redis.url: required on a cluster: set a redis:// URL or spec.redis.urlSecret (a Secret with key "
            "`url`)"
        )
    if spec.remote:
        pass  # trained elsewhere: pools and relays here never touch the store
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
            "with "
            "keys `signing-key` (PEM ed25519) and `public-key`, or set spec.shardcast.requireSignatures: false"
        )
    longest = len(names.trainer(run.metadata.name))
    if longest > names.MAX_STATEFULSET_NAME:
        problems.append(
            f"metadata.name: at most {names.MAX_STATEFULSET_NAME - len(names.trainer(''))} characters on a cluster "
            f"(the trainer StatefulSet {names.trainer(run.metadata.name)!r} would exceed {names.MAX_STATEFULSET_NAME})"
        )
    if problems:
        raise SpecError(problems)
