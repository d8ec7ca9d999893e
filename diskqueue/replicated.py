"""What a replica of a partition needs of its DiskQueue beyond appending: raw appends and
reads of whole batches, epochs, cutting a diverged tail, and the persisted committed end.
It knows nothing of leaders or followers (isr/ drives it).

`Replicated` is a class of DiskQueue's chain (diskqueue/state.py), kept here because it is one
concept: the queue as one replica of a partition (see diskqueue/README.md, "Replication API").
Positions are (offset, count) pairs, never log ids (they differ between replicas).

Invariants (with `QueueOptions.replicated`):
- `committed_end` moves only by `commit_to`, never past the written end; the persisted
  committed end (file `committed`) is written lazily by the write worker
  and is never ahead of `committed_end`; a queue opens with committed = min(persisted, written);
- raw appends go through the writer slot like batches (one writer per file), are checked
  whole before a byte is written, and keep the leader's fields but the log ids and flags;
- `truncate_to` never cuts committed data, and a kill at any point of it leaves a log that
  opens and holds a prefix of what it held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
import time

import structlog

from commitlog import entry as clog_entry
from commitlog.entry import ENTRY_SIZE, SYNCED_BEFORE, same_entries

from .atomic import fsync_dir
from .committed import COMMITTED_FILE, CommittedFile
from .errors import (
    Diverged,
    GapError,
    OffsetOutOfRange,
    QueueClosedError,
    _Unrecoverable,
)
from .groupcommit import GroupCommit
from .raw import RawBatch, check_batch, renumber

log = structlog.get_logger("diskqueue")

_READ_ENTRIES = 4096  # entries read from the commitlog at a time by read_raw
_ENTRY_SIZE_FIELD = struct.Struct(">48xI12x")  # an entry's `size` (commitlog/entry.py)


class Replicated(GroupCommit):
    """The replica side of a DiskQueue; its fields are set in `_init_replication`."""

    __slots__ = ("_commit_limit", "_tail_end", "_tail_epoch")
    _tail_epoch: int  # the epoch of the last entry up to `_tail_end`;
    _tail_end: int  # entries written past it carry `self.epoch`
    _commit_limit: tuple[int, int] | None  # a truncation's point, while it runs

    def _init_replication(self) -> None:
        self._committed_at = (0, 0)
        self._tail_epoch = 0
        self._tail_end = 0
        self._commit_limit = None
        self._committed_file = None
        if self.options.replicated:
            self._committed_file = CommittedFile(os.path.join(self.path, COMMITTED_FILE))
            # The queue commits on write only when solo: `auto_commit` says whether it does.
            self.options = dataclasses.replace(self.options, auto_commit=False)

    def _open_replication(self) -> None:
        """At open (write worker), after recovery: the last epoch, and the committed end."""
        last = self.commitlog.last()
        self._tail_epoch = last.epoch if last is not None else 0
        # write worker: the highest epoch whose entries the commitlog has synced since open
        # (a truncation or a restart sets it back): the next batch above it syncs it
        self._clog_epoch = 0
        self._tail_end = self.written_end
        self.epoch = max(self.epoch, self._tail_epoch)
        if self._committed_file is not None:
            start = (self.start_offset, self.start_count)
            stored = self._committed_file.load() or start
            if stored[0] < self.written_end:
                self.committed_end, self.committed_count = max(stored, start)
        self._committed_at = (self.committed_end, self.committed_count)

    def _close_replication(self) -> None:
        """At close (write worker): store the committed end, synced with the other files."""
        if self._committed_file is not None:
            self._committed_file.store(self._committed_at)
            self._committed_file.close()

    @property
    def last_epoch(self) -> int:
        """The epoch of the last entry written, 0 if none."""
        return self.epoch if self.written_end > self._tail_end else self._tail_epoch

    # ---- raw batches (a follower's appends, a leader's catch-up reads) -------

    async def append_raw(self, offset: int, count: int, entries: bytes | memoryview,
                         data: bytes | memoryview, records_checked: bool = False
                         ) -> tuple[int, int]:
        """Append a leader's batch starting at (offset, count) and return the written end,
        once it is written and synced as the sync policy says. A batch wholly at or before
        the written end (a duplicate) returns at once; one that does not start there raises
        GapError(written end); a bad one BadBatch; a failed write AppendError (DiskFullError
        for ENOSPC) with nothing written. `records_checked`: the data's checksum as a whole
        matched its leader's (see check_batch's `records`)."""
        if self._closing:
            raise QueueClosedError(self.path)
        if self.failed is not None:
            raise self.failed
        if not entries and not data:
            return self.written_end, self.written_count
        try:
            await self._exclusive(self._append_raw_job, offset, count, entries, data,
                                  records_checked, then=self._appended_raw, writes=True)
        except (OSError, _Unrecoverable) as e:
            raise self._batch_error(e) from None
        return self.written_end, self.written_count

    def append_raw_then(self, offset: int, count: int, entries, data, done,
                        records_checked: bool = False) -> None:
        """`append_raw` with a callback (a follower's pushes: no task, no future when the
        writer slot is free): `done(error)` is called on the loop once the batch is written,
        or found a duplicate (error None), or refused (error: what append_raw raises)."""
        if (self._busy or self._closing or self._shut or self.failed is not None
                or not self._has_place()):  # without a place: its files open for it alone
            task = asyncio.ensure_future(self.append_raw(offset, count, entries, data,
                                                         records_checked))
            task.add_done_callback(
                lambda t: done(asyncio.CancelledError() if t.cancelled() else t.exception()))
            return
        if not entries and not data:
            self._loop.call_soon(done, None)
            return
        self._busy = True
        loop = self._loop
        journal = self._journal  # the batch counts in its writers until answered

        def job() -> None:  # write worker
            try:
                result = self._append_raw_job(offset, count, entries, data, records_checked)
            except BaseException as e:
                self._write_worker.post(loop, finished, None, e)
            else:
                self._write_worker.post(loop, finished, result, None)

        def finished(result, error) -> None:  # loop
            if journal is not None:
                journal.writers -= 1
            try:
                if error is None:
                    self._appended_raw(result)
                elif isinstance(error, (OSError, _Unrecoverable)):
                    error = self._batch_error(error)
            except Exception as e:  # (a bug) the caller is answered all the same
                error = e
            finally:
                self._write_next(turns_first=False)
            done(error)

        self._write_worker.call(job)
        if journal is not None:
            journal.writers += 1

    def _append_raw_job(self, offset, count, entries, data, records_checked):
        """Check, renumber, write and (as the policy says) sync a raw batch (write worker). A
        batch wholly within what is written is a duplicate only when its entries are the ones
        held there (isr.core.same_entries), else Diverged."""
        if offset + len(data) <= self.written_end:
            self._check_duplicate(offset, entries)
            return None
        if (offset, count) != (self.written_end, self.written_count):
            raise GapError(self.written_end, self.written_count)
        checked = check_batch(offset, count, entries, data, self.partition, self.last_epoch,
                              records=not records_checked)
        flags = SYNCED_BEFORE if not self._unsynced_messages else 0
        clog = renumber(checked, self.commitlog.next_log_id, flags)
        messages = checked[-1].count_after - count
        sync = self._should_sync(messages)
        t0 = time.perf_counter()
        self._write_sync(data, clog, len(checked), sync, checked[-1].epoch)
        self._store_committed()
        return checked[-1], messages, sync, time.perf_counter() - t0

    def _check_duplicate(self, offset: int, entries) -> None:
        pushed = [clog_entry.decode(entries, i) for i in range(0, len(entries), ENTRY_SIZE)]
        held = []
        first = self.commitlog.find_by_offset(offset) if offset >= self.start_offset else None
        if first is not None and first.offset == offset:
            held = [self.commitlog.get(first.log_id + i) for i in range(len(pushed))
                    if first.log_id + i < self.commitlog.next_log_id]
        if not same_entries(pushed, held):
            raise Diverged(f"{self.path}: the batch at {offset} is not the one held there")

    def _appended_raw(self, written) -> None:
        """The loop's view of a raw batch written (before the slot passes on)."""
        if written is None:
            return
        last, messages, synced, elapsed = written
        self.stats["batches"] += 1
        self.stats["batch_messages_total"] += messages
        if synced:
            self._count_sync(elapsed)
            self._unsynced_messages = 0
        else:
            if not self._unsynced_messages:
                self._unsynced_since = time.monotonic()
            self._unsynced_messages += messages
        self.written_end, self.written_count = last.end_offset, last.count_after
        self._last_ts = max(self._last_ts, last.timestamp)
        self._tail_epoch, self._tail_end = last.epoch, self.written_end
        if self.options.auto_commit:
            self._commit(self.written_end, self.written_count)

    async def restart_at(self, offset: int, count: int) -> None:
        """Drop the whole log and go on, empty, at (offset, count), ahead of the written end:
        a follower whose every record is before its leader's start (retention dropped
        them there) takes the leader's history from that start. ValueError when (offset,
        count) is not ahead. A kill at any point leaves the old log or the empty new one
        (meta.json first: open finishes the rest, as for `empty`)."""
        if offset <= self.written_end or count < self.written_count:
            raise ValueError(f"({offset}, {count}) is not ahead of the written end "
                             f"{(self.written_end, self.written_count)}")
        await self._exclusive(self._restart_job, offset, count, then=self._restarted)

    def _restart_job(self, offset: int, count: int):
        next_log_id = self.commitlog.next_log_id
        dropped = self.written_end - self.start_offset
        self._leave_journal()
        self._write_meta(offset, count, next_log_id)
        self._segments.reset(offset)
        self.commitlog.reset(next_log_id)
        self._clog_epoch = 0
        log.warning("restarted_at", path=self.path, partition=self.partition, offset=offset,
                    count=count, dropped_bytes=dropped)
        return offset, count

    def _restarted(self, position) -> None:
        self.written_end, self.written_count = position
        self._unsynced_messages = 0
        self._tail_end = self.written_end
        self.shared_chunks.clear()
        self._commit(*position)

    async def read_raw(self, offset: int, max_bytes: int) -> RawBatch:
        """Whole entries from the one that begins at `offset` (ValueError if none does), up to
        `max_bytes` of data (at least one entry), up to the written end. At the written end:
        no entry. Before the start: OffsetOutOfRange(start)."""
        return await self._exclusive(self._read_raw_job, offset, max_bytes)

    def _read_raw_job(self, offset: int, max_bytes: int) -> RawBatch:
        end = (self.written_end, self.written_count)
        if offset < self.start_offset:
            raise OffsetOutOfRange(self.start_offset, self.start_count)
        if offset == self.written_end:
            return RawBatch(offset, self.written_count, b"", 0, b"", end)
        first = self.commitlog.find_by_offset(offset) if offset < self.written_end else None
        if first is None or first.offset != offset:
            raise ValueError(f"no entry begins at offset {offset}")
        parts, n, size, log_id = [], 0, 0, first.log_id
        while log_id < self.commitlog.next_log_id:
            buf = self.commitlog.read_encoded(log_id, _READ_ENTRIES)
            taken = 0
            for e in _ENTRY_SIZE_FIELD.iter_unpack(buf):  # each entry's size; the follower checks
                if (n or taken) and size + e[0] > max_bytes:
                    break
                size += e[0]
                taken += 1
            parts.append(buf[:taken * ENTRY_SIZE])
            n += taken
            log_id += taken
            if taken < len(buf) // ENTRY_SIZE:
                break
        data = self._segments.read(offset, offset + size)
        return RawBatch(offset, first.count_before, b"".join(parts), n, data, end)

    # ---- epochs and divergence --------------------------------------------

    async def set_epoch(self, epoch: int) -> None:
        """Sync the commitlog, then new entries carry `epoch` (never lower than the last)."""
        if epoch < self.last_epoch:
            raise ValueError(f"epoch {epoch} is below the log's last epoch {self.last_epoch}")
        await self._exclusive(self.commitlog.sync, then=lambda _: self._raise_epoch(epoch))

    def _raise_epoch(self, epoch: int) -> None:
        self._tail_epoch, self._tail_end = self.last_epoch, self.written_end
        self.epoch = epoch

    async def epoch_starts(self) -> list[tuple[int, tuple[int, int]]]:
        """(epoch, (offset, count) of its first entry) of every epoch in the log, oldest
        first (a leader's epoch cache: isr/core.py)."""
        return await self._exclusive(self._epoch_starts_job)

    def _epoch_starts_job(self) -> list[tuple[int, tuple[int, int]]]:
        out = []
        log = self.commitlog
        entry = log.get(log.first_log_id) if log.next_log_id > log.first_log_id else None
        while entry is not None:
            out.append((entry.epoch, (entry.offset, entry.count_before)))
            entry = log.first_after_epoch(entry.epoch)
        return out

    async def epoch_end(self, epoch: int) -> tuple[int, int]:
        """The start of the first entry whose epoch is above `epoch`, or the written end."""
        return await self._exclusive(self._epoch_end_job, epoch)

    def _epoch_end_job(self, epoch: int) -> tuple[int, int]:
        entry = self.commitlog.first_after_epoch(epoch)
        if entry is None:
            return self.written_end, self.written_count
        return entry.offset, entry.count_before

    async def truncate_to(self, offset: int, count: int) -> None:
        """Cut the data and the commitlog back to the entry that begins at (offset, count),
        across segments. ValueError if no entry begins there or it is below committed_end.
        A kill at any point leaves a log that opens and holds a prefix of what it held.
        While it waits for the writer, nothing is committed past (offset, count)."""
        if offset < self.committed_end:
            raise ValueError(f"cannot truncate to {offset}: committed up to {self.committed_end}")
        limit = self._commit_limit
        self._commit_limit = min(limit or (offset, count), (offset, count))
        try:
            await self._exclusive(self._truncate_job, offset, count, then=self._truncated)
        except OSError as e:
            raise self._fail_queue(f"truncating failed: {e}") from None
        finally:
            self._commit_limit = limit

    def _truncate_job(self, offset: int, count: int):
        if offset < self.committed_end:
            raise ValueError(f"cannot truncate to {offset}: committed up to {self.committed_end}")
        if (offset, count) == (self.written_end, self.written_count):
            return None
        entry = self.commitlog.find_by_offset(offset) if offset < self.written_end else None
        if entry is None or (entry.offset, entry.count_before) != (offset, count):
            raise ValueError(f"no entry begins at ({offset}, {count})")
        self._leave_journal()  # no journal record may come back over the cut tail
        # The commitlog first: an entry past the data would be a loss at open, a record past
        # the commitlog is only re-indexed.
        self.commitlog.truncate_after(entry.log_id - 1)
        fsync_dir(self.commitlog.path)
        self._segments.cut_to(offset)
        last = self.commitlog.last()
        self._clog_epoch = 0  # the next batch syncs the commitlog (see _write_sync)
        log.warning("truncated", path=self.path, partition=self.partition, offset=offset,
                    count=count, cut_bytes=self.written_end - offset)
        return offset, count, last

    def _truncated(self, cut) -> None:
        if cut is None:
            return
        offset, count, last = cut
        self.written_end, self.written_count = offset, count
        self._unsynced_messages = 0  # what is left was synced by the cut
        self._tail_epoch = last.epoch if last is not None else 0
        self._tail_end = offset
        if last is not None:
            self._last_ts = last.timestamp

