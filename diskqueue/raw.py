"""Raw batches: a leader's commitlog entries and records as they travel to a follower (sans-I/O).

A raw batch is `n` encoded commitlog entries (64 bytes each) and the data they index:
whole records, exactly what the leader's segments hold. `check_batch` proves a batch can be
appended where it says it starts, before any byte of it is written; `renumber` gives its
entries this log's log ids. Invariants of a checked batch: every entry decodes (checksum)
and follows the one before it (offset and count contiguous from the batch's start), its
message ids are `partition << 50 | count`, epochs and timestamps never go back, and the
entries cover the data exactly with records whose CRCs hold.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from commitlog.entry import ENTRY_SIZE, Entry, encode_fields
from nsqwire.ids import PARTITION_SHIFT

from .record import FIXED_LENGTH, HEAD, HEAD_SIZE, MAX_RECORD, PREFIX


class BadBatch(Exception):
    """A raw batch that cannot be appended as it is; nothing of it was written."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class RawBatch(NamedTuple):
    """What `DiskQueue.read_raw` returns: `n_entries` entries from (offset, count), their
    `data`, and the log's written end `end` = (offset, count) when it was read."""

    offset: int
    count: int
    entries: bytes
    n_entries: int
    data: bytes
    end: tuple[int, int]


_ENTRY = struct.Struct(">QQQQQQIIII")  # commitlog.entry's fields, then the crc32 of the first 60
_new = tuple.__new__


def check_batch(offset: int, count: int, entries: bytes, data: bytes, partition: int,
                last_epoch: int, records: bool = True) -> list[Entry]:
    """The decoded entries of a batch starting at (offset, count), or BadBatch(reason).

    `last_epoch`: the epoch of the log's last entry (the batch's may not be lower).
    `records=False` skips the record-by-record walk (lengths, CRCs, ids): only for data
    whose checksum as a whole matched what its leader computed from its own encoding (a
    push), not for data read back from a disk (a fetch)."""
    if not entries or len(entries) % ENTRY_SIZE:
        raise BadBatch(f"{len(entries)} bytes of entries: not a whole number of entries")
    crc32 = zlib.crc32
    view, eview = memoryview(data), memoryview(entries)
    prefix = partition << PARTITION_SHIFT
    out = []
    pos, epoch, ts = 0, last_epoch, 0
    for i, fields in enumerate(_ENTRY.iter_unpack(entries)):
        _log_id, e_epoch, first_id, e_offset, before, e_ts, size, n, _flags, crc = fields
        if crc32(eview[i * ENTRY_SIZE:i * ENTRY_SIZE + 60]) != crc:
            raise BadBatch(f"entry {i}: checksum mismatch")
        if e_offset != offset + pos or before != count:
            raise BadBatch(f"entry {i} at ({e_offset}, {before}) does not follow "
                           f"({offset + pos}, {count})")
        if size <= 0 or n <= 0 or pos + size > len(data):
            raise BadBatch(f"entry {i}: size {size} and {n} messages do not fit "
                           f"the {len(data)} bytes of data")
        if first_id != prefix | count:
            raise BadBatch(f"entry {i}: message id {first_id:#x} is not "
                           f"partition {partition}, count {count}")
        if e_epoch < epoch or e_ts < ts:
            raise BadBatch(f"entry {i}: epoch or timestamp goes back")
        if records:
            _check_records(view, pos, pos + size, offset, first_id, n)
        out.append(_new(Entry, fields[:9]))
        pos += size
        count += n
        epoch, ts = e_epoch, e_ts
    if pos != len(data):
        raise BadBatch(f"the entries cover {pos} bytes of the {len(data)} bytes of data")
    return out


def _check_records(view: memoryview, pos: int, end: int, base: int, msg_id: int,
                   n: int) -> None:
    """view[pos:end] holds exactly `n` valid records with ids msg_id, msg_id + 1, ..."""
    crc32 = zlib.crc32
    for _ in range(n):
        if end - pos < HEAD_SIZE:
            raise BadBatch(f"record at offset {base + pos} is cut short")
        crc, length, rec_id, _trace, _ts, _attempts, ext_len = HEAD.unpack_from(view, pos)
        rec_end = pos + PREFIX.size + length
        if length < FIXED_LENGTH + ext_len or length > MAX_RECORD or rec_end > end:
            raise BadBatch(f"record at offset {base + pos}: bad length {length}")
        if crc32(view[pos + 4:rec_end]) != crc:
            raise BadBatch(f"record at offset {base + pos}: checksum mismatch")
        if rec_id != msg_id:
            raise BadBatch(f"record at offset {base + pos}: message id {rec_id:#x}, "
                           f"expected {msg_id:#x}")
        pos = rec_end
        msg_id += 1
    if pos != end:
        raise BadBatch(f"entry ending at offset {base + end} holds more than its records")


def renumber(entries: list[Entry], first_log_id: int, first_flags: int) -> bytes:
    """The entries encoded with this log's log ids from `first_log_id`; everything else the
    leader's but the flags: `first_flags` on the first entry (this log's SYNCED_BEFORE), 0 on
    the others."""
    return b"".join(
        encode_fields(first_log_id + i, e.epoch, e.first_msg_id, e.offset, e.count_before,
                      e.timestamp, e.size, e.msg_count, first_flags if i == 0 else 0)
        for i, e in enumerate(entries))
