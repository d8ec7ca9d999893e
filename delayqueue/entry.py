"""The entry codec of the delay store: its keys and its values (sans-I/O).

Keys, all integers big-endian so that byte order is number order:

    waiting key   [8 due_ms][8 msg_id]   (pack_due_key)
    id key        [8 msg_id]             (pack_id: the keys of `taken` and `due_of`)
    origin key    [8 origin_offset][8 msg_id]   (pack_origin_key; origin_offset >= 0)

A value is one record made by diskqueue.record.encode_into (msg_id, trace_id, timestamp,
attempts, ext, body; its own CRC), then [8 due_ms][8 origin_offset, signed]
[4 crc32 of those 16 bytes, seeded with the record's CRC]. So every byte of a value
is checked before it becomes a message, and the tail cannot be swapped between values.
A change here is a new store format (store.FORMAT).
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from diskqueue.record import HEAD_SIZE, CorruptRecordError, decode_at, encode_into

MAX_U64 = (1 << 64) - 1
MAX_DUE_MS = (1 << 63) - 1

U64 = struct.Struct(">Q")
_DUE_KEY = struct.Struct(">QQ")
_TAIL = struct.Struct(">Qq")  # due_ms, origin_offset
TAIL_SIZE = _TAIL.size + 4  # + crc32
pack_id = U64.pack
pack_due_key = _DUE_KEY.pack
pack_origin_key = _DUE_KEY.pack  # (origin_offset, msg_id): only log messages (offset >= 0)
unpack_origin_key = _DUE_KEY.unpack
_unpack_due_key = _DUE_KEY.unpack
_pack_tail = _TAIL.pack
_unpack_tail = _TAIL.unpack_from
_unpack_sealed_tail = struct.Struct(">QqI").unpack_from  # due_ms, origin_offset, crc32
_unpack_u32 = struct.Struct(">I").unpack_from
_unpack_u16 = struct.Struct(">H").unpack_from
ATTEMPTS_AT = 32  # [4 crc32][4 length][8 msg_id][8 trace_id][8 timestamp][2 attempts]
_crc32 = zlib.crc32
_new = tuple.__new__


class DelayedMessage(NamedTuple):
    """A deferred message: the whole message, when it is due, and where it came from."""

    due_ms: int
    msg_id: int
    trace_id: int
    timestamp: int
    attempts: int
    ext: bytes
    body: bytes
    origin_offset: int = -1  # virtual offset of the original record in the partition log


class CorruptEntry(Exception):
    """An entry failed its checks: in which sub-database, at which key, and why. The store
    raises it as DelayStoreCorruptError, with its file's path, after moving the entry aside."""

    def __init__(self, db: str, key: bytes, reason: str):
        self.db = db
        self.key = bytes(key)
        self.reason = reason


def encode_value(m: DelayedMessage) -> bytearray:
    """The stored value of `m` (see the module docstring)."""
    if not 0 <= m.due_ms <= MAX_DUE_MS:
        raise ValueError(f"due_ms out of range: {m.due_ms}")
    if not 0 <= m.msg_id <= MAX_U64:
        raise ValueError(f"msg_id out of range: {m.msg_id}")
    if not 0 <= m.trace_id <= MAX_U64 or not 0 <= m.timestamp <= MAX_U64:
        raise ValueError(f"trace_id or timestamp out of range: {m.trace_id}, {m.timestamp}")
    if not 0 <= m.attempts <= 0xFFFF:
        raise ValueError(f"attempts out of range (0..65535): {m.attempts}")
    if len(m.ext) > 0xFFFF:
        raise ValueError(f"ext header too long: {len(m.ext)} bytes (max 65535)")
    if not -(1 << 63) <= m.origin_offset < (1 << 63):
        raise ValueError(f"origin_offset out of range: {m.origin_offset}")
    out = bytearray()
    encode_into(out, m.msg_id, m.trace_id, m.timestamp, m.attempts, m.ext, m.body)
    _seal(out, int.from_bytes(out[:4], "big"), m.due_ms, m.origin_offset)
    return out


