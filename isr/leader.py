"""`LeaderLog`: the leader side of one partition.

Owns: pushing every batch (`q.on_batch`) to each ISR follower over the node's shared,
pipelined `Peer`; collecting ACKs; committing (`q.replicated_to`) the minimum acked end
over the ISR; timing a follower out after `repl_timeout` and asking the host to move it
from `isr` to `catchup` (CAS, epoch + 1); refusing appends below `min_isr` (`writable`,
`reason`) and failing the parked batches then; serving FETCH, EPOCH_END and JOIN to
catching-up replicas; sending channel states (latest wins, at most every 200 ms).

Invariants: a follower counts for the commit while the partition state has it in the ISR,
even after it failed (until the CAS that removes it is written), so nothing is committed
that an ISR member in etcd lacks; pushes to one follower go out in log order (a joining
or reconnecting follower's pushes are held, then sent after what it lacks); the commit
never moves back.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import zlib

import structlog

from commitlog import entry as clog_entry
from diskqueue.errors import OffsetOutOfRange

from . import wire
from .follower import batch_end
from .metadata import Conflict
from .peer import Peer, PeerError, Peers
from .rpc import Answer, error
from .wire import Frame, Kind

log = structlog.get_logger("isr.leader")

REPL_TIMEOUT = 1.0
TICK = 0.05
COMMIT_EVERY = 0.2
CHANNELS_EVERY = 0.2
JOIN_TIMEOUT = 2.0
MAX_FETCH = 1 << 20


class NotWritable(Exception):
    """The partition takes no publish now (nsqd answers E_FAILED_ON_NOT_WRITABLE)."""


class _Follower:
    """What the leader knows of one follower of this partition."""

    __slots__ = ("acked", "failed", "held", "node", "peer", "sent_commit", "unacked")

    def __init__(self, node: str, peer: Peer, held: bool):
        self.node = node
        self.peer = peer
        self.acked = (0, 0)  # the end it acked
        self.unacked: collections.deque = collections.deque()  # send times, oldest first
        self.held: list | None = [] if held else None  # pushes waiting to be sent in order
        self.failed = False  # no more pushes; waits for the CAS that drops it
        self.sent_commit = (0, 0)


class LeaderLog:
    """Replicates one partition's log from this node (its leader) to the ISR."""

    def __init__(self, host, peers: Peers, topic: str, partition: int, q, state, *,
                 min_isr: int = 1, repl_timeout: float = REPL_TIMEOUT):
        self.host = host
        self.peers = peers
        self.topic = topic
        self.partition = partition
        self.q = q
        self.state = state
        self.min_isr = min_isr
        self.repl_timeout = repl_timeout
        self.followers: dict[str, _Follower] = {}
        self.pushed_end = (q.written_end, q.written_count)
        self.committed = (q.committed_end, q.committed_count)
        self.writable = False
        self.reason = "not started"
        self._isr_lock = asyncio.Lock()
        self._joining: set[str] = set()
        self._counted: set[str] = set()  # joiners whose acks the commit waits for (not in isr yet)
        self._tasks: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self._channels: dict | None = None
        self._channels_sent = 0.0
        self._commit_sent = 0.0
        self._closed = False
        self.stats = {"pushes": 0, "acks": 0, "isr_shrinks": 0, "isr_grows": 0, "fetches": 0,
                      "channels_sent": 0, "channels_pushed": 0}

    @property
    def closed(self) -> bool:
        """Closed for good: stepped down, a newer epoch seen, a local write failed, or close()."""
        return self._closed

    @property
    def _base(self) -> dict:
        return {"topic": self.topic, "partition": self.partition}

    # ---- lifecycle ----

    async def start(self) -> LeaderLog:
        await self.q.set_epoch(self.state.epoch)
        self.pushed_end = (self.q.written_end, self.q.written_count)
        self.q.on_batch = self._on_batch
        self.q.on_written = self._advance
        self._apply(self.state)
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def close(self, reason: str = "leader closed") -> None:
        """Stop leading: no more pushes; parked batches fail with NotWritable."""
        self._closed = True
        self._set_writable(False, reason)
        if self.q.on_batch == self._on_batch:
            self.q.on_batch = None
        if self.q.on_written == self._advance:
            self.q.on_written = None
        for t in [self._ticker, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._ticker, *self._tasks] if t),
                             return_exceptions=True)

    def update_state(self, state) -> None:
        """The host saw a newer partition state (its own CAS or etcd's)."""
        if state.epoch < self.state.epoch:
            return
        if state.leader != self.host.node_id:
            self.state = state
            self._close_soon(f"no longer the leader at epoch {state.epoch}")
            return
        self._apply(state)

    def _close_soon(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            self._set_writable(False, reason)
            self.q.on_batch = None
            self.q.on_written = None
            log.warning("leader_stepping_down", topic=self.topic, partition=self.partition,
                        reason=reason)

    def _apply(self, state) -> None:
        """Take `state`'s ISR: push to its followers, commit over them."""
        self.state = state
        me = self.host.node_id
        for node in state.isr:
            if node != me and node not in self.followers:
                self._add(node, held=False)
        for node in list(self.followers):
            if node not in state.isr and node not in self._joining:
                del self.followers[node]  # dropped
        solo = state.isr == (me,) and self.min_isr <= 1
        self.q.set_solo(solo)
        if len(state.isr) < self.min_isr:
            self._set_writable(False, f"isr {list(state.isr)} below min_isr {self.min_isr}")
        elif not self._closed:
            self._set_writable(True, "")
        self._advance()

    def _set_writable(self, writable: bool, reason: str) -> None:
        if writable == self.writable and reason == self.reason:
            return
        self.writable, self.reason = writable, reason
        log.info("leader_writable", topic=self.topic, partition=self.partition,
                 writable=writable, reason=reason, isr=list(self.state.isr),
                 epoch=self.state.epoch)
        if not writable:
            self.q.fail_uncommitted(NotWritable(reason))

    def _add(self, node: str, held: bool) -> _Follower:
        f = self.followers[node] = _Follower(node, self.peers.get(node), held)
        if not f.peer.connected and not held:
            f.held = []
            self._spawn(self._connect(f))
        return f

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _connect(self, f: _Follower) -> None:
        try:
            await f.peer.connect()
        except PeerError as e:
            self._fail(f, str(e))
            return
        self._release(f)

    # ---- the push path ----

    def _on_batch(self, offset, count, entries, n_entries, data, epoch) -> None:
        if (offset, count) != self.pushed_end:
            # a local write failed (and was cut back) after its batch was pushed: the
            # followers hold a tail this log lacks and would take the next batch, at the
            # same place, for a duplicate. Stop leading; a follower (holding the tail) leads.
            self._close_soon(f"local log at {[offset, count]} is behind what was pushed "
                             f"{list(self.pushed_end)} (a local write failed)")
            return
        end = batch_end(offset, count, entries)
        self.pushed_end = end
        header = {**self._base, "epoch": self.state.epoch, "leader": self.host.node_id,
                  "offset": offset, "count": count, "n": n_entries, "data_len": len(data),
                  "crc": zlib.crc32(data), "commit": list(self.committed)}
        head = wire.encode_header(Kind.PUSH, header)  # once for every follower
        payload = (entries, data)
        for f in self.followers.values():
            if not f.failed:
                self._push(f, header, payload, end, head)

    def _push(self, f: _Follower, header: dict, payload, end, head: bytes | None = None) -> None:
        if f.held is not None:
            f.held.append((header, payload, end, head))
            return
        try:
            f.peer.send_callback(Kind.PUSH, head or header, payload,
                                 lambda answer: self._acked(f, answer))
        except PeerError as e:
            self._fail(f, str(e))
            return
        self.stats["pushes"] += 1
        f.unacked.append(time.monotonic())
        f.sent_commit = tuple(header["commit"])

    def _release(self, f: _Follower) -> None:
        """Send a follower's held pushes in order; later ones go straight out."""
        held, f.held = f.held or [], None
        for header, payload, end, head in held:
            self._push(f, header, payload, end, head)

    def _acked(self, f: _Follower, frame: Frame | PeerError) -> None:
        """A push's answer (or the broken connection's PeerError), from the peer's read."""
        if f.unacked:
            f.unacked.popleft()
        if isinstance(frame, PeerError):
            self._fail(f, str(frame))
            return
        if frame.kind is Kind.ACK:
            self.stats["acks"] += 1
            end = tuple(frame.header.get("end", (0, 0)))
            f.acked = max(f.acked, end)
            self._advance()
            return
        code = frame.header.get("code")
        seen = frame.header.get("epoch")
        if code == wire.E_STALE_EPOCH and isinstance(seen, int) and seen > self.state.epoch:
            self._close_soon(f"{f.node} has seen epoch {seen}")
        # else a push of an older epoch of ours (sent before our own ISR change) was
        # refused: that follower catches up, this leader goes on
        self._fail(f, f"{code}: {frame.header.get('message')}")

    def _advance(self) -> None:
        """Commit the minimum acked end over the ISR's followers (never backwards; never
        once closed: a stepped-down leader commits nothing). Called on each ACK and after
        each local write (`q.on_written`): followers may ack a batch before it is written
        here, and it is committed as soon as both hold it."""
        if self._closed:
            return
        me = self.host.node_id
        ends = []
        for node in (*self.state.isr, *self._counted):
            if node == me:
                continue
            f = self.followers.get(node)
            if f is None:
                return
            ends.append(f.acked)
        if not ends:
            return
        low = min(ends)
        if low > self.committed:
            self.q.replicated_to(*low)
            self.committed = (self.q.committed_end, self.q.committed_count)

    def _fail(self, f: _Follower, reason: str) -> None:
        """Stop pushing to `f`; a joining one is forgotten, an ISR one dropped by CAS."""
        if f.failed or self.followers.get(f.node) is not f:
            return
        f.failed = True  # (its connection stays: other partitions share it)
        log.warning("follower_failed", topic=self.topic, partition=self.partition,
                    node=f.node, reason=reason)
        if f.node in self.state.isr and not self._closed:
            self._spawn(self._shrink(f.node))
        elif f.node not in self.state.isr:
            del self.followers[f.node]

    async def _shrink(self, node: str) -> None:
        """Move `node` from isr to catchup by CAS (epoch + 1); retry on Conflict."""
        async with self._isr_lock:
            for _ in range(50):
                state = self.state
                if self._closed or node not in state.isr:
                    return
                new = state.evolve(isr=tuple(x for x in state.isr if x != node),
                                   catchup=(*(x for x in state.catchup if x != node), node),
                                   epoch=state.epoch + 1)
                try:
                    done = await self.host.change_isr(self.topic, self.partition, state, new)
                except Conflict:
                    await asyncio.sleep(0.05)
                    continue
                self.stats["isr_shrinks"] += 1
                log.warning("isr_shrunk", topic=self.topic, partition=self.partition, node=node,
                            isr=list(done.isr), epoch=done.epoch)
                await self.q.set_epoch(done.epoch)
                self.update_state(done)
                return
            self._close_soon(f"could not drop {node} from the isr")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            if not self.writable:  # batches that were in flight when it stopped
                self.q.fail_uncommitted(NotWritable(self.reason))
            for f in list(self.followers.values()):
                if not f.failed and f.unacked and now - f.unacked[0] > self.repl_timeout:
                    self._fail(f, f"no ack in {self.repl_timeout} s")
            if now - self._commit_sent >= COMMIT_EVERY:
                self._commit_sent = now
                self._send_commit()
            if self._channels is not None and now - self._channels_sent >= CHANNELS_EVERY:
                self._channels_sent = now
                channels, self._channels = self._channels, None
                self._send_channels(channels)

    def _send_commit(self) -> None:
        """An empty PUSH to each follower that has not heard the current commit, or whose
        end is not known to be ours (a new leader learns from the ACKs what the ISR holds,
        so what the old leader committed is committed again without waiting for a publish)."""
        header = {**self._base, "epoch": self.state.epoch, "leader": self.host.node_id,
                  "offset": self.pushed_end[0], "count": self.pushed_end[1], "n": 0,
                  "data_len": 0, "commit": list(self.committed)}
        for f in self.followers.values():
            if f.failed or f.held is not None:
                continue
            if f.sent_commit < self.committed or (f.acked < self.pushed_end and not f.unacked):
                self._push(f, header, b"", self.pushed_end)

    # ---- channels ----

    def send_channels(self, channels: dict) -> None:
        """The latest channel states; sent to the ISR at most every 200 ms (latest wins per
        channel: states of other channels waiting to be sent are kept)."""
        if self._channels is None:
            self._channels = dict(channels)
        else:
            self._channels.update(channels)

    async def push_channels(self, channels: dict) -> None:
        """Send channel states to the ISR now and return once every ISR follower stored them
        (an ordered channel's FIN). A follower that fails or does not answer within
        `repl_timeout` is dropped from the ISR (as a failed push is), and the wait goes on
        until the CAS that drops it is written. Raises NotWritable when this log closes."""
        self.stats["channels_pushed"] += 1
        stored: set[str] = set()
        while True:
            if self._closed:
                raise NotWritable(self.reason)
            header = {**self._base, "epoch": self.state.epoch, "channels": channels}
            me = self.host.node_id
            waiting = [node for node in self.state.isr if node != me and node not in stored]
            if not waiting:
                return
            asked = []
            for node in waiting:
                f = self.followers.get(node)
                if f is None or f.failed or f.held is not None:
                    continue  # waits for the CAS that drops it, or for its join to end
                try:
                    asked.append((f, f.peer.send(Kind.CHANNELS, header)))
                except PeerError as e:
                    self._fail(f, f"channels: {e}")
            if not asked:
                await asyncio.sleep(TICK)
                continue
            done, _ = await asyncio.wait([fut for _, fut in asked], timeout=self.repl_timeout)
            for f, fut in asked:
                if fut not in done:
                    fut.add_done_callback(lambda fut: fut.cancelled() or fut.exception())
                    self._fail(f, f"no answer to channels in {self.repl_timeout} s")
                elif fut.exception() is not None:
                    self._fail(f, f"channels: {fut.exception()}")
                elif fut.result().kind is Kind.OK:
                    stored.add(f.node)
                else:
                    await asyncio.sleep(TICK)  # refused (an epoch moving on): asked again

    async def _send_every_channel(self, f: _Follower) -> None:
        """Every channel's state (the host's `channel_states`) to a joiner, stored before it
        enters the ISR: a member of the ISR may come to lead, and one that lacks a channel's
        state starts the channel blind (redelivering what was finished). Channels that do
        not change are not sent otherwise."""
        channels = await self.host.channel_states(self.topic, self.partition)
        for head in self._channel_heads(channels) if channels else ():
            answer = await f.peer.send(Kind.CHANNELS, head)
            if answer.kind is not Kind.OK:
                raise ValueError(f"refused: {answer.header}")

    def _send_channels(self, channels: dict) -> None:
        """As many CHANNELS frames as the states need, to each follower (not waited for)."""
        self.stats["channels_sent"] += 1
        for head in self._channel_heads(channels):
            for f in self.followers.values():
                if f.failed or f.held is not None:
                    continue
                try:
                    fut = f.peer.send(Kind.CHANNELS, head)
                except PeerError:
                    continue
                fut.add_done_callback(lambda fut: fut.cancelled() or fut.exception())

    def _channel_heads(self, channels: dict) -> list[bytes]:
        """CHANNELS headers for the states, each at most wire.MAX_HEADER bytes; a state too
        large for a frame of its own is left out, with one log line."""
        base = {**self._base, "epoch": self.state.epoch}
        try:
            heads = [wire.dumps({**base, "channels": channels})]  # one frame, mostly
        except ValueError:
            heads = []
            for group in _fitting(channels, wire.MAX_HEADER - 1024):  # 1 KiB: topic, epoch
                try:
                    heads.append(wire.dumps({**base, "channels": group}))
                except ValueError as e:
                    log.error("channel_state_too_large", topic=self.topic,
                              partition=self.partition, channels=sorted(group), error=str(e))
        return heads

    # ---- requests from catching-up replicas ----

    async def handle(self, frame: Frame) -> Answer:
        h = frame.header
        if self._closed:
            return error(wire.E_NOT_LEADER, self.reason)
        if h["epoch"] > self.state.epoch:
            return error(wire.E_NOT_LEADER, f"epoch {h['epoch']} is newer than mine",
                         epoch=self.state.epoch)
        if frame.kind is Kind.EPOCH_END:
            return await self._epoch_end(h["last_epoch"])
        if h["epoch"] < self.state.epoch:
            return error(wire.E_STALE_EPOCH, f"epoch {h['epoch']} < {self.state.epoch}",
                         epoch=self.state.epoch)
        if frame.kind is Kind.FETCH:
            return await self._fetch(h)
        return await self._join(h)

    async def _epoch_end(self, last_epoch: int) -> Answer:
        """Start of the first entry newer than `last_epoch`; else the end pushed so far
        (batches handed to followers before they are written here count)."""
        pos = await self.q.epoch_end(last_epoch)
        if tuple(pos) >= (self.q.written_end, self.q.written_count):
            pos = self.pushed_end
        return Kind.POSITION, {"offset": pos[0], "count": pos[1]}, b""

    async def _fetch(self, h: dict) -> Answer:
        end = [self.q.written_end, self.q.written_count]
        if h["offset"] >= self.q.written_end:
            return Kind.DATA, {"offset": h["offset"], "count": h["count"], "n": 0, "data_len": 0,
                               "end": end, "commit": list(self.committed)}, b""
        try:
            raw = await self.q.read_raw(h["offset"], min(h["max_bytes"], MAX_FETCH))
        except OffsetOutOfRange as e:
            return error(wire.E_OUT_OF_RANGE, str(e), end=end, start=list(e.start))
        except ValueError as e:
            return error(wire.E_GAP, f"no entry starts at {h['offset']}: {e}", end=end)
        if raw.count != h["count"]:
            return error(wire.E_GAP, f"count {h['count']} != {raw.count} at {h['offset']}",
                         end=end)
        self.stats["fetches"] += 1
        return Kind.DATA, {"offset": raw.offset, "count": raw.count, "n": raw.n_entries,
                           "data_len": len(raw.data), "end": list(raw.end),
                           "commit": list(self.committed)}, (raw.entries, raw.data)

    async def _join(self, h: dict) -> Answer:
        """Bring `node` level (copy what it lacks while holding its live pushes), then
        CAS it into the ISR. The copy is bounded to JOIN_TIMEOUT, else E_FAILED."""
        node = h["node"]
        if node in self.state.isr:
            return Kind.OK, {"epoch": self.state.epoch}, b""
        async with self._isr_lock:
            old = self.followers.get(node)
            if old is not None:
                del self.followers[node]
            f = self._add(node, held=True)
            self._joining.add(node)
            try:
                return await self._join_locked(f, h)
            finally:
                self._joining.discard(node)

    async def _join_locked(self, f: _Follower, h: dict) -> Answer:
        node = f.node
        try:
            async with asyncio.timeout(JOIN_TIMEOUT):
                await self._copy(f, (h["offset"], h["count"]))
        except (TimeoutError, PeerError, OSError, ValueError) as e:
            if self.followers.get(node) is f:
                del self.followers[node]
            return error(wire.E_FAILED, f"join: {e!r}")
        self._release(f)
        self._counted.add(node)  # from now on nothing commits without it...
        try:
            return await self._join_isr(f)
        finally:
            self._counted.discard(node)
            self._advance()

    async def _join_isr(self, f: _Follower) -> Answer:
        """...so it enters the ISR only once it acked every commit (a joiner whose held pushes
        failed, or that lags past JOIN_TIMEOUT, does not: it would lack committed data)."""
        node = f.node
        deadline = time.monotonic() + JOIN_TIMEOUT
        while f.acked < self.committed:
            if f.failed or self.followers.get(node) is not f or time.monotonic() > deadline:
                if self.followers.get(node) is f:
                    del self.followers[node]
                return error(wire.E_FAILED, "join: not level with the commit")
            await asyncio.sleep(0.01)
        try:
            async with asyncio.timeout(JOIN_TIMEOUT):
                await self._send_every_channel(f)
        except (TimeoutError, PeerError, OSError, ValueError) as e:
            if self.followers.get(node) is f:
                del self.followers[node]
            return error(wire.E_FAILED, f"join: channel states: {e!r}")
        for _ in range(50):
            state = self.state
            if self._closed:
                return error(wire.E_NOT_LEADER, self.reason)
            if f.failed or self.followers.get(node) is not f:
                return error(wire.E_FAILED, "join: failed while joining")
            if node not in state.catchup:  # the master took it off the partition meanwhile
                if self.followers.get(node) is f:
                    del self.followers[node]
                return error(wire.E_FAILED, "join: no longer a replica of this partition")
            new = state.evolve(isr=(*state.isr, node),
                               catchup=tuple(x for x in state.catchup if x != node),
                               epoch=state.epoch + 1)
            try:
                done = await self.host.change_isr(self.topic, self.partition, state, new)
                break
            except Conflict:
                await asyncio.sleep(0.05)
        else:
            if self.followers.get(node) is f:
                del self.followers[node]
            return error(wire.E_FAILED, "join: the partition state kept changing")
        self.stats["isr_grows"] += 1
        log.info("isr_grown", topic=self.topic, partition=self.partition, node=node,
                 isr=list(done.isr), epoch=done.epoch)
        await self.q.set_epoch(done.epoch)
        self.update_state(done)
        if f.failed:  # failed while the CAS was on its way: out again
            self._spawn(self._shrink(node))
        return Kind.OK, {"epoch": done.epoch}, b""

    async def _copy(self, f: _Follower, at: tuple[int, int]) -> None:
        """PUSH `f` everything from `at` to the end pushed when the join began."""
        target = self.pushed_end
        await f.peer.connect()
        while self.q.written_end < target[0]:
            await asyncio.sleep(0.002)
        while at < target:
            raw = await self.q.read_raw(at[0], MAX_FETCH)
            n, size = 0, 0
            while n < raw.n_entries:
                e = clog_entry.decode(raw.entries, n * wire.ENTRY_SIZE)
                if e.end_offset > target[0]:
                    break
                n, size = n + 1, size + e.size
            if n == 0:
                raise ValueError(f"no whole entry between {at} and {target}")
            header = {**self._base, "epoch": self.state.epoch, "leader": self.host.node_id,
                      "offset": at[0], "count": at[1], "n": n, "data_len": size,
                      "commit": list(self.committed)}
            r = await f.peer.request(Kind.PUSH, header, (
                memoryview(raw.entries)[:n * wire.ENTRY_SIZE], memoryview(raw.data)[:size]))
            if r.kind is not Kind.ACK:
                raise ValueError(f"copy refused: {r.header}")
            f.acked = at = tuple(r.header["end"])


def _fitting(channels: dict, room: int) -> list[dict]:
    """`channels` in groups whose states take at most `room` bytes of JSON together (a state
    larger than `room` is a group of its own)."""
    groups: list[dict] = []
    size = room
    for name, state in channels.items():
        n = len(json.dumps({name: state}, separators=(",", ":")))
        if size + n > room:
            groups.append({})
            size = 0
        groups[-1][name] = state
        size += n
    return groups
