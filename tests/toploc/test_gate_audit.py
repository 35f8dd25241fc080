"""The verifier's audit streams (`rejected`, `deadletter`) under a flood, against the real gate and Redis: each
stays under its byte bound (`redis.auditStreamMaxBytes`) and its entry bound (`redis.streamMaxLen`), drops
only its oldest entries and no more than it must, keeps a running byte total equal to what it holds (entries an
older rlfleet wrote uncounted included), and an entry keeps what an audit needs: the reason, the message's
length and sha256, the message whole up to 1/16 of the bound (rlfleet/services/toploc/audit.py)."""

from __future__ import annotations

import hashlib

from rlfleet.operator.names import VERIFIER
from rlfleet.services.toploc.audit import AUDIT_WHOLE_ENTRIES
from rlfleet.services.toploc.main import Gate
from rlfleet.wire.streams import MESSAGE_FIELD, decode_json
from tests.toploc.test_gate import as_, gate_system, run_gate

MAX_BYTES = 2**20
MAX_ENTRIES = 100
BOUNDS = {
    "redis": f"{{streamMaxLen: {MAX_ENTRIES}, auditStreamMaxBytes: {MAX_BYTES}}}",
    "ingest": "{maxBacklog: 50}",  # below streamMaxLen, as the config requires
}
CUT = MAX_BYTES // AUDIT_WHOLE_ENTRIES


def entry_bytes(fields: dict) -> int:
    """What the bound counts of an entry: its field names and values."""
    return sum(len(k) + len(v) for k, v in fields.items())


def held(r, stream: str) -> list[tuple[bytes, dict]]:
    return r.xrange(stream)


def check_bounded(r, keys, stream: str) -> list[dict]:
    """The stream's bounds hold and its running total is exact; its records, oldest first."""
    entries = held(r, stream)
    total = sum(entry_bytes(f) for _, f in entries)
    assert total <= MAX_BYTES and len(entries) <= MAX_ENTRIES, (total, len(entries))
    assert int(r.hget(keys.audit_bytes, stream)) == total, "the running total is what the stream holds"
    return [{**decode_json(f), "original": f[b"original"], "size": entry_bytes(f)} for _, f in entries]


def test_a_flood_of_rejections_keeps_the_rejected_stream_under_its_bounds(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, **BOUNDS) as (ctx, _, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        # what an older rlfleet left: entries nobody counted, 1.2 MiB of them
        for i in range(3):
            r.xadd(keys.rejected, {b"json": b'{"reason": "old"}', b"original": bytes([i]) * 400_000})

        # 40 undecodable messages of 100 kB: the byte bound binds
        big = {r.xadd(keys.rollouts, {MESSAGE_FIELD: bytes([0xFF, i]) * 50_000}).decode(): i for i in range(40)}
        run_gate(ctx, origin_url, tmp / "cache", expected=40)
        records = check_bounded(r, keys, keys.rejected)
        assert all(rec["reason"] == "malformed" for rec in records), "the old entries went first"
        kept = [rec["inbox_id"] for rec in records]
        assert kept == list(big)[-len(kept) :], "the newest are kept, in order"
        assert sum(rec["size"] for rec in records) + records[0]["size"] > MAX_BYTES, "no more dropped than needed"
        assert len(kept) >= AUDIT_WHOLE_ENTRIES - 1  # each entry holds a little more than its cut message
        for rec in records:
            message = bytes([0xFF, big[rec["inbox_id"]]]) * 50_000
            assert rec["original"] == message[:CUT] and rec["original_bytes"] == len(message)
            assert rec["original_sha256"] == hashlib.sha256(message).hexdigest()

        # 150 small ones: the entry bound binds, exactly
        small = [r.xadd(keys.rollouts, {MESSAGE_FIELD: b"not json %d" % i}).decode() for i in range(150)]
        run_gate(ctx, origin_url, tmp / "cache", expected=190)
        records = check_bounded(r, keys, keys.rejected)
        assert [rec["inbox_id"] for rec in records] == small[-MAX_ENTRIES:]
        assert records[-1]["original"] == b"not json 149"  # a small message is kept whole
        assert int(r.hget(keys.stats, "rejected")) == 190, "every rejection counted, whatever the stream kept"


def test_dead_letters_keep_the_dead_letter_stream_under_its_bounds(tmp_path, redis_url):
    with gate_system(tmp_path, redis_url, **BOUNDS) as (ctx, _, origin_url, tmp):
        r, keys = ctx.redis, ctx.keys
        gate = Gate(as_(ctx, VERIFIER), "verifier-0", origin_url, tmp / "cache")
        sent = [r.xadd(keys.rollouts, {MESSAGE_FIELD: b"x" * 200_000}) for _ in range(30)]
        pending = gate.read(count=30)
        assert [msg_id for msg_id, _ in pending] == sent
        for msg_id, fields in pending:
            assert gate.dead_letter(msg_id, fields, tries=3) == 1
        records = check_bounded(r, keys, keys.dead_letter)
        assert [rec["inbox_id"] for rec in records] == [m.decode() for m in sent[-len(records) :]]
        assert all(len(rec["original"]) == CUT and rec["original_bytes"] == 200_000 for rec in records)
        assert int(r.hget(keys.stats, "dead_letter")) == 30 and r.xlen(keys.rollouts) == 0
