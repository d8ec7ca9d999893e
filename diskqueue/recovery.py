"""Crash recovery: make the data and the commitlog agree, trusting the data.

Run once at open, before any write. The rules:
- only the active (last) segment can have a torn tail: the writer syncs a
  segment before it creates the next one;
- with the durable policy (every batch synced before the next is written) its tail
  is checked record by record from a little before the last commitlog entry (at most
  one unsynced batch can be torn); with a lazier policy any part of the active segment
  may be unsynced, so all of it is checked;
- a bad record followed by a valid record at a later commitlog entry marked
  SYNCED_BEFORE (written only once everything before it was synced) is corruption
  in the middle, not a torn tail: it is reported and kept, never cut; a bad record
  with no such entry after it is in data that was never synced, so never
  acknowledged under the durable policy: the tail from it is cut;
- otherwise the data is cut at the first bad record;
- the commitlog is then cut to the data (entries past the data's end go), and
  records past its last entry get one regenerated entry each. They may have been
  acknowledged: the commitlog is synced lazily (CommitLog.open has already cut it at
  its first bad entry among the ones that can be unsynced), so after a power loss it
  can lag the synced data. Ids, offsets, counts and timestamps come from the records;
  only the grouping of records into requests (and so the log ids from there on) is
  lost, and the epoch is the last surviving entry's. A bad record in that lagging part
  has no SYNCED_BEFORE entry after it and is cut as a torn tail: under the durable
  policy it was synced, so that takes a second fault (the power loss, plus corruption
  of synced data);
- a commitlog entry that fails its checksum makes the whole commitlog be rebuilt
  from the data, one entry per record (`index_rebuilt` says why). The tail check
  then has no entry to resume at, so a bad record in the active segment is cut
  as a torn tail: only a second fault (data and index both damaged) can cost data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from commitlog.entry import SYNCED_BEFORE, CorruptEntryError, Entry
from commitlog.log import CommitLog
from nsqwire.ids import SEQUENCE_MASK

from .record import CorruptRecordError, decode_at
from .segments import MissingSegmentError, Segments

SCAN_CHUNK = 4 * 1024 * 1024


@dataclass
class Recovered:
    end: int  # virtual offset just past the last valid record
    count: int  # messages in the history up to `end`
    cut_bytes: int = 0  # torn tail removed from the data
    cut_entries: int = 0  # commitlog entries removed (their data was not there)
    rebuilt_entries: int = 0  # commitlog entries regenerated from the data
    index_rebuilt: str = ""  # why the whole commitlog was rebuilt from the data, if it was
    corrupt: list[tuple[int, str]] = field(default_factory=list)  # (offset, reason) kept in place


def scan(fd: int, base: int, start: int, end: int):
    """Yield each valid record (offset, size, msg_id, timestamp) in [start, end) of one segment.

    Stops at the first invalid or incomplete record; returns (offset, reason) of
    that stop, or (end, None) when every byte was valid.
    """
    pos = start
    buf = b""
    buf_start = start
    while True:
        i = pos - buf_start
        try:
            rec = decode_at(buf, i, buf_start)
        except CorruptRecordError as e:
            return pos, e.reason
        if rec is None:
            if buf_start + len(buf) >= end:
                return pos, (None if pos == end else "record cut short")
            want = min(SCAN_CHUNK, end - (buf_start + len(buf)))
            more = os.pread(fd, want, buf_start + len(buf) - base)
            if not more:
                return pos, "record cut short"
            buf = buf[i:] + more
            buf_start = pos
            continue
        yield rec.offset, rec.size, rec.msg_id, rec.timestamp
        pos = rec.offset + rec.size


def _valid_record_at(fd: int, base: int, offset: int, end: int) -> bool:
    return next(scan(fd, base, offset, end), None) is not None


def recover(segments: Segments, clog: CommitLog, unsynced_window: int | None,
            start_count: int, epoch: int = 0) -> Recovered:
    """`unsynced_window`: the most bytes that can be unsynced at a crash (one batch, for
    the durable policy), or None when it is unbounded (a lazier policy)."""
    try:
        return _recover(segments, clog, unsynced_window, start_count, epoch)
    except CorruptEntryError as e:
        clog.reset(clog.first_log_id)
        result = _recover(segments, clog, unsynced_window, start_count, epoch)
        result.index_rebuilt = str(e)
        return result


def _recover(segments: Segments, clog: CommitLog, unsynced_window: int | None,
             start_count: int, epoch: int) -> Recovered:
    base = segments.active_base
    file_end = segments.end
    last = clog.last()
    if (unsynced_window is not None and last is not None
            and last.end_offset > file_end + 2 * unsynced_window):
        raise MissingSegmentError(
            f"{segments.path}: the commitlog records writes up to offset {last.end_offset} but the "
            f"data ends at {file_end}: more than one unsynced batch is missing")

    scan_from = base
    if last is not None and unsynced_window is not None:
        anchor = clog.find_by_offset(max(base, min(last.offset, file_end) - unsynced_window))
        if anchor is not None and anchor.offset >= base:
            scan_from = anchor.offset

    result = Recovered(end=scan_from, count=start_count)
    fd = os.open(segments.file(base), os.O_RDONLY)
    try:
        stop = _check_tail(fd, base, scan_from, file_end, clog, result)
        if stop < file_end:
            result.cut_bytes = file_end - stop
            segments.truncate_to(stop)
        result.end = stop
    finally:
        os.close(fd)

    before = len(clog)
    tail = clog.find_by_offset(stop - 1) if stop > segments.start else None
    if tail is None:
        clog.reset(clog.first_log_id)
    elif tail.end_offset > stop:
        clog.truncate_after(tail.log_id - 1)
    else:
        clog.truncate_after(tail.log_id)
    result.cut_entries = before - len(clog)

    last = clog.last()
    if last is None:
        orphans = [(b, b, e) for b, e in _segment_ranges(segments)]
    elif last.end_offset < stop:  # they may start in an earlier segment (a lost unsynced tail)
        orphans = [(b, max(b, last.end_offset), e) for b, e in _segment_ranges(segments)
                   if e > last.end_offset]
    else:
        orphans = []
    count = _rebuild(clog, segments, orphans, last, epoch, result) if orphans else None
    if count is None:
        count = last.count_after if last is not None else start_count
    result.count = count
    return result


def _check_tail(fd: int, base: int, pos: int, file_end: int, clog: CommitLog,
                result: Recovered) -> int:
    """Verify records from `pos`; return where the valid data ends.

    A bad record is skipped (and reported in `result.corrupt`) only when a later
    SYNCED_BEFORE commitlog entry points at a valid record after it.
    """
    while True:
        stop, reason = _drain(scan(fd, base, pos, file_end))
        if reason is None:
            return stop
        resume = next((e.offset for e in _entries_after(clog, stop)
                       if e.flags & SYNCED_BEFORE and e.offset < file_end
                       and _valid_record_at(fd, base, e.offset, file_end)), None)
        if resume is None:
            return stop
        result.corrupt.append((stop, reason))
        pos = resume


def _drain(gen):
    """Run a `scan` to its end and return its (stop offset, reason)."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def _entries_after(clog: CommitLog, offset: int):
    entry = clog.find_by_offset(offset)
    log_id = clog.first_log_id if entry is None else entry.log_id
    while log_id < clog.next_log_id:
        e = clog.get(log_id)
        if e.offset > offset:
            yield e
        log_id += 1


def _segment_ranges(segments: Segments):
    bases = segments.bases
    for i, b in enumerate(bases):
        yield b, (bases[i + 1] if i + 1 < len(bases) else segments.end)


def _rebuild(clog: CommitLog, segments: Segments, ranges, last: Entry | None, epoch: int,
             result: Recovered) -> int | None:
    """Append one entry per record in each (segment base, start, end); return the count after
    (None when there was no record).

    The cumulative count of a record is the sequence in its message id.
    """
    log_id = first = clog.next_log_id
    epoch = last.epoch if last is not None else epoch
    count = last.count_after if last is not None else None
    for base, start, end in ranges:
        entries = []
        fd = os.open(segments.file(base), os.O_RDONLY)
        try:
            gen = scan(fd, base, start, end)
            for offset, size, msg_id, ts in gen:
                if count is None:
                    count = msg_id & SEQUENCE_MASK
                entries.append(Entry(log_id, epoch, msg_id, offset, count, ts, size, 1))
                log_id += 1
                count += 1
        finally:
            os.close(fd)
        clog.append(entries)
        result.rebuilt_entries += len(entries)
    if log_id > first:  # nothing rebuilt: nothing to sync
        clog.sync()
    return count
