"""Held-out evaluation (`spec.eval`): its config errors, the held-out problems, the trainer's evaluator
thread on real models (rlfleet/services/trainer/evaluation.py), and a missing eval dataset at `rlfleet run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlfleet.config import ArithmeticTaskSpec, ConfigError, ModelSpec, parse_bundle
from rlfleet.models.sources import resolve_model_path
from rlfleet.services.trainer.evaluation import Evaluator
from rlfleet.tasks.held_out import held_out_problems
from tests.runs import bundle_yaml, rlrun, write_rlrun
from tests.support import tiny_policy_dir

MATH = {"type": "math", "dataset": {"path": "builtin://tiny-math"}, "promptTemplate": "{problem}"}


def warm_arithmetic():
    """The builtin tiny-arithmetic of the example (shipped prebuilt): warm-started, it mostly answers right."""
    return resolve_model_path(
        ModelSpec(path="builtin://tiny-arithmetic"), ArithmeticTaskSpec(type="arithmetic", max_operand=20)
    )


def run_spec(task: dict | None = None, **eval_fields):
    text = bundle_yaml(rlrun(task=task or {"maxOperand": 20}, sampling={"maxTokens": 6}, eval=eval_fields))
    return parse_bundle(text).run.spec


@pytest.mark.parametrize(
    ("task", "eval_fields", "message"),
    [
        (None, {"every": 0}, "spec.eval.every: Input should be greater than or equal to 1"),
        (None, {"maxProblems": 0}, "spec.eval.maxProblems: Input should be greater than or equal to 1"),
        (None, {"mode": "sampled", "k": 0}, "spec.eval.k: Input should be greater than or equal to 1"),
        (None, {"k": 4}, "k: greedy decoding gives one completion per problem, not 4; set mode: sampled"),
        (None, {"temperature": 0.7}, "temperature: greedy decoding takes no temperature"),
        (None, {"mode": "beam"}, "spec.eval.mode: Input should be 'greedy' or 'sampled'"),
        (None, {"seed": 0}, "eval.seed: 0 is the training seed (task.seed)"),
        (None, {"dataset": {"path": "x.jsonl"}}, "eval.dataset: an arithmetic task is held out by seed"),
        (MATH, {}, "eval.dataset: required for task type math"),
        (MATH, {"seed": 3}, "eval.seed: a math task is held out by rows; give eval.dataset"),
        (MATH, {"dataset": {"path": "builtin://tiny-math"}}, "eval.dataset.path: 'builtin://tiny-math' is the "),
    ],
)
def test_bad_eval_settings_are_errors_naming_the_field(task, eval_fields, message):
    with pytest.raises(ConfigError) as err:
        run_spec(task, **eval_fields)
    assert any(message in p for p in err.value.problems), err.value.problems


def test_an_unreadable_eval_dataset_names_eval_dataset(tmp_path):
    path = tmp_path / "held-out.jsonl"
    spec = run_spec(MATH, dataset={"path": str(path)})
    assert held_out_problems(spec) == [
        f"spec.eval.dataset.path: cannot read {str(path)!r}: No such file or directory (relative paths are resolved "
        f"against the working directory {os.getcwd()!r})"
    ]
    path.write_text(json.dumps({"question": "1+1"}) + "\n")
    assert held_out_problems(spec) == [
        "spec.eval.dataset: row 0 has no field answer, problem (needed by task.promptTemplate or the task type); it "
        "has question"
    ]
    assert held_out_problems(run_spec()) == [], "an arithmetic seed always loads"


def test_rlfleet_run_refuses_a_missing_eval_dataset_before_starting_anything(tmp_path):
    missing = tmp_path / "held-out.jsonl"
    config = write_rlrun(tmp_path / "rlrun.yaml", rlrun("math", model="builtin://tiny-math", task=MATH,
                                                         eval={"dataset": {"path": str(missing)}}))  # fmt: skip
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{config}: spec.eval.dataset.path: cannot read '{missing}'" in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists(), "nothing started, nothing written"


def test_the_evaluator_scores_due_versions_and_a_trained_model_beats_an_untrained_one(tmp_path):
    spec = run_spec(every=2, seed=7, maxProblems=24)
    warm = warm_arithmetic()
    evaluator = Evaluator(spec, warm)
    assert len(evaluator.task_ids) == 24 and all(t.startswith("arith-7-") for t in evaluator.task_ids)
    evaluator.offer(1, warm)
    assert evaluator.take(wait=True) == {}, "version 1 is not due (every 2)"
    evaluator.offer(2, warm)
    trained = evaluator.take(wait=True)
    assert {k: trained[k] for k in ("eval/version", "eval/problems", "eval/k")} == {
        "eval/version": 2,
        "eval/problems": 24,
        "eval/k": 1,
    }
    evaluator.offer(3, warm, final=True)  # not due, but the last version always is
    assert evaluator.take(wait=True)["eval/version"] == 3
    untrained_dir = tiny_policy_dir(tmp_path / "untrained", seed=0)  # random weights
    untrained_evaluator = Evaluator(spec, untrained_dir)
    untrained_evaluator.offer(0, untrained_dir)
    untrained = untrained_evaluator.take(wait=True)
    assert trained["eval/score"] >= 0.5 > untrained["eval/score"], (trained, untrained)
    evaluator.offer(4, warm)
    assert evaluator.take(wait=True)["eval/score"] == trained["eval/score"], "greedy: the same weights, the same score"


def test_sampled_pass_at_k_is_at_least_pass_at_one_on_the_same_stream():
    warm = warm_arithmetic()
    scores = {}
    for k in (1, 4):
        evaluator = Evaluator(run_spec(mode="sampled", k=k, temperature=2.0, maxProblems=16), warm)
        evaluator.offer(0, warm)
        scores[k] = evaluator.take(wait=True)
        assert scores[k]["eval/k"] == k and scores[k]["eval/problems"] == 16
    # Problem i draws sample j with the same seed for any k: the k=4 samples include the k=1 one.
    assert scores[4]["eval/score"] >= scores[1]["eval/score"]


def test_a_math_eval_reads_its_own_rows(tmp_path):
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(json.dumps({"problem": f"{i}+1=?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    spec = run_spec(MATH, dataset={"path": str(held_out)}, maxProblems=100)
    model = tiny_policy_dir(tmp_path / "policy", seed=0)
    evaluator = Evaluator(spec, model)
    assert evaluator.task_ids == ["held-out-0", "held-out-1", "held-out-2"], "every row, in file order"
    evaluator.offer(0, model)
    assert evaluator.take(wait=True)["eval/problems"] == 3


def test_a_lora_runs_adapter_versions_are_evaluated_as_base_plus_adapter(tmp_path):
    """The trainer offers an adapter version as `Adapters.save` wrote it, before the publisher signs the manifest
    naming its base (a fetched adapter without one is refused): the evaluator merges it into its own base, so a
    fresh adapter scores as the base and a trained one as the whole merged model (merge_dir)."""
    from rlfleet.config.training import LoraSpec
    from rlfleet.models.adapter import merge_dir
    from rlfleet.models.policy import load_policy
    from rlfleet.services.trainer.lora import attach
    from tests.trainer.test_lora import trained_adapter

    spec = run_spec(every=1, seed=7, maxProblems=24)
    warm = warm_arithmetic()
    model, _ = load_policy(warm)
    adapters = attach(model, LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), warm, "builtin://x")
    assert adapters is not None
    adapters.save(model.state_dict(), tmp_path / "v0")
    trained_adapter(adapters.peft_model, seed=1)
    adapters.save(model.state_dict(), tmp_path / "v1")
    merge_dir(warm, tmp_path / "v1", tmp_path / "merged")

    def score(version: int, path, base=warm) -> float:
        evaluator = Evaluator(spec, base)
        evaluator.offer(version, path)
        result = evaluator.take(wait=True)
        assert result["eval/version"] == version, "the evaluation failed (logged): no result"
        return result["eval/score"]

    assert score(0, tmp_path / "v0") == score(0, warm) >= 0.5
    trained = score(1, tmp_path / "v1")
    assert trained == score(1, tmp_path / "merged", base=tmp_path / "merged")
    assert trained < 0.5, "a random adapter of this size breaks the warm-started model: the adapter was applied"