def _seal(out: bytearray, record_crc: int, due_ms: int, origin_offset: int) -> None:
    tail = _pack_tail(due_ms, origin_offset)
    out += tail
    out += _crc32(tail, record_crc).to_bytes(4, "big")


def with_due(value: bytes, due_ms: int) -> bytes | bytearray:
    """`value` with its tail's due time changed (the record itself is not touched).
    A value whose tail fails its checksum is returned unchanged: resealing it would
    make a corrupt origin_offset look valid."""
    tail = checked_tail(value)
    if tail is None:
        return value
    out = bytearray(memoryview(value)[:len(value) - TAIL_SIZE])
    _seal(out, int.from_bytes(value[:4], "big"), due_ms, tail[1])
    return out


def checked_tail(value: bytes) -> tuple[int, int] | None:
    """(due_ms, origin_offset) from a value's tail, or None if the tail fails its checksum."""
    if len(value) < TAIL_SIZE + 4:
        return None
    end = len(value) - TAIL_SIZE
    crc = int.from_bytes(value[end + 16:], "big")
    if _crc32(memoryview(value)[end:end + 16], int.from_bytes(value[:4], "big")) != crc:
        return None
    return _unpack_tail(value, end)


def held_fields(value: bytes) -> tuple[int, int, int] | None:
    """(due_ms, origin_offset, attempts) of a value whose record and tail both pass their
    checksums (None otherwise), without copying its ext or body."""
    tail = checked_tail(value)
    if tail is None or len(value) < TAIL_SIZE + HEAD_SIZE:
        return None
    with memoryview(value) as view:
        if _crc32(view[4:len(value) - TAIL_SIZE]) != _unpack_u32(value, 0)[0]:
            return None
    return tail[0], tail[1], _unpack_u16(value, ATTEMPTS_AT)[0]


def tail_due_ms(value: bytes) -> int | None:
    """The due time in a value's tail, or None if the tail fails its checksum."""
    tail = checked_tail(value)
    return None if tail is None else tail[0]


def decode_value(value: bytes, db: str = "?", key: bytes = b"") -> DelayedMessage:
    """Decode and verify a stored value; raises CorruptEntry (never returns garbage)."""
    try:
        rec = decode_at(value, 0, 0)
    except CorruptRecordError as e:
        raise CorruptEntry(db, key, f"record {e.reason}") from None
    if rec is None:
        raise CorruptEntry(db, key, f"value too short ({len(value)} bytes)")
    if rec.size + TAIL_SIZE != len(value):
        raise CorruptEntry(db, key, f"value is {len(value)} bytes, record {rec.size} "
                                    f"+ tail {TAIL_SIZE}")
    size = rec.size
    due_ms, origin, crc = _unpack_sealed_tail(value, size)
    if _crc32(value[size:size + 16], _unpack_u32(value, 0)[0]) != crc:
        raise CorruptEntry(db, key, "tail checksum mismatch")
    return _new(DelayedMessage, (due_ms, rec.msg_id, rec.trace_id, rec.timestamp, rec.attempts,
                                 rec.ext, rec.body, origin))


def check_waiting(key: bytes, m: DelayedMessage) -> None:
    """Raises CorruptEntry unless `key` is the waiting key of the decoded value `m`."""
    if len(key) != 16 or _unpack_due_key(key) != (m.due_ms, m.msg_id):
        raise CorruptEntry("waiting", key, f"key does not match value (due {m.due_ms}, "
                                           f"id {m.msg_id})")


def check_taken(key: bytes, m: DelayedMessage) -> None:
    """Raises CorruptEntry unless `key` is the id key of the decoded value `m`."""
    if key != pack_id(m.msg_id):
        raise CorruptEntry("taken", key, f"key does not match value (id {m.msg_id})")

