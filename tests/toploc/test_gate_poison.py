"""Hostile inbox entries against the real gate loop, Redis and origin (issue 16 item 7): whatever cannot
be decoded is a `malformed` rejection, counted, and the gate goes on; an entry whose handling still
fails is retried, then dead-lettered and acknowledged; POST /verify answers 4xx for bad input and never
holds more than maxMessageBytes of a body."""

from __future__ import annotations

import json
import socket
import threading
import time

from prometheus_client import REGISTRY

from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.api import serve_in_thread
from rlfleet.services.toploc.main import Gate
from rlfleet.wire.ports import free_port
from rlfleet.wire.streams import MESSAGE_FIELD, decode_json
from tests.toploc.test_gate import as_, gate_system, honest_group, run_gate, verified_ids


def hostile_bodies(honest: dict) -> dict[str, bytes]:
    """Inbox message bodies that are not group messages, built from an honest one `honest`."""

    def variant(raw_value: str, **fields) -> bytes:
        """`honest` with fields replaced; the value "@RAW@" is written as the JSON text `raw_value`."""
        text = json.dumps({**honest, **fields})
        return text.replace('"@RAW@"', raw_value).encode()

    deep = b'{"schema": 2, "worker_id": "w-deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return {
        "nested 100k deep": deep,
        "policy_version 1e400": variant("1e400", policy_version="@RAW@"),
        "lone surrogate worker id": variant("", worker_id="\ud800"),
        "lone surrogate rollout id": variant("", rollout_id="\udfff"),
        "not UTF-8": b'{"schema": 2, "worker_id": "\xff\xfe"}',
        "top_k 1e400": variant("1e400", sampling={**honest["sampling"], "top_k": "@RAW@"}),
        "temperature a string": variant("", sampling={**honest["sampling"], "temperature": "hot"}),
        "reward NaN": variant("NaN", samples=[{**honest["samples"][0], "r": "@RAW@"}, *honest["samples"][1:]]),
        "task id an object": variant("", task_id={"a": [1, 2]}),
        "samples a string": variant("", samples="abc"),
        "policy_version a float": variant("", policy_version=0.5),
        "huge integer seed": variant(str(2**70), sampling={**honest["sampling"], "seed": "@RAW@"}),
    }


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_undecodable_entries_are_malformed_rejections_and_the_gate_goes_on(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url) as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        honest = honest_group(engine, ctx, 1)
        bodies = hostile_bodies(json.loads(honest.encode()[MESSAGE_FIELD]))
        ids = {r.xadd(keys.rollouts, {MESSAGE_FIELD: body}).decode(): name for name, body in bodies.items()}
        r.xadd(keys.rollouts, honest.encode())  # after every hostile one: the gate must still be serving
        before = counter("rlfleet_verifier_groups_total", verdict="rejected", reason="malformed")

        run_gate(ctx, origin_url, tmp / "cache", expected=len(bodies) + 1)

        records = [decode_json(f) for _, f in r.xrange(keys.rejected)]
        reasons = {ids[rec["inbox_id"]]: rec["reason"] for rec in records}
        assert reasons == {name: "malformed" for name in bodies}, reasons
        assert verified_ids(ctx) == [honest.rollout_id]
        assert int(r.hget(keys.stats, "rejected:malformed")) == len(bodies)
        assert counter("rlfleet_verifier_groups_total", verdict="rejected", reason="malformed") - before == len(bodies)
        assert r.xpending(keys.rollouts, keys.verifier_group)["pending"] == 0  # every entry acknowledged
        assert r.xlen(keys.rollouts) == 0 and r.hlen(keys.attempts) == 0
        # Only a valid worker id is charged; the surrogate one is not a hash field.
        assert all(b"\xed" not in f for f in r.hkeys(keys.workers))


