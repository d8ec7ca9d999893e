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
- a checkpoint also saves the finished ranges beyond `confirmed` and the attempts of
  unfinished messages (see `checkpoint`): after a crash, reading skips the saved ranges
  and a message comes back with its attempts carried on;
- at most `max_window` messages are taken and unconfirmed: a stuck message
  stops fresh reads, it never grows memory without bound;
- with `max_attempts`, a message delivered that many times is never delivered again: it
  is buried (deadletters.py), and stays unfinished (`burying`) until its dead copy is
  committed; `##dead` records are skipped, but for the revived copies addressed here.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from operator import itemgetter

import structlog

from diskqueue.queue import DiskQueue
from diskqueue.record import CorruptRecordError
from diskqueue.segments import MissingSegmentError
from nsqwire.ext import DEAD_MARKER, HALF_MARKER
from nsqwire.ids import PARTITION_SHIFT

from . import tags
from .cursor import MAX_SAVED_RANGES, Cursor, SavedWindow, joined_ranges, pack_u64
from . import deadletters, halves
from .deadletters import DeadLetters
from .delaying import ChannelDelay
from .handover import take_over
from .message import Message, defer_until_ms
from .ordered import OrderedDispatch
from .timeouts import TimeoutScan

log = structlog.get_logger("nsqd.channel")

MAX_SAVED_ATTEMPTS = 4096  # attempts of unfinished messages a checkpoint keeps (the highest)
BURY_RETRY_MS = 1000  # a message whose dead copy was refused waits this long to be buried


