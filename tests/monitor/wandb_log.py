"""Reading an offline W&B run's ``run-<id>.wandb`` file: the history rows it holds.

wandb 0.31 has no Python reader of its own for this file any more (``wandb.sdk.internal.datastore`` went with
the move to wandb-core, ``wandb sync --view`` with it; ``wandb.beta.LocalApi`` is not released). The file is
wandb's record log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then blocks of 32 KiB, each a run of
chunks ``[crc32 u32][length u16][type u8][data]`` (type 1 a whole record, 2/3/4 its first/middle/last part;
the crc covers the type byte then the data; a block's tail shorter than a chunk header is zero padding).
Each record is a ``wandb.proto.wandb_internal_pb2.Record``, decoded with wandb's own message class, so only
the framing is read here, and every chunk's checksum is checked.

wandb-core, a process of its own, writes the file: ``run.finish()`` can return before the last records are on
disk (seen under load: a 7-byte file, complete a moment later). :func:`history` therefore waits for the run's
``exit`` record, the last one it writes.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from typing import Dict, Iterator, List

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
CHUNK = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[bytes]:
    """The serialized records of the log at ``path``, in order (those written whole so far)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:len(HEADER)] == HEADER, f"{path} is not a W&B record log: it starts {data[:7]!r}"
    pos, parts = len(HEADER), []
    while pos + CHUNK.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK.size:  # padding
            pos += left_in_block
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # the zeroed end of a block
            pos += left_in_block
            continue
        if pos + CHUNK.size + length > len(data):  # a chunk still being written
            return
        body = data[pos + CHUNK.size:pos + CHUNK.size + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos += CHUNK.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join(parts + [body])


def _parsed(path: str) -> list:
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def history(path: str, timeout: float = 60.0) -> List[Dict[str, object]]:
    """Every history row (one per ``run.log``) of the finished run whose file is ``path``: key -> value. Waits
    (at most ``timeout`` seconds) for wandb-core to write the run's end."""
    deadline = time.monotonic() + timeout
    while True:
        parsed = _parsed(path)
        kinds = [record.WhichOneof("record_type") for record in parsed]
        if "exit" in kinds:
            break
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s: {kinds}"
        time.sleep(0.1)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record, kind in zip(parsed, kinds) if kind == "history"]
