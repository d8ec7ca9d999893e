"""The commitlog entry codec (sans-I/O).

One entry per client write request, 64 bytes, big-endian:

    [8 log_id][8 epoch][8 first_msg_id][8 offset][8 count_before][8 timestamp_ns]
    [4 size][4 msg_count][4 flags][4 crc32 of the first 60 bytes]

`offset` is the virtual offset of the request's first record, `size` the bytes
of all its records, `count_before` the number of messages in the partition
before this request. Log ids are contiguous, so entry N sits at a computable place.
Flags: SYNCED_BEFORE says every byte of the partition before `offset` was synced
when this entry was written (recovery uses it to tell a torn tail from corruption).
"""

from __future__ import annotations

import struct
import zlib
from typing import Final, NamedTuple

_BODY: Final = struct.Struct(">QQQQQQIII")
ENTRY_SIZE: Final = 64
_CRC: Final = struct.Struct(">I")
_pack: Final = _BODY.pack
_crc32: Final = zlib.crc32
SYNCED_BEFORE: Final = 1


class CorruptEntryError(Exception):
    """An entry failed its checksum or does not carry the log id of its place."""


class Entry(NamedTuple):
    log_id: int
    epoch: int
    first_msg_id: int
    offset: int
    count_before: int
    timestamp: int
    size: int
    msg_count: int
    flags: int = 0

    @property
    def end_offset(self) -> int:
        return self.offset + self.size

    @property
    def count_after(self) -> int:
        return self.count_before + self.msg_count


def encode_fields(log_id: object, epoch: object, first_msg_id: object, offset: object,
                  count_before: object, timestamp: object, size: object, msg_count: object,
                  flags: object = 0) -> bytes:
    """Encode one entry from its fields (the write path's form: no Entry object)."""
    body = _pack(log_id, epoch, first_msg_id, offset, count_before, timestamp, size, msg_count,
                 flags)
    return body + _crc32(body).to_bytes(4, "big")


def encode(e: Entry) -> bytes:
    return encode_fields(*e)


def decode(buf, pos: int = 0) -> Entry:
    """Decode the entry at `pos`; raise CorruptEntryError on a checksum mismatch."""
    fields = _BODY.unpack_from(buf, pos)
    (crc,) = _CRC.unpack_from(buf, pos + 60)
    if zlib.crc32(memoryview(buf)[pos:pos + 60]) != crc:
        raise CorruptEntryError(f"entry checksum mismatch at byte {pos}")
    return Entry(*fields)


def same_entries(pushed, held) -> bool:
    """Whether entries from another replica are the ones held at their place: (epoch, offset,
    count before, timestamp, size, message count) of each, log ids aside (they differ
    between replicas). A duplicate push is told from a diverged one by this, never by its
    offset alone."""
    if len(pushed) != len(held):
        return False
    return all((a.epoch, a.offset, a.count_before, a.timestamp, a.size, a.msg_count)
               == (b.epoch, b.offset, b.count_before, b.timestamp, b.size, b.msg_count)
               for a, b in zip(pushed, held))
