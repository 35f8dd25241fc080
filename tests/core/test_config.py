"""The config tree (rlfleet/config/) and `rlfleet validate`: every error is reported with its field path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfleet.config import ConfigError, load_bundle, parse_bundle, worker_dtype
from tests.support import REPO

ROOT = REPO
# RLRun bundles (Helm values files under examples/ are checked by tests/chart/test_chart.py).
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("**/*.yaml") if "apiVersion: rlfleet.io/" in p.read_text())

RUN = """\
apiVersion: rlfleet.io/v1alpha1
kind: RLRun
metadata:
  name: demo
spec:
  model:
    path: builtin://tiny-arithmetic
  task:
    type: arithmetic
"""

POOL = """\
apiVersion: rlfleet.io/v1alpha1
kind: InferencePool
metadata:
  name: demo-pool
spec:
  run: demo
"""


def _doc(*docs: str) -> str:
    return "---\n".join(docs)


def _validate(path: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_bundle(text, "f.yaml")
    return info.value.problems


def test_there_are_examples():
    assert EXAMPLES, "no examples/**/*.yaml found"


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_every_example_parses(path):
    bundle = load_bundle(path)
    assert bundle.run.kind == "RLRun"
    for other in [*bundle.pools, *bundle.relays]:
        assert other.spec.run == bundle.run.metadata.name


def test_validate_cli_accepts_the_example():
    proc = _validate(ROOT / "examples" / "arithmetic" / "rlrun.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout and "RLRun arithmetic" in proc.stdout


def test_camel_case_yaml_maps_to_snake_case_attributes():
    bundle = load_bundle(ROOT / "examples" / "arithmetic" / "rlrun.yaml")
    spec = bundle.run.spec
    assert spec.trainer.batch_size == 16
    assert spec.trainer.learning_rate == pytest.approx(1e-3)
    assert spec.trainer.max_async_level == 2
    assert spec.sampling.group_size == 8
    assert spec.sampling.max_tokens == 6
    assert spec.task.max_operand == 20
    assert bundle.pools[0].spec.max_pending == 32
    assert bundle.relays[0].spec.keep_versions == 3
    # Fields the file leaves out take their documented defaults.
    assert spec.trainer.weight_decay == 0.0
    assert spec.verifier.toploc.decode_batching_size == 32


def test_minimal_run_gets_defaults():
    bundle = parse_bundle(RUN)
    assert bundle.run.metadata.name == "demo"
    assert bundle.run.spec.task.seed == 0 and bundle.run.spec.task.operations == ["+"]
    assert bundle.run.spec.store.uri is None
    assert bundle.pools == [] and bundle.relays == []


# (name, file text, text every reported problem list must contain)
BAD_FILES = [
    ("unknown-field", RUN + "  trainer:\n    stepz: 3\n", ["spec.trainer.stepz", "unknown field"]),
    ("out-of-range", RUN + "  trainer:\n    batchSize: 0\n", ["spec.trainer.batchSize"]),
    ("out-of-range-task", RUN + "    maxOperand: 0\n", ["spec.task.maxOperand"]),
    ("wrong-kind", RUN.replace("kind: RLRun", "kind: RLRunn"), ["kind", "RLRunn"]),
    ("wrong-api-version", RUN.replace("rlfleet.io/v1alpha1", "rlfleet.io/v1"), ["apiVersion", "rlfleet.io/v1"]),
    (
        "missing-model",
        RUN.replace("  model:\n    path: builtin://tiny-arithmetic\n", ""),
        ["spec.model", "required field is missing"],
    ),
    (
        "pool-names-no-run",
        _doc(RUN, POOL.replace("run: demo", "run: other")),
        ["spec.run", "'other'", "names no RLRun"],
    ),
    ("two-runs", _doc(RUN, RUN.replace("name: demo", "name: demo2")), ["exactly one RLRun", "found 2"]),
    ("no-run", POOL, ["exactly one RLRun", "found 0"]),
    ("invalid-yaml", RUN + "  trainer: [1, 2\n", ["not valid YAML"]),
    ("bad-store-uri", RUN + "  store:\n    uri: http://bucket/x\n", ["spec.store", "file:// or s3://"]),
    ("lora-rank-0", RUN + "  trainer:\n    lora: {rank: 0}\n", ["spec.trainer.lora.rank"]),
    ("lora-no-targets", RUN + "  trainer:\n    lora: {targetModules: []}\n", ["spec.trainer.lora.targetModules"]),
]


@pytest.mark.parametrize("name,text,expected", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_validate_cli_rejects_bad_file_with_field_path(tmp_path, name, text, expected):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    proc = _validate(path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    for fragment in expected:
        assert fragment in proc.stderr, (fragment, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{path}: ")  # problems name the file


def test_validate_cli_reports_a_missing_file(tmp_path):
    proc = _validate(tmp_path / "nope.yaml")
    assert proc.returncode == 2
    assert "nope.yaml" in proc.stderr and "cannot read" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_validate_cli_reports_every_error_of_a_file(tmp_path):
    text = _doc(
        RUN + "  trainer:\n    stepz: 3\n    batchSize: 0\n  sampling:\n    temperature: 0\n",
        POOL + "  maxPending: 0\n",
    )
    path = tmp_path / "many.yaml"
    path.write_text(text)
    proc = _validate(path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    for fragment in ["spec.trainer.stepz", "spec.trainer.batchSize", "spec.sampling.temperature", "spec.maxPending"]:
        assert sum(fragment in line for line in lines) == 1, (fragment, lines)
    assert len(lines) == 4
    # Each names its document.
    assert any("document 0 (RLRun demo)" in line for line in lines)
    assert any("document 1 (InferencePool demo-pool)" in line for line in lines)


def test_unknown_task_type_is_reported_at_spec_task():
    problems = _problems(RUN.replace("type: arithmetic", "type: chess"))
    assert len(problems) == 1 and "spec.task" in problems[0]


def test_task_field_path_omits_the_union_tag():
    problems = _problems(RUN + "    operations: ['*']\n")
    assert any("spec.task.operations" in p for p in problems), problems
    assert not any("arithmetic" in p.split(":")[1] for p in problems), problems


def test_non_mapping_document_is_reported():
    problems = _problems(_doc(RUN, "- just\n- a list\n"))
    assert problems == ["document 1: expected a mapping with apiVersion, kind, metadata and spec"]


def test_bad_metadata_name_is_reported():
    problems = _problems(RUN.replace("name: demo", "name: Demo_Run"))
    assert len(problems) == 1 and "metadata.name" in problems[0]


@pytest.mark.parametrize("uri", ["file:///abs/dir", "file://./rel/dir", "s3://bucket/prefix"])
def test_store_uri_accepts_file_and_s3(uri):
    bundle = parse_bundle(RUN + f"  store:\n    uri: {uri}\n")
    assert bundle.run.spec.store.uri == uri


@pytest.mark.parametrize("uri", ["http://bucket/x", "/abs/dir", "gs://bucket"])
def test_store_uri_rejects_other_schemes(uri):
    problems = _problems(RUN + f"  store:\n    uri: {uri}\n")
    assert len(problems) == 1
    assert "spec.store" in problems[0] and "file:// or s3://" in problems[0] and uri in problems[0]


def test_config_error_report_is_one_line_per_problem():
    err = ConfigError("x.yaml", ["a: bad", "b: worse"])
    assert err.report() == textwrap.dedent("""\
        x.yaml: a: bad
        x.yaml: b: worse""")


@pytest.mark.parametrize(
    "spec, field",
    [
        ("  trainer: {learningRate: .inf}\n", "spec.trainer.learningRate"),
        ("  trainer: {learningRate: .nan}\n", "spec.trainer.learningRate"),
        ("  trainer: {steps: 1e30}\n", "spec.trainer.steps"),
        ("  trainer: {batchSize: 1e18}\n", "spec.trainer.batchSize"),
        ("  verifier: {replicas: 100000}\n", "spec.verifier.replicas"),
    ],
)
def test_infinite_and_absurd_numbers_are_field_errors(spec, field):
    problems = _problems(RUN + spec)
    assert len(problems) == 1 and problems[0].startswith(f"document 0 (RLRun demo): {field}:"), problems


def test_a_pool_of_a_million_workers_is_refused_by_the_model():
    problems = _problems(_doc(RUN, POOL + "  replicas: 1000000\n"))
    assert problems == [
        "document 1 (InferencePool demo-pool): spec.replicas: Input should be less than or equal to 100000"
    ]


def test_a_file_that_is_not_utf8_gets_a_clear_error(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(RUN.encode() + "  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_bundle(bad)
    assert (
        info.value.problems[0].startswith("not UTF-8 text (byte 0xe9 at offset")
        and "save the file as UTF-8" in (info.value.problems[0])
    )
    result = _validate(bad)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "not UTF-8 text" in result.stderr


def test_runaway_nesting_gets_a_clear_error_not_a_traceback(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text(RUN + "  sampling: " + "[" * 20000 + "]" * 20000 + "\n")
    result = _validate(deep)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "nested too deeply" in result.stderr


def test_a_worker_picks_its_pool_by_name_and_an_unknown_name_lists_the_pools():
    admits_vllm = RUN + "  verifier: {engines: [torch, vllm]}\n"  # a vllm pool needs the run to admit vllm
    two = parse_bundle(_doc(admits_vllm, POOL, POOL.replace("demo-pool", "gpu-pool") + "  engine: vllm\n"))
    assert two.pool("gpu-pool")[1].engine == "vllm"
    with pytest.raises(
        ConfigError, match="--pool 'cpu' is not an InferencePool of this file; its pools: demo-pool, gpu-pool"
    ):
        two.pool("cpu")
    with pytest.raises(
        ConfigError, match="--pool is required: this file has several InferencePools: demo-pool, gpu-pool"
    ):
        two.pool(None)
    name, spec = parse_bundle(RUN).pool(None)
    assert name == "local" and spec.replicas == 2 and spec.engine == "torch", "no pool document: the model's defaults"


def test_lora_is_off_by_default_and_parses_camel_case():
    assert parse_bundle(RUN, "f.yaml").run.spec.trainer.lora is None
    lora = parse_bundle(RUN + "  trainer:\n    lora: {rank: 4, alpha: 8, targetModules: [q_proj, up_proj]}\n", "f.yaml")
    spec = lora.run.spec.trainer.lora
    assert spec is not None and (spec.rank, spec.alpha, spec.target_modules) == (4, 8.0, ["q_proj", "up_proj"])


@pytest.mark.parametrize(
    "spec, field",
    [
        ("  trainer: {lora: {rank: 2000}}\n", "spec.trainer.lora.rank"),
        ("  trainer: {lora: {alpha: 0}}\n", "spec.trainer.lora.alpha"),
        ("  trainer: {lora: {targetModules: [model.layers.0.q_proj]}}\n", "spec.trainer.lora.targetModules.0"),
        ("  trainer: {lora: {rank: 4, dropout: 0.1}}\n", "spec.trainer.lora.dropout"),
        ("  trainer: {lora: {}, sharding: fsdp, replicas: 2}\n", "spec.trainer"),
    ],
)
def test_lora_errors_name_the_field(spec, field):
    problems = _problems(RUN + spec)
    assert len(problems) == 1 and problems[0].startswith(f"document 0 (RLRun demo): {field}"), problems


def test_a_pool_dtype_the_run_does_not_admit_is_an_error_naming_both_fields():
    bf16_pool = POOL + "  dtype: bfloat16\n"
    with pytest.raises(ConfigError) as info:
        parse_bundle(_doc(RUN, bf16_pool))
    [problem] = info.value.problems
    assert problem.startswith("InferencePool demo-pool: spec.dtype: bfloat16 is not the dtype the run admits"), problem
    assert "RLRun spec.model.dtype (no workerDtype) is float32" in problem
    assert "set RLRun spec.verifier.workerDtype: bfloat16" in problem
    declared = parse_bundle(_doc(RUN + "  verifier: {workerDtype: bfloat16}\n", bf16_pool))
    assert worker_dtype(declared.run.spec) == "bfloat16" and declared.run.spec.model.dtype == "float32"
    assert declared.pool(None)[1].dtype == "bfloat16"
    with pytest.raises(ConfigError, match="RLRun spec.verifier.workerDtype is bfloat16"):
        parse_bundle(_doc(RUN + "  verifier: {workerDtype: bfloat16}\n", POOL + "  dtype: float32\n"))
    plain = parse_bundle(_doc(RUN, POOL))
    assert plain.pool(None)[1].dtype is None and worker_dtype(plain.run.spec) == "float32", "empty: the model's"


# The example's sampling block with groupSize given twice: before the strict loader, the second one won silently.
TWICE = RUN + "  sampling:\n    groupSize: 8\n    temperature: 1.0\n    groupSize: 4\n"


def test_a_key_given_twice_is_an_error_naming_the_key_and_both_lines_through_the_cli(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(TWICE)
    proc = _validate(path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f'{path}: line 13: key "groupSize" is already set at line 11 of this mapping; give each key once'
    )


def test_a_key_given_twice_anywhere_in_any_document_is_refused_and_merge_keys_still_override():
    twice_in_pool = _doc(RUN, POOL + "  replicas: 1\n  maxPending: 4\n  replicas: 2\n")
    [problem] = _problems(twice_in_pool)
    assert problem == 'line 19: key "replicas" is already set at line 17 of this mapping; give each key once'
    with pytest.raises(ConfigError, match='line 2: key "metadata" is already set at line 1'):
        parse_bundle("metadata: {name: a}\nmetadata: {name: b}\n")
    # The same key in two mappings, or a key a merge (<<) brings in and the mapping sets again, is no repeat.
    merged = RUN + "  sampling: &s {groupSize: 8}\n  trainer:\n    <<: {batchSize: 16, steps: 3}\n    steps: 5\n"
    spec = parse_bundle(merged).run.spec
    assert spec.sampling.group_size == 8 and spec.trainer.batch_size == 16 and spec.trainer.steps == 5


def test_the_strict_loader_reads_what_safe_load_reads_and_refuses_a_repeated_key_with_both_marks():
    from rlfleet.config.strict_yaml import DuplicateKeyError, load, load_all

    text = "a: 1\nb: [x, {c: 2}]\nd: {1: one, 1.5: two}\n"
    assert load(text) == {"a": 1, "b": ["x", {"c": 2}], "d": {1: "one", 1.5: "two"}}
    assert list(load_all("a: 1\n---\nb: 2\n")) == [{"a": 1}, {"b": 2}]
    with pytest.raises(DuplicateKeyError) as info:
        load("outer:\n  x: 1\n  inner: {y: 1, y: 2}\n")
    assert (info.value.key, info.value.line, info.value.first_line) == ("y", 3, 3)
    with pytest.raises(DuplicateKeyError, match='line 3: key "1" is already set at line 1'):
        load("1: a\n2: b\n1: c\n")
