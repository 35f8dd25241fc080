"""The one config tree: RLRun, InferencePool and RelayTier (apiVersion rlfleet.io/v1alpha1).

The same multi-document YAML is read by `rlfleet run FILE` on one machine and applied with
`kubectl apply -f FILE` on a cluster. Field names are camelCase in YAML (Kubernetes style) and
snake_case in Python. Unknown fields are errors, so a typo never becomes a silent default, and so is a key
given twice in one mapping (strict_yaml.py), so a second value never silently replaces the first.
`load_bundle` collects every error of every document, each with its field path.

The models live in this package's modules, one per part of the spec (tasks, training, verifier,
infra, resources); everything is importable from `rlfleet.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from rlfleet.config import strict_yaml
from rlfleet.config.base import API_VERSION, NAME_PATTERN, Metadata, Spec
from rlfleet.config.evaluation import EvalSpec
from rlfleet.config.infra import AdmissionSpec, DeltaSpec, IngestSpec, RedisSpec, ShardcastSpec, StoreSpec
from rlfleet.config.model import ModelSpec
from rlfleet.config.resources import (
    KINDS,
    LOCAL_POOL,
    InferencePool,
    InferencePoolSpec,
    RelayTier,
    RelayTierSpec,
    RLRun,
    RLRunSpec,
    VLLMSpec,
    worker_dtype,
)
from rlfleet.config.tasks import (
    TASK_TYPES,
    ArithmeticTaskSpec,
    CodeTaskSpec,
    DatasetSpec,
    DatasetTaskFields,
    LengthPenaltySpec,
    MathTaskSpec,
    MixtureSourceSpec,
    MixtureTaskSpec,
    PythonTaskSpec,
    SingleTaskSpec,
    TaskSpec,
    task_datasets,
    task_sources,
)
from rlfleet.config.tracking import MlflowSpec, TrackingSpec, WandbSpec
from rlfleet.config.training import OnlineFilterSpec, SamplingSpec, TrainerSpec
from rlfleet.config.verifier import BanPolicySpec, RejectionReason, ToplocSpec, VerifierSpec

__all__ = [
    "API_VERSION",
    "KINDS",
    "LOCAL_POOL",
    "NAME_PATTERN",
    "TASK_TYPES",
    "ArithmeticTaskSpec",
    "BanPolicySpec",
    "Bundle",
    "CodeTaskSpec",
    "ConfigError",
    "DatasetSpec",
    "DatasetTaskFields",
    "DeltaSpec",
    "EvalSpec",
    "InferencePool",
    "InferencePoolSpec",
    "AdmissionSpec",
    "IngestSpec",
    "LengthPenaltySpec",
    "MathTaskSpec",
    "MixtureSourceSpec",
    "MixtureTaskSpec",
    "MlflowSpec",
    "OnlineFilterSpec",
    "PythonTaskSpec",
    "SingleTaskSpec",
    "Metadata",
    "ModelSpec",
    "RLRun",
    "RLRunSpec",
    "RedisSpec",
    "RejectionReason",
    "RelayTier",
    "RelayTierSpec",
    "SamplingSpec",
    "ShardcastSpec",
    "Spec",
    "StoreSpec",
    "TaskSpec",
    "ToplocSpec",
    "TrackingSpec",
    "TrainerSpec",
    "VLLMSpec",
    "VerifierSpec",
    "WandbSpec",
    "load_bundle",
    "task_datasets",
    "task_sources",
    "parse_bundle",
    "validation_problems",
    "worker_dtype",
]


@dataclass
class Bundle:
    """The documents of one file: exactly one RLRun, any pools and relay tiers that name it."""

    run: RLRun
    pools: list[InferencePool] = field(default_factory=list)
    relays: list[RelayTier] = field(default_factory=list)

    def pool(self, name: str | None, source: str = "<config>") -> tuple[str, InferencePoolSpec]:
        """The InferencePool a worker serves: `name`, else the file's only pool, else (no pool documents)
        the defaults of InferencePoolSpec under the name `local`. An unknown name lists the pools."""
        names = [p.metadata.name for p in self.pools]
        if name is None and len(self.pools) <= 1:
            chosen = self.pools[0] if self.pools else None
        else:
            chosen = next((p for p in self.pools if p.metadata.name == name), None)
            if chosen is None:
                listed = ", ".join(names) or "none (the file has no InferencePool documents)"
                problem = (f"--pool {name!r} is not an InferencePool of this file; its pools: {listed}" if name
                           else f"--pool is required: this file has several InferencePools: {listed}")  # fmt: skip
                raise ConfigError(source, [problem])
        if chosen is None:
            return LOCAL_POOL, InferencePoolSpec(run=self.run.metadata.name)
        return chosen.metadata.name, chosen.spec


class ConfigError(Exception):
    """Every problem found in a config file, one line each: `document N (Kind name): field.path: message`."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def report(self) -> str:
        return "\n".join(f"{self.source}: {p}" for p in self.problems)


