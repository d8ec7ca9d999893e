"""Topic: a named stream of messages, stored as partitions, each with its channels.

A Partition owns one DiskQueue (the partition's log) and the channels that
read it. Publishing appends to the log through group commit and returns only
when the storage engine acknowledged it. The topic's Assignment (assignment.py) says
how many partitions it has and which this node leads: only those are open, and only
open, led partitions are `writable` (a publish without a partition goes round-robin
over them; one to another partition is refused: PartitionNotFound out of range,
PartitionNotLed in range but not led here, StorageError when it does not serve).

Invariants:
- the first channel of a partition starts at `floor`: what was published
  while the partition had no channel (the oldest retained message at first);
  later channels start at the partition's end, or (in cluster mode, a channel etcd has
  and this partition lacks) at the first message written since the channel was made,
  never below the floor;
- retention never drops a segment some channel has not confirmed past;
- a fault stays inside its partition: a partition that does not open (corrupt beyond
  repair, its folder or a segment missing, EIO) is held in `failed` with the reason, kept
  in the topic's stored state, and refuses publishes (StorageError) until a reopen
  succeeds; the topic's other partitions, and every other topic, serve. A partition whose
  log failed while running (`queue.failed`, after a failed sync) stays in `partitions`
  (its channels still deliver what it holds) and refuses publishes the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import operator
import os
import shutil
import time
from typing import Any, cast

import structlog

from diskqueue.atomic import fsync_dir
from diskqueue.errors import NotCommitted
from diskqueue.groupcommit import Appended, settle
from diskqueue.queue import DiskQueue, QueueOptions, SyncPolicy
from nsqwire.partitioning import partition_of

from .assignment import Assignment
from .channel import Channel
from .cursor import SavedWindow
from .errors import (PartitionNotFound, PartitionNotLed, PartitionNotWritable,
                     ProducersLoading, StorageError)
from .handover import opening_state
from .halves import CHECK_AFTER_S, MAX_CHECKS, Halves, check_back
from .producers import (MARKER, SCAN_BYTES, SCAN_REQUESTS, SCAN_SECONDS, UNKNOWN, WRITE,
                        ProducerTable, answer_of, mark_of, marked)

log = structlog.get_logger("nsqd.topic")
_FLOOR_OF = operator.attrgetter("_floor")  # a Partition's floor, read in C (Topic.state)

FIND_EVERY = 0.2  # s: how often a partition looks in its log for UNKNOWN requests
FIND_TRIES = 150


def _answer_of(entry) -> Appended:
    """The answer a request got, from its commitlog entry (a request is one entry)."""
    return answer_of(entry.first_msg_id, entry.msg_count, entry.offset, entry.end_offset)


def sync_policy(sync_every: int, sync_timeout_ms: int) -> SyncPolicy:
    """--sync-every / --sync-timeout as a SyncPolicy: 1 syncs every batch (durable)."""
    return SyncPolicy(every_messages=max(1, sync_every),
                      every_ms=sync_timeout_ms if sync_every > 1 else 0)


def topic_folder(data_path: str, name: str) -> str:
    """`<data-path>/<name>.topic`. The suffix keeps every name a plain folder name: `.` and
    `..` are legal NSQ names, and a bare `..` would be the data path's parent."""
    return os.path.join(data_path, f"{name}.topic")


def delay_folder(partition_path: str, channel: str) -> str:
    """A channel's delay queue: `<partition folder>/delay/<channel>.channel` (same reason)."""
    return os.path.join(partition_path, "delay", f"{channel}.channel")


TOMBSTONE = ".deleted"


def bury(path: str) -> str | None:
    """Rename the folder `path` to a tombstone beside it, `<path>.<ns>.deleted`, and sync
    the parent: one atomic, durable step after which nothing under the old name is the
    old files, so a topic or channel made again gets a fresh folder. Returns the tombstone,
    or None when there is no folder. Blocking."""
    grave = f"{path}.{time.time_ns()}{TOMBSTONE}"
    try:
        os.rename(path, grave)
    except FileNotFoundError:
        return None
    fsync_dir(os.path.dirname(path))
    return grave


def buried_path(grave: str) -> str:
    """The path a tombstone was renamed from (see bury)."""
    return grave[:-len(TOMBSTONE)].rpartition(".")[0]


