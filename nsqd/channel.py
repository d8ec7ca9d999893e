"""Channel: a cursor over one partition's log and the clients that consume it.

A channel copies nothing: it reads the partition's segments through its own
Reader. It owns its cursor (what is confirmed, what is read next), the
messages taken from the log and not yet finished (in flight at a client,
requeued for immediate redelivery, or deferred until a due time), the
delivery loop that hands messages to clients by their RDY, and timeouts.

Invariants:
- every message read from the log is in exactly one place until it is
  finished: a client's in-flight table, `requeued`, or `deferred`;
- `confirmed` only moves over finished messages, so after a crash the channel
  restarts at `confirmed` and redelivers, never skips (at-least-once);
- at most `max_window` messages are taken and unconfirmed: a stuck message
  stops fresh reads, it never grows memory without bound.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import deque

import structlog

from diskqueue.queue import DiskQueue
from diskqueue.record import CorruptRecordError
from diskqueue.segments import MissingSegmentError

from .cursor import Cursor

log = structlog.get_logger("nsqd.channel")

SEQUENCE_MASK = (1 << 50) - 1
DEFER_KEY = "##defer_until_ms"


class Message:
    """A message taken from the log, with its delivery state; also its own cursor Slot
    (offset, end, count, done), so taking a message costs one object."""

    __slots__ = ("offset", "end", "count", "done", "msg_id", "timestamp", "attempts", "body",
                 "ext", "deadline", "client", "first_delivered")

    def __init__(self, rec):
        self.offset = rec.offset
        self.end = rec.offset + rec.size
        self.count = rec.msg_id & SEQUENCE_MASK
        self.done = False
        self.msg_id = rec.msg_id
        self.timestamp = rec.timestamp
        self.attempts = rec.attempts
        self.body = rec.body
        self.ext = rec.ext
        self.deadline = 0.0
        self.client = None
        self.first_delivered = 0.0


def defer_ext(defer_ms: int) -> bytes:
    """The ext header of a deferred publish (DPUB, HTTP /pub?defer=): due now + defer_ms."""
    if not defer_ms:
        return b""
    return json.dumps({DEFER_KEY: int(time.time() * 1000) + defer_ms}).encode()


def defer_until_ms(ext: bytes) -> int:
    """The due time (unix ms) a DPUB stored in the record's ext header, or 0."""
    try:
        return int(json.loads(ext).get(DEFER_KEY, 0))
    except (ValueError, AttributeError, TypeError):
        return 0