def _field_path(loc: tuple) -> str:
    # A discriminated union puts its tag in the path (spec.task.arithmetic.x); users wrote spec.task.x.
    parts = [str(p) for i, p in enumerate(loc) if not (i > 0 and loc[i - 1] == "task" and p in TASK_TYPES)]
    return ".".join(parts) or "(document)"


def _parse_document(index: int, doc: object, problems: list[str]) -> Spec | None:
    where = f"document {index}"
    if not isinstance(doc, dict):
        problems.append(f"{where}: expected a mapping with apiVersion, kind, metadata and spec")
        return None
    kind = doc.get("kind")
    name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
    if name:
        where += f" ({kind} {name})"
    if kind not in KINDS:
        problems.append(f"{where}: kind: {kind!r} is not one of {', '.join(KINDS)}")
        return None
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"{where}: apiVersion: {doc.get('apiVersion')!r} must be {API_VERSION!r}")
        return None
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        problems.extend(f"{where}: {p}" for p in validation_problems(exc))
        return None


def validation_problems(exc: ValidationError) -> list[str]:
    """One `field.path: message` line per error, in the words a YAML author needs."""
    problems = []
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; fields are camelCase)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        problems.append(f"{_field_path(err['loc'])}: {msg}")
    return problems


def parse_bundle(text: str, source: str = "<config>") -> Bundle:
    """Parse a multi-document YAML string into a Bundle, or raise ConfigError listing every problem."""
    problems: list[str] = []
    try:
        docs = [d for d in strict_yaml.load_all(text) if d is not None]
        parsed = [_parse_document(i, d, problems) for i, d in enumerate(docs)]
    except strict_yaml.DuplicateKeyError as exc:
        raise ConfigError(source, [str(exc)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    except RecursionError:
        raise ConfigError(source, ["nested too deeply to read (thousands of levels); an rlfleet config is a "
                                   "few levels deep: check the file for runaway brackets"]) from None  # fmt: skip
    runs = [p for p in parsed if isinstance(p, RLRun)]
    pools = [p for p in parsed if isinstance(p, InferencePool)]
    relays = [p for p in parsed if isinstance(p, RelayTier)]
    if not problems and len(runs) != 1:
        problems.append(f"expected exactly one RLRun document, found {len(runs)}")
    if not problems:
        run_name = runs[0].metadata.name
        others: list[InferencePool | RelayTier] = [*pools, *relays]
        for other in others:
            if other.spec.run != run_name:
                problems.append(
                    f"{other.kind} {other.metadata.name}: spec.run: {other.spec.run!r} names no RLRun in this file "
                    f"(expected {run_name!r})"
                )
        problems += _pool_problems(runs[0], pools)
    if problems:
        raise ConfigError(source, problems)
    return Bundle(run=runs[0], pools=pools, relays=relays)


def _pool_problems(run: RLRun, pools: list[InferencePool]) -> list[str]:
    """What a pool asks of its run that the run does not give: room in the inbox, an admitted engine and dtype."""
    problems, spec = [], run.spec
    for pool in pools:
        where = f"InferencePool {pool.metadata.name}"
        if pool.spec.max_pending >= spec.redis.stream_max_len:
            problems.append(
                f"{where}: spec.maxPending: {pool.spec.max_pending} must be below the run's redis.streamMaxLen "
                f"({spec.redis.stream_max_len}); lower it or raise streamMaxLen"
            )
        if pool.spec.engine in ("vllm", "auto") and "vllm" not in spec.verifier.engines:
            problems.append(
                f"{where}: spec.engine: {pool.spec.engine} may draw with vLLM, whose groups the gate "
                f"refuses unless the run admits them: add vllm to RLRun spec.verifier.engines (or use engine: torch)"
            )
        if pool.spec.dtype is not None and pool.spec.dtype != worker_dtype(spec):
            declared = (
                "spec.verifier.workerDtype" if spec.verifier.worker_dtype else "spec.model.dtype (no workerDtype)"
            )
            problems.append(
                f"{where}: spec.dtype: {pool.spec.dtype} is not the dtype the run admits for its workers: RLRun "
                f"{declared} is {worker_dtype(spec)}; set RLRun spec.verifier.workerDtype: {pool.spec.dtype} or drop "
                f"the pool's dtype"
            )
    return problems


def load_bundle(path: str | Path) -> Bundle:
    """Read and validate a config file (see parse_bundle)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                                      "save the file as UTF-8"]) from None  # fmt: skip
    return parse_bundle(text, str(path))
