"""`LeaderLog`: the leader side of one partition: the driver of `core.LeaderCore`.

The core decides (commit, ISR changes, writable, solo, stepping down, EPOCH_END answers);
this driver does the I/O it asks for: taking publishes (its `LeaderWriter`, isr/writer.py),
pushing every batch to the followers as the log encodes it, over the node's shared,
pipelined `Peer`, handing ACKs and failures to the core, the CAS
of the partition state (with a deadline; an unknown outcome read back before anything is
decided on it), `set_epoch` before the pushes of a new epoch, serving FETCH, EPOCH_END
and JOIN to catching-up replicas, and sending channel states (latest wins, every 200 ms).

Invariants (the core's, see isr/core.py): nothing is committed that an ISR member in etcd
lacks; every leadership writes in an epoch of its own (a CAS before its first push);
pushes to one follower go out in log order (a joining or reconnecting follower's pushes
are held, then sent after what it lacks); the commit never moves back.
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
from .core import EpochCache, LeaderCore
from .metadata import Conflict
from .peer import Peer, PeerError, Peers
from .rpc import Answer, error
from .wire import Frame, Kind
from .writer import LeaderWriter

log = structlog.get_logger("isr.leader")

REPL_TIMEOUT = 1.0
TICK = 0.05
COMMIT_EVERY = 0.2
CHANNELS_EVERY = 0.2
JOIN_TIMEOUT = 2.0
CAS_TIMEOUT = 3.0  # an ISR change or a read of the state: past this its outcome is unknown
MAX_FETCH = 1 << 20


class NotWritable(Exception):
    """The partition takes no publish now (nsqd answers E_FAILED_ON_NOT_WRITABLE)."""


class _Link:
    """The driver's side of one follower: its connection and its pushes held for order."""

    __slots__ = ("held", "node", "peer", "sent_commit")

    def __init__(self, node: str, peer: Peer, held: bool):
        self.node = node
        self.peer = peer
        self.held: list | None = [] if held else None  # pushes waiting to be sent in order
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
        self.min_isr = min_isr
        self.repl_timeout = repl_timeout
        self.core = LeaderCore(host.node_id, state, min_isr=min_isr,
                               written=(q.written_end, q.written_count), epochs=EpochCache(),
                               repl_timeout=repl_timeout)
        self.core.committed = (q.committed_end, q.committed_count)
        self.writer = LeaderWriter(q, self._on_batch, self._on_written, self._on_unwritten)
        self._last_batch: tuple[tuple[int, int], bool] | None = None  # (start, went out)
        self.links: dict[str, _Link] = {}
        self._backlog: collections.deque = collections.deque()  # actions waiting their turn
        self._runner: asyncio.Task | None = None
        self._joins: dict[str, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self._followed = asyncio.Event()  # set while the core has followers: the ticker runs
        self._channels: dict | None = None
        self._channels_sent = 0.0
        self._commit_sent = 0.0
        self._closed = False
        self.stats = {"pushes": 0, "acks": 0, "isr_shrinks": 0, "isr_grows": 0, "fetches": 0,
                      "channels_sent": 0, "channels_pushed": 0, "epochs_taken": 0,
                      "cas_unknown": 0}

    @property
    def state(self):
        return self.core.state

    @property
    def writable(self) -> bool:
        return self.core.writable and not self._closed

    @property
    def reason(self) -> str:
        return self.core.reason

    @property
    def committed(self) -> tuple[int, int]:
        return self.core.committed

    @property
    def pushed_end(self) -> tuple[int, int]:
        return self.core.pushed

    @property
    def epoch(self) -> int:
        """The epoch this leadership writes in (0 until etcd gave it one)."""
        return self.core.epoch

    @property
    def followed(self) -> bool:
        """Whether it has followers (ISR members, joiners) to push to."""
        return bool(self.core.followers)

    @property
    def closed(self) -> bool:
        """Closed for good: stepped down, a newer epoch seen, a local write failed, or close()."""
        return self._closed or self.core.stopped is not None

    @property
    def _base(self) -> dict:
        return {"topic": self.topic, "partition": self.partition}

    # ---- lifecycle ----

    async def start(self) -> LeaderLog:
        """Load the log's epochs, then ask etcd for this leadership's epoch (not writable
        until it is written and the log's new entries carry it)."""
        self.core.epochs = EpochCache(await self.q.epoch_starts())
        self.core.written = self.core.pushed = (self.q.written_end, self.q.written_count)
        self.core.begin()
        self._do()
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def taken(self, timeout: float = CAS_TIMEOUT * 2) -> bool:
        """Wait until this leadership has its epoch (True) or has stopped (False)."""
        async with asyncio.timeout(timeout):
            while not (self.core.epoch and not self._backlog) and not self.closed:
                await asyncio.sleep(0.005)
        return not self.closed

    async def close(self, reason: str = "leader closed") -> None:
        """Stop leading: no more pushes; what waits fails (LeaderWriter.close)."""
        self.core.stop(reason)
        self._do()
        self._closed = True
        self.writer.close(NotWritable(reason))
        tasks = [t for t in [self._ticker, self._runner, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def update_state(self, state) -> None:
        """The host saw a newer partition state (etcd's, through its mirror)."""
        self.core.seen(state)
        self._do()

    # ---- doing what the core says ----

    def _do(self) -> None:
        """Do the core's actions in order. An epoch change is awaited (set_epoch) before the
        actions after it: a publish taken after "writable" never carries the old epoch."""
        actions = self.core.take()
        if self.core.followers:
            self._followed.set()
        if not actions:
            return
        for node in self.core.followers:  # connected before the first push goes out
            if node not in self.links:
                self._link(node)
        self._backlog.extend(actions)
        if self._runner is None or self._runner.done():
            while self._backlog and self._backlog[0].kind != "epoch":
                self._act(self._backlog.popleft())
            if self._backlog:
                self._runner = asyncio.create_task(self._run_backlog())

    async def _run_backlog(self) -> None:
        while self._backlog:
            action = self._backlog.popleft()
            if action.kind == "epoch":
                epoch = action.args[0]
                if epoch > self.q.epoch and not self.q.closed:
                    try:
                        await self.q.set_epoch(epoch)
                    except Exception as e:  # the log failed or closed: stop leading
                        self.core.stop(f"could not raise the log's epoch: {e!r}")
                        self._backlog.extend(self.core.take())
                continue
            self._act(action)

    def _act(self, action) -> None:
        kind, args = action
        if kind == "commit":
            self.writer.commit_to(args[0])
        elif kind == "cas":
            self._spawn(self._cas(*args))
        elif kind == "read":
            self._spawn(self._read_back())
        elif kind == "writable":
            writable, reason = args
            log.info("leader_writable", topic=self.topic, partition=self.partition,
                     writable=writable, reason=reason, isr=list(self.core.state.isr),
                     epoch=self.core.epoch)
            if not writable:
                self.writer.fail_uncommitted(NotWritable(reason))
        elif kind == "solo":
            self.writer.set_solo(args[0])
        elif kind in ("joined", "join_failed"):
            fut = self._joins.pop(args[0], None)
            if fut is not None and not fut.done():
                fut.set_result(action)
        elif kind == "stop":
            self.writer.close(NotWritable(args[0]))
            log.warning("leader_stepping_down", topic=self.topic, partition=self.partition,
                        reason=args[0])

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _cas(self, expected, new) -> None:
        """Write `new` by CAS on `expected`'s revision, within CAS_TIMEOUT; a conflict or an
        unknown outcome is read back and handed to the core."""
        try:
            async with asyncio.timeout(CAS_TIMEOUT):
                written = await self.host.change_isr(self.topic, self.partition, expected, new)
        except Conflict:
            await self._read_back(known=True)
            return
        except Exception as e:  # noqa: BLE001 - etcd away, stalled, a lost reply: unknown
            self.stats["cas_unknown"] += 1
            log.warning("isr_change_unknown", topic=self.topic, partition=self.partition,
                        isr=list(new.isr), epoch=new.epoch, error=repr(e))
            self.core.cas_unknown()
            self._do()
            return
        self._count_change(expected, written)
        self.core.cas_applied(written)
        self._do()

    async def _read_back(self, known: bool = False) -> None:
        """Read the partition state until etcd answers (each try within CAS_TIMEOUT)."""
        delay = 0.05
        while not self.closed:
            try:
                async with asyncio.timeout(CAS_TIMEOUT):
                    current = await self.host.read_state(self.topic, self.partition)
                break
            except Exception as e:  # noqa: BLE001 - tried again
                log.info("isr_read_back_retry", topic=self.topic, partition=self.partition,
                         error=repr(e), delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        else:
            return
        self.core.state_read(current)
        self._do()

    def _count_change(self, old, new) -> None:
        if new.epoch and old.leader == new.leader and set(old.isr) == set(new.isr):
            self.stats["epochs_taken"] += 1
        elif len(new.isr) < len(old.isr):
            self.stats["isr_shrinks"] += 1
            log.warning("isr_shrunk", topic=self.topic, partition=self.partition,
                        isr=list(new.isr), epoch=new.epoch)
        else:
            self.stats["isr_grows"] += 1
            log.info("isr_grown", topic=self.topic, partition=self.partition,
                     isr=list(new.isr), epoch=new.epoch)

    def _link(self, node: str, held: bool = False) -> _Link:
        self._followed.set()
        link = self.links.get(node)
        if link is None or held:
            link = self.links[node] = _Link(node, self.peers.get(node), held)
            if not link.peer.connected and not held:
                link.held = []
                self._spawn(self._connect(link))
        return link

    async def _connect(self, link: _Link) -> None:
        try:
            await link.peer.connect()
        except PeerError as e:
            self._fail(link.node, str(e))
            return
        self._release(link)

    def _fail(self, node: str, reason: str) -> None:
        f = self.core.followers.get(node)
        if f is not None and not f.failed:
            log.warning("follower_failed", topic=self.topic, partition=self.partition,
                        node=node, reason=reason)
        self.core.failed(node, reason)
        self._do()

    # ---- the push path ----

    def _on_batch(self, offset, count, entries, n_entries, data, epoch) -> bool:
        """A batch as the log encodes it: pushed to the followers. Whether it went out."""
        end = batch_end(offset, count, entries)
        nodes = self.core.pushed_batch((offset, count), end, epoch)
        self._last_batch = ((offset, count), bool(nodes))
        if not nodes:  # None: stopped; []: alone in its ISR (no header, no checksum to make)
            if nodes is None:
                self._do()
            return False
        header = {**self._base, "epoch": self.core.epoch, "leader": self.host.node_id,
                  "offset": offset, "count": count, "n": n_entries, "data_len": len(data),
                  "crc": zlib.crc32(data), "commit": list(self.core.committed)}
        head = wire.encode_header(Kind.PUSH, header)  # once for every follower
        payload = (entries, data)
        for node in nodes:
            self._push(self._link(node), header, payload, head)
        return True

    def _on_unwritten(self) -> None:
        """The last batch failed to be written here: when it went to no follower (a leader
        alone in its ISR), the log goes on from its start (a full disk refuses publishes
        until there is room, as an unreplicated log does); else the log failed for good."""
        if self._last_batch is not None and not self._last_batch[1]:
            self.core.unwritten(self._last_batch[0])

    def _on_written(self, end: tuple[int, int]) -> None:
        low = self.core.written_to(end)
        if low is not None:
            self.writer.commit_to(low)

    def _push(self, link: _Link, header: dict, payload, head: bytes | None = None) -> None:
        if link.held is not None:
            link.held.append((header, payload, head))
            return
        node = link.node
        try:
            link.peer.send_callback(Kind.PUSH, head or header, payload,
                                    lambda answer: self._acked(node, answer))
        except PeerError as e:
            self._fail(node, str(e))
            return
        self.stats["pushes"] += 1
        self.core.sent(node, time.monotonic())
        link.sent_commit = tuple(header["commit"])

    def _release(self, link: _Link) -> None:
        """Send a follower's held pushes in order; later ones go straight out."""
        held, link.held = link.held or [], None
        for header, payload, head in held:
            self._push(link, header, payload, head)

    def _acked(self, node: str, frame: Frame | PeerError) -> None:
        """A push's answer (or the broken connection's PeerError), from the peer's read."""
        if isinstance(frame, PeerError):
            self._fail(node, str(frame))
            return
        if frame.kind is Kind.ACK:
            self.stats["acks"] += 1
            low = self.core.acked(node, tuple(frame.header.get("end", (0, 0))))
            if low is not None:
                self.writer.commit_to(low)
            return
        code = frame.header.get("code")
        seen = frame.header.get("epoch")
        # a push of an older epoch of ours (sent before our own ISR change) refused: that
        # follower catches up, this leader goes on; a newer epoch seen ends this leadership
        self.core.refused(node, seen if code == wire.E_STALE_EPOCH and isinstance(seen, int)
                          else None, f"{code}: {frame.header.get('message')}")
        self._do()

    async def _tick(self) -> None:
        """Every TICK while the core has followers (their timeouts, commit updates, channel
        states); a leader alone in its ISR (a topic of one replica) has nothing to tick and
        waits until a follower comes (a join, a state that lists one)."""
        while True:
            if not self.core.followers:
                self._followed.clear()
                await self._followed.wait()
            await asyncio.sleep(TICK)
            now = time.monotonic()
            self.core.tick(now)
            self._do()
            if not self.writable:  # batches that were in flight when it stopped
                self.writer.fail_uncommitted(NotWritable(self.reason))
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
        if self.closed or not self.core.epoch:
            return
        pushed, committed = self.core.pushed, self.core.committed
        header = {**self._base, "epoch": self.core.epoch, "leader": self.host.node_id,
                  "offset": pushed[0], "count": pushed[1], "n": 0,
                  "data_len": 0, "commit": list(committed)}
        for f in list(self.core.followers.values()):
            link = self._link(f.node)
            if f.failed or link.held is not None:
                continue
            if link.sent_commit < committed or (f.acked < pushed and not f.unacked):
                self._push(link, header, b"")

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
            if self.closed:
                raise NotWritable(self.reason)
            header = {**self._base, "epoch": self.core.epoch, "channels": channels}
            me = self.host.node_id
            waiting = [node for node in self.state.isr if node != me and node not in stored]
            if not waiting:
                return
            asked = []
            for node in waiting:
                f = self.core.followers.get(node)
                link = self._link(node) if f is not None else None
                if f is None or f.failed or link.held is not None:
                    continue  # waits for the CAS that drops it, or for its join to end
                try:
                    asked.append((node, link.peer.send(Kind.CHANNELS, header)))
                except PeerError as e:
                    self._fail(node, f"channels: {e}")
            if not asked:
                await asyncio.sleep(TICK)
                continue
            done, _ = await asyncio.wait([fut for _, fut in asked], timeout=self.repl_timeout)
            for node, fut in asked:
                if fut not in done:
                    fut.add_done_callback(lambda fut: fut.cancelled() or fut.exception())
                    self._fail(node, f"no answer to channels in {self.repl_timeout} s")
                elif fut.exception() is not None:
                    self._fail(node, f"channels: {fut.exception()}")
                elif fut.result().kind is Kind.OK:
                    stored.add(node)
                else:
                    await asyncio.sleep(TICK)  # refused (an epoch moving on): asked again

    async def _send_every_channel(self, link: _Link) -> None:
        """Every channel's state (the host's `channel_states`) to a joiner, stored before it
        enters the ISR: a member of the ISR may come to lead, and one that lacks a channel's
        state starts the channel blind (redelivering what was finished). Channels that do
        not change are not sent otherwise."""
        channels = await self.host.channel_states(self.topic, self.partition)
        for head in self._channel_heads(channels) if channels else ():
            answer = await link.peer.send(Kind.CHANNELS, head)
            if answer.kind is not Kind.OK:
                raise ValueError(f"refused: {answer.header}")

    def _send_channels(self, channels: dict) -> None:
        """As many CHANNELS frames as the states need, to each follower (not waited for)."""
        self.stats["channels_sent"] += 1
        for head in self._channel_heads(channels):
            for f in list(self.core.followers.values()):
                link = self._link(f.node)
                if f.failed or link.held is not None:
                    continue
                try:
                    fut = link.peer.send(Kind.CHANNELS, head)
                except PeerError:
                    continue
                fut.add_done_callback(lambda fut: fut.cancelled() or fut.exception())

    def _channel_heads(self, channels: dict) -> list[bytes]:
        """CHANNELS headers for the states, each at most wire.MAX_HEADER bytes; a state too
        large for a frame of its own is left out, with one log line."""
        base = {**self._base, "epoch": self.core.epoch}
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
        epoch = self.core.epoch
        if self.closed or not epoch:
            return error(wire.E_NOT_LEADER, self.reason)
        if h["epoch"] > epoch:
            return error(wire.E_NOT_LEADER, f"epoch {h['epoch']} is newer than mine",
                         epoch=epoch)
        if frame.kind is Kind.EPOCH_END:
            found, pos = self.core.epoch_end(h["last_epoch"])
            return Kind.POSITION, {"offset": pos[0], "count": pos[1], "epoch": found}, b""
        if h["epoch"] < epoch:
            return error(wire.E_STALE_EPOCH, f"epoch {h['epoch']} < {epoch}", epoch=epoch)
        if frame.kind is Kind.FETCH:
            return await self._fetch(h)
        return await self._join(h)

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
        """Bring `node` level (copy what it lacks while holding its live pushes), count it for
        the commit, wait until it acked every commit, give it every channel's state, then
        have the core CAS it into the ISR. Each step has a deadline, else E_FAILED."""
        node = h["node"]
        if node in self._joins:
            return error(wire.E_FAILED, "join: another join of this node is in progress")
        begun = self.core.join_begin(node)
        if begun is None:
            return error(wire.E_FAILED, "join: its last join is still going")
        if not begun:
            return Kind.OK, {"epoch": self.core.epoch}, b""
        fut = self._joins[node] = asyncio.get_running_loop().create_future()
        link = self._link(node, held=True)
        try:
            async with asyncio.timeout(JOIN_TIMEOUT):
                at = await self._copy(link, (h["offset"], h["count"]))
            self._release(link)
            self.core.join_count(node, at)  # from now on nothing commits without it...
            self._do()
            async with asyncio.timeout(JOIN_TIMEOUT):
                while (level := self.core.join_level(node)) is False:  # ...it acks the commit
                    await asyncio.sleep(0.01)
            if level is None:
                raise ValueError("failed while joining")
            async with asyncio.timeout(JOIN_TIMEOUT):
                await self._send_every_channel(link)
            self.core.join_ready(node)
            self._do()
            async with asyncio.timeout(CAS_TIMEOUT * 4):
                kind, args = await fut
        except (TimeoutError, PeerError, OSError, ValueError) as e:
            self._joins.pop(node, None)
            self.core.join_abandon(node)
            self._do()
            return error(wire.E_FAILED, f"join: {e!r}")
        if kind == "join_failed":
            return error(wire.E_FAILED, f"join: {args[1]}")
        log.info("follower_joining_isr", topic=self.topic, partition=self.partition, node=node,
                 epoch=args[1])
        return Kind.OK, {"epoch": args[1]}, b""

    async def _copy(self, link: _Link, at: tuple[int, int]) -> tuple[int, int]:
        """PUSH everything from `at` to the end pushed when the join began; returns the end
        the follower acked."""
        target = self.core.pushed
        await link.peer.connect()
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
            header = {**self._base, "epoch": self.core.epoch, "leader": self.host.node_id,
                      "offset": at[0], "count": at[1], "n": n, "data_len": size,
                      "commit": list(self.committed)}
            r = await link.peer.request(Kind.PUSH, header, (
                memoryview(raw.entries)[:n * wire.ENTRY_SIZE], memoryview(raw.data)[:size]))
            if r.kind is not Kind.ACK:
                raise ValueError(f"copy refused: {r.header}")
            at = tuple(r.header["end"])
        return at


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
