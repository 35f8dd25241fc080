"""User environments (spec.task type python, rlfleet/tasks/python_env.py): loading by entry point, the contract's
errors at load, and a misbehaving reward (raises, hangs, not a number) turned into a clear failure."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from rlfleet.config import parse_bundle
from rlfleet.tasks import make_run_task
from rlfleet.tasks.python_env import EnvironmentFailure, PythonEnvironment
from tests.runs import bundle_yaml, rlrun
from tests.support import REPO, tiny_policy_dir

SUMS = REPO / "examples" / "environments" / "sums"


@pytest.fixture
def sums_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(SUMS))


def python_task(entrypoint: str, **fields) -> dict:
    return {"type": "python", "entrypoint": entrypoint, **fields}


def test_the_example_environment_runs_behind_the_process_boundary(sums_on_path):
    spec = parse_bundle(bundle_yaml(rlrun(task=python_task("rlfleet_sums:SumsEnvironment", config={"terms": "4"}))))
    task = make_run_task(spec.run.spec)
    ids = [task.sample_id(np.random.default_rng(3)) for _ in range(2)]
    assert ids[0] == ids[1], "the caller's generator decides the id"
    problem = task.problem(ids[0])
    numbers = [int(n) for n in problem.prompt.split(",")]
    assert len(numbers) == 4 and problem.answer == str(sum(numbers))
    assert task.rewards(problem, [f"\\boxed{{{problem.answer}}}", problem.answer, ""]) == [1.0, 0.0, 0.0]
    with pytest.raises(KeyError, match="sums-0-<index>"):
        task.problem("other-1")
    fresh = make_run_task(spec.run.spec)  # the verifier's copy rebuilds the same problem
    assert fresh.problem(ids[0]) == problem


def test_an_installed_package_s_entry_point_is_found_by_name(sums_on_path, tmp_path, monkeypatch):
    """The `rlfleet.environments` entry point group, as `pip install examples/environments/sums` registers it
    (here a dist-info directory on sys.path, which is what pip writes)."""
    dist = tmp_path / "site" / "rlfleet_sums-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlfleet-sums\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[rlfleet.environments]\nsums = rlfleet_sums:SumsEnvironment\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    task = make_run_task(parse_bundle(bundle_yaml(rlrun(task=python_task("sums")))).run.spec)
    assert task.problem("sums-0-5").answer.isdigit()
    with pytest.raises(ValueError, match=r"spec\.task\.entrypoint: no installed package has an entry point 'nope' "
                                         r"in group rlfleet.environments \(installed: \['sums'\]\)"):  # fmt: skip
        make_run_task(parse_bundle(bundle_yaml(rlrun(task=python_task("nope")))).run.spec)


@pytest.mark.parametrize(
    "entrypoint,message",
    [
        ("no_such_package.envs:Factory", "cannot import module 'no_such_package.envs'"),
        ("tests.core.user_envs:Missing", "module 'tests.core.user_envs' has no attribute 'Missing'"),
        ("tests.core.user_envs:NOT_CALLABLE", "is a int, not a factory to call"),
        ("tests.core.user_envs:not_a_source", "returned a dict, not a rlfleet.tasks.TaskSource"),
        ("tests.core.user_envs:failing_factory", "raised RuntimeError: cannot reach the problem bank"),
    ],
)
def test_a_bad_entry_point_is_an_error_naming_the_field(entrypoint, message):
    text = bundle_yaml(rlrun(task={"type": "mixture", "mixture": [{"weight": 1, "task": python_task(entrypoint)}]}))
    with pytest.raises(ValueError) as info:
        make_run_task(parse_bundle(text).run.spec)
    assert str(info.value).startswith("spec.task.mixture[0].task.entrypoint: "), info.value
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kind,reason",
    [
        ("raise", "rewards raised RuntimeError: the reward model is down"),
        ("hang", "rewards: no answer within timeoutSeconds 1"),
        ("nan", "reward returned nan, not a finite number"),
        ("str", "reward returned 'high' (str), not a number"),
        ("short", "rewards returned list [0.0], not 2 numbers"),
    ],
)
def test_a_misbehaving_reward_is_a_failure_with_its_reason_and_the_next_call_works(kind, reason):
    env = PythonEnvironment("tests.core.user_envs:Moody", {"kinds": kind}, timeout_seconds=1.0)
    try:
        bad = env.problem(f"mood-{kind}-3")
        with pytest.raises(EnvironmentFailure) as info:
            env.rewards(bad, ["4", "5"])
        assert str(info.value) == reason
        good = env.problem("mood-ok-3")  # after a hang, a fresh process answers
        assert env.rewards(good, ["4", "5"]) == [1.0, 0.0]
    finally:
        env.close()


def test_rlfleet_run_stops_before_starting_anything_on_a_bad_task(tmp_path):
    """An unknown entry point and a chat template the model lacks: `rlfleet run` says which field, starts no
    component and writes no metrics (nothing to lose)."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    cases = {
        "entrypoint": (rlrun(task=python_task("no_such_package:Env")), "spec.task.entrypoint: cannot import module"),
        "template": (rlrun(model=policy, task={"chatTemplate": True}), "spec.task.chatTemplate: the model"),
    }
    for name, (doc, message) in cases.items():
        config, run_dir = tmp_path / f"{name}.yaml", tmp_path / name
        config.write_text(bundle_yaml(doc))
        argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert list((run_dir / "logs").iterdir()) == [], "no component was started"
        assert not (run_dir / "metrics.jsonl").exists()
