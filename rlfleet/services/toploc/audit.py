"""The verifier's audit streams, `rejected` and `deadletter`: what they keep of an entry, and their bound.

An entry records why (the reason, the error, who sent it, which replica judged it) and the original inbox
message: whole up to `entry_message_bytes`, cut there otherwise, with its full length and sha256 so a cut
entry can still be matched against the sender's copy. A flood of rejections is exactly what these streams
must survive: each is bounded by entries (`redis.streamMaxLen`) and by bytes (`redis.auditStreamMaxBytes`,
counting every field name and value). An entry's message is cut to 1/AUDIT_WHOLE_ENTRIES of the byte bound,
so a full stream still holds at least its newest AUDIT_WHOLE_ENTRIES entries, the new one always among them.

Redis has no trim by bytes, so the scripts that write these streams append through `AUDIT_APPEND_LUA`: it
keeps a running total per stream in the run's `audit_bytes` hash (stream key -> bytes), updated in the same
script as the stream, and drops the oldest entries until both bounds hold. An append reads only the
entries it drops, and the trim is exact (no `~`), so the bound is a bound.
"""

from __future__ import annotations

import hashlib

from rlfleet.config import RLRunSpec
from rlfleet.wire.streams import encode_json

AUDIT_WHOLE_ENTRIES = 16

# A Lua function the commit and dead-letter scripts define and call (they prepend this text).
AUDIT_APPEND_LUA = """
local function audit_append(stream, sizes, max_len, max_bytes, fields)
  local function size_of(f)
    local n = 0
    for _, v in ipairs(f) do n = n + string.len(v) end
    return n
  end
  if redis.call('HEXISTS', sizes, stream) == 0 then
    -- a stream written before its bytes were counted (an older rlfleet), or a lost total: count it once
    local total, cursor = 0, '-'
    while true do
      local page = redis.call('XRANGE', stream, cursor, '+', 'COUNT', 100)
      if #page == 0 then break end
      for _, e in ipairs(page) do total = total + size_of(e[2]) end
      cursor = '(' .. page[#page][1]
    end
    redis.call('HSET', sizes, stream, total)
  end
  redis.call('XADD', stream, '*', unpack(fields))
  local total = redis.call('HINCRBY', sizes, stream, size_of(fields))
  local len = redis.call('XLEN', stream)
  local dropped = 0
  while len > 1 and (total > max_bytes or len > max_len) do
    local oldest = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)[1]
    redis.call('XDEL', stream, oldest[1])
    total, len, dropped = total - size_of(oldest[2]), len - 1, dropped + 1
  end
  if len == 1 then total = size_of(fields) end  -- exact again, whatever trimmed the stream behind our back
  if dropped > 0 or len == 1 then redis.call('HSET', sizes, stream, total) end
  return dropped
end
"""


def entry_message_bytes(spec: RLRunSpec) -> int:
    """How much of the original message an audit entry keeps (module docstring)."""
    return min(spec.verifier.max_message_bytes, spec.redis.audit_stream_max_bytes // AUDIT_WHOLE_ENTRIES)


def audit_entry(record: dict, message: bytes, spec: RLRunSpec) -> dict[bytes, bytes]:
    """The fields of one audit entry: `record` (JSON) with the message's length and sha256, and the message
    itself, cut to entry_message_bytes."""
    whole = {**record, "original_bytes": len(message), "original_sha256": hashlib.sha256(message).hexdigest()}
    return {**encode_json(whole), b"original": message[: entry_message_bytes(spec)]}


def audit_bounds(spec: RLRunSpec) -> list[int]:
    """The script arguments of the bounds, in AUDIT_APPEND_LUA's order: entries, bytes."""
    return [spec.redis.stream_max_len, spec.redis.audit_stream_max_bytes]
