"""GroupCommit: the write path of a DiskQueue (a class of its chain, diskqueue/state.py; its
fields are set in DiskQueue.__init__). Appends wait in batches; one writer slot (the loop
hands it on) takes each batch in turn: encoded on the loop, written and synced by the
partition's write worker, then answered. Exclusive jobs (retain, find, truncate) take the
same slot between batches. A durable queue hands its next batch over while one is in flight
(encoded for the place after it), so the worker goes from one sync straight to the next
write; a batch is written only where it was encoded for, never after a failed sync. A batch
given whole (`DiskQueue.write_batch`, a leader's) may be announced when it is encoded,
before it is written: once its announce says it went out (others may hold it), its place is
never given to another batch (a failed write fails the queue); it is never handed over
ahead. While other partitions write in the node journal's rounds, an answered batch's
successor lingers for the clients it answered (`_linger_after`).
Invariants and figures: diskqueue/README.md ("Workers", "The commitlog lags the data").
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import time
from collections import deque
from typing import Any, NamedTuple

import structlog

from commitlog.entry import SYNCED_BEFORE, encode_fields
from nsqwire.ids import PARTITION_SHIFT

from .errors import (AppendError, CommitTimeout, DiskFullError, NotCommitted, QueueClosedError,
                     QueueFailedError, _Unrecoverable)
from .record import encode_records
from .state import QueueState

log = structlog.get_logger("diskqueue")

_new = tuple.__new__


class _Stale(Exception):
    """A batch's outcome: not written, the log was not where it was encoded for."""


_STALE = _Stale()

# A batch answered while other partitions write in the node journal's rounds: the next one
# waits at most this long for as many requests as were just answered (see `_linger_after`).
LINGER = 0.001

# Upper bounds of the group-commit histograms in `DiskQueue.histograms` (one slot per
# bound, plus one for larger values; counts per slot, not cumulative): messages per
# written batch, and seconds per sync.
BATCH_MESSAGES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
SYNC_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Appended(NamedTuple):
    """What one `append` call wrote: ids first_id .. first_id + count - 1."""

    first_id: int
    count: int  # type: ignore[assignment]  # a field named as a method of tuple
    offset: int  # virtual offset of the first record
    end_offset: int  # just past the last record
    log_id: int  # its commitlog entry
    timestamp: int
    offsets: list[int]  # virtual offset of each record
    duplicate: bool = False  # an idempotent producer's request answered again (nsqd/producers.py)


class _Batch:
    __slots__ = ("ahead", "announce", "bytes", "count", "deadline", "done", "pushed",
                 "requests")

    def __init__(self, announce: Any = None, done: Any = None) -> None:
        self.requests: list = []  # (future, bodies, trace_id, ext, attempts); lists: per record
        self.bytes = 0
        self.count = 0
        self.ahead = False  # handed over while another batch was in flight
        self.deadline = 0.0  # loop time by which its requests are answered (commit_timeout)
        self.announce = announce  # fn(offset, count, entries, n_entries, data, epoch), encoded
        self.pushed = False  # its announce said it went out: others may hold it
        self.done = done  # fn(results, error) once for the whole batch (its requests: no waiter)


def settle(waiter, result, error) -> None:
    """Resolve one request's waiter: a future, or a callback(result, error); None: the
    request was answered already (GroupCommit._expire)."""
    if waiter is None:
        return
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            if error is None:
                waiter.set_result(result)
            else:
                waiter.set_exception(error)
        return
    try:
        waiter(result, error)
    except Exception:  # a caller's bug must never stop the writer
        log.exception("append_callback_failed")


