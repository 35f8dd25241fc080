"""How a component's pods are scheduled on a cluster (cluster only; `rlfleet run` ignores all of it):
resource requests and limits, and a `podTemplate` override merged into the pod the operator builds.

Every component that runs as pods takes these fields (`spec.trainer`, `spec.verifier`, `spec.origin`,
`spec.ingest`, an InferencePool's and a RelayTier's spec). No process reads them: they are left out of
the config documents pods read, so changing them rolls the pods through their template alone.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema

from rlfleet.config.base import Spec

# Kubernetes' own grammar of a quantity (resource.Quantity): a number, then a binary or decimal suffix or an
# exponent. The CRD carries it as a pattern, so `kubectl apply` refuses what the API server would refuse
# later in the pod template (a 422 for the operator's StatefulSet instead of for the user's run).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity(value: object) -> object:
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if isinstance(text, str) and not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity: write e.g. 2, 0.5, 500m, 4Gi")
    return text


# A Kubernetes quantity: 2, 0.5, "500m", "4Gi" (a number or a string, as in a pod spec).
Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "description": "A quantity: 2, 0.5, 500m, 4Gi.",
        }
    ),
]


def _int_or_percent(value: int | str) -> int | str:
    if isinstance(value, str) and not (value.endswith("%") and value[:-1].isdigit()):
        raise ValueError(f"{value!r} is neither a whole number nor a percentage like 25%")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{value} must not be negative")
    return value


# A count or a percentage of pods, as a PodDisruptionBudget takes it: 1, "25%".
IntOrPercent = Annotated[
    int | str,
    AfterValidator(_int_or_percent),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "description": "A pod count (1) or a percentage (25%)."}),
]
GPU_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"

POD_TEMPLATE_DESCRIPTION = (
    "Cluster only: a Kubernetes PodTemplateSpec fragment (`metadata` labels/annotations, `spec`) merged into the "
    "pod the operator builds: maps merge key by key, your scalars win; `containers`, `initContainers`, `volumes`, "
    "`env`, `volumeMounts`, `ports` and `imagePullSecrets` merge by name (mountPath for volumeMounts, containerPort "
    "for ports), so `containers: [{name: <component>, ...}]` amends the main container and other names add "
    "sidecars; any other list replaces the built one. For nodeSelector, tolerations, affinity, "
    "priorityClassName, serviceAccountName (IRSA / workload identity for S3), securityContext, extra volumes."
)


class ResourcesSpec(Spec):
    """Compute resources of a component's main container (a Kubernetes ResourceRequirements)."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Requested resources, e.g. {cpu: 1, memory: 4Gi}; an HPA on CPU utilization needs cpu.",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Resource limits, e.g. {memory: 8Gi}; GPUs come from the component's gpus field.",
    )


def resources(cpu: str, memory: str) -> Any:
    """A default for a component's `resources` field: these requests, no limits."""
    return Field(
        default_factory=lambda: ResourcesSpec(requests={"cpu": cpu, "memory": memory}),
        description=f"Cluster only: requests and limits of the main container (default requests: cpu {cpu}, memory "
        f"{memory}; no limits). Replaces the default as a whole.",
        # the CRD's default is the whole value, so the API server never fills in an empty one
        json_schema_extra={"default": {"requests": {"cpu": cpu, "memory": memory}}},
    )


def pod_template() -> Any:
    return Field(
        default=None,
        description=POD_TEMPLATE_DESCRIPTION,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class OriginSpec(Spec):
    """The origin: serves policy versions from the store to relays and the verifier."""

    resources: ResourcesSpec = resources("250m", "512Mi")
    pod_template: dict[str, Any] | None = pod_template()


def gpu_resource() -> Any:
    return Field(
        default="nvidia.com/gpu",
        pattern=GPU_RESOURCE_PATTERN,
        description="Cluster only: the extended resource that `gpus` asks for, e.g. nvidia.com/gpu or amd.com/gpu.",
    )


def max_unavailable(default: int | str) -> Any:
    return Field(
        default=default,
        description="Cluster only: a PodDisruptionBudget lets a voluntary disruption (node drain, cluster upgrade) "
        f"take down at most this many pods (count or percentage) at once (default {default}).",
    )
