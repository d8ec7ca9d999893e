"""Reader: reads a partition's records forward from an offset, with read-ahead.

Invariants:
- it never returns a record past the queue's `committed_end`;
- it never skips a record: a corrupt one raises CorruptRecordError with its
  offset, each time it is reached, after the good records before it are returned;
- one blocking `pread` of up to `read_ahead` bytes, off the event loop on the
  queue's own read worker (never a pool shared with other partitions), serves many
  records;
- records it decoded are shared with the queue's other Readers (SharedChunks), so
  channels reading near each other decode and checksum each record once;
- a reader holds no descriptor: each refill opens its segment, reads and closes it in
  one job of the read worker (an open and a close a refill of up to `read_ahead` bytes),
  so a node's readers hold at most one descriptor per read thread, however many
  channels read;
- a read that reaches what was committed when it began drops the buffer (all of it
  decoded: a refill reads whole committed records), so a reader caught up and waiting
  holds no memory either.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from operator import itemgetter

import aiofiles.os

from .record import CorruptRecordError, Record, decode_all
from .segments import MissingSegmentError

_offset_of = itemgetter(0)  # Record.offset


def _pread(path: str, size: int, pos: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, pos)
    finally:
        os.close(fd)


_pread_off_loop = aiofiles.os.wrap(_pread)


class SharedChunks:
    """The record lists a queue's Readers decoded lately, for its other Readers.

    Only verified, committed records go in (what `Reader.read` returned), and committed
    records never change, so a hit is exactly what decoding again would give. Chunks
    never overlap and are kept in offset order: a read adds only what lies past the
    furthest record held, so a look-up is two binary searches. At most `limit` records
    are held, the oldest chunks dropped first: readers further behind decode for
    themselves. The lists are shared: callers never change what `Reader.read` returns.
    """

    MIN_RECORDS = 16  # smaller reads are not worth keeping

    def __init__(self, limit: int = 16384):
        self.limit = limit
        self._chunks: list[list[Record]] = []  # in offset order, disjoint
        self._firsts: list[int] = []  # the first offset of each chunk
        self._end = -1  # just past the furthest record held
        self._held = 0
        self.hits = 0  # records handed out from here instead of decoded again

    def add(self, records: list[Record]) -> None:
        if len(records) < self.MIN_RECORDS or records[-1].end <= self._end:
            return
        if records[0].offset < self._end:  # keep only what is new
            records = records[bisect_left(records, self._end, key=_offset_of):]
        self._chunks.append(records)
        self._firsts.append(records[0].offset)
        self._end = records[-1].end
        self._held += len(records)
        while self._held > self.limit:
            self._held -= len(self._chunks.pop(0))
            del self._firsts[0]

    def take(self, offset: int, max_count: int) -> list[Record]:
        """Up to `max_count` records from the one at `offset`, or [] if no chunk has it."""
        i = bisect_right(self._firsts, offset) - 1
        if i < 0:
            return []
        records = self._chunks[i]
        if offset > records[-1].offset:
            return []
        j = bisect_left(records, offset, key=_offset_of)
        if records[j].offset != offset:
            return []
        found = records[j:j + max_count]
        self.hits += len(found)
        return found

    def clear(self) -> None:
        self._chunks.clear()
        self._firsts.clear()
        self._end = -1
        self._held = 0


class Reader:
    def __init__(self, queue, offset: int, read_ahead: int = 1 << 20):
        self.queue = queue
        self.read_ahead = read_ahead
        self.seek(offset)

    def seek(self, offset: int) -> None:
        """Read from `offset` next (it must be a record boundary)."""
        self.offset = offset
        self._buf = b""
        self._buf_start = offset
        self._pos = 0

    def close(self) -> None:
        """Drop the buffer; a read after it goes on from `offset`."""
        self.seek(self.offset)

    async def read(self, max_count: int = 1024) -> list[Record]:
        """Up to `max_count` committed records from `offset` on; [] when none is committed yet."""
        committed = self.queue.committed_end
        if self.offset >= committed:
            return []
        shared = self.queue.shared_chunks
        records = shared.take(self.offset, max_count)
        if records:
            self._skip_to(records[-1].end)
        else:
            records = self._decode(committed, max_count)
            if not records:
                await self._refill(committed)
                records = self._decode(committed, max_count)
            shared.add(records)
        if self.offset >= committed:
            self.close()  # caught up with what is committed
        return records

    def _skip_to(self, offset: int) -> None:
        """Go on from `offset` (past records taken from the shared chunks); the buffer stays
        when it holds that place."""
        self.offset = offset
        if self._buf_start <= offset <= self._buf_start + len(self._buf):
            self._pos = offset - self._buf_start
        else:
            self._buf = b""
            self._buf_start = offset
            self._pos = 0

    async def read_wait(self, max_count: int = 1024, timeout: float | None = None) -> list[Record]:
        """Like `read`, but wait up to `timeout` seconds for something to be committed."""
        if self.offset >= self.queue.committed_end:
            await self.queue.wait_committed(self.offset, timeout)
        return await self.read(max_count)

    def _decode(self, committed: int, max_count: int) -> list[Record]:
        end = min(len(self._buf), committed - self._buf_start)
        records, pos, error = decode_all(self._buf, self._pos, end, self._buf_start, max_count)
        self._pos = pos
        self.offset = self._buf_start + pos
        if error is not None and not records:
            path, _, _ = self.queue.segment_of(error.offset)
            raise CorruptRecordError(error.offset, error.reason, path)
        return records

    async def _refill(self, committed: int) -> None:
        """Read the buffer again from `offset`: a record cut at the old buffer's end is read
        whole (page cache), rather than copying the old tail in front of the new bytes."""
        path, base, seg_end = self.queue.segment_of(self.offset)
        have = len(self._buf) - self._pos  # a record's first part: more than this is needed
        want = min(max(self.read_ahead, 2 * have + 4096), min(committed, seg_end) - self.offset)
        if want <= have:
            if have:  # a record that should be whole is not: the segment was cut
                raise CorruptRecordError(self.offset, "record cut short", path)
            return
        start = self.offset
        try:
            data = await _pread_off_loop(path, want, start - base,
                                         executor=self.queue.read_worker)
        except FileNotFoundError:  # retention dropped it since `segment_of`
            raise MissingSegmentError(f"{path}: dropped before {start} was read") from None
        if self.offset != start:  # sought elsewhere meanwhile: these bytes are not from there
            return
        if len(data) <= have:
            raise CorruptRecordError(self.offset, "segment ends before its committed data", path)
        self._buf = data
        self._buf_start = self.offset
        self._pos = 0
