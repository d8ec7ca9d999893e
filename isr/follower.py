"""`FollowerLog`: the follower side of one partition.

Owns: fencing (`epoch`, the highest epoch seen, persisted in the partition folder's
`fence.json` before anything of that epoch is written), PUSH handling (append the
leader's batch with `append_raw_then`, then commit min(the leader's commit, written)), the
catch-up loop (EPOCH_END and truncate until the log is a prefix of the leader's, FETCH in
chunks, JOIN when the lag is small), and CHANNELS (handed to `host.channels_received`).

Invariants: nothing of an epoch older than `epoch` is taken; the log is appended only
while it is checked level with the pushing leader at the push's epoch (`level`: a new
leader or epoch first runs the EPOCH_END round); appends and truncations run one at a
time (`_lock`: a push group goes to the queue with `append_raw_then` only while the lock is
free, and whoever takes the lock first waits for it), pushes in the order they arrived, one
group at a time, contiguous pushes in one append (group commit on the follower too). Every
push is appended by one path (`_append_next`); one that needs fencing or a reconcile first
waits for `_prepare` to do that under the lock, then goes the same way.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import structlog

from commitlog import entry as clog_entry
from diskqueue.atomic import read_json, write_json_atomic
from diskqueue.errors import AppendError, DiskFullError, Diverged, GapError
from diskqueue.raw import BadBatch

from . import wire
from .core import Verdict, push_verdict, truncation_point
from .peer import PeerError, Peers
from .rpc import Answer, error
from .wire import Frame, Kind

log = structlog.get_logger("isr.follower")

FENCE_FILE = "fence.json"
REQUEST_TIMEOUT = 2.0  # s: EPOCH_END, FETCH and JOIN to a leader that does not answer
FETCH_BYTES = 1 << 20
JOIN_LAG = 64 * 1024


class FollowError(Exception):
    """The leader refused a catch-up step: `code` and the ERROR header."""

    def __init__(self, header: dict):
        super().__init__(f"{header.get('code')}: {header.get('message')}")
        self.header = header


def batch_end(offset: int, count: int, entries: bytes) -> tuple[int, int]:
    """The (offset, count) after a batch's entries (its start when it has none)."""
    if not entries:
        return offset, count
    e = clog_entry.decode(entries, len(entries) - wire.ENTRY_SIZE)
    return e.end_offset, e.count_after


def _answer_error(e: Exception, end: tuple[int, int]) -> Answer:
    """The ERROR answer for an append failure (diskqueue's typed errors)."""
    if isinstance(e, GapError):
        return error(wire.E_GAP, str(e), end=list(end))
    if isinstance(e, BadBatch):
        return error(wire.E_BAD_BATCH, str(e), end=list(end))
    if isinstance(e, DiskFullError):
        return error(wire.E_DISK_FULL, str(e), end=list(end))
    return error(wire.E_FAILED, repr(e), end=list(end))


def _checksums_match(group) -> bool:
    """Whether every push of `group` carries the checksum of its data, and it matches (its
    leader computed it from its own encoding: the records need no walk one by one). A
    mismatch is a BadBatch: the push was damaged on its way."""
    for h, payload, _ in group:
        if "crc" not in h:
            return False
        if zlib.crc32(memoryview(payload)[h["n"] * wire.ENTRY_SIZE:]) != h["crc"]:
            raise BadBatch(f"push at {[h['offset'], h['count']]}: data checksum mismatch")
    return True


