"""ChannelDelay: a channel's link to its disk delay queue (delayqueue.DelayStore, LMDB).

Moves deferred and often-retried messages into the store in batched, synced
writes, and brings due ones back. All store calls run off the event loop, one
at a time per channel.

Invariants:
- a message taken from the log counts as confirmed only after the write that
  holds it in the store is committed (`on_stored` is called then);
- a message brought back from the store stays in it ("taken") until its FIN
  is written, so a crash at any moment brings it back (at-least-once);
- a store is made only when a message first needs it (the first move), never when the
  channel is made: an LMDB store costs a folder, two files and a map, and making one on a
  full disk must cost one error, not the process (delayqueue preallocates its files). A
  store that exists (or that the checkpoint says existed) is opened with the channel;
- when the store cannot be opened, or its writes keep failing (GIVE_UP_AFTER
  flushes in a row), `error` names the file and the channel keeps its deferred
  messages in memory, as classic nsqd does: moves not yet written are given back
  (`give_back`), so nothing waits on a broken store. A store that could not be made is
  tried again, at most every CREATE_RETRY_S, by a later move;
- a log record the store already holds (moved there, then a crash before the cursor
  was saved) is the store's: `holding` tells the channel, which confirms it unsent;
- `min_origin` is the smallest (log offset, msg_id) the store holds (None: no log
  message), read in the same worker call as every write that may change it, and updated
  before `on_stored` confirms anything: whenever the cursor has passed a message because
  the store holds it, `min_origin` is at or below it (what replicas get when the store
  cannot be listed: nsqd/replica.py).
  The flusher and the poller read in two threads: a read older (by `store.commits`) than
  the one applied last is dropped, so a late one never undoes a newer one;
- `held` reads the first log messages the store holds when a replica state is made (not
  with every write: it costs ~3 us an entry), at least as new as the checkpoint it goes
  with; `on_stored` is called after every flush that changed the store, so the channel
  saves (and its followers get) a checkpoint with the store's new content;
- `open(restore=...)` (a new leader, nsqd/handover.py) empties a store left from an older
  term and puts the old leader's held messages in, before the store is used at all.
"""

from __future__ import annotations

import asyncio
import os
import time

import structlog

from .health import FailureLog

log = structlog.get_logger("nsqd.delay")

GIVE_UP_AFTER = 3  # failed store writes in a row before moves stop going to the store
CREATE_RETRY_S = 30.0  # after a store could not be made, moves wait in memory this long


