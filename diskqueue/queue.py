"""DiskQueue: one partition's durable log, written by group commit.

Write path: every `append` joins the open batch and waits on its own future (or
callback). The writer is a slot, not a task: when it is free, the next turn of the
loop encodes the whole batch into one buffer (records plus one commitlog entry per
request) and hands it to the queue's own write worker (one thread), which does one
data write, one commitlog write and, as the sync policy says, one sync of the data
file, then hands the outcome back with one `call_soon_threadsafe`. The loop starts
the next batch first (the disk works while the loop answers), then resolves every
future of the batch together, with its ids and offsets, or with the same error.

The commitlog is not synced per batch: it is an index that recovery rebuilds from the
data (see diskqueue/README.md, "The commitlog lags the data"). It is synced at least
every `clog_sync_every` entries, when the data rotates to a new segment, and at close.

Each queue has its own two workers (created at open, shut down at close): one thread
for writes, syncs and the exclusive jobs (retain, empty, find, open, close), and one
for its readers' read-ahead; a slow disk call of one partition never delays another.
With the node journal (`QueueOptions.journal`, diskqueue/journal.py) the writes, syncs and
exclusive jobs of every queue run on the journal's one thread instead, and a durable batch
is answered once the round's journal sync is done; with `QueueOptions.read_workers` its
read-ahead runs on one thread of the node's pool. With `QueueOptions.files` (the node's
FileBudget, diskqueue/budget.py) a batch opens the log's files only once the log holds a
place of it; till then its batches wait.

Invariants:
- `committed_end <= written_end`; readers never see past `committed_end`;
- a future resolves only after its data is written, synced when the policy
  says so, and (with `auto_commit`) committed; without it (a replicated queue) the
  commit moves only by `commit_to`;
- a failed batch leaves data and commitlog exactly as before it; a failed sync (or
  a failed undo) fails the queue: no append is taken again until it is reopened;
- at most one piece of work holds the writer slot (`_busy`): a batch, a sync, or an
  exclusive job; the loop's view (`written_end` ...) matches the files whenever an
  exclusive job runs;
- the writer never stops: a batch that fails in any way fails its own waiters;
- message ids are `partition << 50 | sequence`, the sequence being the
  message's 0-based place in the partition's history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
import time
from collections import deque
from typing import Sequence

import structlog

from commitlog.entry import ENTRY_SIZE, Entry
from commitlog.entry import decode as decode_entry
from commitlog.log import CommitLog, fsync_dir

from .atomic import make_dirs, read_json, write_json_atomic
from .errors import (AppendError, CommitTimeout, DiskFullError, GapError,  # noqa: F401
                     NotCommitted, OffsetOutOfRange, QueueClosedError, QueueFailedError,
                     _Unrecoverable)

from .raw import BadBatch, RawBatch  # noqa: F401  (the replication API's types, importable here)
from .record import FIXED_LENGTH, HEAD_SIZE, MAX_EXT, MAX_RECORD
from .locate import KINDS, NotABoundary, Position, locate  # noqa: F401  (importable here)
from .reader import Reader, SharedChunks
from .recovery import recover
from .groupcommit import (BATCH_MESSAGES_BUCKETS, SYNC_SECONDS_BUCKETS, Appended,  # noqa: F401
                          _Batch)
from .replicated import Replicated
from .state import META_FILE, QueueOptions, SyncPolicy, new_journal_id
from .segments import MissingSegmentError, Segments
from .worker import Worker

log = structlog.get_logger("diskqueue")
_EXT_LEN = struct.Struct(">H")  # a record head's last field
_ENTRY_OFFSET = struct.Struct(">24xQ32x")  # a commitlog entry's `offset` (commitlog/entry.py)
MARKED_PER_JOB = 16384  # requests `marked_requests` reads while the writer waits (~40 ms)


class DiskQueue(Replicated):
    """The data and commitlog of one partition, in folder `path`: the last class of the
    chain QueueState <- GroupCommit <- Replicated <- DiskQueue (diskqueue/state.py)."""

    __slots__ = ()  # its fields are declared where they are first used, up the chain

    def __init__(self, path: str, options: QueueOptions = QueueOptions()):
        self.path = path
        self.options = options
        self.partition = options.partition
        self.epoch = 0
        self._segments = Segments(os.path.join(path, "data"), options.segment_bytes)
        self.commitlog = CommitLog(os.path.join(path, "commitlog"), options.clog_entries_per_segment,
                                   options.clog_sync_every)
        self._batches = deque()
        self._open = None
        self._flight = deque()
        self._ahead = (0, 0, 0, 0)
        self._ahead_due = False
        self._write_broken = False
        self._loop = None  # set by open()
        # This queue's own workers, made by open() and shut down by close(): one thread for
        # writes, syncs and exclusive jobs, one for its readers' read-ahead.
        self.thread_prefix = f"diskqueue:{path}"
        self._write_worker = None
        self._journal = options.journal
        self._files = options.files
        self._journal_id = 0
        self._journal_key = None
        self.read_worker = None
        self._busy = False
        self._turns = deque()
        self._idle = None
        self.files_used_at = None
        self._sync_timer = None
        self._linger = None
        self._expiry = None
        self._closing = False
        self._shut = False
        self.failed = None
        self._committed_waiters = []
        self.commit_listeners = []
        self._unsynced_messages = 0
        self._unsynced_since = 0.0
        self._last_ts = 0
        self.written_end = self.committed_end = 0
        self.written_count = self.committed_count = 0
        self.start_count = 0
        self.corrupt = []
        self.shared_chunks = SharedChunks()
        self.stats = {"batches": 0, "syncs": 0, "batch_messages_total": 0, "sync_seconds_total": 0.0}
        self.histograms = {"batch_messages": [0] * (len(BATCH_MESSAGES_BUCKETS) + 1),
                           "sync_seconds": [0] * (len(SYNC_SECONDS_BUCKETS) + 1)}
        self._init_replication()

    # ---- lifecycle -------------------------------------------------------

    @classmethod
    async def open(cls, path: str, options: QueueOptions = QueueOptions()) -> "DiskQueue":
        q = cls(path, options)
        q._loop = asyncio.get_running_loop()
        q._write_worker = (Worker(q.thread_prefix + ":write") if q._journal is None
                           else q._journal.worker)
        q.read_worker = (Worker(q.thread_prefix + ":read") if options.read_workers is None
                         else options.read_workers.pick(path))
        try:
            await q._exclusive(q._open_sync)
        except BaseException:
            q._shut_down()
            raise
        return q

    def _open_sync(self) -> None:
        meta_path = os.path.join(self.path, META_FILE)
        meta = read_json(meta_path)
        if meta is None:  # a new log: its folders on disk (each synced) before its meta.json
            for folder in (self.path, self._segments.path, self.commitlog.path):
                make_dirs(folder)
            meta = {"partition": self.partition, "start_offset": 0, "start_count": 0,
                    "start_log_id": 0, "journal_id": new_journal_id()}
            write_json_atomic(meta_path, meta)
        else:
            # Its folders were made, each synced into its parent, before meta.json was
            # written; only meta.json's rename may be unsynced (a crash right after it).
            for folder in (self._segments.path, self.commitlog.path):
                if not os.path.isdir(folder):  # lost since: made again, as a new log's
                    make_dirs(folder)
            fsync_dir(self.path)
        self._meta = meta
        self._journal_id = meta.get("journal_id", 0)
        self._segments.open(meta["start_offset"])
        if self._journal is not None:
            self._journal_key = self._journal.key(self.path, self._journal_id)
            self._leave_journal()  # opened again while the journal holds records of before
        if self._segments.start > meta["start_offset"]:
            raise MissingSegmentError(
                f"{self._segments.path}: history should start at offset {meta['start_offset']} "
                f"but the first segment starts at {self._segments.start}")
        self.commitlog.open(meta["start_log_id"])
        start = meta["start_offset"]
        if self._segments.start < start:  # a crash cut retain() or empty() short: finish it
            last = self.commitlog.last()
            if self._segments.end <= start and (last is None or last.end_offset <= start):
                self._segments.reset(start)
                self.commitlog.reset(self.commitlog.next_log_id)
            else:
                self._segments.drop_before(start)
        window = self.options.max_batch_bytes if self.options.sync.durable else None
        found = recover(self._segments, self.commitlog, window,
                        meta["start_count"], self.epoch)
        self.corrupt = found.corrupt
        self.start_count = meta["start_count"]
        self.written_end = self.committed_end = found.end
        self.written_count = self.committed_count = found.count
        last = self.commitlog.last()
        self._last_ts = last.timestamp if last is not None else 0
        self._open_replication()
        if (found.cut_bytes or found.cut_entries or found.rebuilt_entries or found.corrupt
                or found.index_rebuilt):
            log.warning("recovered", path=self.path, partition=self.partition,
                        cut_bytes=found.cut_bytes, cut_entries=found.cut_entries,
                        rebuilt_entries=found.rebuilt_entries, corrupt=found.corrupt,
                        index_rebuilt=found.index_rebuilt)

    async def close(self) -> None:
        """Write what is pending, sync, close the files. Later appends raise QueueClosedError."""
        if self._closing:
            return
        self._closing = True
        if self._busy or self._batches:  # write what is pending first
            self._idle = self._loop.create_future()
            self._kick()
            await self._idle
        linger = self._linger[1] if self._linger is not None else None
        for timer in (self._sync_timer, self._expiry, linger):
            if timer is not None:
                timer.cancel()
        try:
            await self._exclusive(self._close_sync)
        finally:
            if self._files is not None:
                self._files.give_back(self)
            self._shut_down()
            self._wake_readers()

    def _shut_down(self) -> None:
        """Let the workers' threads end (each after the job it is doing)."""
        self._shut = True
        if self._journal is None:
            self._write_worker.shutdown(wait=False)
        if self.options.read_workers is None:
            self.read_worker.shutdown(wait=False)

    def _close_sync(self) -> None:
        self._segments.sync()
        self.commitlog.sync()
        self._close_replication()
        self._segments.close()
        self.commitlog.close()

    @property
    def closed(self) -> bool:
        return self._closing

    # ---- appending -------------------------------------------------------

    def append(self, bodies: Sequence[bytes], trace_id: int = 0, ext: bytes = b"",
               attempts: int = 0, callback=None, *, trace_ids: Sequence[int] | None = None,
               exts: Sequence[bytes] | None = None) -> asyncio.Future | None:
        """Queue one write request (one commitlog entry); await the result for an `Appended`.

        All bodies of one call are contiguous and share trace id, ext header and attempts;
        or, given `trace_ids` and `exts` (one of each per body, as MPUB_EXT has), each
        record gets its own. Either way the request is written whole or not at all.
        With `callback`, no future is made: the writer calls `callback(appended, error)`
        (one of the two is None) and `append` returns None; the hot path of TCP publishing.
        """
        bodies, traced, headers, attempts, size = self.request(bodies, trace_id, ext, attempts,
                                                               trace_ids=trace_ids, exts=exts)
        batch = self._open
        if batch is None or (batch.count and (
                batch.bytes + size > self.options.max_batch_bytes
                or batch.count + len(bodies) > self.options.max_batch_count)):
            batch = self._open = _Batch()
            self._batches.append(batch)
            if self.options.commit_timeout:
                batch.deadline = self._loop.time() + self.options.commit_timeout
                if self._expiry is None:
                    self._expiry = self._loop.call_at(batch.deadline, self._expire)
        fut = self._loop.create_future() if callback is None else None
        batch.requests.append((fut or callback, bodies, traced, headers, attempts))
        batch.bytes += size
        batch.count += len(bodies)
        self._kick()
        return fut

    def request(self, bodies: Sequence[bytes], trace_id: int = 0, ext: bytes = b"",
                attempts: int = 0, *, trace_ids: Sequence[int] | None = None,
                exts: Sequence[bytes] | None = None) -> tuple:
        """One write request as `append` and `write_batch` take it: (bodies, trace_id, ext,
        attempts, size in bytes), checked. Raises QueueClosedError, the queue's failure, or
        ValueError (see `append`)."""
        if self._closing:
            raise QueueClosedError(self.path)
        if self.failed is not None:
            raise self.failed
        if not bodies:
            raise ValueError("a write request needs at least one message")
        traced: int | list[int] = trace_id
        headers: bytes | list[bytes] = ext
        if exts is not None:  # one (trace id, ext) per record: kept in the request as lists
            traced, headers = list(trace_ids or ()), list(exts)
            if len(headers) != len(bodies) or len(traced) != len(bodies):
                raise ValueError("one trace id and one ext header per message")
            ext_len = max(map(len, headers))
            ext_bytes = sum(map(len, headers))
            traces_ok = all(0 <= t < 1 << 64 for t in traced)
        else:
            ext_len = len(ext)
            ext_bytes = ext_len * len(bodies)
            traces_ok = 0 <= trace_id < 1 << 64
        if ext_len > MAX_EXT or not 0 <= attempts <= 0xFFFF or not traces_ok:
            raise ValueError("ext longer than 65535 bytes, or attempts or trace_id out of range")
        body_bytes = sum(map(len, bodies))
        # The largest body is at most the sum of all: look for it only when the sum is big.
        if (FIXED_LENGTH + ext_len + body_bytes > MAX_RECORD
                and FIXED_LENGTH + ext_len + max(map(len, bodies)) > MAX_RECORD):
            raise ValueError(f"a body may hold at most {MAX_RECORD - FIXED_LENGTH - ext_len} bytes")
        size = HEAD_SIZE * len(bodies) + ext_bytes + body_bytes
        return bodies, traced, headers, attempts, size

    def write_batch(self, requests: Sequence[tuple], announce=None, done=None) -> None:
        """Write `requests` (each from `request`) as one batch of their own, in the order
        given, after what is queued before it: `announce(offset, count, entries, n_entries,
        data, epoch)` is called when it is encoded, before it is written (a leader pushes
        it), and returns whether it went out (others may hold it); `done(results, error)`
        once it is written (one Appended per request) or failed (a batch that went out and
        failed to write fails the queue: its place is never reused; one that went nowhere
        fails alone, as an append does). Raises QueueClosedError or the queue's failure at
        once."""
        if self._closing:
            raise QueueClosedError(self.path)
        if self.failed is not None:
            raise self.failed
        batch = _Batch(announce, done)
        batch.deadline = float("inf")  # its giver answers its requests (see _expire)
        for bodies, trace_id, ext, attempts, size in requests:
            batch.requests.append((None, bodies, trace_id, ext, attempts))
            batch.bytes += size
            batch.count += len(bodies)
        self._open = None  # later appends never join it
        self._batches.append(batch)
        self._kick()

    @property
    def pending_bytes(self) -> int:
        return sum(b.bytes for b in self._batches)

    # ---- the writer --------------------------------------------------------
    # All on the loop, except the `*_job` methods: they run in the write worker and hand
    # their outcome back with one call_soon_threadsafe.

    def set_sync(self, policy: SyncPolicy) -> None:
        """Change the sync policy from the next batch on; what is unsynced is synced as the
        new policy says (at once, when it is durable)."""
        self.options = dataclasses.replace(self.options, sync=policy)
        if not self._closing:
            self._kick()

    def commit_to(self, end_offset: int, count: int) -> None:
        """Make data up to (end_offset, count) visible to readers (a replicated partition
        says when its ISR holds it): at most what is written, and never past the point of a
        truncation that waits for the writer; the commit never moves back."""
        limit = self._commit_limit or (self.written_end, self.written_count)
        if end_offset >= limit[0]:
            end_offset, count = limit
        self._commit(end_offset, count)

    async def wait_committed(self, offset: int, timeout: float | None = None) -> bool:
        """Wait until data past `offset` is committed; False on timeout or close."""
        if self.committed_end > offset:
            return True
        if self._closing:
            return False
        fut = asyncio.get_running_loop().create_future()
        self._committed_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except TimeoutError:
            return False
        return self.committed_end > offset

    # ---- reading, searching ----------------------------------------------

    @property
    def segment_count(self) -> int:
        """Segment files the log holds, its active one included (at least 1)."""
        return len(self._segments.bases)

    def segment_of(self, offset: int) -> tuple[str, int, int]:
        """(file path, segment base, segment end) of the segment holding `offset`."""
        base, end = self._segments.locate(offset)
        if base == self._segments.active_base:
            end = self.written_end
        return self._segments.file(base), base, end

    def reader(self, offset: int | None = None, read_ahead: int = 1 << 20) -> Reader:
        return Reader(self, self.start_offset if offset is None else offset, read_ahead)

    async def marked_requests(self, since: int, marker: bytes, within_ns: int = 0,
                              max_requests: int = 0) -> list[tuple[Entry, bytes]]:
        """The write requests from the one holding offset `since` (the log's start, when
        before it), or from the first written within `within_ns` of the last one when that
        is earlier, but no more than `max_requests` (when given) before the written end, to
        the written end, whose first record's ext header holds `marker`: (its
        commitlog entry, that header), in log order. Exclusive jobs off the loop of at most
        MARKED_PER_JOB requests each (retention waits for them; the writer goes on between
        them); records are not checksummed again (recovery did)."""
        found: list[tuple[Entry, bytes]] = []
        log_id = None
        while True:
            part, log_id = await self._exclusive(self._marked_sync, since, marker, within_ns,
                                                 max_requests, log_id)
            found += part
            if log_id is None:
                return found

    def _marked_sync(self, since: int, marker: bytes, within_ns: int, max_requests: int,
                     log_id: int | None) -> tuple[list[tuple[Entry, bytes]], int | None]:
        """One job of `marked_requests`: from entry `log_id` (None: the first job, which
        finds where to start), what it found and the entry the next job starts at (None:
        the written end was reached)."""
        clog, end = self.commitlog, self.written_end
        if log_id is None:
            first = clog.find_by_offset(max(since, self.start_offset)) if len(clog) else None
            if first is not None and within_ns:
                recent = clog.find_by_timestamp(clog.last().timestamp - within_ns)
                if recent is not None and recent.log_id < first.log_id:
                    first = recent
            log_id = first.log_id if first is not None else clog.next_log_id
            if max_requests:
                log_id = max(log_id, clog.next_log_id - max_requests)
        log_id = max(log_id, clog.first_log_id)  # retention may have passed it meanwhile
        stop = min(clog.next_log_id, log_id + MARKED_PER_JOB)
        found: list[tuple[Entry, bytes]] = []
        buf, buf_start = b"", 0
        while log_id < stop:
            raw = clog.read_encoded(log_id, min(4096, stop - log_id))
            # each entry's offset (its 4th field), unchecked: only a found one is decoded
            for i, (offset,) in enumerate(_ENTRY_OFFSET.iter_unpack(raw)):
                if offset >= end:
                    return found, None
                at = offset - buf_start
                if at < 0 or at + HEAD_SIZE > len(buf):
                    buf_start, at = offset, 0
                    buf = self._segments.read(offset, min(end, offset + (1 << 20)))
                ext_len = _EXT_LEN.unpack_from(buf, at + HEAD_SIZE - 2)[0]
                if not ext_len:
                    continue
                if at + HEAD_SIZE + ext_len > len(buf):
                    buf_start, at = offset, 0
                    buf = self._segments.read(offset, offset + HEAD_SIZE + ext_len)
                ext = buf[at + HEAD_SIZE:at + HEAD_SIZE + ext_len]
                if marker in ext:
                    found.append((decode_entry(raw, i * ENTRY_SIZE), ext))
            log_id += len(raw) // ENTRY_SIZE
        return found, (stop if stop < clog.next_log_id else None)

    async def find(self, method: str, value: int) -> Entry | None:
        """Commitlog search off the loop: method is offset, msg_id, count or timestamp.
        An exclusive job, so retention never drops the segment it reads."""
        fn = getattr(self.commitlog, f"find_by_{method}")
        return await self._exclusive(fn, value)

    async def locate(self, kind: str, value: int | None = None) -> Position:
        """The record boundary for a replay (locate.py): kind "timestamp" (ns), "offset",
        "count" or "end". Raises NotABoundary for an offset inside a record."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}")
        end = (self.committed_end, self.committed_count)  # a consistent pair, read on the loop
        return await self._exclusive(self._locate_sync, end, kind, value)

    def _locate_sync(self, end: tuple[int, int], kind: str, value: int | None) -> Position:
        return locate(self._segments.read, self.commitlog, (self.start_offset, self.start_count),
                      end, kind, value)

    # ---- retention and emptying ------------------------------------------

    async def retain(self, before_offset: int = 0, max_age_s: float | None = None,
                     max_bytes: int | None = None, min_age_s: float = 0.0) -> int:
        """Drop whole old segments: those ending at or before `before_offset` (what every
        channel is past) once their last write is `min_age_s` old, those older than
        `max_age_s`, or beyond `max_bytes` in total (oldest first). Never the active one,
        never one holding a record past the committed end (a leader's records its ISR may
        lack). Returns the new start offset."""
        before = self.start_offset
        start = await self._exclusive(self._retain_sync, before_offset, max_age_s, max_bytes,
                                      min_age_s)
        if start != before:
            self.shared_chunks.clear()  # what was dropped is served from nowhere
        return start

    def _retain_sync(self, before_offset, max_age_s, max_bytes, min_age_s) -> int:
        segs = self._segments.sizes()
        total = sum(size for _, size, _ in segs)
        now = time.time()
        committed = self._committed_at[0]
        new_start = self._segments.start
        for base, size, mtime in segs[:-1]:
            end = base + size
            age = now - mtime
            consumed = end <= before_offset and age >= min_age_s
            old = max_age_s is not None and age > max_age_s
            big = max_bytes is not None and total > max_bytes
            if end <= committed and (consumed or old or big):
                new_start = end
                total -= size
            else:
                break
        if new_start == self._segments.start:
            return new_start
        entry = self.commitlog.find_by_offset(new_start)
        start_count = self.start_count
        if entry is not None:
            start_count = entry.count_before if entry.offset >= new_start else entry.count_after
        self._write_meta(new_start, start_count, self.commitlog.first_log_id)
        self._segments.drop_before(new_start)
        self.commitlog.drop_before_offset(new_start)
        log.info("retained", path=self.path, partition=self.partition, start_offset=new_start)
        return new_start

    async def release_files(self) -> None:
        """Close the log's files (its active segment, synced first, its commitlog and a
        replica's committed end); the next write or job opens them again. For a log idle for
        a while: an idle partition then holds no descriptor (bench/scale.py), and gives its
        place of the node's FileBudget back."""
        await self._exclusive(self._release_files_sync)
        if self._files is not None:
            self._files.give_back(self)

    async def empty(self) -> None:
        """Drop every message; offsets, counts and ids continue where they were."""
        await self._exclusive(self._empty_sync)
        self.shared_chunks.clear()

    def _empty_sync(self) -> None:
        end, count, next_log_id = self.written_end, self.written_count, self.commitlog.next_log_id
        self._leave_journal()
        self._write_meta(end, count, next_log_id)
        self._segments.reset(end)
        self.commitlog.reset(next_log_id)