class FollowerLog:
    """Keeps one partition's log a copy of its leader's."""

    def __init__(self, host, peers: Peers, topic: str, partition: int, q, *,
                 fetch_bytes: int = FETCH_BYTES, join_lag: int = JOIN_LAG):
        self.host = host
        self.peers = peers
        self.topic = topic
        self.partition = partition
        self.q = q
        self.fetch_bytes = fetch_bytes
        self.join_lag = join_lag
        self.epoch = 0
        self.level: tuple[str, int] | None = None  # (leader, epoch) the log is checked against
        self.state = None
        self._lock = asyncio.Lock()
        self._pending: list[tuple[dict, bytes, object]] = []  # (header, payload, answer)
        self._preparer: asyncio.Task | None = None  # fences and reconciles for the first push
        self._writing = False  # a group handed to `append_raw_then`, not written yet
        self._quiet: asyncio.Future | None = None  # a lock holder waiting for it
        self._catch_up: asyncio.Task | None = None
        self._fence_path = os.path.join(q.path, FENCE_FILE)
        self.stats = {"pushes": 0, "appends": 0, "fetches": 0, "truncations": 0, "joins": 0,
                      "restarts": 0}

    async def _request(self, peer, kind: Kind, header: dict) -> Frame:
        """A catch-up request with a deadline: a leader that hangs (SIGSTOP, a frozen host)
        never holds this replica (PeerError after REQUEST_TIMEOUT)."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                return await peer.request(kind, header)
        except TimeoutError:
            raise PeerError(f"{peer.node_id}: no answer to {kind.name} in "
                            f"{REQUEST_TIMEOUT} s") from None

    @property
    def end(self) -> tuple[int, int]:
        return self.q.written_end, self.q.written_count

    async def open(self) -> FollowerLog:
        fence = await asyncio.to_thread(read_json, self._fence_path, {})
        self.epoch = max(fence.get("epoch", 0) if isinstance(fence, dict) else 0,
                         self.q.last_epoch)
        return self

    async def close(self) -> None:
        for task in (self._catch_up, self._preparer):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._catch_up, self._preparer) if t),
                             return_exceptions=True)
        pending, self._pending = self._pending, []
        for _, _, answer in pending:
            answer(error(wire.E_NOT_REPLICA, "replica closed"))

    # ---- the partition state (the host calls `follow` with every state it sees) ----

    def follow(self, state) -> None:
        """The partition's state changed: catch up while this node is not in the ISR."""
        old, self.state = self.state, state
        me = self.host.node_id
        outside = state.leader is not None and state.leader != me and me not in state.isr
        moved = old is not None and (old.leader, old.epoch) != (state.leader, state.epoch)
        if outside and moved and self._catch_up is not None and not self._catch_up.done():
            self._catch_up.cancel()  # it may be waiting on the old leader: start again
            self._catch_up = None
        if outside and (self._catch_up is None or self._catch_up.done()):
            self._catch_up = asyncio.create_task(self._catch_up_loop())
        elif not outside and self._catch_up is not None:
            self._catch_up.cancel()
            self._catch_up = None

    async def _raise_epoch(self, epoch: int) -> None:
        """Fence: persist `epoch` before anything of it is written."""
        if epoch > self.epoch:
            await asyncio.to_thread(write_json_atomic, self._fence_path, {"epoch": epoch})
            self.epoch = max(self.epoch, epoch)

    # ---- requests ----

    async def handle(self, frame: Frame) -> Answer:
        h = frame.header
        if frame.kind is Kind.CHANNELS:
            if h["epoch"] < self.epoch:
                return error(wire.E_STALE_EPOCH, f"epoch {h['epoch']} < {self.epoch}",
                             epoch=self.epoch)
            self.host.channels_received(self.topic, self.partition, h["channels"])
            return Kind.OK, {}, b""
        fut = asyncio.get_running_loop().create_future()
        self.push(frame, lambda answer: fut.done() or fut.set_result(answer))
        return await fut

    def push(self, frame: Frame, answer) -> None:
        """Take a PUSH (in arrival order); `answer(Answer)` is called once with its answer.
        Called by the RPC server straight from the connection's read (no task, no future of
        its own per push)."""
        h = frame.header
        if h["epoch"] < self.epoch:
            answer(error(wire.E_STALE_EPOCH, f"epoch {h['epoch']} < {self.epoch}",
                         epoch=self.epoch))
            return
        self._pending.append((h, frame.payload, answer))
        if not self._writing and (self._preparer is None or self._preparer.done()):
            self._append_next()

    def _append_next(self) -> None:
        """Take the pushes that wait, in arrival order, one group at a time: refuse a stale
        one; hand the first to `_prepare` when it needs fencing or a reconcile or the lock is
        held (it comes back here after); else append its group straight to the queue
        (`append_raw_then`), answered in `_appended`."""
        while self._pending:
            h = self._pending[0][0]
            verdict = push_verdict(self.epoch, self.level, self.end, h["leader"], h["epoch"],
                                   (h["offset"], h["count"]), h["n"])
            if verdict == Verdict.STALE:  # the fence rose while it waited
                _, _, answer = self._pending.pop(0)
                answer(error(wire.E_STALE_EPOCH, f"epoch {h['epoch']} < {self.epoch}",
                             epoch=self.epoch))
                continue
            if self._lock.locked() or verdict in (Verdict.FENCE, Verdict.RECONCILE):
                self._preparer = asyncio.create_task(self._prepare())
                return
            group = self._group(self._pending, 0)
            del self._pending[:len(group)]
            self.stats["pushes"] += len(group)
            entries, data = self._joined(group)
            try:
                checked = _checksums_match(group)
            except BadBatch as e:
                self._settle(group, e)
                continue
            self._writing = True
            self.q.append_raw_then(h["offset"], h["count"], entries, data,
                                   lambda e: self._appended(group, e), records_checked=checked)
            return

    def _appended(self, group, e: BaseException | None) -> None:
        """A group handed to `append_raw_then` is written (or refused): answer it, let a
        lock holder waiting for it go on, take the next."""
        self._writing = False
        self._settle(group, e)
        quiet, self._quiet = self._quiet, None
        if quiet is not None and not quiet.done():
            quiet.set_result(None)
        if self._preparer is None or self._preparer.done():
            self._append_next()

    async def _quiet_appends(self) -> None:
        """(With the lock held) wait for the group handed to `append_raw_then`, if any."""
        while self._writing:
            if self._quiet is None:
                self._quiet = asyncio.get_running_loop().create_future()
            await self._quiet

    async def _prepare(self) -> None:
        """Under the lock (once its holder is done): fence and reconcile as the first push
        that waits needs (a failure refuses that push alone), then append through
        `_append_next` again. No group is being written meanwhile: `_append_next` hands
        none out while this runs."""
        async with self._lock:
            if not self._pending:
                return
            h, _, answer = self._pending[0]
            if h["epoch"] >= self.epoch:  # else refused as stale by _append_next
                try:
                    await self._raise_epoch(h["epoch"])
                    if self.level != (h["leader"], h["epoch"]):
                        await self._reconcile(h["leader"], h["epoch"])
                except (PeerError, FollowError, OSError, ValueError) as e:
                    log.warning("follower_reconcile_failed", topic=self.topic,
                                partition=self.partition, error=str(e))
                    self._pending.pop(0)
                    answer(error(wire.E_FAILED, f"reconcile: {e}", end=list(self.end)))
        self._preparer = None  # done: _append_next may start another
        self._append_next()

    @staticmethod
    def _group(pending, i: int) -> list:
        """pending[i] and the pushes after it that continue it (same leader and epoch, each
        starting where the one before ends): appended as one."""
        h, payload, _ = pending[i]
        group = [pending[i]]
        try:
            end = batch_end(h["offset"], h["count"], payload[:h["n"] * wire.ENTRY_SIZE])
            for h2, p2, a2 in pending[i + 1:]:
                if (h2["leader"], h2["epoch"]) != (h["leader"], h["epoch"]) or not h2["n"] \
                        or [h2["offset"], h2["count"]] != list(end):
                    break
                end = batch_end(h2["offset"], h2["count"], p2[:h2["n"] * wire.ENTRY_SIZE])
                group.append((h2, p2, a2))
        except clog_entry.CorruptEntryError:
            pass  # append_raw names the bad entry
        return group

    @staticmethod
    def _joined(group) -> tuple:
        """The group's entries and data (one push: slices of its frame's payload, no copy)."""
        if len(group) == 1:
            h, payload, _ = group[0]
            n = h["n"] * wire.ENTRY_SIZE
            return memoryview(payload)[:n], memoryview(payload)[n:]
        return (b"".join(memoryview(p)[:g["n"] * wire.ENTRY_SIZE] for g, p, _ in group),
                b"".join(memoryview(p)[g["n"] * wire.ENTRY_SIZE:] for g, p, _ in group))

    def _settle(self, group, e: BaseException | None) -> None:
        """Answer a group's pushes: ACK with the end (and commit what the leader committed),
        or the ERROR for `e`."""
        if e is None:
            if group[0][0]["n"]:
                self.stats["appends"] += 1
            self.q.commit_to(*group[-1][0]["commit"])
            answer = (Kind.ACK, {"end": list(self.end)}, b"")
        else:
            if isinstance(e, Diverged):  # reconciled before anything more is taken
                self.level = None
            if not isinstance(e, DiskFullError):
                log.warning("follower_push_refused", topic=self.topic, partition=self.partition,
                            error=str(e))
            answer = _answer_error(e, self.end)
        for _, _, a in group:
            a(answer)

    # ---- divergence and catch-up ----

    async def _restart_at_leader_start(self, start: tuple[int, int], leader: str) -> None:
        """The leader's log starts past everything held here (its retention dropped what
        follows our end): drop ours and take its history from its start. Raises FollowError
        when the start is not ahead (a leader's answer that makes no sense here)."""
        async with self._lock:
            await self._quiet_appends()
            if start[0] <= self.q.written_end:
                raise FollowError({"code": wire.E_OUT_OF_RANGE,
                                   "message": f"leader starts at {list(start)}, at or before "
                                              f"our end {list(self.end)}"})
            log.warning("follower_restarting_at_leader_start", topic=self.topic,
                        partition=self.partition, leader=leader, end=list(self.end),
                        start=list(start))
            await self.q.restart_at(*start)
            self.stats["restarts"] += 1

    async def _reconcile(self, leader: str, epoch: int) -> None:
        """Truncate the log until it is a prefix of `leader`'s (KIP-101, KIP-279): send our
        last epoch; the leader answers its largest epoch not above it and where that epoch
        ends there; cut at the lower of that and our own end of that epoch; repeat."""
        peer = self.peers.get(leader)
        while True:
            last = self.q.last_epoch
            r = await self._request(peer, Kind.EPOCH_END, {
                "topic": self.topic, "partition": self.partition, "epoch": epoch,
                "last_epoch": last})
            if r.kind is not Kind.POSITION:
                raise FollowError(r.header)
            answer = (r.header["offset"], r.header["count"])
            found = r.header.get("epoch", last)  # a leader of before KIP-279: an offset only
            own = await self.q.epoch_end(found) if found < last else self.end
            cut = truncation_point(answer, own, self.end)
            if cut is None:
                break
            log.info("follower_truncate", topic=self.topic, partition=self.partition,
                     leader=leader, epoch=epoch, last_epoch=last, leader_epoch=found,
                     end=list(self.end), to=list(cut))
            await self.q.truncate_to(*cut)
            self.stats["truncations"] += 1
        self.level = (leader, epoch)

    async def _catch_up_loop(self) -> None:
        delay = 0.05
        while True:
            state = self.state
            try:
                if await self._catch_up_once(state.leader, state.epoch):
                    return
                delay = 0.05
            except (PeerError, FollowError, AppendError, GapError, BadBatch, ValueError, OSError) as e:
                log.info("follower_catch_up_retry", topic=self.topic, partition=self.partition,
                         error=str(e), delay=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _catch_up_once(self, leader: str, epoch: int) -> bool:
        """Reconcile, fetch until the lag is small, JOIN. True when joined."""
        peer = self.peers.get(leader)
        base = {"topic": self.topic, "partition": self.partition}
        async with self._lock:
            await self._quiet_appends()
            await self._raise_epoch(epoch)
            await self._reconcile(leader, epoch)
        while True:
            offset, count = self.end
            r = await self._request(peer, Kind.FETCH, {**base, "epoch": epoch, "node": self.host.node_id,
                                                "offset": offset, "count": count,
                                                "max_bytes": self.fetch_bytes})
            if r.kind is not Kind.DATA:
                if r.header.get("code") == wire.E_OUT_OF_RANGE and "start" in r.header:
                    await self._restart_at_leader_start(tuple(r.header["start"]), leader)
                    continue
                if r.header.get("code") == wire.E_STALE_EPOCH and "epoch" in r.header:
                    self.state = self.state.evolve(epoch=max(self.state.epoch, r.header["epoch"]))
                raise FollowError(r.header)
            h = r.header
            self.stats["fetches"] += 1
            if h["n"]:
                async with self._lock:
                    await self._quiet_appends()
                    if self.level != (leader, epoch) or self.end != (offset, count):
                        continue  # a push or a reconcile came between: fetch again
                    n = h["n"] * wire.ENTRY_SIZE
                    await self.q.append_raw(offset, count, r.payload[:n], r.payload[n:])
                self.q.commit_to(*h["commit"])
            if h["end"][0] - self.q.written_end <= self.join_lag:
                offset, count = self.end
                started = time.monotonic()
                r = await self._request(peer, Kind.JOIN, {**base, "epoch": epoch,
                                                   "node": self.host.node_id,
                                                   "offset": offset, "count": count})
                if r.kind is Kind.OK:
                    self.stats["joins"] += 1
                    log.info("follower_joined", topic=self.topic, partition=self.partition,
                             leader=leader, epoch=r.header.get("epoch"),
                             ms=round((time.monotonic() - started) * 1000, 1))
                    return True
                raise FollowError(r.header)
