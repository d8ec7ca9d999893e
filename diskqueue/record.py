"""The record codec: how one message is laid out in a segment (sans-I/O).

Layout, all integers big-endian:

    [4 crc32][4 length][8 msg_id][8 trace_id][8 timestamp_ns][2 attempts][2 ext_len][ext][body]

`length` counts every byte after itself; `crc32` covers every byte after
itself (length included), so a flipped bit anywhere, even in the length,
is detected. A record's size on disk is 8 + length.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple

PREFIX: Final = struct.Struct(">II")  # crc32, length
FIELDS: Final = struct.Struct(">IQQQHH")  # length, msg_id, trace_id, timestamp_ns, attempts, ext_len
HEAD: Final = struct.Struct(">IIQQQHH")  # the whole fixed head, for decoding
HEAD_SIZE: Final = HEAD.size  # 36
FIXED_LENGTH: Final = FIELDS.size - 4  # length of the fixed fields counted by `length` (28)
MAX_EXT: Final = 0xFFFF
MAX_RECORD: Final = 64 * 1024 * 1024  # sanity bound on `length` while scanning

_crc32: Final = zlib.crc32
_pack_fields: Final = FIELDS.pack
_unpack_head: Final = HEAD.unpack_from
_new: Final = tuple.__new__


class CorruptRecordError(Exception):
    """A record failed its checksum or framing; `offset` is its virtual offset."""

    def __init__(self, offset: int, reason: str, where: str = ""):
        self.offset = offset
        self.reason = reason
        self.where = where
        suffix = f" in {where}" if where else ""
        super().__init__(f"corrupt record at offset {offset}{suffix}: {reason}")


class Record(NamedTuple):
    """One decoded message with its place in the partition's history.

    A tuple, built with `tuple.__new__` on the read path: the cheapest
    object CPython can make, which matters at a million records a second.
    """

    offset: int
    size: int
    msg_id: int
    trace_id: int
    timestamp: int
    attempts: int
    ext: bytes
    body: bytes

    @property
    def end(self) -> int:
        return self.offset + self.size


def record_size(body_len: int, ext_len: int = 0) -> int:
    return 8 + FIXED_LENGTH + ext_len + body_len


def encode_into(out: bytearray, msg_id: int, trace_id: int, timestamp: int,
                attempts: int, ext: bytes, body: bytes) -> int:
    """Append one record to `out`; return its size."""
    return encode_records(out.extend, [], 0, msg_id, trace_id, timestamp, attempts, ext,
                          (body,))


def encode_records(add: Callable[[bytes | memoryview], object], offsets: list[int], offset: int,
                   first_id: int, trace_id: int, timestamp: int, attempts: int, ext: bytes,
                   bodies: Iterable[bytes | memoryview]) -> int:
    """Encode consecutive records (ids first_id, first_id + 1, ...) as pieces passed to `add`.

    Appends each record's virtual offset to `offsets`, starting at `offset`;
    returns the offset just past the last record. The write path's hot loop:
    the pieces are joined once per batch.
    """
    ext_len = len(ext)
    msg_id = first_id
    for body in bodies:
        offsets.append(offset)
        fields = _pack_fields(FIXED_LENGTH + ext_len + len(body), msg_id, trace_id, timestamp,
                              attempts, ext_len)
        if ext_len:
            add(_crc32(body, _crc32(ext, _crc32(fields))).to_bytes(4, "big"))
            add(fields)
            add(ext)
        else:
            add(_crc32(body, _crc32(fields)).to_bytes(4, "big"))
            add(fields)
        add(body)
        offset += HEAD_SIZE + ext_len + len(body)
        msg_id += 1
    return offset


def decode_at(buf, pos: int, base_offset: int) -> Record | None:
    """Decode the record at `pos` in `buf` (whose first byte is at `base_offset`).

    Returns None when `buf` holds only part of the record; raises
    CorruptRecordError when the bytes cannot be a valid record.
    """
    end_buf = len(buf)
    if end_buf - pos < HEAD_SIZE:
        return None
    crc, length, msg_id, trace_id, ts, attempts, ext_len = _unpack_head(buf, pos)
    if length < FIXED_LENGTH + ext_len or length > MAX_RECORD:
        raise CorruptRecordError(base_offset + pos, f"bad length {length}")
    end = pos + 8 + length
    if end > end_buf:
        return None
    view = memoryview(buf)
    if _crc32(view[pos + 4:end]) != crc:
        raise CorruptRecordError(base_offset + pos, "checksum mismatch")
    body_start = pos + HEAD_SIZE + ext_len
    return _new(Record, (base_offset + pos, 8 + length, msg_id, trace_id, ts, attempts,
                         bytes(view[pos + HEAD_SIZE:body_start]), bytes(view[body_start:end])))


def decode_all(buf: bytes, pos: int, end: int, base_offset: int, max_count: int):
    """Decode whole records from buf[pos:end] (buf[0] is at `base_offset`), at most `max_count`.

    Returns (records, new_pos, error): `error` is the CorruptRecordError of the
    first bad record (None if none), and `new_pos` points at it, so the records
    before it are still delivered and the bad one is never skipped.
    """
    records: list[Record] = []
    append = records.append
    view = memoryview(buf)
    try:
        while end - pos >= HEAD_SIZE and max_count:
            crc, length, msg_id, trace_id, ts, attempts, ext_len = _unpack_head(buf, pos)
            rec_end = pos + 8 + length
            if length < FIXED_LENGTH + ext_len or length > MAX_RECORD:
                raise CorruptRecordError(base_offset + pos, f"bad length {length}")
            if rec_end > end:
                break
            if _crc32(view[pos + 4:rec_end]) != crc:
                raise CorruptRecordError(base_offset + pos, "checksum mismatch")
            body_start = pos + HEAD_SIZE + ext_len
            append(_new(Record, (base_offset + pos, 8 + length, msg_id, trace_id, ts, attempts,
                                 buf[pos + HEAD_SIZE:body_start] if ext_len else b"",
                                 buf[body_start:rec_end])))
            pos = rec_end
            max_count -= 1
    except CorruptRecordError as e:
        return records, pos, e
    return records, pos, None