class GroupCommit(QueueState):
    """The write path of DiskQueue (see the module docstring); its fields are set in
    DiskQueue.__init__."""

    __slots__ = ("_ahead", "_ahead_due", "_batches", "_busy", "_clog_epoch", "_expiry",
                 "_flight", "_idle", "_last_ts", "_linger", "_open", "_sync_timer", "_turns",
                 "_unsynced_messages", "_unsynced_since", "_write_broken")
    _batches: deque[_Batch]  # waiting for the writer, oldest first
    _open: _Batch | None  # the batch appends join (the last of `_batches`)
    _flight: deque[_Batch]  # handed to the write worker, not back yet
    _ahead: tuple[int, int, int, int]  # (end, count, log id, ts) after the batches in flight
    _ahead_due: bool  # a `_submit_ahead` is scheduled
    _write_broken: bool  # write worker: a failed sync or undo, no batch is written after
    _busy: bool  # the writer slot is taken (see _write_next)
    _turns: deque[Any]  # futures of the exclusive jobs waiting for the slot
    _idle: Any  # a future close() waits on for the writer to drain, or None
    _sync_timer: Any  # the loop's timer handle for a sync by time, or None
    _linger: tuple[int, Any] | None  # (requests awaited, timer handle): see _linger_after
    _expiry: Any  # the timer handle of the next commit deadline (_expire), or None
    _unsynced_messages: int
    _unsynced_since: float
    _last_ts: int  # the timestamp of the last batch written
    _clog_epoch: int  # write worker: the highest epoch whose entries the commitlog synced

    def _kick(self) -> None:
        """Have the writer look at its work on the next turn of the loop (so the appends of
        this turn join the batch); with one batch in flight, hand the next one over then."""
        if not self._busy:
            self._busy = True
            self._loop.call_soon(self._write_next)
        elif len(self._flight) == 1 and not self._ahead_due:
            self._ahead_due = True
            self._loop.call_soon(self._submit_ahead)

    def _write_next(self, turns_first: bool = True) -> None:
        """Give the writer slot (held by the caller) to the next work: an exclusive job
        waiting its turn, the next batch, a sync that is due; or free it. Never raises."""
        if turns_first and self._give_turn():
            return
        while self._batches and not self._lingering():
            if self.failed is None and not self._has_place():
                break  # given_place kicks the writer again
            batch = self._take_batch()
            if self.failed is not None:
                self._fail_batch(batch, self.failed)
                continue
            if self._submit(batch):
                return
        if self._give_turn():
            return
        due = self._sync_due_in()
        if due is not None and due <= 0:
            self._write_worker.call(self._sync_job)
            return
        self._busy = False
        if self._sync_timer is not None:
            self._sync_timer.cancel()
            self._sync_timer = None
        if due is not None and not self._closing:
            self._sync_timer = self._loop.call_later(due, self._kick)
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _has_place(self) -> bool:
        """Whether this log may open its files for a batch: it holds a place of the node's
        FileBudget (diskqueue/budget.py), or takes one now, or has no budget. False: it waits
        for one (`given_place`); a closing log takes one over the limit."""
        files = self._files
        return files is None or self in files.holders or files.take(self, self._closing)

    def given_place(self) -> None:
        """(FileBudget) A place of the budget is this log's now: its batches go on."""
        self._kick()

    def _lingering(self) -> bool:
        """Whether the next batch waits for the clients a batch just answered (`_linger`):
        until as many requests are pending as it awaits, its timer ends, or the queue closes
        or fails."""
        linger = self._linger
        if linger is None:
            return False
        if (sum(len(b.requests) for b in self._batches) < linger[0]
                and not self._closing and self.failed is None):
            return True
        linger[1].cancel()
        self._linger = None
        return False

    def _linger_after(self, batch: _Batch) -> None:
        """A batch was answered while other partitions write in the node journal's rounds:
        the next batch waits, at most LINGER, until as many requests again are pending as
        were answered. The clients just answered send again within a round trip; without
        the wait, a partition's batch left with the requests that came during the last one,
        its other clients' came just after and waited a whole round more, and each round
        carried about half of the clients (as LeaderWriter's linger says of replication)."""
        if (batch.done is None and self._batches and self.others_writing()
                and not self._closing and self._linger is None):
            pending = sum(len(b.requests) for b in self._batches)
            self._linger = (pending + len(batch.requests),
                            self._loop.call_later(LINGER, self._end_linger))

    def _end_linger(self) -> None:
        self._linger = None
        self._kick()

    def others_writing(self) -> bool:
        """Whether other partitions (or followers' raw appends) are writing in the node
        journal's rounds now; asked once this queue's batch is answered."""
        return self._journal is not None and self._journal.writers > 0

    def _take_batch(self) -> _Batch:
        batch = self._batches.popleft()
        if batch is self._open:
            self._open = None
        return batch

    def _submit(self, batch: _Batch) -> bool:
        """Encode `batch` for the place the log will be at once the batches in flight are
        written, and hand it to the write worker. False: it could not be encoded (a bug, or
        a request the encoder cannot take), and its waiters failed."""
        if self._flight:
            end, count, log_id, last_ts = self._ahead
        else:
            end, count = self.written_end, self.written_count
            log_id, last_ts = self.commitlog.next_log_id, self._last_ts
        try:
            ts = max(time.time_ns(), last_ts)
            data, clog, results, seq = self._encode(batch.requests, ts, end, count, log_id)
            sync = self._should_sync(batch.count)
            self._write_worker.call(self._write_job, batch, data, clog, results, seq, ts, sync,
                                    (end, log_id))
        except Exception as e:
            log.exception("write_batch_failed", path=self.path, partition=self.partition)
            self._fail_batch(batch, AppendError(f"writing {self.path} failed: {e!r}"))
            return False
        batch.ahead = bool(self._flight)
        if not self._flight and self._journal is not None:
            self._journal.writers += 1
        self._flight.append(batch)
        self._ahead = (end + len(data), seq, log_id + len(results), ts)
        if batch.announce is not None:
            try:
                batch.pushed = bool(batch.announce(end, count, clog, len(results), data,
                                                   self.epoch))
            except Exception:  # the announcer's bug must never stop the writer
                batch.pushed = True  # it may have gone out before it raised
                log.exception("announce_failed", path=self.path)
        return True

    def _submit_ahead(self) -> None:
        """With one batch in flight, hand the next one to the write worker now: it starts
        the moment the one before is synced, with no trip through the loop between them
        (the loop's hand-over waited 150-200 us for a busy loop and a busy CPU). Only for a
        durable queue that is not replicated, with nothing unsynced (so each batch in flight
        is synced before the next is written, and its first entry is SYNCED_BEFORE); never
        a batch to be announced (its place must be sure), and never while an exclusive job
        waits for the slot (the pipe drains for it)."""
        self._ahead_due = False
        if (len(self._flight) == 1 and self._batches and not self._turns
                and (self._journal is None or self._journal.writers <= 1)
                and self.failed is None and self.options.sync.durable
                and not self._unsynced_messages and self._batches[0].announce is None):
            self._submit(self._take_batch())

    def _give_turn(self) -> bool:
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return True
        return False

    async def _exclusive(self, fn, *args, then=None, writes: bool = False):
        """Run fn(*args) in the write worker while the writer is stopped: no batch in flight,
        and `written_end` & co. match the files (open, close, retain, empty, find). `then`
        (on the loop) takes its result before the slot passes on. `writes`: the job writes
        a batch (a follower's raw append), so it counts in `Journal.writers` while it runs."""
        if self._shut:
            raise QueueClosedError(self.path)
        if self._busy:
            turn = self._loop.create_future()
            self._turns.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # it was ours: pass it on
                    self._write_next(turns_first=False)
                raise
        else:
            self._busy = True
        journal = self._journal if writes else None
        if journal is not None:
            journal.writers += 1
        try:
            result = await self._write_worker.run(self._loop, self._keeping_closed, fn, *args)
            if then is not None:
                then(result)
            return result
        finally:
            if journal is not None:
                journal.writers -= 1
            self._write_next(turns_first=False)  # batches first: a stream of jobs never starves them

    def _keeping_closed(self, fn, *args):
        """(write worker) An exclusive job, fn(*args): on a log whose files are closed (a
        log opens so, or was released), it closes them again after; only a write keeps
        them open (so a start of many partitions never holds their descriptors at once)."""
        closed = self.files_used_at is None
        try:
            return fn(*args)
        finally:
            if closed:
                self._release_files_sync()

    def _expire(self) -> None:
        """A commit deadline passed (loop): every request of a batch older than the commit
        timeout is answered CommitTimeout now. A batch never handed to the write worker
        leaves the queue (nothing of it is stored); one being written stays where it is
        with its waiters cleared (its outcome is unknown: it may still be written, and is
        then answered to no one). Then the timer is set for the next batch's deadline.
        A batch given whole (`done`) has no waiters here: its giver keeps its deadlines."""
        self._expiry = None
        now = self._loop.time()
        timeout = self.options.commit_timeout
        unknown = CommitTimeout(f"not committed within {timeout:g}s: it may still be delivered")
        waiting = list(self._flight)
        for batch in waiting:
            if batch.deadline <= now:
                self._answer_now(batch, unknown)
        kept: deque[_Batch] = deque()
        for batch in self._batches:
            if batch.deadline > now:
                kept.append(batch)
                continue
            if batch is self._open:
                self._open = None
            self._answer_now(batch, CommitTimeout(
                f"not written within {timeout:g}s: nothing of it is stored", unwritten=True))
        self._batches = kept
        upcoming = [b.deadline for b in (*waiting, *kept)
                    if b.deadline > now and any(r[0] is not None for r in b.requests)]
        if upcoming:
            self._expiry = self._loop.call_at(min(upcoming), self._expire)

    @staticmethod
    def _answer_now(batch: _Batch, error: Exception) -> None:
        requests = batch.requests
        for i, request in enumerate(requests):
            if request[0] is not None:
                settle(request[0], None, error)
                requests[i] = (None, *request[1:])

    def _fail_batch(self, batch: _Batch, err: Exception) -> None:
        for waiter, *_ in batch.requests:
            settle(waiter, None, err)
        if batch.done is not None:
            settle(batch.done, None, err)

    def _fail_queue(self, reason: str) -> QueueFailedError:
        if self.failed is None:
            self.failed = QueueFailedError(f"{self.path}: {reason}; no append is taken until "
                                           "the queue is reopened")
            log.error("queue_failed", path=self.path, partition=self.partition, reason=reason)
        return self.failed

    def _sync_due_in(self) -> float | None:
        if not self._unsynced_messages or self.failed is not None:  # a failed queue waits
            return None
        policy = self.options.sync
        if policy.durable:  # set_sync made the queue durable with data unsynced
            return 0.0
        if not policy.every_ms:
            return None
        return max(0.0, self._unsynced_since + policy.every_ms / 1000 - time.monotonic())

    def _sync_job(self) -> None:
        """Sync the data (write worker): what the time rule or set_sync asked for."""
        t0 = time.perf_counter()
        error = None
        try:
            self._segments.sync()
        except BaseException as e:
            error = e
        self._write_worker.post(self._loop, self._synced, time.perf_counter() - t0, error)

    def _synced(self, elapsed: float, error: BaseException | None) -> None:
        if error is not None:
            self._fail_queue(f"sync failed: {error}")
        else:
            self._count_sync(elapsed)
            self._unsynced_messages = 0
            if self.options.auto_commit:
                self._commit(self.written_end, self.written_count)
        self._write_next()

    def _count_sync(self, elapsed: float) -> None:
        self.stats["syncs"] += 1
        self.stats["sync_seconds_total"] += elapsed
        self.histograms["sync_seconds"][bisect.bisect_left(SYNC_SECONDS_BUCKETS, elapsed)] += 1

    def _write_job(self, batch: _Batch, data, clog, results, seq: int, ts: int,
                   sync: bool, at: tuple[int, int]) -> None:
        """Write (and sync) one batch (write worker), then hand it back to the loop. Only
        at the place it was encoded for (`at`: data end, next log id), and never after a
        failed sync or undo: else it comes back `_STALE`, written nowhere (a batch handed
        over ahead, whose predecessor failed)."""
        t0 = time.perf_counter()
        error: BaseException | None = None
        if self._write_broken or at != (self._segments.end, self.commitlog.next_log_id):
            error = _STALE
        else:
            try:
                self._write_sync(data, clog, len(results), sync, self.epoch)
            except BaseException as e:
                error = e
                self._write_broken = isinstance(e, _Unrecoverable)
            else:
                self._store_committed()
        self._write_worker.post(self._loop, self._written, batch, len(data), results, seq, ts,
                                sync, time.perf_counter() - t0, error)

    def _written(self, batch: _Batch, size: int, results, seq: int, ts: int, synced: bool,
                 elapsed: float, error: BaseException | None) -> None:
        """A batch came back from the worker (loop): account for it, start the next batch,
        then resolve this one. Batches come back in the order they were handed over."""
        self._flight.popleft()
        if not self._flight and self._journal is not None:
            self._journal.writers -= 1
        if error is _STALE and batch.ahead:  # written nowhere: it goes again, once at the front
            self._batches.appendleft(batch)
            if not self._flight:
                self._write_next()
            return
        if error is _STALE:  # the loop's view and the files disagree: never write over them
            error = _Unrecoverable("the log's files are not where the writer expected them")
        if error is not None:
            announced = batch.pushed
            err: Exception = self._batch_error(error, announced)
            if announced:  # the followers may hold it, and a new leader may commit it
                err = NotCommitted(f"not written here ({err}): it may still be delivered")
            self._fail_batch(batch, err)
            if not self._flight:  # else the one in flight comes back (stale) first
                self._write_next()
            return
        self.stats["batches"] += 1
        self.stats["batch_messages_total"] += batch.count
        self.histograms["batch_messages"][
            bisect.bisect_left(BATCH_MESSAGES_BUCKETS, batch.count)] += 1
        if synced:
            self._count_sync(elapsed)
        self._last_ts = ts
        self.written_end += size
        self.written_count = seq
        if synced:
            self._unsynced_messages = 0
        else:
            if not self._unsynced_messages:
                self._unsynced_since = time.monotonic()
            self._unsynced_messages += batch.count
        if self.options.auto_commit:
            self._commit(self.written_end, self.written_count)
        if not self._flight:
            self._linger_after(batch)
            self._write_next()  # the disk works on the next batch while the loop answers this one
        elif self._batches:
            self._kick()  # the next goes ahead of the one in flight, on the next turn
        if batch.done is not None:
            settle(batch.done, results, None)
            return
        for request, result in zip(batch.requests, results):
            settle(request[0], result, None)

    def _batch_error(self, error: BaseException, announced: bool = False) -> AppendError:
        if isinstance(error, _Unrecoverable):
            return self._fail_queue(str(error))
        if announced:  # others may hold it (a leader pushed it): its place is never reused
            return self._fail_queue(f"a batch announced before its write (a leader pushed it) "
                                    f"was not written: {error!r}")
        if isinstance(error, OSError):
            err = self._append_error(error)
            log.error("append_failed", path=self.path, partition=self.partition, error=str(err))
            return err
        log.error("write_batch_failed", path=self.path, partition=self.partition,
                  error=repr(error))
        return AppendError(f"writing {self.path} failed: {error!r}")

    def _encode(self, requests, ts: int, offset: int, seq: int, log_id: int):
        """Encode a batch starting at (offset, seq, log_id): (data bytes, commitlog bytes,
        one Appended per request, next sequence).

        The hot loop of the write path: no per-record object but the pieces joined once.
        """
        parts: list[bytes | memoryview] = []
        add = parts.append
        clog = []
        results = []
        prefix = self.partition << PARTITION_SHIFT
        epoch = self.epoch
        flags = SYNCED_BEFORE if not self._unsynced_messages else 0  # the first entry's
        for _fut, bodies, trace_id, ext, attempts in requests:
            start = offset
            first_id = prefix | seq
            offsets: list[int] = []
            if ext.__class__ is bytes:
                offset = encode_records(add, offsets, offset, first_id, trace_id, ts, attempts,
                                        ext, bodies)
            else:  # a trace id and an ext header per record (append's trace_ids, exts)
                for i, body in enumerate(bodies):
                    offset = encode_records(add, offsets, offset, first_id + i, trace_id[i], ts,
                                            attempts, ext[i], (body,))
            n = len(bodies)
            clog.append(encode_fields(log_id, epoch, first_id, start, seq, ts, offset - start, n,
                                      flags))
            flags = 0
            results.append(_new(Appended, (first_id, n, start, offset, log_id, ts, offsets, False)))
            seq += n
            log_id += 1
        return b"".join(parts), b"".join(clog), results, seq

    def _should_sync(self, count: int) -> bool:
        policy = self.options.sync
        if self._unsynced_messages + count >= policy.every_messages:
            return True
        return bool(policy.every_ms and self._unsynced_messages
                    and time.monotonic() - self._unsynced_since >= policy.every_ms / 1000)

    def _write_sync(self, data, clog, entries: int, sync: bool, epoch: int) -> None:
        """Write one batch of `epoch` (write worker), and sync its data if `sync` (in the
        same system call as its write when it can: Segments.write). A failed write is undone
        (both files cut back) and re-raised; a failed undo or a failed sync raises
        _Unrecoverable.

        The commitlog is synced only when `clog_sync_every` entries are unsynced, the data
        moved to a new segment (so its lag never spans a data segment), or the batch is the
        first of an epoch above the last synced entry's: recovery rebuilds what a power loss
        took of the commitlog from the data, giving the rebuilt entries the last surviving
        entry's epoch, so that one must be the epoch they were written in (an older one
        made a restarted replica cut committed records as if they were another leader's).

        With the node journal, a batch to sync with nothing unsynced before it is written
        without a sync and journaled instead: its answer waits for the round's journal sync
        (diskqueue/journal.py)."""
        self._segments.ready()  # the files open first: one that cannot (no descriptor left)
        self.commitlog.ready()  # fails the batch with nothing written, so nothing to undo
        data_before = self._segments.end
        base_before = self._segments.active_base
        log_before = self.commitlog.next_log_id
        self.files_used_at = time.monotonic()
        journal = self._journal
        if journal is not None and not journal.begin(self._journal_key,
                                                     sync and not self._segments.unsynced):
            journal = None  # not journaled: this segment syncs itself, as its policy says
        try:
            if journal is not None:  # durable once the round's journal sync is done
                where = self._segments.write_journaled(data)
                synced = True
            else:
                synced = self._segments.write(data, sync)  # durable: write + sync, one call
            self.commitlog.append_encoded(clog, entries)
        except _Unrecoverable:  # its sync failed: the queue fails, as after a failed fdatasync
            raise
        except BaseException as e:
            try:
                self.commitlog.truncate_after(log_before - 1)
                self._segments.truncate_to(max(data_before, self._segments.active_base))
            except OSError as undo:
                raise _Unrecoverable(f"undoing a failed write failed: {undo}") from undo
            if self._journal is not None and getattr(e, "errno", None) == errno.ENOSPC:
                self._journal.make_room()  # its copies of synced data free their space
            raise
        if journal is not None:
            journal.record(self._journal_key, self._segments, where, data)
        try:
            if sync and not synced:
                self._segments.sync()
            if (self.commitlog.sync_due or self._segments.active_base != base_before
                    or epoch > self._clog_epoch):
                self.commitlog.sync()
                self._clog_epoch = max(self._clog_epoch, epoch)
        except OSError as e:
            raise _Unrecoverable(f"sync failed: {e}") from e

    def _append_error(self, e: OSError) -> AppendError:
        if e.errno == errno.ENOSPC:
            return DiskFullError(f"no space left on device writing {self.path}: "
                                 "nothing of this batch was acknowledged")
        return AppendError(f"writing {self.path} failed: {e}")

    # ---- committing and waiting ------------------------------------------
