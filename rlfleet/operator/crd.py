"""CustomResourceDefinitions for RLRun, InferencePool and RelayTier, generated from the config models.

`rlfleet crds --out crds/` writes them; `crds/*.yaml` are checked in and a test fails when they
drift from this generator. The spec schema is the config model's, made structural by schema.py;
cross-field rules that a JSON schema cannot say are CEL rules (`x-kubernetes-validations`).
"""

from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlfleet.config import InferencePoolSpec, RelayTierSpec, RLRunSpec
from rlfleet.operator import names, peering
from rlfleet.operator.schema import structural_schema

# CEL rules for what one field's schema cannot say.
# The operator refuses file:// stores (check_cluster_run: pods on different nodes cannot share a directory),
# so a cluster's CRD takes only s3:// (StoreSpec._scheme also takes file:// for `rlfleet run`).
STORE_RULES = [
    {
        "rule": "!has(self.uri) || self.uri == '' || self.uri.startsWith('s3://')",
        "message": "uri must start with s3:// on a cluster (file:// is a directory pods on other nodes cannot read)",
        "fieldPath": ".uri",
    }
]
# One CA bundle per run (TrustSpec._one_bundle): a Secret or a ConfigMap.
TLS_RULES = [
    {
        "rule": "!has(self.caSecret) || !has(self.caConfigMap)",
        "message": "name the CA bundle once, in caSecret or in caConfigMap, not both",
    }
]
# A pool's or tier's run is what its children are built from and tied to: moving it would leave them with
# the old run's owner reference and labels. Delete and re-create it instead.
RUN_REF_RULES = [{"rule": "self == oldSelf", "message": "spec.run is immutable: delete and re-create the object"}]
MAX_RUN_NAME = names.MAX_STATEFULSET_NAME - len(names.trainer(""))
RUN_RULES = [
    {
        "rule": f"size(self.metadata.name) <= {MAX_RUN_NAME}",
        "message": f"metadata.name: at most {MAX_RUN_NAME} characters on a cluster "
        "(the trainer StatefulSet is NAME-trainer, at most 52)",
    }
]