def run_until(ctx, gate: Gate, condition, timeout: float = 60) -> None:
    thread = threading.Thread(target=gate.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not condition():
            assert thread.is_alive(), "the gate died"
            assert time.monotonic() < deadline, "condition not met in time"
            time.sleep(0.05)
    finally:
        ctx.stop.set()
        thread.join(30)
        ctx.stop.clear()


def test_a_poison_entry_is_retried_then_dead_lettered_and_the_others_verified(tmp_path, redis_url, monkeypatch):
    verifier = "{claimIdleMs: 200, maxAttempts: 3}"
    with gate_system(tmp_path, redis_url, verifier=verifier) as (ctx, policy, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        engine = TorchEngine(policy, 0)
        groups = [honest_group(engine, ctx, i) for i in (1, 2, 3)]
        poison = groups[1]
        entries = [r.xadd(keys.rollouts, g.encode()) for g in groups]
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        original = gate.checker.check

        def check(group, msg_id, prefill=True, **options):  # a bug that only this entry reaches
            if group.rollout_id == poison.rollout_id:
                raise RuntimeError("the gate cannot handle this entry")
            return original(group, msg_id, prefill, **options)

        monkeypatch.setattr(gate.checker, "check", check)
        failures = counter("rlfleet_verifier_handle_failures_total", error="RuntimeError")
        dead = counter("rlfleet_verifier_dead_letters_total")

        run_until(ctx, gate, lambda: r.xlen(keys.dead_letter) == 1 and r.hget(keys.stats, "accepted") == b"2")

        assert sorted(verified_ids(ctx)) == sorted([groups[0].rollout_id, groups[2].rollout_id])
        (_, fields), *_ = r.xrange(keys.dead_letter)
        record = decode_json(fields)
        assert record["inbox_id"] == entries[1].decode() and record["attempts"] == 3
        assert record["last_error"] == "RuntimeError: the gate cannot handle this entry"
        assert fields[b"original"] == poison.encode()[MESSAGE_FIELD]  # kept whole for an operator
        assert r.hget(keys.stats, "dead_letter") == b"1"
        # The batch of three fails once; then the poison alone, at once and after claimIdleMs.
        assert counter("rlfleet_verifier_handle_failures_total", error="RuntimeError") - failures == 3
        assert counter("rlfleet_verifier_dead_letters_total") - dead == 1
        assert r.xpending(keys.rollouts, keys.verifier_group)["pending"] == 0
        assert r.xlen(keys.rollouts) == 0 and r.hlen(keys.attempts) == 0


def test_a_verifier_that_dies_on_an_entry_counts_a_try(tmp_path, redis_url, monkeypatch):
    """A try is counted before it starts, so replicas that die on an entry (here: SystemExit out of the
    gate loop, as a crash would end it) bring it to the dead letter instead of a crash loop."""
    with gate_system(tmp_path, redis_url, verifier="{claimIdleMs: 100, maxAttempts: 2}") as (ctx, *_, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        entry = r.xadd(keys.rollouts, {MESSAGE_FIELD: b'{"schema": 2}'})
        for replica in ("verifier-a", "verifier-b"):
            dying = Gate(as_(ctx, VERIFIER), replica, origin_url, tmp / replica)

            def die(msg_id, fields):
                raise SystemExit("killed while handling")

            monkeypatch.setattr(dying, "handle", die)
            time.sleep(0.15)  # past claimIdleMs: the entry left by the previous replica is claimable
            claimed = dying.claim() or dying.read()
            assert [e[0] for e in claimed] == [entry]
            try:
                dying.attempt(*claimed[0])
            except SystemExit:
                pass
            else:
                raise AssertionError("the replica should have died")
        assert r.hget(keys.attempts, entry) == b"2"

        run_until(
            ctx, Gate(as_(ctx, VERIFIER), "verifier-c", origin_url, tmp / "c"), lambda: r.xlen(keys.dead_letter) == 1
        )
        record = decode_json(r.xrange(keys.dead_letter)[0][1])
        assert (record["attempts"], record["last_error"]) == (2, "the verifier stopped while handling it")
        assert r.xlen(keys.rejected) == 0 and r.xpending(keys.rollouts, keys.verifier_group)["pending"] == 0


def raw_post(port: int, head: bytes, body_parts, timeout: float = 20) -> bytes:
    """Send `head` and the body parts without finishing the request; what the server answers meanwhile."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        return sock.recv(65536)


def test_verify_api_answers_4xx_for_bad_bodies_and_bounds_what_it_reads(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, verifier="{maxMessageBytes: 65536}") as (ctx, policy, origin_url, tmp):
        honest = honest_group(TorchEngine(policy, 0), ctx, 1)
        gate = Gate(as_(ctx, VERIFIER), "verifier-api", origin_url, tmp / "cache-api")
        port = free_port()
        server = serve_in_thread(gate, "127.0.0.1", port)
        try:
            import httpx

            api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            for name, body in hostile_bodies(json.loads(honest.encode()[MESSAGE_FIELD])).items():
                if len(body) > 65535:  # the deep one is over maxMessageBytes here: 413 (below, 422 under it)
                    body = b'{"x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
                resp = api.post("/verify", content=body, headers={"content-type": "application/json"})
                assert resp.status_code == 422, (name, resp.status_code, resp.text)
                assert resp.json()["reason"] in ("malformed", "schema_version") and resp.json()["detail"], name
            assert api.post("/verify", content=honest.encode()[MESSAGE_FIELD]).json()["accepted"]

            # 64 MiB announced: refused from the Content-Length, before the body arrives.
            head = b"POST /verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            answer = raw_post(port, head + b"Content-Length: 67108864\r\n\r\n", [b"{" * 1024])
            assert answer.startswith(b"HTTP/1.1 413") and b"maxMessageBytes" in answer, answer[:200]
            # Chunked: refused once the limit is passed, while 60 MiB of it have not been sent.
            chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"  # 16 KiB chunks, never a last chunk
            answer = raw_post(port, head + b"Transfer-Encoding: chunked\r\n\r\n", [chunk] * 8)
            assert answer.startswith(b"HTTP/1.1 413") and b"maxMessageBytes" in answer, answer[:200]
            assert api.get("/healthz").json()["status"] == "ok"
        finally:
            server.stop()