class ChannelDelay:
    def __init__(self, path: str, on_stored, give_back, take_limit: int = 1000,
                 expected: bool = False, on_waiting=None):
        self.path = path
        self.expected = expected  # the channel had a store: a missing folder is an error
        self.on_stored = on_stored  # called with the log messages whose store write committed
        self.give_back = give_back  # called with (message, due_ms) the store did not take
        self.on_waiting = on_waiting  # called when a read of the store finds `waiting` > 0
        self.take_limit = take_limit
        self.store = None
        self.opened = False  # open() has run: what the store holds is known (or failed)
        self.error: str | None = None
        self.waiting = 0
        self.taken = 0
        self.oldest_due_ms: int | None = None
        self.min_origin: tuple[int, int] | None = None  # (offset, msg_id): see the docstring
        self._read_at = 0  # store.commits before the read applied last (see _refresh)
        self._held: tuple[int, int, list] = (-1, 0, [])  # store.commits before, limit, rows
        self.max_origin = -1  # at open: no log record past this offset is in the store
        self._puts: list = []  # (DelayedMessage, message from the log or None)
        self._finishes: list[int] = []
        self._requeues: list[tuple[int, int, int]] = []
        self._pending = asyncio.Event()
        self._flusher: asyncio.Task | None = None
        self._taking = False
        self._closed = False
        self._failed = False  # writes kept failing, or a store that exists did not open
        self._create_after = 0.0  # monotonic time before which no store is made
        self._write_failures = FailureLog(log, "delay_store_write_failed")
        self.flushes = 0  # store writes done: many moves share one

    @property
    def available(self) -> bool:
        """Moves may go to the store: it is open, or it may be made on the first move."""
        if self._closed or self._failed:
            return False
        return self.store is not None or time.monotonic() >= self._create_after

    async def open(self, restore: list | None = None) -> bool:
        """Open the channel's store if it has one; a new one is made by the first move.
        `restore` (a new leader's takeover): DelayedMessages to hold instead of whatever the
        store holds, made when there are some; False when they could not be stored."""
        if self.expected and not os.path.isdir(self.path):
            self.error = (f"{self.path}: the channel's delay store is missing (what it held "
                          "counts as confirmed in the log): deferred messages wait in memory")
            self._failed = True  # never an empty store in its place
            log.error("delay_store_missing", path=self.path)
            self.opened = True
            return not restore
        stored = True
        if restore is not None and (restore or os.path.isdir(self.path)):
            stored = await self._open_store(restore)
        elif os.path.isdir(self.path):
            stored = await self._open_store()
        self.opened = True
        if not stored and os.path.isdir(self.path):
            self._failed = True
            return False
        if not stored:  # could not be made (a full disk?): as after a failed first move
            self._create_after = time.monotonic() + CREATE_RETRY_S
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        return stored

    async def _open_store(self, restore: list | None = None) -> bool:
        """Open (or make) the store, with only `restore` in it when given; False, with
        `error` set and one log line, if it fails."""
        from delayqueue.store import DelayStore, DelayStoreError

        try:
            self.store = await asyncio.to_thread(DelayStore.open, self.path)
            if restore is not None:
                await asyncio.to_thread(self._replace, restore)
            self._read_at = 0
            self._refresh(*await asyncio.to_thread(self._read_state))
            self.max_origin = await asyncio.to_thread(self.store.max_origin_offset)
        except (DelayStoreError, OSError, ValueError) as e:
            if self.store is not None:
                await asyncio.to_thread(self.store.close)
                self.store = None
            self.error = str(e)
            log.error("delay_store_unavailable", path=self.path, error=self.error)
            return False
        self.error = None
        return True

    def _replace(self, items: list) -> None:
        """Hold exactly `items` (worker thread): two synced transactions, so a crash between
        them leaves an empty store, and the takeover, not yet done, runs again."""
        self.store.empty()
        self.store.put(items)

    async def held(self, limit: int) -> list[tuple[int, int, int, int]] | None:
        """The first `limit` log messages the store holds, (origin, msg_id, due_ms, attempts)
        in origin order (DelayStore.first_held; read again only when the store changed):
        [] without a store, None when it cannot be read (or is not open yet)."""
        store = self.store
        if store is None:
            return None if self._failed or self._closed or not self.opened else []
        at = store.commits
        read_at, read_limit, rows = self._held
        if read_at == at and (read_limit >= limit or len(rows) < read_limit):
            return rows[:limit]
        try:
            rows = await asyncio.to_thread(store.first_held, limit)
        except Exception as e:  # closed meanwhile, or LMDB failed: the caller is careful
            log.warning("delay_store_held_unread", path=self.path, error=str(e))
            return None
        self._held = (at, limit, rows)
        return rows

    async def holding(self, records) -> set[int]:
        """Ids of the log `records` that the store held when it was opened (checked only
        for records at or before `max_origin`: after a restart, at most one checkpoint's
        worth)."""
        if not self.available or not records or records[0].offset > self.max_origin:
            return set()
        ids = [r.msg_id for r in records if r.offset <= self.max_origin]
        return await asyncio.to_thread(self.store.holding, ids)

    # ---- moving messages in ----------------------------------------------

    def move(self, msg, due_ms: int) -> None:
        """Store a message (from the log or from the store) to come back at `due_ms`."""
        from delayqueue.entry import DelayedMessage

        attempts = min(msg.attempts, 0xFFFF)  # the record's field is 16 bits
        if msg.delayed:
            self._requeues.append((msg.msg_id, due_ms, attempts))
        else:
            self._puts.append((DelayedMessage(due_ms, msg.msg_id, msg.trace_id, msg.timestamp,
                                              attempts, msg.ext, msg.body, msg.offset), msg))
        self._pending.set()

    def finish(self, msg) -> None:
        self._finishes.append(msg.msg_id)
        self._pending.set()

    async def _flush_loop(self) -> None:
        failures = 0
        while True:
            if not (self._puts or self._finishes or self._requeues):
                if self._closed:
                    return
                await self._pending.wait()
                self._pending.clear()
                continue
            if self.store is None and not await self._open_store():
                # No store could be made (a full disk?): the moves wait in memory, and a
                # later move tries again after CREATE_RETRY_S. Only log messages can be
                # here: nothing was ever taken from a store that does not exist.
                self._create_after = time.monotonic() + CREATE_RETRY_S
                puts, self._puts = self._puts, []
                self.give_back([(m, d.due_ms) for d, m in puts if m is not None])
                self._finishes.clear()
                self._requeues.clear()
                continue
            puts, self._puts = self._puts, []
            finishes, self._finishes = self._finishes, []
            requeues, self._requeues = self._requeues, []
            try:
                state = await asyncio.to_thread(self._apply, [d for d, _ in puts], finishes,
                                                requeues)
            except Exception as e:  # the messages stay where they were: in the log, or taken
                self._write_failures.failed(e, path=self.path)
                self.error = str(e)
                if self._closed:
                    return
                failures += 1
                if failures >= GIVE_UP_AFTER and not self._failed:
                    self._failed = True
                    log.error("delay_store_given_up", path=self.path, error=self.error)
                if self._failed:  # moves from the log wait in the channel's memory instead
                    self.give_back([(m, d.due_ms) for d, m in puts + self._puts if m is not None])
                    puts, self._puts = [], []
                await asyncio.sleep(1)
                self._puts[:0], self._finishes[:0], self._requeues[:0] = puts, finishes, requeues
                continue
            failures = 0
            self._write_failures.ok(path=self.path)
            self.flushes += 1
            self._refresh(*state)
            self.on_stored([m for _, m in puts if m is not None])

    def _apply(self, puts, finishes, requeues):
        """One flush (worker thread): each kind in one synced transaction."""
        if puts:
            self.store.put(puts)
        if requeues:
            self.store.requeue(requeues)
        if finishes:
            self.store.finish(finishes)
        return self._read_state()

    def _read_state(self):
        """(waiting, taken, oldest due_ms, min_origin, commits before the read) of the store
        (worker thread)."""
        commits = self.store.commits
        return (*self.store.stats(), self.store.min_origin(), commits)

    def _refresh(self, waiting: int, taken: int, oldest_due_ms, min_origin,
                 read_at: int) -> None:
        if read_at < self._read_at:  # read before the state applied last: stale
            return
        self._read_at = read_at
        self.waiting, self.taken, self.oldest_due_ms = waiting, taken, oldest_due_ms
        self.min_origin = min_origin
        if waiting and self.on_waiting is not None:
            self.on_waiting()

    # ---- bringing due messages back ----------------------------------------

    def due(self, now_ms: int) -> bool:
        return (self.available and self.store is not None and not self._taking
                and self.waiting > 0 and self.oldest_due_ms is not None
                and self.oldest_due_ms <= now_ms)

    async def take_due(self, now_ms: int, limit: int):
        """Due messages, moved to "taken" in the store (one transaction)."""
        from delayqueue.store import DelayStoreCorruptError

        self._taking = True
        try:
            taken = await asyncio.to_thread(self.store.take_due, now_ms, min(limit,
                                                                             self.take_limit))
        except DelayStoreCorruptError as e:  # set aside by the store; the next take goes on
            log.error("delay_store_corrupt_entry", path=self.path, error=str(e))
            taken = []
        finally:
            self._taking = False
        self._refresh(*await asyncio.to_thread(self._read_state))
        return taken

    # ---- operations --------------------------------------------------------

    async def empty(self) -> int:
        if not self.available or self.store is None:
            return 0
        dropped = await asyncio.to_thread(self.store.empty)
        self._refresh(*await asyncio.to_thread(self._read_state))
        return dropped

    async def requeue_all_now(self, now_ms: int) -> int:
        if not self.available or self.store is None:
            return 0
        moved = await asyncio.to_thread(self.store.requeue_all_now, now_ms)
        self._refresh(*await asyncio.to_thread(self._read_state))
        return moved

    async def close(self) -> None:
        """Write what is pending, then close. (Deleting a channel buries the closed store's
        folder: Partition.remove_channel.)"""
        self._closed = True
        self._pending.set()
        if self._flusher is not None:
            await self._flusher
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None
