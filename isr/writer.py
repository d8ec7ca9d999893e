"""`LeaderWriter`: the write path of a partition led here with replicas (a `LeaderLog`'s).

Publishes wait in `pending` while a batch is in replication. When none is, the pending
requests (up to the log's batch limits) go to the log as one batch of their own
(`DiskQueue.write_batch`): pushed to the followers as it is encoded (`push`), written and
synced here, and answered once committed (`commit_to`, when the ISR holds it; the core
commits on the local write alone when the leader is solo).

Invariants:
- one batch is in replication at a time, from its hand-over to the log until it is
  committed or failed: what arrives meanwhile goes as the next batch, one push and one
  follower write and sync for all of it (each push costs every follower about what the
  leader's whole batch costs);
- every request is answered once: its `Appended` once its batch is committed; else an
  error: `CommitTimeout` past its deadline ("nothing of it is stored" while pending, "it
  may still be delivered" once handed to the log), `NotCommitted` when the leadership
  cannot commit it (written or being written: it may still be delivered), the refusal
  (`fail_uncommitted`'s error, the log's failure) when it was pending;
- a batch handed to the log is never taken back: the log writes it where it was encoded
  for, or fails for good (its place is never given to another batch).
"""

from __future__ import annotations

import asyncio

import structlog

from diskqueue.errors import CommitTimeout, NotCommitted
from diskqueue.groupcommit import settle
from nsqwire.ids import SEQUENCE_MASK

log = structlog.get_logger("isr.writer")

LINGER = 0.002  # s: how long a batch released by a commit waits for the clients it answered


class _InReplication:
    """The batch in replication: its requests' (waiter, deadline), and once written its
    results and end."""

    __slots__ = ("waiters", "results", "end")

    def __init__(self, waiters: list):
        self.waiters = waiters
        self.results: list | None = None
        self.end: tuple[int, int] | None = None

    def answer(self, results, error) -> None:
        """Answer every request once (a later answer reaches no one)."""
        waiters, self.waiters = self.waiters, [(None, d) for _w, d in self.waiters]
        for i, (waiter, _deadline) in enumerate(waiters):
            settle(waiter, None if results is None else results[i], error)


