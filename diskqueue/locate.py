"""Locate: the record boundary a channel's cursor moves to (replay), by time, offset or count.

The commitlog's binary searches find the write request (one entry per PUB or MPUB); a
request's records share one timestamp (the batch's), so a time search ends at an entry's
first record, while an offset or count inside an MPUB walks that one request's records.
No search scans the partition: O(log entries) commitlog reads plus at most one request's
bytes. Runs in the queue's write worker (DiskQueue.locate), so retention never drops what
it reads.

Bounds, the same for every kind: a place at or past the committed end is the end
(`clipped="end"`); a place before the oldest kept record is that record
(`clipped="retention"`). Only an offset inside a record is refused (NotABoundary).
"""

from __future__ import annotations

from typing import NamedTuple

from commitlog.log import CommitLog

from .record import PREFIX

KINDS = ("timestamp", "offset", "count", "end")  # timestamp in ns since the epoch


class Position(NamedTuple):
    """A record boundary: its virtual offset and the messages before it in the history."""

    offset: int
    count: int
    clipped: str | None = None  # None, "end" or "retention"


class NotABoundary(ValueError):
    """`offset` falls inside a record: `before` and `after` are the nearest boundaries."""

    def __init__(self, offset: int, before: int, after: int):
        super().__init__(f"offset {offset} is inside the record at {before}..{after}")
        self.offset, self.before, self.after = offset, before, after


def locate(read, commitlog: CommitLog, start: tuple[int, int], end: tuple[int, int],
           kind: str, value: int | None) -> Position:
    """The boundary for `kind` ("timestamp" ns, "offset", "count", "end") and `value`.

    `read(a, b)` returns the history's bytes in [a, b); `start` and `end` are (offset,
    count) of the oldest kept record and of the committed end."""
    start_pos, end_pos = Position(*start), Position(*end)
    if kind == "end":
        return end_pos
    if kind == "timestamp":
        entry = commitlog.find_by_timestamp(value)
        if entry is None or entry.offset >= end_pos.offset:
            return end_pos._replace(clipped="end")
        dropped_before = start_pos.count > 0 and (
            entry.offset < start_pos.offset
            or (entry.log_id == commitlog.first_log_id and entry.timestamp > value))
        if dropped_before:  # what was at that time may be gone: the oldest kept
            return start_pos._replace(clipped="retention")
        return Position(entry.offset, entry.count_before)
    if kind == "offset":
        if value >= end_pos.offset:
            return end_pos if value == end_pos.offset else end_pos._replace(clipped="end")
        if value < start_pos.offset:
            return start_pos._replace(clipped="retention")
        entry = commitlog.find_by_offset(value)
    elif kind == "count":
        if value >= end_pos.count:
            return end_pos if value == end_pos.count else end_pos._replace(clipped="end")
        if value < start_pos.count:
            return start_pos._replace(clipped="retention")
        entry = commitlog.find_by_count(value)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    if entry is None:
        raise LookupError(f"no commitlog entry holds {kind} {value}")
    if (kind == "offset" and value == entry.offset) or (
            kind == "count" and value == entry.count_before):
        return Position(entry.offset, entry.count_before)
    return _walk(read(entry.offset, entry.offset + entry.size), entry, kind, value)


def _walk(data: bytes, entry, kind: str, value: int) -> Position:
    """Within one request's records: the record at `value` (offset or count)."""
    pos, count = 0, entry.count_before
    while pos < len(data):
        offset = entry.offset + pos
        size = 8 + PREFIX.unpack_from(data, pos)[1]
        if kind == "count" and count == value:
            return Position(offset, count)
        if kind == "offset":
            if offset == value:
                return Position(offset, count)
            if offset < value < offset + size:
                raise NotABoundary(value, offset, offset + size)
        pos += size
        count += 1
    raise LookupError(f"{kind} {value} not found in the request at {entry.offset}")
