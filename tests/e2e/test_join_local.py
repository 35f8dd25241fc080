"""A local run that admits outside workers: `rlfleet run` starts the ingest, announces its own relay in the run
document and prints the join URL; `rlfleet join URL [--code C]`, a separate process, joins through the door, and
the trainer steps on that worker's groups alone (the run's one pool has no workers of its own)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.runs import pool, relay_tier, rlrun, write_rlrun

RUN = "door"
STEPS = 4


def door_run(tmp_path: Path, mode: str) -> Path:
    # No relayUrls: the run announces its own. Every group of the worker stays on probation (prefill-checked).
    admission: dict = {"mode": mode, "probationGroups": 1000, "probationRatePerMinute": 600}
    if mode == "invite":
        (tmp_path / "invites.yaml").write_text(json.dumps(["first-code", "second-code"]))
        admission["invitesFile"] = str(tmp_path / "invites.yaml")
    return write_rlrun(
        tmp_path / "rlrun.yaml",
        rlrun(
            RUN,
            task={"maxOperand": 20, "operations": ["+"]},
            sampling={"groupSize": 2, "maxTokens": 6},
            trainer={"steps": STEPS, "batchSize": 2, "maxAsyncLevel": 2},
            ingest={"admission": admission},
        ),
        pool("local", RUN, replicas=0),  # every group the trainer gets comes through the door
        relay_tier("tier0", RUN),
    )


def wait_for_document(run_dir: Path, proc: subprocess.Popen, seconds: float) -> tuple[str, dict]:
    """(join URL from endpoints.json, the run document) once the ingest serves it."""
    deadline, endpoints = time.monotonic() + seconds, run_dir / "endpoints.json"
    while True:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the ingest never served the run document"
        if endpoints.exists():
            url = json.loads(endpoints.read_text())["join"]
            try:
                answer = requests.get(url, timeout=5)
                if answer.status_code == 200:
                    return url, answer.json()
            except requests.ConnectionError:
                pass  # not listening yet
        time.sleep(0.5)


@pytest.mark.slow  # about a minute each: a local run of 4 steps and a joined worker process
@pytest.mark.parametrize("mode", ["open", "invite"])
def test_a_worker_joins_a_local_run_from_the_printed_url_and_its_groups_are_trained(tmp_path, mode):
    config, run_dir = door_run(tmp_path, mode), tmp_path / "run"
    argv = [sys.executable, "-m", "rlfleet.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        url, document = wait_for_document(run_dir, launcher, 300)
        relays = json.loads((run_dir / "endpoints.json").read_text())["http"]
        assert document["relayUrls"] == [relays["relay/tier0-0"]], "the run document announces the run's own relay"
        assert document["admission"] == {"mode": mode, "codeRequired": mode == "invite"}
        environ = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
        code = ["--code", "second-code"] if mode == "invite" else []
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "rlfleet.cli", "join", url, *code, "--work-dir", str(tmp_path / "worker")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**environ, "RLFLEET_TORCH_THREADS": "1"},
                cwd=tmp_path,
            )
        _, err = launcher.communicate(timeout=600)
    finally:
        for proc in (launcher, worker):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if proc is launcher else signal.SIGTERM)
                proc.wait(120)
    assert launcher.returncode == 0, err[-4000:] + (tmp_path / "worker.log").read_text()[-2000:]
    printed = re.search(r"rlfleet: outside workers join with: rlfleet join (\S+)( --code CODE)?\n", err)
    assert printed and printed.group(1) == url and bool(printed.group(2)) == (mode == "invite"), err
    joined = json.loads((tmp_path / "worker" / "credentials.json").read_text())["worker_id"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Every step trained a full batch, and every trained group was the joined worker's.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["worker_ids"] == [joined, joined] for r in records), [r["worker_ids"] for r in records]
    stats = json.loads((run_dir / "workers.json").read_text())[joined]
    counters = stats["counters"]
    assert stats["banned"] is None and counters["accepted"] >= 2 * STEPS, stats
    assert {c for c in counters if c.startswith("rejected:")} <= {"rejected:stale_version"}, counters
    assert counters.get("unchecked", 0) == 0, "a group of a worker on probation skipped the prefill checks"
    # The run sets no assignment and lets workers join, so it assigns the work: every accepted group used a ticket.
    assert document["taskIds"]["assignment"] == "run"
    assert counters["tickets_used"] == counters["accepted"], counters