def remove_grave(grave: str) -> None:
    """Remove a tombstone and sync its parent, so it cannot come back. Blocking."""
    shutil.rmtree(grave, ignore_errors=True)
    fsync_dir(os.path.dirname(grave))


def _folders(path: str) -> set[str]:
    """Names of the folders in `path` (none when it is missing). Blocking."""
    try:
        with os.scandir(path) as entries:
            return {e.name for e in entries if e.is_dir()}
    except FileNotFoundError:
        return set()


class Solo:
    """The writer of a partition that is not replicated: its own log. A publish is answered
    once written (and synced as the sync policy says); a channel's state stays on this node
    (the node's checkpoint stores it)."""

    __slots__ = ("append",)
    writable = True  # while open: a failed log's append raises why (answered as StorageError)
    starting = False
    reason = ""

    def __init__(self, queue: DiskQueue):
        self.append = queue.append

    def save_channel(self, channel: Channel, state: dict) -> None:
        """A checkpoint of the channel was stored here: nothing more to do."""

    async def push_channel(self, channel: Channel) -> None:
        """Nothing to wait for: no other node holds the partition."""


class NotLed:
    """The writer of a replicated partition while this node does not lead it (its
    replication is starting, or stopping): takes no publish and no channel state.
    `starting`: its leadership is on its way (a publish may wait for it: NSQD.until_led)."""

    __slots__ = ("reason", "starting")
    writable = False

    def __init__(self, reason: str, starting: bool = False):
        self.reason = reason
        self.starting = starting

    def save_channel(self, channel: Channel, state: dict) -> None:
        """Kept on this node only: the partition's leader sends its own."""

    async def push_channel(self, channel: Channel) -> None:
        raise PartitionNotWritable(f"partition {channel.partition} is not led here: "
                                   f"{self.reason}")


STARTING = NotLed("its replication is starting", starting=True)


