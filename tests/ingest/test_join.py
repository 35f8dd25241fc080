"""The ingest's door (`spec.ingest.admission`), against a real redis-server and real uvicorn servers on 127.0.0.1:
the public run document, joining in modes open and invite, hashed tokens any replica honours, bans that take
effect on the next request and on rejoins from the same address, probation, and every bad join refused with
its status code and nothing stored."""

from __future__ import annotations

import hashlib
import json
import re
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import redis
import requests

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.fleet.reputation import on_probation
from rlfleet.services.ingest.client import join_url, run_document_url, tickets_url
from rlfleet.services.ingest.door import make_door
from rlfleet.services.ingest.main import make_app
from rlfleet.versions.signing import generate_keypair
from rlfleet.wire.asgi import BackgroundServer
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import RunKeys
from tests.ingest.test_ingest import group_bytes, post
from tests.runs import bundle_yaml, rlrun
from tests.support import redis_from_url

RUN = "demo"
KEYS = RunKeys(RUN)
RELAY = "https://relay.example.org"
DOOR_KEYS = [KEYS.credentials, KEYS.joined, KEYS.invites_used, KEYS.active, KEYS.join_addresses]


def run_bundle(tmp_path: Path, admission: dict, **ingest):
    _, public = generate_keypair(tmp_path / "keys")
    doc = rlrun(
        RUN,
        shardcast={"publicKey": public},
        redis={"url": "redis://secret-host:6379/0"},
        store=tmp_path / "store",
        ingest={"maxBodyBytes": 4096, "ratePerMinute": 1000, "maxBacklog": 5, **ingest, "admission": admission},
    )
    return parse_bundle(bundle_yaml(doc)).run, public


@contextmanager
def door_ingest(tmp_path: Path, redis_url: str, replicas: int = 1, invites: list[str] | None = None, **admission):
    """`replicas` ingests of one run on one Redis (mode open unless `admission` says otherwise)."""
    admission = {"mode": "open", "relayUrls": [RELAY], **admission}
    run, _ = run_bundle(tmp_path, admission)
    invites_file = None
    if invites is not None:
        invites_file = tmp_path / "invites.yaml"
        invites_file.write_text(json.dumps(invites))
    client = redis_from_url(redis_url)
    with ExitStack() as stack:
        bases = []
        for _ in range(replicas):
            door = make_door(run, client, str(invites_file) if invites else None)
            app = make_app(RUN, run.spec.ingest, client, {"w1": "token-of-w1"}, door)
            server = BackgroundServer(app, "127.0.0.1", free_port(), "ingest").start()
            stack.callback(server.stop)
            bases.append(f"http://127.0.0.1:{server.server.config.port}")
        yield bases, client
    client.close()


def join(base: str, body=None, run: str = RUN, raw: bytes | None = None) -> requests.Response:
    data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
    return requests.post(join_url(base, run), data=data, timeout=10)


def door_state(client: redis.Redis) -> int:
    """Keys the door stores (0: a refused join stored nothing)."""
    return sum(int(client.exists(k)) for k in DOOR_KEYS)


def group_of(worker: str) -> bytes:
    return group_bytes("w1").replace(b'"worker_id":"w1"', json.dumps({"worker_id": worker})[1:-1].encode())


def banned_refusals(base: str) -> float:
    text = requests.get(base + "/metrics", timeout=5).text
    return float(re.search(r"^rlfleet_ingest_banned_refusals_total (\S+)$", text, re.M).group(1))


def test_the_run_document_tells_a_worker_everything_public_and_nothing_secret(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url) as ([base], _):
        resp = requests.get(run_document_url(base, RUN), timeout=10)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        assert doc["relayUrls"] == [RELAY] and doc["publicKey"].startswith("ed25519:")
        assert doc["engines"] == ["torch"] and doc["admission"] == {"mode": "open", "codeRequired": False}
        assert doc["rlrun"]["kind"] == "RLRun" and doc["rlrun"]["spec"]["model"]["path"] == "builtin://tiny-arithmetic"
        assert doc["sampling"]["groupSize"] == doc["rlrun"]["spec"]["sampling"]["groupSize"]
        assert doc["limits"]["probationRatePerMinute"] == 6 and doc["paths"]["join"] == "/v1/demo/join"
        text = resp.text
        assert "secret-host" not in text and "store" not in doc["rlrun"]["spec"] and "redis" not in doc["rlrun"]["spec"]
        assert requests.get(run_document_url(base, "other"), timeout=10).status_code == 404


