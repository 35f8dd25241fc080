"""Read a W&B offline run's `.wandb` file back: the records wandb itself wrote, decoded with wandb's protobuf.

The file is a LevelDB-style log (what `wandb sync` reads): a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then
32 KiB blocks of chunks, each `crc32 (4) | length (2, little-endian) | type (1) | data`, type 1 a whole record and
2/3/4 its first, middle and last pieces; a block's tail shorter than a chunk header is padding. Each record is a
`wandb_internal_pb2.Record`; a history record holds one `wandb.log` call, its items JSON-encoded.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a .wandb file"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue  # zero padding
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """Every `wandb.log` call of the run, as {key: value} with its `_step`."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict:
    """The run's config: the run record's, updated by later config records (top-level keys, values JSON-decoded)."""
    out: dict = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            for item in (record.run.config if kind == "run" else record.config).update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def summary(path: Path) -> dict:
    out: dict = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