class Partition:
    def __init__(self, topic: "Topic", number: int, queue: DiskQueue, floor: tuple[int, int]):
        self.topic = topic
        self.number = number
        self.queue = queue
        self._floor = floor  # (offset, count) where a first channel would start
        self.channels: dict[str, Channel] = {}
        # What takes the partition's publishes and channel states, as its mode says:
        # `append` (DiskQueue.append's arguments and answers), `writable` and `reason`,
        # `save_channel(channel, state)` (a checkpoint stored here: replicas get it soon),
        # `await push_channel(channel)` (replicas hold the channel's state now). Solo when
        # not replicated; else the writer of its replication while it leads here (set by
        # nsqd/replication.py), STARTING until then.
        # Any: any writer (Solo, NotLed, replication's _Led, a test's stand-in); a compiled
        # attribute would check a union of the classes named here
        self.writer: Any = STARTING if queue.options.replicated else Solo(queue)
        # The idempotent producers' sequences (producers.py): read from the log's tail on
        # the first request that names a producer, then kept as requests are written.
        self.producers: ProducerTable | None = None
        self._producers_loading: asyncio.Future | None = None
        self._finding: asyncio.Task | None = None  # what UNKNOWN requests became
        self._unknown_since = 0  # the log's written end before the first UNKNOWN request
        # Its half messages (halves.py): read back from the log's tail at `start`.
        def writer() -> Any:  # the writer of the moment: replication gives it another
            return self.writer  # (a compiled lambda would check the type __init__ gave)

        self.halves = Halves(queue, topic.name, writer, check_back,
                             check_after_s=topic.half_check[0], max_checks=topic.half_check[1])

    @property
    def writable(self) -> bool:
        return self.writer.writable

    def append_named(self, producer: tuple[str, int], bodies: list[bytes], trace_id: int = 0,
                     ext: bytes = b"", *, trace_ids=None, exts=None, callback=None):
        """The writer's `append` (DiskQueue.append's arguments and answers) for an idempotent
        producer's request, `producer` (id, sequence): written once, answered as
        producers.py says. Raises BadSequence, NotCommitted when a try's outcome is not
        known yet, ProducersLoading before the table is read (`load_producers`)."""
        table = self.producers
        if table is None:
            raise ProducersLoading(self)
        now = time.time()
        found = table.check(*producer, now)
        if found is WRITE:  # its first record stores its name (producers.py)
            fut = asyncio.get_running_loop().create_future() if callback is None else None
            waiters = [fut if callback is None else callback]
            written = functools.partial(self._producer_written, producer, waiters,
                                        self.queue.written_end)
            if exts is not None:
                self.writer.append(bodies, callback=written, trace_ids=trace_ids,
                                   exts=(marked(exts[0], producer), *exts[1:]))
            elif len(bodies) == 1:
                self.writer.append(bodies, trace_id, marked(ext, producer), callback=written)
            else:
                self.writer.append(bodies, callback=written,
                                   trace_ids=(trace_id,) * len(bodies),
                                   exts=(marked(ext, producer),) + (ext,) * (len(bodies) - 1))
            table.begin(*producer, now, waiters)
            return fut
        if found is UNKNOWN:
            raise NotCommitted(f"sequence {producer[1]} of producer {producer[0]} was written "
                               "and its outcome is not known yet: it may still be delivered")
        fut = asyncio.get_running_loop().create_future() if callback is None else None
        waiter = fut if callback is None else callback
        if isinstance(found, list):  # in flight: answered with it
            found.append(waiter)
        else:
            asyncio.get_running_loop().call_soon(settle, waiter, found, None)
        return fut

    def _producer_written(self, producer, waiters: list, since: int, appended, exc) -> None:
        maybe_stored = isinstance(exc, NotCommitted) and not getattr(exc, "unwritten", False)
        self.producers.settle(*producer, waiters, appended, maybe_stored)  # type: ignore[call-arg]
        settle(waiters[0], appended, exc)
        if len(waiters) > 1:  # retries that came while it was in flight
            again = appended._replace(duplicate=True) if appended is not None else None
            for waiter in waiters[1:]:
                settle(waiter, again, exc)
        if maybe_stored:
            self._unknown_since = min(self._unknown_since, since) if self._finding else since
            if self._finding is None:
                self._finding = asyncio.get_running_loop().create_task(self._find_unknown())

    async def load_producers(self) -> None:
        """Read the producer table from the log's tail (SCAN_BYTES, SCAN_SECONDS), once;
        every caller waits for the one read (a failed read is tried again by the next)."""
        if self.producers is not None:
            return
        if self._producers_loading is None:
            self._producers_loading = asyncio.ensure_future(self._read_producers())
        loading = self._producers_loading
        try:
            await asyncio.shield(loading)
        finally:
            if loading.done() and loading.exception() is not None:
                self._producers_loading = None

    async def _read_producers(self) -> None:
        q = self.queue
        table = ProducerTable()
        committed = q.committed_end
        since = None
        for entry, ext in await q.marked_requests(q.written_end - SCAN_BYTES, MARKER,
                                                  SCAN_SECONDS * 1_000_000_000,
                                                  SCAN_REQUESTS):
            mark = mark_of(ext)
            if mark is None:
                continue
            if entry.end_offset <= committed:
                table.replayed(*mark, _answer_of(entry), entry.timestamp / 1e9)
            else:  # a new leader's tail, not committed yet: answered once it is
                table.replayed(*mark, UNKNOWN, entry.timestamp / 1e9)
                since = entry.offset if since is None else since
        self.producers = table
        if since is not None:
            self._unknown_since = since
            self._finding = asyncio.get_running_loop().create_task(self._find_unknown())

    async def _find_unknown(self) -> None:
        """What UNKNOWN requests became: each found committed in the log is answered from
        it from then on. Looked for every FIND_EVERY while any is UNKNOWN, at most
        FIND_TRIES times; one never found stays UNKNOWN until the partition opens again."""
        try:
            for _ in range(FIND_TRIES):
                await asyncio.sleep(FIND_EVERY)
                q, table = self.queue, self.producers
                if q.closed or q.failed is not None:
                    return
                committed = q.committed_end
                for entry, ext in await q.marked_requests(self._unknown_since, MARKER):
                    mark = mark_of(ext)
                    if entry.end_offset > committed:
                        break
                    if mark is not None:
                        table.replayed(*mark, _answer_of(entry), entry.timestamp / 1e9)
                if not table.unknown():
                    return
        except Exception as e:  # a read that failed: the partition opens again to find out
            log.warning("producers_unknown_unresolved", topic=self.topic.name,
                        partition=self.number, error=f"{type(e).__name__}: {e}")
        finally:
            self._finding = None

    @property
    def floor(self) -> tuple[int, int]:
        q = self.queue
        if self._floor[0] < q.start_offset:
            self._floor = (q.start_offset, q.start_count)
        return self._floor

    def add_channel(self, name: str, state: dict | None, start: tuple[int, int] | None = None,
                    **settings) -> Channel:
        """Open a channel: from its stored state, or as a new one (see the module invariants;
        `start`: (offset, count) where a new channel that is not the first one starts, the
        end when None). `settings` are Channel's keyword options; its delay store is in
        `delay_folder`."""
        if state is None:
            q = self.queue
            if not self.channels:
                offset, count = self.floor
            else:
                offset, count = max(start or (q.committed_end, q.committed_count), self.floor)
            state = {"confirmed": offset, "confirmed_count": count, "paused": False}
        else:
            state = opening_state(state, self.topic.name, self.number, name)
        channel = Channel(self.topic, name, self.queue, state["confirmed"],
                          state["confirmed_count"], paused=state.get("paused", False),
                          delay_path=delay_folder(self.queue.path, name),
                          delay_expected=state.get("delay_store", False),
                          saved=self._saved_window(name, state),
                          ordered=state.get("ordered", False) or self.topic.assignment.ordered,
                          held=state.get("held"), max_attempts=state.get("max_attempts", 0),
                          dead_from=state.get("dead_from"), **settings)
        if self.topic.tracer is not None:  # nsqd/tracing.py
            channel.trace = self.topic.tracer.for_channel(self.topic.name, name)
        self.channels[name] = channel
        channel.start()
        return channel

    def _saved_window(self, name: str, state: dict) -> SavedWindow | None:
        """The window a checkpoint saved; a damaged one is dropped (only duplicates follow)."""
        try:
            return SavedWindow.from_state(state)
        except ValueError as e:
            log.warning("saved_window_dropped", topic=self.topic.name, partition=self.number,
                        channel=name, reason=str(e))
            return None

    def start(self) -> None:
        self.halves.start()

    async def close(self) -> None:
        """Close the half messages and the channels, then the log. What fails is logged,
        never raised: the node is stopping, or the partition is about to be opened again."""
        await self.halves.close()
        for c in list(self.channels.values()):
            try:
                await c.close()
            except Exception as e:
                log.error("channel_close_failed", topic=self.topic.name, partition=self.number,
                          channel=c.name, error=f"{type(e).__name__}: {e}")
        try:
            await self.queue.close()
        except Exception as e:
            log.error("partition_close_failed", topic=self.topic.name, partition=self.number,
                      error=f"{type(e).__name__}: {e}")

    async def remove_channel(self, name: str) -> str:
        """Close a channel and forget it; return its delay store folder, which the caller
        buries (see bury) once the partition's new floor is stored."""
        channel = self.channels.pop(name)
        await channel.close()
        if not self.channels:
            self._floor = (self.queue.committed_end, self.queue.committed_count)
        return delay_folder(self.queue.path, name)

    async def empty(self) -> None:
        """Classic topic empty: drop what the partition holds for channels that do not exist
        yet (the backlog a first channel would start at, and its segments). Messages that
        channels already have are theirs: emptying a channel is a channel operation."""
        if self.channels:
            return
        await self.queue.empty()
        self._floor = (self.queue.start_offset, self.queue.start_count)

    def retention_floor(self) -> int:
        """Where retention may drop the log up to: what every channel has confirmed (or
        the floor, without one), and never past an undecided half message."""
        floor = (min(c.kept_from for c in self.channels.values()) if self.channels
                 else self.floor[0])
        halves_from = self.halves.kept_from()
        return floor if halves_from is None else min(floor, halves_from)

    def depth(self) -> int:
        """Messages the emptiest channel has not read (classic nsqd reports the topic's own
        buffer; with cursors that is what the slowest channel still lacks)."""
        q = self.queue
        if not self.channels:
            return q.committed_count - self.floor[1]
        return min(c.backend_depth for c in self.channels.values())