# The status schema (`_status_schema`): a condition, the fields every kind has, then the scale subresource's
# (pools and tiers) or the run's progress (RLRun).
_CONDITION_SCHEMA = {
    "type": "object",
    "description": "One observation of the object's state (Kubernetes condition conventions).",
    "required": ["type", "status"],
    "properties": {
        "type": {
            "type": "string",
            "description": "Condition type: Ready, Suspended, Complete, Failed, TrainerStarted, PodsHealthy, "
            "StateLost (pools and tiers: Ready, Failed).",
        },
        "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown."},
        "reason": {
            "type": "string",
            "description": "CamelCase reason, e.g. Running, Pending, StepsDone, InvalidSpec, SecretKeyMissing, "
            "DeadlineExceeded, StartupDeadlineExceeded, ApplyFailed, ImagePullBackOff, CrashLoopBackOff, "
            "OOMKilled, Unschedulable, RedisStateLost, RunNotFound.",
        },
        "message": {
            "type": "string",
            "description": "Human-readable detail: for InvalidSpec the field path and the fix.",
        },
        "lastTransitionTime": {"type": "string", "format": "date-time", "description": "When status last changed."},
        "observedGeneration": {
            "type": "integer",
            "format": "int64",
            "description": "metadata.generation this condition was computed from.",
        },
    },
}
_STATUS_PROPERTIES = {
    "phase": {
        "type": "string",
        "description": "Pending, Running, Suspended, Failed, Succeeded (pools and tiers: Complete with their run).",
    },
    "observedGeneration": {
        "type": "integer",
        "format": "int64",
        "description": "metadata.generation the operator last reconciled.",
    },
    "conditions": {
        "type": "array",
        "description": "Latest observations; one per type.",
        "items": _CONDITION_SCHEMA,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
    "readyReplicas": {"type": "integer", "format": "int32", "description": "Pods of the main workload that are ready."},
}
_SCALE_STATUS_PROPERTIES = {
    "replicas": {"type": "integer", "format": "int32", "description": "Current replicas (scale subresource)."},
    "selector": {"type": "string", "description": "Label selector of the pods (scale subresource, HPA)."},
}
_RUN_STATUS_PROPERTIES = {
    "step": {
        "type": "integer",
        "format": "int64",
        "description": "Trainer steps committed (each publishes one policy version).",
    },
    "policyVersion": {
        "type": "integer",
        "format": "int64",
        "description": "Newest policy version announced on the policy stream.",
    },
    "reward": {"type": "number", "description": "Mean reward of the newest step, when the trainer announces it."},
    "suspendedSeconds": {
        "type": "integer",
        "format": "int64",
        "description": "Seconds the run spent suspended (ended suspensions); spec.activeDeadlineSeconds "
        "does not count them.",
    },
    "completionTime": {
        "type": "string",
        "format": "date-time",
        "description": "When the run completed or failed; spec.ttlSecondsAfterFinished counts from it.",
    },
    "accepted": {"type": "integer", "format": "int64", "description": "Rollout groups the verifier accepted."},
    "rejected": {"type": "integer", "format": "int64", "description": "Rollout groups the verifier rejected."},
}


def _status_schema(scalable: bool) -> dict:
    """The status of a scalable kind (pools, tiers: the scale subresource's fields) or of an RLRun (its progress);
    a fresh copy each time, so no two CRDs share a mapping."""
    props = {**_STATUS_PROPERTIES, **(_SCALE_STATUS_PROPERTIES if scalable else _RUN_STATUS_PROPERTIES)}
    return deepcopy({"type": "object", "description": "Observed state, written by the operator.", "properties": props})


def _columns(kind: names.KindInfo) -> list[dict]:
    common_tail = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    phase = {
        "name": "Phase",
        "type": "string",
        "jsonPath": ".status.phase",
        "description": "Pending, Running, Suspended, Failed, Succeeded (pools and tiers: Complete).",
    }
    if kind is names.RLRUN:
        return [
            phase,
            {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Trainer steps committed."},
            {
                "name": "Policy",
                "type": "integer",
                "jsonPath": ".status.policyVersion",
                "description": "Newest policy version.",
            },
            {
                "name": "Reward",
                "type": "number",
                "jsonPath": ".status.reward",
                "description": "Mean reward of the newest step.",
            },
            {
                "name": "Accepted",
                "type": "integer",
                "jsonPath": ".status.accepted",
                "priority": 1,
                "description": "Groups accepted by the verifier.",
            },
            {
                "name": "Rejected",
                "type": "integer",
                "jsonPath": ".status.rejected",
                "priority": 1,
                "description": "Groups rejected by the verifier.",
            },
            {
                "name": "Ready",
                "type": "integer",
                "jsonPath": ".status.readyReplicas",
                "description": "Ready trainer pods.",
            },
            *common_tail,
        ]
    extra = (
        [{"name": "Tier", "type": "integer", "jsonPath": ".spec.tier", "description": "Relay tier."}]
        if kind is names.RELAY_TIER
        else []
    )
    return [
        {"name": "Run", "type": "string", "jsonPath": ".spec.run", "description": "The RLRun."},
        *extra,
        phase,
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired pods."},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods."},
        *common_tail,
    ]


def build_crd(kind: names.KindInfo) -> dict:
    """One CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict."""
    spec_models: dict[str, type[BaseModel]] = {
        "RLRun": RLRunSpec,
        "InferencePool": InferencePoolSpec,
        "RelayTier": RelayTierSpec,
    }
    spec_model = spec_models[kind.kind]
    description = {
        "RLRun": "Desired state of an asynchronous GRPO run: model, task, sampling, trainer, verifier, Redis and "
        "store.",
        "InferencePool": "A fleet of rollout workers generating for one RLRun.",
        "RelayTier": "One tier of the checkpoint relay tree of an RLRun.",
    }[kind.kind]
    spec = {"type": "object", "description": description, **structural_schema(spec_model)}
    if kind is names.RLRUN:
        spec["properties"]["store"]["x-kubernetes-validations"] = STORE_RULES
        spec["properties"]["tls"]["x-kubernetes-validations"] = TLS_RULES
    else:
        spec["properties"]["run"]["x-kubernetes-validations"] = RUN_REF_RULES
    scalable = kind is not names.RLRUN
    subresources: dict[str, Any] = {"status": {}}
    if scalable:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": kind.crd_name,
            "labels": {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/part-of": "rlfleet"},
        },
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": kind.short_names,
                "categories": [names.CATEGORY],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": _columns(kind),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            **({"x-kubernetes-validations": RUN_RULES} if kind is names.RLRUN else {}),
                            "description": f"{kind.kind} ({names.API_VERSION}): reconciled by `rlfleet operator`; "
                            "the same document runs locally with `rlfleet run`.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": f"Always {names.API_VERSION}."},
                                "kind": {"type": "string", "description": f"{kind.kind}."},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": _status_schema(scalable),
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = (
    "# Generated by `rlfleet crds --out crds/` from rlfleet/config/; do not edit "
    "(tests/operator/test_crds.py checks drift).\n"
)


def render_crd(kind: names.KindInfo) -> str:
    # Through JSON first: a schema reused in two places (a task type's fields, at spec.task and in each mixture
    # entry) is written out twice instead of as a YAML anchor and alias.
    return HEADER + yaml.safe_dump(json.loads(json.dumps(build_crd(kind))), sort_keys=False, width=120)


def crd_files() -> dict[str, str]:
    """File name -> YAML text of every CRD: the rlfleet kinds, and kopf's ClusterKopfPeering, which
    `rlfleet operator --peering` needs (Helm installs a chart's CRDs only where they are missing)."""
    files = {f"{k.crd_name}.yaml": render_crd(k) for k in names.KINDS.values()}
    files[peering.CRD_FILE] = HEADER + yaml.safe_dump(peering.peering_crd(), sort_keys=False, width=120)
    return files


def write_crds(out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in crd_files().items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