class LeaderWriter:
    """Takes a led partition's publishes (see the module docstring). `push(offset, count,
    entries, n_entries, data, epoch)` is called with each batch as it is encoded, and says
    whether it went out; `written(end)` once it is written here, with its (end offset,
    count); `unwritten()` when it failed to be written."""

    def __init__(self, q, push, written, unwritten):
        self.q = q
        self._push = push
        self._written = written
        self._unwritten = unwritten
        self._loop = asyncio.get_running_loop()
        self._timeout = q.options.commit_timeout
        self.solo = False  # the core commits on the local write alone: no linger
        self.closed: Exception | None = None
        self._pending: list = []  # [waiter, deadline, request]
        self._batch: _InReplication | None = None
        self._flush_due = False
        self._linger: tuple[int, asyncio.TimerHandle] | None = None  # (requests awaited, timer)
        self._expiry: asyncio.TimerHandle | None = None

    def append(self, bodies, trace_id: int = 0, ext: bytes = b"", attempts: int = 0,
               callback=None, *, trace_ids=None, exts=None) -> asyncio.Future | None:
        """`DiskQueue.append`'s arguments and answers, once the batch is committed. Raises
        at once (nothing queued): the writer's closing reason, the log's failure or
        ValueError."""
        if self.closed is not None:
            raise self.closed
        request = self.q.request(bodies, trace_id, ext, attempts, trace_ids=trace_ids,
                                 exts=exts)
        fut = self._loop.create_future() if callback is None else None
        deadline = self._loop.time() + self._timeout if self._timeout else float("inf")
        self._pending.append([fut or callback, deadline, request])
        if self._timeout and self._expiry is None:
            self._expiry = self._loop.call_at(deadline, self._expire)
        self._wake()
        return fut

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    # ---- the batch in replication ----

    def _wake(self) -> None:
        """Have the pending requests go as the next batch on the next loop turn (so the
        appends of this turn join it), unless a batch is in replication or a linger waits
        for more requests."""
        if self._linger is not None:
            if len(self._pending) < self._linger[0] and self.closed is None:
                return
            self._linger[1].cancel()
            self._linger = None
        if self._batch is None and self._pending and not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._batch is not None or not self._pending or self._linger is not None:
            return
        if self.closed is not None:
            return self._fail_pending(self.closed)
        options = self.q.options
        size = count = n = 0
        for _waiter, _deadline, request in self._pending:
            if n and (size + request[4] > options.max_batch_bytes
                      or count + len(request[0]) > options.max_batch_count):
                break
            size += request[4]
            count += len(request[0])
            n += 1
        taken, self._pending = self._pending[:n], self._pending[n:]
        batch = _InReplication([(w, d) for w, d, _r in taken])
        try:
            self.q.write_batch([r for _w, _d, r in taken], announce=self._push,
                               done=lambda results, error: self._batch_written(batch, results,
                                                                               error))
        except Exception as e:  # the log closed or failed: nothing of it is stored
            batch.answer(None, e)
            return self._fail_pending(e)
        self._batch = batch

    def _batch_written(self, batch: _InReplication, results, error) -> None:
        """The log wrote the batch (or failed it: an announced batch that fails fails the
        log, and `error` says it may still be delivered)."""
        if error is not None:
            batch.answer(None, error)
            self._unwritten()
            if batch is self._batch:
                self._batch = None
            if self.q.failed is not None:
                self._fail_pending(self.q.failed)
            self._wake()
            return
        last = results[-1]
        batch.results = results
        batch.end = (last.end_offset, (last.first_id & SEQUENCE_MASK) + last.count)
        self._written(batch.end)

    def commit_to(self, position: tuple[int, int]) -> None:
        """The partition is committed up to `position` (the core's commit): the log's
        committed end moves, and the batch in replication is answered once wholly in it."""
        self.q.commit_to(*position)
        batch = self._batch
        if batch is None or batch.end is None or batch.end[0] > self.q.committed_end:
            return
        self._batch = None
        batch.answer(batch.results, None)
        self._release(len(batch.waiters))

    def _release(self, answered: int) -> None:
        """A batch was committed (answering `answered` requests) or forgotten: the pending
        requests go next. After a commit, first linger: wait, at most LINGER, until as many
        requests again are pending as were answered. The clients just answered are the other
        half of the publishers (the pending ones came while theirs were in replication) and
        send again within a round trip, so one push carries both halves instead of each
        taking turns (single PUBs from 100 connections, R=3: about 1.5 times the messages a
        push). When solo, only while other partitions write in the node journal's rounds (as
        DiskQueue's own linger: a batch written alone goes at once); never when closed."""
        if (answered and self._pending and self.closed is None
                and (not self.solo or self.q.others_writing())):
            self._linger = (len(self._pending) + answered,
                            self._loop.call_later(LINGER, self._end_linger))
        self._wake()

    def _end_linger(self) -> None:
        self._linger = None
        self._wake()

    def set_solo(self, solo: bool) -> None:
        """Solo: the core commits on the local write alone; a linger for the followers'
        clients ends (unless other partitions write in the journal's rounds)."""
        self.solo = solo
        if solo and self._linger is not None and not self.q.others_writing():
            self._linger[1].cancel()
            self._linger = None
        self._wake()

    # ---- failing ----

    def fail_uncommitted(self, error: Exception) -> None:
        """The partition cannot commit now: the batch in replication is answered
        NotCommitted (saying `error`; its data stays in the log and may still be committed
        by whoever leads next) and forgotten, the pending requests `error` (nothing of them
        was stored)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.answer(None, NotCommitted(f"not committed ({error}): it may still be "
                                            "delivered"))
        self._fail_pending(error)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, []
        for waiter, _deadline, _request in pending:
            settle(waiter, None, error)
        if self._linger is not None:
            self._linger[1].cancel()
            self._linger = None

    def close(self, error: Exception) -> None:
        """Take no more requests (`append` raises `error`); answer what waits as
        fail_uncommitted does."""
        if self.closed is None:
            self.closed = error
        self.fail_uncommitted(error)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        """A commit deadline passed: a pending request is answered "nothing of it is
        stored" and leaves; one in the batch in replication "it may still be delivered" (it
        stays in the batch, answered to no one when committed). Then the timer is set for
        the next deadline."""
        self._expiry = None
        now = self._loop.time()
        timeout = self._timeout
        kept = []
        for entry in self._pending:
            if entry[1] > now:
                kept.append(entry)
            else:
                settle(entry[0], None, CommitTimeout(
                    f"not written within {timeout:g}s: nothing of it is stored",
                    unwritten=True))
        self._pending = kept
        upcoming = [d for _w, d, _r in kept]
        batch = self._batch
        if batch is not None:
            waiters = batch.waiters
            for i, (waiter, deadline) in enumerate(waiters):
                if waiter is None:
                    continue
                if deadline <= now:
                    settle(waiter, None, CommitTimeout(
                        f"not committed within {timeout:g}s: it may still be delivered"))
                    waiters[i] = (None, deadline)
                else:
                    upcoming.append(deadline)
        if upcoming and self.closed is None:
            self._expiry = self._loop.call_at(min(upcoming), self._expire)