class Channel:
    def __init__(self, topic, name: str, queue: DiskQueue, confirmed: int,
                 confirmed_count: int, *, paused: bool = False,
                 max_window: int = 100_000, read_batch: int = 1024,
                 delay_path: str | None = None, delay_threshold_ms: int = 60_000,
                 max_attempts_in_memory: int = 10, clock=time.time, delay_expected: bool = False,
                 saved: SavedWindow | None = None, ordered: bool = False, confirm_fin=None,
                 held: bytes | None = None, max_attempts: int = 0,
                 dead_from: int | None = None, timeouts: TimeoutScan | None = None,
                 changed: set | None = None):
        self.topic = topic
        self.topic_name = topic.name
        self.name = name
        self.partition = queue.partition
        self.queue = queue
        self.ephemeral = name.endswith("#ephemeral")
        self.paused = paused
        self.max_window = max_window
        self.read_batch = read_batch
        self.cursor = Cursor(confirmed, confirmed_count, saved.ahead if saved else None)
        self.saved = saved  # until reading passes its `next_read`
        self.held = held  # the old leader's held messages, until put back (handover.py)
        self.put_back: dict[int, Message] = {}  # offset -> log message requeued or deferred
        self._saved_finished = (-1, b"")  # (cursor.changes, encoded ranges) of the last save
        self._reader = queue.reader(confirmed)
        self.clients: list = []
        self.requeued: deque[Message] = deque()
        self.from_delay: deque[Message] = deque()  # due messages brought back from the store
        self.deferred: list[tuple[float, int, Message]] = []  # (due clock time, msg_id, msg)
        self.clock = clock
        self.timeouts = timeouts  # the node's scan, visiting the channel while `timing`
        self.delay_threshold_ms = delay_threshold_ms
        self.max_attempts_in_memory = max_attempts_in_memory
        self.delay = (ChannelDelay(delay_path, self._stored, self._given_back,
                                   expected=delay_expected, on_waiting=self.watch_timeouts)
                      if delay_path else None)
        self._rr = 0
        self._undeferred_at = -1  # offset of a record known not to be a deferred publish
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None
        self.error: str | None = None
        self.message_count = 0  # deliveries of fresh messages
        self.opened_count = confirmed_count  # history count at open: /stats message_count base
        self.requeue_count = 0
        self.timeout_count = 0
        self.finish_count = 0
        self.filtered_count = 0  # auto-finished: no consumer's ext_filter took them (tags.py)
        self.router: tags.Router | None = None  # while a client has a desired_tag or ext_filter
        self.changed = changed  # the node's channels changed since its last checkpoint
        self.dirty = True
        self.seeks = 0  # moves of the cursor (seek) so far
        self.trace = None  # the node's Tracer while this channel's events are on (tracing.py)
        self.confirm_fin = confirm_fin  # ordered, replicated: awaited after a FIN (ordered.py)
        self.ordered: OrderedDispatch | None = None
        if ordered:
            self.set_ordered(True)
        self.max_attempts = max_attempts  # 0: never buried
        self.burying = 0  # messages whose dead copy is on its way
        # The dead letters, once the channel ever had `max_attempts` (deadletters.py).
        self.dead = (DeadLetters(self, dead_from, self._writer) if dead_from is not None
                     else None)

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())
        self.queue.commit_listeners.append(self.wake)
        if self.dead is not None:
            self.dead.start()

    def _writer(self):
        """The partition's writer (its `append`): how dead letters are written."""
        return self.topic.partitions[self.partition].writer

    def set_max_attempts(self, n: int) -> None:
        """Bury a message once it was delivered `n` times (0: never); saved with the next
        checkpoint. Dead letters already kept stay, whatever `n` becomes."""
        self.max_attempts = n
        if n and self.dead is None:  # none can be in the log before this point
            self.dead = DeadLetters(self, self.queue.written_end, self._writer)
        self.dirty = True
        self._wake.set()

    async def close(self) -> None:
        """Stop delivering; write what the delay store still has pending."""
        self._closed = True
        self._wake.set()
        if self.ordered is not None:
            self.ordered.close()
        if self.wake in self.queue.commit_listeners:
            self.queue.commit_listeners.remove(self.wake)
        if self.dead is not None:
            self.dead.close()
        if self._task is not None:
            await self._task
        self._reader.close()
        if self.delay is not None:
            await self.delay.close()

    def wake(self) -> None:
        self._wake.set()

    @property
    def dirty(self) -> bool:
        """The channel changed since its last checkpoint; while so, it is in `changed` (the
        node's checkpoint visits only those: NSQD.checkpoint)."""
        return self._dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._dirty = value
        if value and self.changed is not None:
            self.changed.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def set_ordered(self, on: bool) -> None:
        """Turn the ordered rule (ordered.py) on or off; saved with the next checkpoint."""
        if on == (self.ordered is not None):
            return
        if self.ordered is not None:
            self.ordered.close()
        self.ordered = OrderedDispatch(self, self.confirm_fin) if on else None
        self.dirty = True
        self._wake.set()

    def checkpoint(self) -> dict:
        """The state to store: the cursor (`confirmed`; `next_read`; `finished`, the first
        MAX_SAVED_RANGES finished ranges beyond `confirmed` as packed u64s, re-encoded only
        when they changed), `attempts` of unfinished messages not delivered exactly once
        (at most MAX_SAVED_ATTEMPTS, the highest), and the channel's flags. What a restart
        brought back and reading has not passed yet is saved again with it."""
        self.dirty = False
        d = self.delay
        c = self.cursor
        if c.ahead is not None and not c.window_size:
            c.take_finished()  # when it starts at `confirmed`, it is confirmed (reading skips it)
        ranges = c.ranges()
        saved = self.saved
        if saved is not None:
            finished = joined_ranges(ranges, c.ahead).encode(MAX_SAVED_RANGES)
            next_read = max(c.next_read, saved.next_read)
        else:
            if self._saved_finished[0] != c.changes:
                self._saved_finished = (c.changes, ranges.encode(MAX_SAVED_RANGES))
            finished, next_read = self._saved_finished[1], c.next_read
        return {"confirmed": c.confirmed, "confirmed_count": c.confirmed_count,
                "next_read": next_read, "finished": finished,
                "attempts": self._saved_attempts(), "paused": self.paused,
                "ordered": self.ordered is not None,
                "delay_store": d is not None and (d.store is not None or d.expected),
                **({"held": self.held} if self.held is not None else {}),
                **({"max_attempts": self.max_attempts, "dead_from": self.dead.saved_from()}
                   if self.dead is not None else {}),
                **self._halves_from()}

    def _halves_from(self) -> dict:
        """{"halves_from": the partition's first undecided half message}, while one waits:
        its replicas keep the log from there (halves.py)."""
        part = self.topic.partitions.get(self.partition)
        kept = part.halves.kept_from() if part is not None else None
        return {} if kept is None else {"halves_from": kept}

    def reopen_at(self, state: dict) -> None:
        """Start again from `state` (a checkpoint) before anything was delivered (handover)."""
        self.saved = saved = SavedWindow.from_state(state)
        self.cursor = Cursor(state["confirmed"], state["confirmed_count"],
                             saved.ahead if saved else None)
        self._saved_finished = (-1, b"")
        self._reader.seek(state["confirmed"])
        self.dirty = True

    def _saved_attempts(self) -> bytes:
        """Offsets, then attempts, of the unfinished log messages whose attempts are not 1:
        put back ones (REQ, timeout, disconnect), ones read but never delivered, and saved
        ones not read again yet. A message in flight that is not listed was delivered once."""
        put_back = self.put_back
        if any(m.done for m in put_back.values()):
            put_back = self.put_back = {o: m for o, m in put_back.items() if not m.done}
        saved = {o: m.attempts for o, m in put_back.items()}
        for m in (self.requeued if self.router is None
                  else (*self.requeued, *self.router.messages())):
            if m.attempts == 0 and not m.delayed:
                saved[m.offset] = 0
        if self.saved is not None:
            next_read = self.cursor.next_read
            saved.update((o, a) for o, a in self.saved.attempts.items() if o >= next_read)
        if not saved:
            return b""
        items = (sorted(saved.items()) if len(saved) <= MAX_SAVED_ATTEMPTS else
                 sorted(heapq.nlargest(MAX_SAVED_ATTEMPTS, saved.items(), key=itemgetter(1))))
        return pack_u64([o for o, _ in items]) + pack_u64([a for _, a in items])

    # ---- clients ---------------------------------------------------------

    def add_client(self, client) -> None:
        self.clients.append(client)
        self._reroute()
        self._wake.set()

    def remove_client(self, client) -> None:
        """Detach a client; its in-flight messages of this channel are requeued at once."""
        if client in self.clients:
            self.clients.remove(client)
        mine = client.in_flight_of(self.partition)
        if len(mine) == len(client.in_flight):
            client.in_flight.clear()
        else:
            for m in mine:
                del client.in_flight[m.wire_id]
        if mine and self.trace is not None:
            self.trace.given_back(self, mine)
        self._requeue_all(mine, "closed")
        self._reroute()

    def _reroute(self) -> None:
        """Clients changed: route by tags and filters while any client has one (tags.py);
        when none has any more, what the router held is requeued."""
        if tags.routed(self.clients):
            if self.router is None:
                self.router = tags.Router()
            self.router.regroup(self.clients)
        elif self.router is not None:
            self.requeued.extendleft(reversed(self.router.take_all()))
            self.router = None
            self._wake.set()

    # ---- delivery --------------------------------------------------------

    async def _pump(self) -> None:
        if self.held is not None:
            await take_over(self)  # the old leader's held messages into the store first
        elif self.delay is not None:
            await self.delay.open()
        self.dirty = True  # the checkpoint now records whether the channel has a store
        self._wake.set()  # deferred publishes at the head count as deferred from the start
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
            except Exception:  # a bug must stall one channel for a second, never for good
                log.exception("delivery_failed", topic=self.topic_name, partition=self.partition,
                              channel=self.name)
                await asyncio.sleep(1)
                self._wake.set()

    async def _deliver_ready(self) -> None:
        while not self.paused and not self.topic.paused and not self._closed:
            if self.router is not None and self.ordered is None:  # ordered: tags ignored
                return await self._deliver_routed(self.router)
            capacity = 0
            for c in self.clients:
                room = c.ready_count - len(c.in_flight)
                if c.channel is None:  # it consumes several partitions: its share
                    room = c.room_in(self, room)
                if room > 0 and c.writable:
                    capacity += room
            if self.ordered is not None:
                capacity = self.ordered.room(capacity)
                if not capacity:
                    return
            if not capacity:
                await self._hold_deferred_ahead()
                return
            msgs = []
            requeued = self.requeued
            while requeued and len(msgs) < capacity:
                msgs.append(requeued.popleft())
            from_delay = self.from_delay
            if from_delay:  # fair with fresh messages: at most half the room when both wait
                share = capacity - len(msgs)
                if self.queue.committed_end > self.cursor.next_read:
                    share = (share + 1) // 2
                while from_delay and share > 0:
                    msgs.append(from_delay.popleft())
                    share -= 1
            window_room = self.max_window - self.cursor.window_size
            if window_room <= 0:
                self._spill_deferred()
            room = min(capacity - len(msgs), window_room, self.read_batch)
            held = 0
            if room > 0:
                self.error = None
                seeks = self.seeks
                held = await self._take(await self._reader.read(room), msgs, seeks)
                if self.seeks != seeks:  # moved meanwhile (replay): what this pass holds is stale
                    self._drop_stale(msgs)
                    continue
            if msgs:
                self._distribute(msgs)
            elif not held:  # nothing to hand out, and nothing read that was kept back
                return

    async def _deliver_routed(self, router) -> None:
        """`_deliver_ready` while clients have tags or filters: each message goes only to a
        client that may take it (tags.py). Reading goes on while any client has room and the
        window allows, so messages waiting for a busy client never hold back the others."""
        while (router is self.router and not self.paused and not self.topic.paused
               and not self._closed):
            for waiting in (self.requeued, self.from_delay):
                if waiting:
                    router.add(self._bury_spent(waiting, "spent") if self.max_attempts
                               else waiting)
                    waiting.clear()
            tags.deliver_routed(self, router)
            room = sum(max(0, tags.room_of(self, c)) for c in self.clients)
            window_room = self.max_window - self.cursor.window_size
            if window_room <= 0:
                self._spill_deferred()
            if room <= 0:
                await self._hold_deferred_ahead()
                return
            if window_room <= 0:
                return
            self.error = None
            fresh: list[Message] = []
            seeks = self.seeks
            held = await self._take(await self._reader.read(min(room, window_room,
                                                                self.read_batch)), fresh, seeks)
            if self.seeks != seeks:  # moved meanwhile (replay): what this pass holds is stale
                self._drop_stale(fresh)
                continue
            if not fresh and not held:
                return
            router.add(self._bury_spent(fresh, "spent") if self.max_attempts else fresh)

    async def _take(self, records, out: list, seeks: int) -> int:
        """Take records read from the log: to `out` the ones to deliver now; the rest are
        held (deferred, or already in the delay store). Returns how many were held.
        `seeks`: the count when the read began; a move since then makes the records stale:
        none is taken, and the reader goes back to the cursor (the read may have carried it
        past the place the move set)."""
        held = 0
        delay = self.delay
        in_store = (await delay.holding(records)  # only after a restart, briefly
                    if delay is not None and records and self.seeks == seeks
                    and records[0].offset <= delay.max_origin else ())
        if self.seeks != seeks:  # moved meanwhile: the records are from before the move
            self._reader.seek(self.cursor.next_read)
            return 0
        cursor = self.cursor
        take = cursor.take
        saved = self.saved
        for rec in records:
            if saved is not None:  # after a restart: skip, or carry attempts on
                if rec.offset < cursor.next_read or (
                        cursor.ahead is not None and cursor.take_finished()):
                    held += 1  # in a finished range the checkpoint saved
                    continue
                msg = Message(rec)
                take(msg)
                if rec.ext and self._skipped(msg):
                    held += 1
                    continue
                if self._resume(msg, in_store):
                    held += 1
                else:
                    out.append(msg)
                continue
            msg = Message(rec)
            take(msg)
            if in_store and msg.msg_id in in_store:  # moved there before a crash
                cursor.finish(msg)
                held += 1
                continue
            if rec.ext and self._skipped(msg):
                held += 1
                continue
            if rec.ext and self._defer_if_due_later(msg):
                held += 1
                continue
            out.append(msg)
        if saved is not None and cursor.ahead is None and (  # past the saved window
                self._reader.offset >= cursor.next_read >= saved.next_read):
            self.saved = None
        self.dirty = True
        return held

    async def _hold_deferred_ahead(self) -> None:
        """No client has room: still take the deferred publishes (DPUB) at the head of the
        unread log that are not due yet, as classic nsqd defers a DPUB in its channels at
        once, so they count in `deferred_count`, not in `depth`; and skip the `##dead`
        records there (deadletters.py), which are no message of this channel. It stops at
        the first other record and leaves it unread (`_undeferred_at`): a message that
        waits for a client is never held in memory for it."""
        reader = self._reader
        while reader.offset != self._undeferred_at and not self.topic.paused:
            room = min(self.read_batch, self.max_window - self.cursor.window_size)
            seeks = self.seeks
            records = await reader.read(room) if room > 0 else []
            if self.seeks != seeks:  # moved meanwhile: stale, and the reader goes back
                reader.seek(self.cursor.next_read)
                return
            if not records:
                return
            now_ms = self.clock() * 1000
            k = 0
            while k < len(records) and records[k].ext and (
                    defer_until_ms(records[k].ext) > now_ms or self._no_message(records[k].ext)):
                k += 1
            if k < len(records):
                self._undeferred_at = records[k].offset
                reader.seek(self._undeferred_at)
            due_now: list[Message] = []  # came due since the check above
            await self._take(records[:k], due_now, seeks)
            self.requeued.extend(due_now)

    def _skipped(self, msg: Message) -> bool:
        """A record with an ext header that is no message of this channel is finished
        unsent: a `##dead` record but a revived copy addressed here (deadletters.role), a
        `##half` record but a commit (halves.role). True when it was skipped."""
        if not self._no_message(msg.ext):
            return False
        self.cursor.finish(msg)
        return True

    def _no_message(self, ext: bytes) -> bool:
        return ((DEAD_MARKER in ext and deadletters.role(ext, self.name) == deadletters.SKIP)
                or (HALF_MARKER in ext and halves.role(ext) == halves.SKIP))

    def _resume(self, msg: Message, in_store) -> bool:
        """A message read again after a restart, not in a saved finished range: give it the
        attempts it had (saved, or 1 when it was in the window and delivered once), unless it
        is a DPUB still not due (then it was never delivered). True when it is kept back."""
        if in_store and msg.msg_id in in_store:  # moved to the delay store before the crash
            self.cursor.finish(msg)
            return True
        saved = self.saved
        if msg.offset >= saved.next_read:  # read for the first time
            return bool(msg.ext) and self._defer_if_due_later(msg)
        attempts = saved.attempts.get(msg.offset)
        if attempts is not None:
            msg.attempts = min(attempts, 0xFFFF)
        if msg.ext and self._defer_if_due_later(msg):
            return True
        if attempts is None and msg.attempts == 0:
            msg.attempts = 1
        return False

    def _defer_if_due_later(self, msg: Message) -> bool:
        """A DPUB's message read before it is due: held in memory when due soon, moved to
        the delay store when due later."""
        if self.ordered is not None:  # the log's order rules (ordered.py)
            return False
        due_ms = defer_until_ms(msg.ext)
        if not due_ms or due_ms <= self.clock() * 1000:
            return False
        self._hold(msg, due_ms)
        return True

    def _hold(self, msg: Message, due_ms: int) -> None:
        """Keep a message until `due_ms`: on disk when far off or often retried, else in memory."""
        delay = self.delay
        if delay is not None and delay.available and (
                due_ms - self.clock() * 1000 >= self.delay_threshold_ms
                or msg.attempts >= self.max_attempts_in_memory):
            delay.move(msg, due_ms)
            if self.trace is not None:
                self.trace.delay_in(self, msg, due_ms)
        else:
            self._defer(due_ms / 1000, msg)

    def _defer(self, due: float, msg: Message) -> None:
        """Hold a message in memory until clock time `due`."""
        heapq.heappush(self.deferred, (due, msg.msg_id, msg))
        self.watch_timeouts()

    def _spill_deferred(self) -> None:
        """The confirm window is full: move log messages held in memory to the delay store,
        so their offsets confirm and fresh reads go on."""
        delay = self.delay
        if delay is None or not delay.available:
            return
        keep = []
        for entry in self.deferred:
            if entry[2].delayed:
                keep.append(entry)
            else:
                delay.move(entry[2], int(entry[0] * 1000))
                if self.trace is not None:
                    self.trace.delay_in(self, entry[2], int(entry[0] * 1000))
        if len(keep) != len(self.deferred):
            heapq.heapify(keep)
            self.deferred = keep

    def _stored(self, msgs: list[Message]) -> None:
        """The delay store holds these log messages now: their offsets are confirmed."""
        for msg in msgs:
            self.cursor.finish(msg)
        self.dirty = True
        self._wake.set()

    def _given_back(self, held: list[tuple[Message, int]]) -> None:
        """The delay store could not take these log messages: they wait in memory."""
        for msg, due_ms in held:
            self._defer(due_ms / 1000, msg)

    def _distribute(self, msgs: list[Message]) -> None:
        """Hand messages to clients in turn, each up to its free RDY; keep the rest requeued.
        One delivered `max_attempts` times already is buried instead."""
        if self.max_attempts:
            msgs = self._bury_spent(msgs, "spent")
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
            if client.channel is None:
                room = client.room_in(self, room)
            if room <= 0 or not client.writable:
                continue
            chunk = msgs[i:i + room]
            i += len(chunk)
            for m in chunk:
                if m.attempts == 0:
                    fresh += 1
            client.deliver(self, chunk, now)
            if self.trace is not None:
                self.trace.delivered(self, chunk, client)
        self._rr = (self._rr + 1) % max(n, 1)
        self.message_count += fresh
        if i < len(msgs):
            self.requeued.extendleft(reversed(msgs[i:]))

    # ---- acknowledgements ------------------------------------------------

    def finish(self, msg: Message) -> None:
        """A message is done (FIN, or skipped by sampling)."""
        self.finish_many((msg,))

    def finish_many(self, msgs) -> None:
        finish = self.cursor.finish
        for msg in msgs:
            if msg.delayed:
                self.delay.finish(msg)
            else:
                finish(msg)
        if self.trace is not None:
            self.trace.finished(self, msgs)
        self.finish_count += len(msgs)
        self.dirty = True
        self._wake.set()
        if self.ordered is not None:
            self.ordered.finished()

    def requeue(self, msg: Message, delay_ms: int, error: str | None = None) -> None:
        """A consumer's REQ: counted in `requeue_count`, as classic nsqd does. `error`: the
        reason it gave, kept for its dead copy while the channel has `max_attempts`
        (DeadLetters.remember_error)."""
        self.requeue_count += 1
        if self.trace is not None:
            self.trace.requeued(self, msg, delay_ms)
        if error and self.max_attempts:  # kept apart: a message pays nothing without one
            self.dead.remember_error(msg.msg_id, error)
        self._put_back(msg, delay_ms, "req")

    def _put_back(self, msg: Message, delay_ms: int, cause: str) -> None:
        """Put a message back: at once, or after `delay_ms` (see `_hold`); buried instead
        when it was delivered `max_attempts` times (`cause`: why it came back)."""
        msg.client = None
        if not msg.delayed:
            self.put_back[msg.offset] = msg  # its attempts go with the next checkpoint
        if self.max_attempts and not self._bury_spent((msg,), cause):
            return
        if self.ordered is not None:  # first in line again, whatever the delay
            self.ordered.put_back((msg,))
        elif delay_ms > 0 or msg.attempts >= self.max_attempts_in_memory:
            self._hold(msg, int(self.clock() * 1000) + delay_ms)
        else:
            self.requeued.append(msg)
            self._wake.set()

    def _requeue_all(self, msgs: list[Message], cause: str) -> None:
        if self.max_attempts:
            msgs = self._bury_spent(msgs, cause)
        if self.ordered is not None and len(msgs) > 1:  # back in log order
            for m in msgs:
                m.client = None
                if not m.delayed:
                    self.put_back[m.offset] = m
            self.ordered.put_back(msgs)
            return
        for m in msgs:
            self._put_back(m, 0, cause)

    # ---- dead letters (deadletters.py) ---------------------------------------

    def _bury_spent(self, msgs, cause: str) -> list[Message]:
        """Bury each of `msgs` delivered `max_attempts` times; the others, to put back or
        deliver. One the partition cannot bury now (not writable) is among the others."""
        keep = []
        limit = self.max_attempts
        for m in msgs:
            if m.attempts >= limit and self.dead is not None:
                m.client = None
                if not m.delayed:
                    self.put_back[m.offset] = m
                self.burying += 1
                if self.dead.bury(m, cause, lambda ok, m=m: self._bury_done(m, cause, ok)):
                    continue
                self.burying -= 1
            keep.append(m)
        return keep

    def _bury_done(self, msg: Message, cause: str, buried: bool) -> None:
        """A dead copy was committed (the message is finished), or refused: then the message
        waits BURY_RETRY_MS and is buried when it would be delivered."""
        self.burying -= 1
        if self._closed:
            return
        if not buried:
            if self.ordered is not None:
                self.ordered.put_back((msg,))
            else:
                self._defer(self.clock() + BURY_RETRY_MS / 1000, msg)
            self._wake.set()
            return
        if msg.delayed:
            self.delay.finish(msg)
        else:
            self.cursor.finish(msg)
        if self.trace is not None:
            self.trace.buried(self, msg, cause)
        self.dirty = True
        self._wake.set()
        if self.ordered is not None:
            self.ordered.finished()

    def watch_timeouts(self) -> None:
        """Something of this channel may come due: the node's timeout scan visits it from
        now on, until it is not `timing` (nsqd/timeouts.py)."""
        if self.timeouts is not None:
            self.timeouts.watch(self)

    @property
    def timing(self) -> bool:
        """Whether something of this channel may come due: a message deferred in memory,
        messages waiting in the delay store, or a message in flight at one of its clients
        (any client's counts: a client consuming several partitions holds others' too)."""
        return (bool(self.deferred) or (self.delay is not None and self.delay.waiting > 0)
                or any(c.in_flight for c in self.clients))

    def process_timeouts(self, now: float) -> int:
        """Requeue expired in-flight messages and release due deferred ones; return how many."""
        moved = 0
        partition = self.partition
        for client in self.clients:
            expired = []
            for m in client.in_flight.values():
                if m.deadline > now:
                    break
                if m.msg_id >> PARTITION_SHIFT == partition:  # else another channel's
                    expired.append(m)
            if expired and self.trace is not None:
                self.trace.timed_out(self, expired)
            for m in expired:
                del client.in_flight[m.wire_id]
            self.timeout_count += len(expired)
            self._requeue_all(expired, "timeout")
            moved += len(expired)
        deferred = self.deferred
        wall = self.clock()
        while deferred and deferred[0][0] <= wall:
            self.requeued.append(heapq.heappop(deferred)[2])
            moved += 1
        delay = self.delay
        if delay is not None and len(self.from_delay) < delay.take_limit and delay.due(
                int(wall * 1000)):
            asyncio.get_running_loop().create_task(self._take_due(int(wall * 1000)))
        if moved:
            self._wake.set()
        return moved

    async def _take_due(self, now_ms: int) -> None:
        for d in await self.delay.take_due(now_ms, self.delay.take_limit - len(self.from_delay)):
            self.from_delay.append(Message.from_store(d))
            if self.trace is not None:
                self.trace.delay_out(self, self.from_delay[-1])
        self._wake.set()

    # ---- operations ------------------------------------------------------

    def pause(self) -> None:
        self.paused = True
        self.dirty = True

    def unpause(self) -> None:
        self.paused = False
        self.dirty = True
        self._wake.set()

    def empty(self) -> None:
        """Drop every message of the channel held in memory: backlog, requeued, deferred and
        in flight. (The delay store is emptied by `empty_delayed`.) Messages brought back from
        the delay store go back to it, due now: it still holds them as taken."""
        delay = self.delay
        if delay is not None and delay.available:
            now_ms = int(self.clock() * 1000)
            held = [m for c in self.clients for m in c.in_flight_of(self.partition)]
            held += [*self.requeued, *self.from_delay, *(entry[2] for entry in self.deferred)]
            if self.router is not None:
                held += self.router.messages()
            for m in held:
                if m.delayed:
                    delay.move(m, now_ms)
        if self.trace is not None:
            self.trace.emptied(self)
        for client in self.clients:
            for m in client.in_flight_of(self.partition):
                del client.in_flight[m.wire_id]
        self.requeued.clear()
        self.from_delay.clear()
        self.deferred.clear()
        if self.router is not None:
            self.router.take_all()
        self.put_back.clear()
        self.saved = None
        self.cursor.reset(self.queue.committed_end, self.queue.committed_count)
        self._reader.seek(self.queue.committed_end)
        self.dirty = True

    def seek(self, offset: int, count: int) -> None:
        """Move the cursor (replay or skip); what was taken is forgotten. A delivery pass
        that awaited meanwhile sees `seeks` changed and drops what it held (_drop_stale)."""
        self.empty()
        if self.trace is not None:  # REPLAY: /channel/setoffset lands here
            self.trace.replayed(self, offset)
        self.cursor.reset(offset, count)
        self._reader.seek(offset)
        self.seeks += 1
        self._wake.set()

    def _drop_stale(self, msgs: list[Message]) -> None:
        """Messages a delivery pass took before a seek: dropped as `empty` drops them (one
        brought back from the delay store goes back to it, due now)."""
        delay = self.delay
        if delay is not None and delay.available:
            now_ms = int(self.clock() * 1000)
            for m in msgs:
                if m.delayed:
                    delay.move(m, now_ms)

    async def empty_delayed(self) -> int:
        """Drop every message in the delay store; return how many."""
        self.from_delay.clear()
        return await self.delay.empty() if self.delay is not None else 0

    async def requeue_delayed_now(self) -> int:
        """Make every delayed message due now; return how many."""
        if self.delay is None:
            return 0
        return await self.delay.requeue_all_now(int(self.clock() * 1000))

    # ---- stats -----------------------------------------------------------

    @property
    def delayed_count(self) -> int:
        """Messages in the delay store (waiting or brought back and not yet finished)."""
        return self.delay.waiting + self.delay.taken if self.delay is not None else 0

    @property
    def kept_from(self) -> int:
        """Where retention may drop the log up to: `confirmed`, or the first dead letter
        before it (deadletters.py), or the log's start while the old leader's held messages
        are taken over (they are read from the log: handover.py)."""
        if self.held is not None:
            return 0
        confirmed = self.cursor.confirmed
        return confirmed if self.dead is None else min(confirmed, self.dead.dead_from)

    @property
    def dead_count(self) -> int:
        return len(self.dead.index) if self.dead is not None else 0

    @property
    def backend_depth(self) -> int:
        """Messages not read yet (less those a checkpoint saved as finished)."""
        return self.queue.committed_count - self.cursor.next_count - self.cursor.ahead_count

    @property
    def depth(self) -> int:
        routed = self.router.count if self.router is not None else 0
        return self.backend_depth + len(self.requeued) + len(self.from_delay) + routed

    @property
    def in_flight_count(self) -> int:
        return sum(len(c.in_flight) if c.channel is self else len(c.in_flight_of(self.partition))
                   for c in self.clients)
