"""`rlfleet join URL` starts a working worker from the run document's URL alone: a real redis-server, a signed
policy version served by an origin over HTTP (the run's relay), the ingest with its door, `rlfleet join` as a
subprocess, and a real gate that accepts the groups the joined worker made, every one prefill-checked
(probation) although the run spot-checks none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.fleet.reputation import one_worker_stats
from rlfleet.services.ingest.client import run_document_url
from rlfleet.services.ingest.door import make_door
from rlfleet.services.ingest.main import make_app
from rlfleet.services.rollout.join import fetch_document, split_url, worker_config
from rlfleet.services.shardcast import origin
from rlfleet.versions.checkpoint import publish_version
from rlfleet.versions.signing import generate_keypair, load_private_key, make_signer
from rlfleet.versions.store import FileStore
from rlfleet.wire.asgi import BackgroundServer
from rlfleet.wire.ports import free_port
from rlfleet.wire.runtime import Context
from rlfleet.wire.streams import RolloutGroup, RunKeys, encode_json
from rlfleet.wire.views import VIEWS, view_bundle
from tests.runs import bundle_yaml, rlrun
from tests.support import redis_from_url, serving, tiny_policy_dir
from tests.toploc.test_gate import run_gate

RUN = "joinrun"
KEYS = RunKeys(RUN)


def joined_run(policy: Path, store: Path, public: str, relay: str, mode: str, invites: Path | None):
    admission = {"mode": mode, "relayUrls": [relay], "probationGroups": 100, "probationRatePerMinute": 600}
    if invites:
        admission["invitesFile"] = str(invites)
    return parse_bundle(
        bundle_yaml(
            rlrun(
                RUN,
                model=policy,
                task={"maxOperand": 20},
                sampling={"groupSize": 2, "maxTokens": 4},
                trainer={"batchSize": 1, "maxAsyncLevel": 1},
                verifier={"spotCheckFraction": 0.0},  # only probation makes the gate prefill-check a group
                shardcast={"publicKey": public},
                store=store,
                ingest={"maxBacklog": 50, "admission": admission},
            )
        )
    )


@pytest.mark.slow  # about 45 s each: torch, a policy, a worker process, a gate
@pytest.mark.parametrize("mode", ["open", "invite"])
def test_rlfleet_join_starts_a_worker_whose_groups_the_gate_accepts(tmp_path, redis_url, mode):
    policy = tiny_policy_dir(tmp_path / "policy", seed=0)
    store = FileStore(tmp_path / "store")
    key_file, public = generate_keypair(tmp_path / "keys")
    publish_version(store, RUN, 0, policy, signer=make_signer(load_private_key(key_file)))
    invites = tmp_path / "invites.yaml"
    invites.write_text(json.dumps(["let-me-in"]))
    client = redis_from_url(redis_url)
    client.xadd(KEYS.policy, encode_json({"version": 0}))
    with serving(origin.make_app(store, RUN)) as relay:
        bundle = joined_run(policy, tmp_path / "store", public, relay, mode, invites if mode == "invite" else None)
        door = make_door(view_bundle(bundle, VIEWS["ingest"]).run, client, str(invites) if mode == "invite" else None)
        app = make_app(RUN, bundle.run.spec.ingest, client, {}, door)
        server = BackgroundServer(app, "127.0.0.1", free_port(), "ingest").start()
        base = f"http://127.0.0.1:{server.server.config.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
        env["RLFLEET_TORCH_THREADS"] = "1"
        code = ["--code", "let-me-in"] if mode == "invite" else []
        log = open(tmp_path / "worker.log", "wb")
        worker = subprocess.Popen(
            [sys.executable, "-m", "rlfleet.cli", "join", run_document_url(base, RUN), *code]
            + ["--work-dir", str(tmp_path / "worker")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
        try:
            deadline = time.monotonic() + 180
            while client.xlen(KEYS.rollouts) < 3:
                assert worker.poll() is None, (tmp_path / "worker.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
                time.sleep(0.2)
        finally:
            worker.terminate()
            worker.wait(30)
            server.stop()
        groups = [RolloutGroup.decode(fields) for _, fields in client.xrange(KEYS.rollouts)]
        [joined] = client.hkeys(KEYS.joined)
        assert {g.worker_id for g in groups} == {joined.decode()}
        credentials = json.loads((tmp_path / "worker" / "credentials.json").read_text())
        assert (
            credentials["worker_id"] == joined.decode()
            and (tmp_path / "worker" / "credentials.json").stat().st_mode & 0o077 == 0
        )
        ctx = Context(bundle=bundle, redis=client, keys=KEYS, stop=threading.Event())
        run_gate(ctx, relay, tmp_path / "gate-cache", expected=len(groups), timeout=120)
        counters = one_worker_stats(client, KEYS, joined.decode())["counters"]
        assert counters.get("accepted") == len(groups) and counters.get("rejected", 0) == 0, counters
        assert counters.get("unchecked", 0) == 0, "a group of a worker on probation skipped the prefill checks"
    assert "redis" not in (tmp_path / "worker.log").read_text().lower(), "the joined worker never spoke of Redis"
    client.close()


def test_join_url_must_name_a_run_document():
    assert split_url("https://ingest.example.org/v1/demo/") == ("https://ingest.example.org", "demo")
    assert split_url("http://h:8080/prefix/v1/demo") == ("http://h:8080/prefix", "demo")
    for bad in ("https://ingest.example.org", "ftp://h/v1/demo", "http://h/v1/demo/join"):
        with pytest.raises(Exception, match="run document"):
            split_url(bad)


def test_the_worker_config_checks_manifests_with_the_documents_key():
    doc = {
        "run": RUN,
        "publicKey": "ed25519:AAAA",
        "rlrun": {"apiVersion": "x", "kind": "RLRun", "metadata": {"name": RUN}, "spec": {"model": {"path": "m"}}},
    }
    text = worker_config(doc, "http://ingest", "torch")
    assert "publicKey: ed25519:AAAA" in text and "ingestUrl: http://ingest" in text
    assert "publicKey" not in json.dumps(doc["rlrun"]), "the document was changed in place"


def test_a_refused_join_is_a_clear_error_not_a_traceback(tmp_path, redis_url):
    client = redis_from_url(redis_url)
    bundle = joined_run(tmp_path, tmp_path / "store", generate_keypair(tmp_path / "k")[1], "http://r", "invite", None)
    invites = tmp_path / "invites.yaml"
    invites.write_text('["only-code"]')
    door = make_door(view_bundle(bundle, VIEWS["ingest"]).run, client, str(invites))
    server = BackgroundServer(make_app(RUN, bundle.run.spec.ingest, client, {}, door), "127.0.0.1", free_port(), "i")
    server.start()
    try:
        base = f"http://127.0.0.1:{server.server.config.port}"
        result = subprocess.run(
            [sys.executable, "-m", "rlfleet.cli", "join", run_document_url(base, RUN), "--code", "wrong"]
            + ["--work-dir", str(tmp_path / "w")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop()
        client.close()
    assert result.returncode == 2 and "HTTP 403: unknown invite code" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "w" / "credentials.json").exists()


def test_join_names_what_is_wrong_with_a_url_that_serves_no_run_document():
    from aiohttp import web

    async def healthz(_):
        return web.json_response({"status": "ok"})

    async def not_a_document(_):
        return web.json_response({"hello": "world"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/{run}", not_a_document)
    with serving(app) as base:
        with pytest.raises(ConfigError, match="not an rlfleet run document"):
            fetch_document(run_document_url(base, RUN))
        with pytest.raises(ConfigError, match="no run document: HTTP 404"):
            fetch_document(base + "/v2/nothing")
