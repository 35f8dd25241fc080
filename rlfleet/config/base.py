"""The base of every config model and the metadata every document carries."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# The API version of every document, spelled here only: the models' `apiVersion` field takes this type,
# the operator's CRDs its group and version.
ApiVersion = Literal["rlfleet.io/v1alpha1"]
API_VERSION: str = get_args(ApiVersion)[0]
GROUP, VERSION = API_VERSION.split("/")
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class Spec(BaseModel):
    """Base of every config model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", allow_inf_nan=False)


class Metadata(Spec):
    name: str = Field(
        pattern=NAME_PATTERN,
        max_length=50,
        description="Resource name (DNS label); namespaces Redis keys and store paths of the run.",
    )
    namespace: str | None = Field(default=None, description="Kubernetes namespace; ignored by the local launcher.")
    labels: dict[str, str] = Field(default_factory=dict, description="Kubernetes labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Kubernetes annotations.")