class Channel:
    def __init__(self, topic, name: str, queue: DiskQueue, confirmed: int,
                 confirmed_count: int, *, paused: bool = False,
                 max_window: int = 100_000, read_batch: int = 1024):
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.partition = queue.partition
        self.queue = queue
        self.ephemeral = name.endswith("#ephemeral")
        self.paused = paused
        self.max_window = max_window
        self.read_batch = read_batch
        self.cursor = Cursor(confirmed, confirmed_count)
        self._reader = queue.reader(confirmed)
        self.clients: list = []
        self.requeued: deque[Message] = deque()
        self.deferred: list[tuple[float, int, Message]] = []  # (due monotonic, msg_id, msg)
        self._rr = 0
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None
        self.error: str | None = None
        self.message_count = 0  # deliveries of fresh messages
        self.opened_count = confirmed_count  # history count at open: /stats message_count base
        self.requeue_count = 0
        self.timeout_count = 0
        self.finish_count = 0
        self.dirty = True  # cursor changed since the last checkpoint

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())
        self.queue.commit_listeners.append(self.wake)

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self.wake in self.queue.commit_listeners:
            self.queue.commit_listeners.remove(self.wake)
        if self._task is not None:
            await self._task
        self._reader.close()

    def wake(self) -> None:
        self._wake.set()

    def checkpoint(self) -> dict:
        self.dirty = False
        return {"confirmed": self.cursor.confirmed, "confirmed_count": self.cursor.confirmed_count,
                "paused": self.paused}

    # ---- clients ---------------------------------------------------------

    def add_client(self, client) -> None:
        self.clients.append(client)
        self._wake.set()

    def remove_client(self, client) -> None:
        """Detach a client; its in-flight messages are requeued at once."""
        if client in self.clients:
            self.clients.remove(client)
        self._requeue_all(list(client.in_flight.values()))
        client.in_flight.clear()

    # ---- delivery --------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                await self._deliver_ready()
            except MissingSegmentError:
                q = self.queue
                log.warning("retention_passed_cursor", topic=self.topic_name,
                            partition=self.partition, channel=self.name,
                            confirmed=self.cursor.confirmed, start_offset=q.start_offset)
                self.seek(q.start_offset, q.start_count)
            except CorruptRecordError as e:
                self.error = str(e)
                log.error("corrupt_record", topic=self.topic_name, partition=self.partition,
                          channel=self.name, offset=e.offset, where=e.where)
                await asyncio.sleep(5)
                self._wake.set()

    async def _deliver_ready(self) -> None:
        while not self.paused and not self.topic.paused and not self._closed:
            capacity = 0
            for c in self.clients:
                room = c.ready_count - len(c.in_flight)
                if room > 0 and c.writable:
                    capacity += room
            if not capacity:
                return
            msgs = []
            requeued = self.requeued
            while requeued and len(msgs) < capacity:
                msgs.append(requeued.popleft())
            room = min(capacity - len(msgs), self.max_window - self.cursor.window_size,
                       self.read_batch)
            if room > 0:
                self.error = None
                take = self.cursor.take
                for rec in await self._reader.read(room):
                    msg = Message(rec)
                    take(msg)
                    if rec.ext and self._defer_if_due_later(msg):
                        continue
                    msgs.append(msg)
                self.dirty = True
            if not msgs:
                return
            self._distribute(msgs)

    def _defer_if_due_later(self, msg: Message) -> bool:
        due_ms = defer_until_ms(msg.ext)
        wait = due_ms / 1000 - time.time()
        if due_ms and wait > 0:
            heapq.heappush(self.deferred, (time.monotonic() + wait, msg.msg_id, msg))
            return True
        return False

    def _distribute(self, msgs: list[Message]) -> None:
        """Hand messages to clients in turn, each up to its free RDY; keep the rest requeued."""
        now = time.monotonic()
        clients = self.clients
        n = len(clients)
        i = 0
        fresh = 0
        for k in range(n):
            if i >= len(msgs):
                break
            client = clients[(self._rr + k) % n]
            room = client.ready_count - len(client.in_flight)
            if room <= 0 or not client.writable:
                continue
            chunk = msgs[i:i + room]
            i += len(chunk)
            for m in chunk:
                if m.attempts == 0:
                    fresh += 1
            client.deliver(self, chunk, now)
        self._rr = (self._rr + 1) % max(n, 1)
        self.message_count += fresh
        if i < len(msgs):
            self.requeued.extendleft(reversed(msgs[i:]))

    # ---- acknowledgements ------------------------------------------------

    def finish(self, msg: Message) -> None:
        """A message is done (FIN, or skipped by sampling)."""
        self.cursor.finish(msg)
        self.finish_count += 1
        self.dirty = True
        self._wake.set()

    def finish_many(self, msgs: list[Message]) -> None:
        finish = self.cursor.finish
        for msg in msgs:
            finish(msg)
        self.finish_count += len(msgs)
        self.dirty = True
        self._wake.set()

    def requeue(self, msg: Message, delay_ms: int) -> None:
        """Put a message back: at once, or after `delay_ms`."""
        self.requeue_count += 1
        msg.client = None
        if delay_ms > 0:
            heapq.heappush(self.deferred, (time.monotonic() + delay_ms / 1000, msg.msg_id, msg))
        else:
            self.requeued.append(msg)
            self._wake.set()

    def _requeue_all(self, msgs: list[Message]) -> None:
        for m in msgs:
            self.requeue(m, 0)

    def process_timeouts(self, now: float) -> int:
        """Requeue expired in-flight messages and release due deferred ones; return how many."""
        moved = 0
        for client in self.clients:
            expired = []
            for m in client.in_flight.values():
                if m.deadline > now:
                    break
                expired.append(m)
            for m in expired:
                del client.in_flight[m.msg_id]
                self.timeout_count += 1
                self.requeue(m, 0)
            moved += len(expired)
        deferred = self.deferred
        while deferred and deferred[0][0] <= now:
            self.requeued.append(heapq.heappop(deferred)[2])
            moved += 1
        if moved:
            self._wake.set()
        return moved

    # ---- operations ------------------------------------------------------

    def pause(self) -> None:
        self.paused = True
        self.dirty = True

    def unpause(self) -> None:
        self.paused = False
        self.dirty = True
        self._wake.set()

    def empty(self) -> None:
        """Drop every message of the channel: backlog, requeued, deferred and in flight."""
        for client in self.clients:
            client.in_flight.clear()
        self.requeued.clear()
        self.deferred.clear()
        self.cursor.reset(self.queue.committed_end, self.queue.committed_count)
        self._reader.seek(self.queue.committed_end)
        self.dirty = True

    def seek(self, offset: int, count: int) -> None:
        """Move the cursor (replay or skip); what was taken is forgotten."""
        self.empty()
        self.cursor.reset(offset, count)
        self._reader.seek(offset)
        self._wake.set()

    # ---- stats -----------------------------------------------------------

    @property
    def depth(self) -> int:
        return self.queue.committed_count - self.cursor.next_count + len(self.requeued)

    @property
    def in_flight_count(self) -> int:
        return sum(len(c.in_flight) for c in self.clients)