def test_an_open_join_gives_a_token_any_replica_honours_stored_only_hashed(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, replicas=2, probationRatePerMinute=1000) as ([a, b], client):
        resp = join(a)
        assert resp.status_code == 201, resp.text
        worker, token = resp.json()["worker_id"], resp.json()["token"]
        assert client.hget(KEYS.credentials, hashlib.sha256(token.encode()).hexdigest()).decode() == worker
        dump = b"".join(v for k in DOOR_KEYS if client.type(k) == b"hash" for v in client.hgetall(k).values())
        assert token.encode() not in dump, "a token is stored in the clear"
        assert json.loads(client.hget(KEYS.joined, worker))["address"] == "127.0.0.1"
        # the other replica authenticates it, for that worker id only
        assert post(b, group_of(worker), token=token).status_code == 202
        assert post(b, group_of("w1"), token=token).status_code == 403
        assert post(a, group_of(worker), token=token + "x").status_code == 401
        assert requests.post(tickets_url(b, RUN), headers={"Authorization": f"Bearer {token}"}, timeout=10).ok
        assert client.zscore(KEYS.active, worker) is not None
        metrics = requests.get(a + "/metrics", timeout=5).text
        assert 'rlfleet_ingest_joins_total{outcome="201"}' in metrics


def test_a_ban_refuses_the_next_request_and_a_rejoin_from_the_same_address(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, probationRatePerMinute=1000) as ([base], client):
        first = join(base).json()
        auth = {"Authorization": f"Bearer {first['token']}"}
        assert post(base, group_of(first["worker_id"]), token=first["token"]).status_code == 202
        refusals_before = banned_refusals(base)
        client.hset(KEYS.banned, first["worker_id"], json.dumps({"reason": "proof", "at": time.time()}))
        refused = post(base, group_of(first["worker_id"]), token=first["token"])
        assert refused.status_code == 403 and "banned" in refused.json()["detail"]
        assert requests.post(tickets_url(base, RUN), headers=auth, timeout=10).status_code == 403
        before = client.hlen(KEYS.credentials)
        again = join(base)
        assert again.status_code == 403 and first["worker_id"] in again.json()["detail"], again.text
        assert int(again.headers["Retry-After"]) > 80000  # rejoinBanSeconds 86400 after the ban
        assert client.hlen(KEYS.credentials) == before, "a refused rejoin stored a credential"
        assert banned_refusals(base) == refusals_before + 3  # the submission, the ticket, the rejoin


def test_a_ban_older_than_rejoin_ban_seconds_lets_the_address_join(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, rejoinBanSeconds=60) as ([base], client):
        worker = join(base).json()["worker_id"]
        client.hset(KEYS.banned, worker, json.dumps({"reason": "proof", "at": 1000.0}))  # long ago
        assert join(base).status_code == 201


def test_probation_a_new_worker_is_slow_and_every_group_is_checked_until_it_earns_standing(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, probationGroups=2, probationRatePerMinute=2) as ([base], client):
        joined = join(base).json()
        worker, token = joined["worker_id"], joined["token"]
        assert joined["probation"] == {"groups": 2, "ratePerMinute": 2}
        answers = [post(base, group_of(worker), token=token) for _ in range(3)]
        assert [a.status_code for a in answers] == [202, 202, 429]
        assert int(answers[2].headers["Retry-After"]) >= 20  # about 30 s: a token per half minute
        # the gate checks every group of the worker while it has fewer than 2 accepted, and writes its standing
        assert on_probation(client, KEYS, worker, 2)
        assert not on_probation(client, KEYS, "w1", 2), "a worker with a written token is never on probation"
        client.hset(KEYS.workers, f"{worker}|accepted", 4)
        assert not on_probation(client, KEYS, worker, 2)
        assert client.hget(KEYS.standing, worker) == b"4"
        # 4 accepted = twice probationGroups: the rate doubled twice (2 -> 8 per minute): a token in 7.5 s
        wider = post(base, group_of(worker), token=token)
        assert wider.status_code == 429 and int(wider.headers["Retry-After"]) <= 8, wider.headers


