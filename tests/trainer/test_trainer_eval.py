"""A real trainer process with `spec.eval` and `spec.sampling.onlineFilter`: the held-out score and the
retired prompts reach metrics.jsonl and the trainer's /metrics (scraped over HTTP), and the prompt whose
groups were all solved is retired in Redis."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import yaml

from rlfleet.fleet.prompt_filter import prompt_key
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys
from tests.support import start_trainer, tiny_policy_dir, trainer_run_config
from tests.trainer.test_trainer import group
from tests.trainer.test_trainer_metrics import scrape

TRAINER = "{batchSize: 2, maxAsyncLevel: 1, learningRate: 1.0e-3, steps: 2, skipZeroAdvantageGroups: true}"


def test_eval_scores_and_retired_prompts_reach_metrics_jsonl_and_metrics(tmp_path, redis_url, redis_client):
    docs = list(
        yaml.safe_load_all(trainer_run_config(tiny_policy_dir(tmp_path / "policy", seed=0), tmp_path / "s", TRAINER))
    )
    docs[0]["spec"]["eval"] = {"every": 100, "seed": 5, "maxProblems": 8}
    docs[0]["spec"]["sampling"]["onlineFilter"] = {"window": 2}
    config = tmp_path / "rlrun.yaml"
    config.write_text(yaml.safe_dump_all(docs))
    keys = RunKeys("tr")
    solved = group("solved", [1.0, 1.0])
    # Two all-solved groups of one prompt (other completions, so not repeats): dropped, and the prompt retired.
    again = replace(group("again", [1.0, 1.0]), prompt_ids=solved.prompt_ids)
    batches = [group("a", [1.0, 0.0]), solved, again, group("b", [0.0, 1.0]), group("c", [1.0, 0.0])]
    for g in [*batches, group("d", [0.0, 1.0])]:
        redis_client.xadd(keys.verified, g.encode())
    port = free_port()
    proc = start_trainer(
        config, redis_url, tmp_path, "--metrics-port", str(port), "--hold-when-done", env={"RLFLEET_LOCAL": "1"}
    )
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()
            assert time.monotonic() < deadline, "no two steps in time"
            time.sleep(0.1)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        samples = scrape(f"http://127.0.0.1:{port}/metrics")  # the trainer holds after its last step
    finally:
        proc.terminate()
        proc.wait(60)

    last = records[-1]
    assert last["eval/version"] == 2, "the last version is evaluated and waited for"
    assert last["eval/problems"] == 8 and last["eval/k"] == 1 and 0.0 <= last["eval/score"] <= 1.0
    assert records[0]["prompts_retired_solved"] == 1 and last["prompts_retired_failed"] == 0
    assert redis_client.lrange(keys.retired_prompts, 0, -1) == [prompt_key(solved.prompt_ids).encode()]
    for stat in ("score", "version", "problems", "k"):
        assert samples[("rlfleet_trainer_eval", frozenset({"stat": stat}.items()))] == last[f"eval/{stat}"], stat
    assert samples[("rlfleet_trainer_prompts_retired", frozenset({"outcome": "solved"}.items()))] == 1
