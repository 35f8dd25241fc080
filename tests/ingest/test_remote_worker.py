"""A worker of a pool that posts to an ingest (a remote pool) reaches the run only through the ingest and
the relays: `rlfleet rollout` with no Redis URL at all follows policy versions by long-polling its
relay and gets its groups into the inbox through the authenticated ingest, with its own token file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.services.shardcast import origin
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.store import FileStore
from rlfleet.wire.streams import RolloutGroup, RunKeys
from tests.ingest.test_ingest import ingest
from tests.runs import pool, rlrun, write_rlrun
from tests.support import serving, tiny_policy_dir

RUN = "demo"  # test_ingest's ingest serves this run, with worker w1's token


def config_docs(model: Path, ingest: str) -> list[dict]:
    """The run and its one remote pool, whose worker posts through the ingest at `ingest`."""
    run = rlrun(
        RUN,
        model=model,
        task={"maxOperand": 20},
        sampling={"groupSize": 2, "maxTokens": 4},
        shardcast={"requireSignatures": False},
    )
    return [run, pool("remote", RUN, replicas=1, ingestUrl=ingest)]


@pytest.mark.slow  # about 45 s: torch, a policy, a worker process
def test_a_worker_without_redis_follows_the_relay_and_posts_through_the_ingest(tmp_path, redis_url):
    """Bug: an ingest pool's worker could not run in a cluster (no token, ids nobody registered), so the
    multi-cluster example handed raw Redis to untrusted workers."""
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    store = FileStore(tmp_path / "store")
    publish_version(store, RUN, 0, policy)
    token_file = tmp_path / "w1"
    token_file.write_text("token-of-w1\n")
    with ingest(redis_url, maxBacklog=100) as (ingest_url, client), serving(origin.make_app(store, RUN)) as relay:
        config = write_rlrun(tmp_path / "pool.yaml", *config_docs(policy, ingest_url))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
        env.update(RLFLEET_WORKER_TOKEN_FILE=str(token_file), RLFLEET_TORCH_THREADS="1")
        log = open(tmp_path / "worker.log", "wb")
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "rlfleet.cli", "rollout", "--config", str(config)),
                *("--worker-id", "w1", "--pool", "remote", "--relay-url", relay),
                *("--cache-dir", str(tmp_path / "cache")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while client.xlen(RunKeys(RUN).rollouts) == 0:
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
                time.sleep(0.2)
        finally:
            worker.terminate()
            worker.wait(30)
        [(_, fields)] = client.xrange(RunKeys(RUN).rollouts, count=1)
        group = RolloutGroup.decode(fields)
        assert group.worker_id == "w1" and group.policy_version == 0
    assert "redis" not in (tmp_path / "worker.log").read_text().lower(), "the worker never spoke of Redis"


def test_a_worker_without_its_token_file_names_the_missing_key(tmp_path):
    config = tmp_path / "pool.yaml"
    write_rlrun(config, *config_docs(tmp_path, "http://127.0.0.1:9"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env["RLFLEET_WORKER_TOKEN_FILE"] = str(tmp_path / "tokens" / "remote-rollout-3")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "rlfleet.cli", "rollout", "--config", str(config), "--worker-id"),
            *("remote-rollout-3", "--pool", "remote", "--relay-url", "http://127.0.0.1:9", "--cache-dir", "c"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "key named remote-rollout-3" in result.stderr, result.stderr
