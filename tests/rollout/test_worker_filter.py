"""A rollout worker skips the prompts the online filter retired (spec.sampling.onlineFilter;
rlfleet/fleet/prompt_filter.py): a real worker with a real torch engine and a real Redis, on arithmetic
with four prompts (0+0, 0+1, 1+0, 1+1), three of them retired by the test as the trainer would."""

from __future__ import annotations

import threading

import pytest

from rlfleet.config import load_bundle
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.fleet.assignment import issued_tickets
from rlfleet.fleet.prompt_filter import prompt_key
from rlfleet.services.rollout.main import RolloutOptions, Worker
from rlfleet.services.rollout.work import FILTERED
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import pool, rlrun, write_rlrun
from tests.support import tiny_policy_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("assignment", ["worker", "run"])
def test_the_worker_redraws_retired_prompts(tmp_path, redis_client, assignment):
    run = rlrun(
        "filter",
        model=tmp_path / "not-here",
        task={"maxOperand": 1},
        sampling={"groupSize": 2, "maxTokens": 4, "assignment": assignment, "onlineFilter": {"maxRedraws": 200}},
        store=tmp_path / "store",
        shardcast={"requireSignatures": False},  # no version is downloaded here
    )
    config = write_rlrun(tmp_path / "rlrun.yaml", run, pool("pool", "filter", replicas=1))
    keys = RunKeys("filter")
    ctx = Context(
        bundle=view_bundle(load_bundle(config), VIEWS["rollout"]), redis=redis_client, keys=keys, stop=threading.Event()
    )
    options = RolloutOptions(config=config, worker_id="w", cache_dir=tmp_path / "cache", relay_urls=["http://x"])
    worker = Worker(ctx, options)
    worker.engine = TorchEngine(tiny_policy_dir(tmp_path / "policy", seed=0), 0)
    prompt_of = {}  # prompt text -> key, for the four prompts
    for i in range(200):
        problem = worker.task.problem(f"arith-0-{i}")
        prompt_of[problem.prompt] = prompt_key(worker.draws.prompt_ids(worker.loaded.tokenizer, problem.task_id))
    assert sorted(prompt_of) == ["0+0=", "0+1=", "1+0=", "1+1="]
    redis_client.rpush(keys.retired_prompts, *(prompt_of[p] for p in ("0+0=", "0+1=", "1+0=")))

    skipped_before = FILTERED._value.get()
    work = worker.take_work(12)
    assert work is not None and len(work) == 12
    assert {worker.task.problem(piece.task_id).prompt for piece in work} == {"1+1="}
    skipped = FILTERED._value.get() - skipped_before
    assert skipped > 12, "about 3 of 4 draws are retired prompts, each counted"
    if assignment == "run":  # redrawn along its ticket (rlfleet/fleet/assignment.py)
        assert issued_tickets(redis_client, keys, "w") == 12, "a redraw follows the ticket and spends none"
        assert any(piece.draw > 0 for piece in work)

    redis_client.rpush(keys.retired_prompts, prompt_of["1+1="])  # every prompt retired: the worker keeps going
    work = worker.take_work(2)
    assert work is not None and len(work) == 2