def test_invites_are_single_use(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, invites=["alpha", "beta"], mode="invite") as ([base], client):
        doc = requests.get(run_document_url(base, RUN), timeout=10).json()
        assert doc["admission"]["codeRequired"]
        first = join(base, {"code": "alpha"})
        assert first.status_code == 201, first.text
        assert (
            client.hget(KEYS.invites_used, hashlib.sha256(b"alpha").hexdigest()).decode() == first.json()["worker_id"]
        )
        stored = client.hlen(KEYS.credentials)
        reused = join(base, {"code": "alpha"})
        assert reused.status_code == 409 and "already used" in reused.json()["detail"]
        for body, words in (({"code": "gamma"}, "unknown invite code"), ({}, "invitation")):
            resp = join(base, body)
            assert resp.status_code == 403 and words in resp.json()["detail"], resp.text
        assert client.hlen(KEYS.credentials) == stored, "a refused join stored a credential"
        assert join(base, {"code": "beta"}).status_code == 201


def test_mode_tokens_has_no_door(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, mode="tokens") as ([base], client):
        resp = join(base)
        assert resp.status_code == 403 and "mode tokens" in resp.json()["detail"]
        assert door_state(client) == 0
        assert post(base, group_bytes("w1")).status_code == 202  # the written tokens work as before


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"code": 7}', "code must be"),
        (b'{"who": "me"}', "unknown fields"),
        (b'{"engine": "tpu"}', "not admitted"),
        (b"{" + b" " * 5000 + b"}", "4096 bytes"),
    ],
    ids=["text", "list", "code-type", "unknown-field", "engine", "too-long"],
)
def test_a_malformed_join_is_refused_and_stores_nothing(tmp_path, redis_url, raw, words):
    with door_ingest(tmp_path, redis_url) as ([base], client):
        resp = join(base, raw=raw)
        assert resp.status_code in (413, 422) and words in resp.json()["detail"], resp.text
        assert resp.status_code == (413 if words == "4096 bytes" else 422)
        assert door_state(client) == 0


def test_an_unknown_run_is_404_and_stores_nothing(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url) as ([base], client):
        assert join(base, run="other").status_code == 404
        assert door_state(client) == 0


def test_a_flood_from_one_address_gets_429_with_retry_after(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, joinsPerMinutePerAddress=2) as ([base], client):
        assert [join(base).status_code for _ in range(2)] == [201, 201]
        flood = join(base)
        assert flood.status_code == 429 and int(flood.headers["Retry-After"]) >= 1
        assert client.hlen(KEYS.credentials) == 2


def test_joins_over_the_active_worker_cap_get_503_and_banned_workers_free_their_slot(tmp_path, redis_url):
    with door_ingest(tmp_path, redis_url, maxActiveWorkers=2) as ([base], client):
        workers = [join(base).json()["worker_id"] for _ in range(2)]
        full = join(base)
        assert full.status_code == 503 and "maxActiveWorkers" in full.json()["detail"]
        assert int(full.headers["Retry-After"]) >= 1 and client.hlen(KEYS.credentials) == 2
        client.hset(KEYS.banned, workers[0], json.dumps({"reason": "proof", "at": 0.0}))  # an old ban
        assert join(base).status_code == 201


def test_joining_modes_need_relays_and_invite_mode_its_codes(tmp_path, redis_url):
    opened, _ = run_bundle(tmp_path, {"mode": "open"})  # parses: `rlfleet run` passes its own relays
    with pytest.raises(ConfigError, match="relayUrls: mode open needs the public relay URLs"):
        make_door(opened, redis_from_url(redis_url), None)
    door = make_door(opened, redis_from_url(redis_url), None, relay_urls=["http://127.0.0.1:9"])
    assert door.document["relayUrls"] == ["http://127.0.0.1:9"]
    run, _ = run_bundle(tmp_path, {"mode": "invite", "relayUrls": [RELAY]})
    with pytest.raises(ConfigError, match="invitesFile"):
        make_door(run, redis_from_url(redis_url), None)
    (tmp_path / "bad.yaml").write_text("{a: 1}")
    with pytest.raises(ConfigError, match="list of invite codes"):
        make_door(run, redis_from_url(redis_url), str(tmp_path / "bad.yaml"))
