"""The HTTP ingest for outside workers, against a real redis-server and a real uvicorn on 127.0.0.1.

Every refusal must answer a clear 4xx/503 and leave the inbox untouched; an accepted group must land
in the inbox as exactly the bytes the worker posted.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import redis
import requests

from rlfleet.config import ConfigError, IngestSpec, parse_bundle
from rlfleet.services.ingest.client import post_group, rollouts_url
from rlfleet.services.ingest.main import make_app
from rlfleet.services.ingest.tokens import load_tokens
from rlfleet.wire.asgi import BackgroundServer
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import MESSAGE_FIELD, SCHEMA_VERSION, RolloutGroup, RunKeys, Sample, SamplingParams
from tests.runs import bundle_yaml, pool, rlrun, write_rlrun
from tests.support import redis_from_url, wait_for

RUN = "demo"
TOKENS = {"w1": "token-of-w1", "w2": "token-of-w2"}
KEYS = RunKeys(RUN)


_distinct = itertools.count()


def group_bytes(worker_id: str = "w1", work: int | None = None) -> bytes:
    """A group message; each call is other work (another completion) unless `work` names the same one."""
    n = next(_distinct) if work is None else work
    group = RolloutGroup(
        task_id="arith-1",
        worker_id=worker_id,
        policy_version=0,
        prompt_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=4, seed=7),
        samples=[
            Sample(completion_ids=[4, 5, n], logprobs=[-0.5, -1.0, -1.0], proofs=[b"p" * 8], reward=1.0)
            for _ in range(2)
        ],
    )
    return group.encode()[MESSAGE_FIELD]


@contextmanager
def ingest(redis_url: str, **spec):
    client = redis_from_url(redis_url)
    settings = {"maxBodyBytes": 4096, "ratePerMinute": 1000, "maxBacklog": 5, **spec}
    server = BackgroundServer(
        make_app(RUN, IngestSpec.model_validate(settings), client, TOKENS), "127.0.0.1", free_port(), "ingest"
    ).start()
    try:
        yield f"http://127.0.0.1:{server.server.config.port}", client
    finally:
        server.stop()
        client.close()


def post(base: str, body, token: str | None = "token-of-w1", run: str = RUN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(rollouts_url(base, run), data=body, headers=headers, timeout=10)


def assert_refused(resp: requests.Response, code: int, client: redis.Redis, words: str) -> None:
    assert resp.status_code == code, resp.text
    assert words in resp.json()["detail"], resp.json()
    assert client.xlen(KEYS.rollouts) == 0, "a refused submission reached the inbox"


def test_honest_group_is_enqueued_byte_for_byte(redis_url):
    body = group_bytes("w1")
    with ingest(redis_url) as (base, client):
        resp = post(base, body)
        assert resp.status_code == 202, resp.text
        entries = client.xrange(KEYS.rollouts)
        assert [e[0].decode() for e in entries] == [resp.json()["id"]]
        assert entries[0][1] == {MESSAGE_FIELD: body}
        assert RolloutGroup.decode(entries[0][1]).rollout_id == resp.json()["rollout_id"]
        # /healthz answers from the Redis watch, which reads the backlog about once a second
        wait_for("one group in the inbox", lambda: requests.get(base + "/healthz", timeout=5).json()["inbox"] == 1, 5)
        metrics = requests.get(base + "/metrics", timeout=5).text
        assert 'rlfleet_ingest_requests_total{code="202"}' in metrics


@pytest.mark.parametrize(
    "token", [None, "token-of-w3", "token-of-w1x", ""], ids=["missing", "wrong", "longer", "empty"]
)
def test_bad_token_is_401(redis_url, token):
    with ingest(redis_url) as (base, client):
        assert_refused(post(base, group_bytes(), token=token), 401, client, "token")
        basic = requests.post(
            rollouts_url(base, RUN), data=group_bytes(), timeout=10, headers={"Authorization": "Basic token-of-w1"}
        )
        assert_refused(basic, 401, client, "Bearer")


def test_other_run_is_404(redis_url):
    with ingest(redis_url) as (base, client):
        assert_refused(post(base, group_bytes(), run="other"), 404, client, "'other'")


def test_oversized_body_is_413_by_length_and_while_reading(redis_url):
    with ingest(redis_url, maxBodyBytes=1024) as (base, client):
        body = group_bytes()
        assert len(body) < 1024
        big = body + b" " * 2000  # still a valid group after the padding; only its size is wrong
        assert_refused(post(base, big), 413, client, "maxBodyBytes")
        # Chunked upload: no Content-Length, so the limit is enforced while reading.
        assert_refused(post(base, (big[i : i + 256] for i in range(0, len(big), 256))), 413, client, "maxBodyBytes")
        assert post(base, iter([body[:100], body[100:]])).status_code == 202  # chunked and small is fine


@pytest.mark.parametrize(
    "body,words",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"schema": 99}).encode(), "schema"),
        (json.dumps({"schema": SCHEMA_VERSION, "worker_id": "w1"}).encode(), "malformed field"),
        (b"", "no 'm' field"),
        (b"[" * 2000 + b"]" * 2000, "RecursionError"),
        (group_bytes().replace(b'"policy_version":0', b'"policy_version":1e400'), "policy_version"),
        (group_bytes().replace(b'"worker_id":"w1"', b'"worker_id":"\\ud800"'), "lone surrogate"),
        (group_bytes().replace(b'"seed":7', b'"seed":"7"'), "seed"),
        (b'{"schema": 2, "worker_id": "\xff"}', "not JSON"),
    ],
    ids=["text", "list", "schema", "fields", "empty", "deep", "overflow", "surrogate", "type", "utf8"],
)
def test_malformed_body_is_422_with_the_decode_error(redis_url, body, words):
    with ingest(redis_url) as (base, client):
        assert_refused(post(base, body), 422, client, words)


def test_worker_id_must_be_the_tokens_worker(redis_url):
    with ingest(redis_url) as (base, client):
        assert_refused(post(base, group_bytes("w2"), token="token-of-w1"), 403, client, "'w2'")
        assert_refused(post(base, group_bytes("w1"), token="token-of-w2"), 403, client, "'w1'")


def test_banned_worker_is_403(redis_url):
    with ingest(redis_url) as (base, client):
        # The gate's commit script writes the ban record this way (reputation.ban_plan's record).
        client.hset(
            KEYS.banned,
            "w1",
            json.dumps({"reason": "toploc", "detail": "x", "rollout_id": None, "rule": "banOn", "at": 0}),
        )
        assert_refused(post(base, group_bytes("w1")), 403, client, "banned")
        assert post(base, group_bytes("w2"), token="token-of-w2").status_code == 202  # others still get in


def test_rate_limit_per_worker_is_429_with_retry_after(redis_url):
    with ingest(redis_url, ratePerMinute=3) as (base, client):
        for _ in range(3):
            assert post(base, group_bytes()).status_code == 202
        resp = post(base, group_bytes())
        assert resp.status_code == 429 and "3 groups per minute" in resp.json()["detail"]
        assert int(resp.headers["Retry-After"]) >= 1
        assert client.xlen(KEYS.rollouts) == 3
        assert post(base, group_bytes("w2"), token="token-of-w2").status_code == 202  # the bucket is per worker


def test_backlog_is_503_and_the_worker_resends_the_same_group(redis_url):

    with ingest(redis_url, maxBacklog=2) as (base, client):
        for i in range(3):
            client.xadd(KEYS.rollouts, {MESSAGE_FIELD: b"queued-%d" % i})
        resp = post(base, group_bytes())
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
        assert client.xlen(KEYS.rollouts) == 3

        body, result, stop = group_bytes(), {}, threading.Event()

        def send():
            with requests.Session() as session:  # closed, so the server's shutdown waits for no keep-alive
                result["id"] = post_group(session, rollouts_url(base, RUN), TOKENS["w1"], body, stop)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.3)
        assert sender.is_alive() and client.xlen(KEYS.rollouts) == 3  # held back, not dropped
        client.delete(KEYS.rollouts)  # the verifier caught up
        sender.join(10)
        assert not sender.is_alive()
        assert [(e[0].decode(), e[1]) for e in client.xrange(KEYS.rollouts)] == [(result["id"], {MESSAGE_FIELD: body})]


def test_worker_raises_on_a_refusal_resending_cannot_fix(redis_url):

    with ingest(redis_url) as (base, client):
        with pytest.raises(RuntimeError, match="HTTP 401"):
            post_group(requests.Session(), rollouts_url(base, RUN), "nope", group_bytes(), threading.Event())
        assert client.xlen(KEYS.rollouts) == 0


def test_tokens_file_and_config(tmp_path):
    good = tmp_path / "tokens.yaml"
    good.write_text("w1: abc\nw2: def\n")
    assert load_tokens(good) == {"w1": "abc", "w2": "def"}
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps({"w1": "same", "w2": "same"}))
    with pytest.raises(ConfigError, match="share a token"):
        load_tokens(shared)
    empty = tmp_path / "empty.yaml"
    empty.write_text("w1: ''\n")
    with pytest.raises(ConfigError, match="non-empty string"):
        load_tokens(empty)
    twice = tmp_path / "twice.yaml"
    twice.write_text("w1: abc\nw2: def\nw1: ghi\n")  # w1's first token would be lost without a word
    with pytest.raises(ConfigError, match='line 3: key "w1" is already set at line 1 of this mapping'):
        load_tokens(twice)
    ingest_spec = {"tokensFile": "t.yaml", "maxBodyBytes": 2048, "ratePerMinute": 5, "maxBacklog": 7}
    bundle = parse_bundle(
        bundle_yaml(rlrun(RUN, ingest=ingest_spec), pool("outside", RUN, ingestUrl="https://ingest.example.org"))
    )
    spec = bundle.run.spec.ingest
    assert (spec.tokens_file, spec.max_body_bytes, spec.rate_per_minute, spec.max_backlog) == ("t.yaml", 2048, 5, 7)
    assert bundle.pools[0].spec.ingest_url == "https://ingest.example.org"


def test_cli_serves_the_ingest(redis_url, tmp_path):
    config, tokens, port = tmp_path / "run.yaml", tmp_path / "tokens.yaml", free_port()
    write_rlrun(config, rlrun(RUN))
    tokens.write_text(json.dumps(TOKENS))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "ingest",
            "--config",
            str(config),
            "--redis-url",
            redis_url,
            "--port",
            str(port),
            "--tokens-file",
            str(tokens),
        ],
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                requests.get(base + "/healthz", timeout=1).raise_for_status()
                break
            except requests.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stderr.read().decode() if proc.poll() is not None else "no start"
                )
                time.sleep(0.1)
        assert post(base, group_bytes()).status_code == 202
        assert redis_from_url(redis_url).xlen(KEYS.rollouts) == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_work_tickets_are_issued_to_the_tokens_worker(redis_url):
    from rlfleet.services.ingest.client import request_ticket, tickets_url

    with ingest(redis_url) as (base, client):
        url = tickets_url(base, RUN)
        with requests.Session() as session:
            got = [request_ticket(session, url, TOKENS["w1"], threading.Event()) for _ in range(2)]
            assert got == [0, 1]
            assert request_ticket(session, url, TOKENS["w2"], threading.Event()) == 0  # per worker
            with pytest.raises(RuntimeError, match="HTTP 401"):
                request_ticket(session, url, "nope", threading.Event())
        assert client.hget(KEYS.tickets, "w1") == b"2"


def test_the_ingest_works_with_its_own_redis_user(tmp_path):
    """Its ACL user (rlfleet/wire/redis_acl.py) is enough for admission, idempotency, tickets, bans and health."""
    from rlfleet.local.redis_server import EmbeddedRedis
    from rlfleet.services.ingest.client import request_ticket, tickets_url
    from rlfleet.wire.redis_acl import ADMIN, RunAcl, user_name

    acl = RunAcl.generate(RUN)
    server = EmbeddedRedis(tmp_path / "redis", acl=acl.acl_file(), auth=(user_name(ADMIN, RUN), acl.passwords[ADMIN]))
    with server, ingest(acl.url(server.base_url, "ingest")) as (base, client):
        body = group_bytes()
        assert post(base, body).status_code == 202 and post(base, body).json()["duplicate"] is True
        assert request_ticket(requests.Session(), tickets_url(base, RUN), TOKENS["w1"], threading.Event()) == 0
        wait_for("one group in the inbox", lambda: requests.get(base + "/healthz", timeout=5).json()["inbox"] == 1, 5)
        admin = redis_from_url(server.url)
        admin.hset(KEYS.banned, "w2", "{}")
        assert post(base, group_bytes("w2"), token="token-of-w2").status_code == 403
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.xadd(KEYS.verified, {MESSAGE_FIELD: body})
