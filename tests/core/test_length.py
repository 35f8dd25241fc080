"""Length targets in the prompt and the length penalty of the reward."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.tasks import make_run_task
from tests.runs import bundle_yaml, rlrun


def run_spec(length: str):
    """The spec of a run with `length` (a YAML flow mapping) as its lengthPenalty."""
    run = rlrun("lp", task={"maxOperand": 20}, lengthPenalty=yaml.safe_load(length))
    return parse_bundle(bundle_yaml(run)).run.spec


def test_targets_are_drawn_per_prompt_written_into_it_and_rebuilt_by_id():
    spec = run_spec("{targets: [4, 8], coef: 0.5, promptTemplate: '{prompt} think {target}'}")
    worker, verifier = make_run_task(spec), make_run_task(spec)
    ids = [worker.sample_id(np.random.default_rng(i)) for i in range(20)]
    assert {i.rsplit("@len", 1)[1] for i in ids} == {"4", "8"}
    for task_id in ids:
        seen, rebuilt = worker.problem(task_id), verifier.problem(task_id)
        assert seen == rebuilt
        assert seen.prompt.endswith(f" think {task_id.rsplit('@len', 1)[1]}")


def test_the_penalty_grows_with_the_miss_and_is_capped():
    task = make_run_task(run_spec("{targets: [4], coef: 0.5}"))
    problem = task.problem("arith-0-7@len4")
    right, wrong = problem.answer, str(int(problem.answer) + 1)
    assert task.score(problem, right, 4) == 1.0
    assert task.score(problem, right, 6) == pytest.approx(1.0 - 0.5 * 0.5)
    assert task.score(problem, right, 100) == pytest.approx(0.5), "the miss is capped at 1"
    assert task.score(problem, wrong, 4) == 0.0
    assert task.reward(problem, right) == 1.0


def test_ids_without_a_valid_target_and_bad_templates_are_refused():
    task = make_run_task(run_spec("{targets: [4]}"))
    for bad in ("arith-0-7", "arith-0-7@len5", "arith-0-7@lenx"):
        with pytest.raises(KeyError):
            task.problem(bad)
    with pytest.raises(ConfigError, match="spec.lengthPenalty: .*promptTemplate must contain"):
        run_spec("{targets: [4], promptTemplate: 'no placeholders'}")
    with pytest.raises(ConfigError, match="spec.lengthPenalty.targets"):
        run_spec("{targets: []}")
