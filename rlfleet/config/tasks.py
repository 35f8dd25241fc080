"""The task a run trains on (`spec.task`, `spec.lengthPenalty`); the policy model is in model.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlfleet.config.base import NAME_PATTERN, Spec


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
    tools: list[Literal["calculator"]] = Field(
        default_factory=list,
        max_length=1,
        description="Tools the model may call in its turns (a multi-turn task; spec.sampling.maxTurns >= 2): "
        "`calculator` answers a turn that is an expression such as `37+48` with `=85=`, and the reward reads the "
        "model's last turn (rlfleet/tasks/calculator.py, docs/environments.md).",
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
    tools: list[Literal["python"]] = Field(
        default_factory=list,
        max_length=1,
        description="Tools the model may call in its turns (a multi-turn task; spec.sampling.maxTurns >= 2): "
        "`python` runs a turn's last ```python block in the code task's sandbox (no network, 10 s, 1 GiB) and "
        "answers with what it printed; the reward reads the model's last turn (rlfleet/tasks/python_tool.py, "
        "docs/environments.md).",
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


def tools_problems(spec) -> list[str]:
    """What is wrong with the tools of RLRunSpec `spec`'s task sources: a tool needs turns to be called in."""
    problems = []
    for where, _, single in task_sources(spec.task):
        tools = getattr(single, "tools", None)
        if tools and spec.sampling.max_turns < 2:
            problems.append(
                f"{where}.tools: {tools} need spec.sampling.maxTurns >= 2 (a tool's answer comes in the "
                f"environment's turn, before the model's next); it is {spec.sampling.max_turns}"
            )
    return problems


def task_datasets(task) -> Iterator[tuple[str, DatasetSpec]]:
    """(field path, DatasetSpec) of every dataset `spec.task` reads (mixture sources included)."""
    for where, _, single in task_sources(task):
        dataset = getattr(single, "dataset", None)
        if isinstance(dataset, DatasetSpec):
            yield f"{where}.dataset", dataset