class Topic:
    def __init__(self, name: str, path: str, queue_options: QueueOptions):
        self.name = name
        self.path = path
        self.ephemeral = name.endswith("#ephemeral")
        self.queue_options = queue_options
        self.paused = False
        self.sync: tuple[int, int] | None = None  # its own (sync_every, sync_timeout_ms)
        self.retention_ms: int | None = None  # its own history kept (min age), else the node's
        # (seconds before a half message's first check-back, check-backs before a rollback)
        self.half_check = (CHECK_AFTER_S, MAX_CHECKS)
        self.partitions: dict[int, Partition] = {}
        self.failed: dict[int, str] = {}  # partitions held here that did not open: why
        # Stored floors of partitions not open: failed ones, and ones no longer led here
        # (their data stays on disk, and serves again from there when led again).
        self._floors: dict[int, tuple[int, int]] = {}
        self.assignment = Assignment.single()
        self._state: tuple[tuple, dict] | None = None  # (what `state` was made of, the state)
        self.writable: dict[int, Partition] = {}  # open and led: what takes publishes
        self._spread: tuple[Partition, ...] = ()  # writable, in order: round-robin
        self._next = 0
        self.message_count = 0  # messages published through this node since start
        self.message_bytes = 0
        self.tracer: Any = None  # the node's Tracer (nsqd/tracing.py), which sets `trace`
        self.trace: Any = None  # that Tracer while this topic's PUB events are on

    async def open(self, partitions: list[int], floors: dict[str, list[int]],
                   create: bool = False, at_once: asyncio.Semaphore | None = None) -> None:
        """Open the partitions, as many at a time as `at_once` lets (one by one without
        it; a node's start shares one among its topics); one that fails goes to `failed`
        (never raises for a partition's fault). `create`: a new topic, whose folders may be
        made; a stored partition's folder must exist (a missing one is a fault, not a new
        empty log; the topic's folder is listed once for them all). `self.partitions` ends
        in number order, whatever order they opened in."""
        at_once = at_once or asyncio.Semaphore(1)
        listed = None if create else await asyncio.to_thread(_folders, self.path)

        async def one(number: int) -> None:
            floor = floors.get(str(number))
            async with at_once:
                await self._open_partition(number, cast(tuple[int, int], tuple(floor))
                                           if floor else None, create,
                                           listed)

        await asyncio.gather(*(one(number) for number in partitions))
        self.partitions = {n: self.partitions[n] for n in sorted(self.partitions)}
        self._refresh()

    async def open_partition(self, number: int, floor: tuple[int, int] | None,
                             create: bool = False) -> str | None:
        """Open one partition (again): None when it serves, else the reason (in `failed`)."""
        reason = await self._open_partition(number, floor, create)
        if reason is None:
            self._refresh()
        return reason

    async def _open_partition(self, number: int, floor: tuple[int, int] | None,
                              create: bool, listed: set[str] | None = None) -> str | None:
        """`open_partition` but for `writable`, which the caller refreshes. `listed`: the
        folders in the topic's folder, when the caller listed them (else looked up here)."""
        path = os.path.join(self.path, str(number))
        opts = dataclasses.replace(self.queue_options, partition=number)
        try:
            if not create and not (str(number) in listed if listed is not None
                                   else await asyncio.to_thread(os.path.isdir, path)):
                raise FileNotFoundError(f"{path}: the partition's folder is missing")
            queue = await DiskQueue.open(path, opts)
        except Exception as e:  # whatever it is, it stays inside this partition
            reason = f"open failed: {type(e).__name__}: {e}"
            self.failed[number] = reason
            if floor is not None:
                self._floors[number] = floor
            log.error("partition_open_failed", topic=self.name, partition=number,
                      error=reason)
            return reason
        self.failed.pop(number, None)
        floor = floor or self._floors.pop(number, None) or (queue.start_offset,
                                                            queue.start_count)
        self._floors.pop(number, None)
        self.partitions[number] = part = Partition(self, number, queue,
                                                   cast(tuple[int, int], tuple(floor)))
        part.start()
        return None

    def known_floor(self, number: int) -> bool:
        """Whether this node ever opened the partition (its floor is stored)."""
        return number in self._floors or number in self.partitions

    async def close_partition(self, number: int, reason: str) -> None:
        """Take a partition out of service (it refuses publishes as `failed` with `reason`),
        then close its channels and its log. What fails in closing is logged, not raised:
        the partition is about to be opened again, or the node is stopping."""
        p = self.partitions.pop(number, None)
        if p is None:
            return
        self.failed[number] = reason
        self._floors[number] = p._floor
        self._refresh()
        await p.close()

    async def release_partition(self, number: int) -> Partition | None:
        """Stop serving a partition no longer led here: out of `partitions` at once (no
        publish reaches it), then its channels and log closed, pending appends written
        first. Its data and floor are kept. Returns it (its channels' final cursors are
        for the caller to store), or None when it was not open."""
        self.failed.pop(number, None)
        p = self.partitions.pop(number, None)
        if p is None:
            return None
        self._floors[number] = p._floor
        self._refresh()
        await p.close()
        return p

    def set_assignment(self, assignment: Assignment) -> None:
        """From now on, publishes go to the open partitions `assignment` leads."""
        self.assignment = assignment
        self._refresh()

    def _refresh(self) -> None:
        leading = self.assignment.leading
        self.writable = {n: self.partitions[n] for n in sorted(self.partitions) if n in leading}
        self._spread = tuple(self.writable.values())

    def check_partition(self, number: int) -> None:
        """Raise why `number` takes no publish or SUB here (see the module docstring);
        return when it is writable."""
        if number in self.writable:
            return
        if not self.assignment.in_range(number):
            raise PartitionNotFound(number)
        if number not in self.assignment.leading:
            raise PartitionNotLed(number)
        reason = self.failed.get(number, "it is being opened")
        raise StorageError(f"topic {self.name} partition {number} does not serve: {reason}")

    def errors(self) -> dict[int, str]:
        """Partitions that do not serve, and why: failed to open, or their log failed."""
        out = dict(self.failed)
        for number, p in self.partitions.items():
            if p.queue.failed is not None:
                out[number] = str(p.queue.failed)
        return out

    def state(self) -> dict:
        """The topic's stored state (nsqd/metastore.py). Made again only when what it is made
        of changed: NSQD.checkpoint asks every second, and at 10,000 idle partitions making
        it was half of the node's idle CPU. The dict returned is never changed afterwards."""
        made_of = (self.paused, self.sync, self.retention_ms, self.assignment, tuple(self.failed),
                   tuple(self._floors.items()), tuple(self.partitions),
                   tuple(map(_FLOOR_OF, self.partitions.values())))
        if self._state is None or self._state[0] != made_of:
            self._state = (made_of, self._make_state())
        return self._state[1]

    def _make_state(self) -> dict:
        floors = {str(n): list(f) for n, f in self._floors.items()}
        floors.update({str(n): list(p._floor) for n, p in self.partitions.items()})
        state = {"partitions": sorted({*self.partitions, *self.failed}), "paused": self.paused,
                 "floors": floors, "assignment": self.assignment.state()}
        if self.sync is not None:
            state["sync"] = list(self.sync)
        if self.retention_ms is not None:
            state["retention_ms"] = self.retention_ms
        return state

    def set_sync(self, sync: tuple[int, int]) -> None:
        """Give the topic its own sync policy (messages per sync, ms), from now on."""
        self.sync = sync
        self.queue_options = dataclasses.replace(self.queue_options, sync=sync_policy(*sync))
        for p in self.partitions.values():
            p.queue.set_sync(sync_policy(*sync))

    async def close(self) -> None:
        """Close every partition, each as far as it can (Partition.close); they stay in
        `partitions`, so a last checkpoint saves their channels' final cursors."""
        for p in list(self.partitions.values()):
            await p.close()

    async def close_and_bury(self) -> str | None:
        """Close, then bury the topic's folder (see bury); return the tombstone."""
        await self.close()
        return await asyncio.to_thread(bury, self.path)

    def publish(self, bodies: list[bytes], partition: int | None = None, ext: bytes = b"", *,
                trace_id: int = 0, trace_ids=None, exts=None, callback=None, source: str = "",
                producer: tuple[str, int] | None = None):
        """One write request (every TCP publish, HTTP /pub and /mpub) to a partition's log,
        written whole or not at all (DiskQueue.append's arguments). `partition` None: the
        next writable partition, round-robin (one request stays whole in one partition).
        Raises what `check_partition` raises, or what DiskQueue.append raises, at once.
        Without `callback`, returns an awaitable
        that ends (and counts the messages) once the log acknowledged the request; with one,
        the log calls `callback(appended, error)` and the caller counts them
        (`count_published`) when it answers: TCP's path, with no task per publish.
        `source`: the publisher's address, for the PUB trace events (nsqd/tracing.py) of a
        publish without `callback`; a caller with one records them itself when it is called
        (`Tracer.published`). `producer`: an idempotent producer's (id, sequence), written
        once (Partition.append_named); without a partition it goes to its producer id's
        (nsqwire.partitioning, as a key's); with `callback`, ProducersLoading says what to
        await first."""
        if partition is None and producer is not None:  # its retries land where it did
            partition = partition_of(producer[0], self.assignment.partition_num)
        part: Partition | None  # None: check_partition raises why
        if partition is None:
            if self.assignment.ordered:  # a key's order needs its partition named
                raise PartitionNotFound(None)
            spread = self._spread
            if not spread:
                self._refuse_any()
            part = spread[self._next % len(spread)]
            self._next += 1
            if not part.writable:
                part = self._writable_after(part)
        else:
            part = self.writable.get(partition)
            if part is None:
                self.check_partition(partition)
            if not part.writable:
                raise PartitionNotWritable(f"topic {self.name} partition {partition} is not "
                                           f"writable: {part.writer.reason}")
        if producer is not None:
            if callback is not None:
                return part.append_named(producer, bodies, trace_id, ext, trace_ids=trace_ids,
                                         exts=exts, callback=callback)
            return self._named(cast(Partition, part), producer, bodies, trace_id, ext, trace_ids,
                               exts, source)
        appended = part.writer.append(bodies, trace_id, ext, callback=callback,
                                      trace_ids=trace_ids, exts=exts)
        if callback is None:
            return self._counted(appended, bodies, trace_id, trace_ids, source)

    async def _named(self, part: Partition, producer, bodies, trace_id, ext, trace_ids, exts,
                     source) -> None:
        """`publish` of a named request without `callback`: its partition's producer table
        read first when it is not yet."""
        if part.producers is None:
            await part.load_producers()
            if not part.writable:
                raise PartitionNotWritable(f"topic {self.name} partition {part.number} is not "
                                           f"writable: {part.writer.reason}")
        appended = part.append_named(producer, bodies, trace_id, ext, trace_ids=trace_ids,
                                     exts=exts)
        await self._counted(appended, bodies, trace_id, trace_ids, source)

    def starting(self, partition: int | None) -> bool:
        """Whether a publish to `partition` (None: any) finds no writable partition only
        because a leadership here is starting (its writer not in place, or its epoch being
        taken): worth waiting for."""
        if partition is not None:
            p = self.writable.get(partition)
            return p is not None and not p.writable and p.writer.starting
        return (not any(p.writable for p in self._spread)
                and any(p.writer.starting for p in self._spread))

    def _writable_after(self, refused: Partition) -> Partition:
        """A publish without a partition whose round-robin pick is not writable: the next
        writable one, or PartitionNotWritable naming the first pick's reason."""
        for part in self._spread:
            if part.writable:
                return part
        raise PartitionNotWritable(f"topic {self.name}: no partition led here is writable "
                                   f"(partition {refused.number}: {refused.writer.reason})")

    def _refuse_any(self) -> None:
        """Why a publish without a partition finds no writable partition."""
        for number in sorted(self.assignment.leading):
            self.check_partition(number)  # a led partition that does not serve says why
        raise PartitionNotLed(None)

    async def _counted(self, appended, bodies: list[bytes], trace_id: int, trace_ids,
                       source: str) -> None:
        appended = await appended
        if appended.duplicate:  # written before: nothing new to trace or count
            return
        if self.trace is not None:
            self.trace.published(self, appended, trace_id, trace_ids, source)
        self.count_published(bodies)

    def count_published(self, bodies: list[bytes]) -> None:
        self.message_count += len(bodies)
        self.message_bytes += sum(map(len, bodies))

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        for c in self.channels():
            c.wake()

    async def empty(self) -> None:
        """See Partition.empty."""
        for p in self.partitions.values():
            await p.empty()

    def partition(self, number: int | None) -> Partition | None:
        return self.partitions.get(0 if number is None else number)

    def channels(self):
        for p in self.partitions.values():
            yield from p.channels.values()

    def depth(self) -> int:
        return sum(p.depth() for p in self.partitions.values())
