"""`FollowerLog`: the follower side of one partition: the driver of
`followcore.FollowerCore`.

The core decides (fencing, which pushes go to the log and when, the KIP-279 EPOCH_END
rounds and where to cut, the catch-up's steps and its JOIN); this driver does the I/O it
asks for: the fence file (`fence.json` in the partition folder, written before anything of
its epoch), appends of push groups with `append_raw_then` (no task or future per push),
EPOCH_END / FETCH / JOIN to the leader (each with a deadline: a leader that hangs never
holds this replica), truncations, fetched chunks, a restart at the leader's start, and
CHANNELS (handed to `host.channels_received`).

Invariants: the core's (isr/followcore.py): nothing of an epoch older than the fence is
taken; the log is appended only while level with the pushing leadership; one job changes
the log at a time; pushes are answered in arrival order, each once.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import structlog

from commitlog import entry as clog_entry
from diskqueue.atomic import read_json, write_json_atomic
from diskqueue.errors import DiskFullError, Diverged, GapError
from diskqueue.raw import BadBatch

from . import wire
from .followcore import FollowerCore, Push
from .peer import PeerError, Peers
from .rpc import Answer, error
from .wire import Frame, Kind

log = structlog.get_logger("isr.follower")

FENCE_FILE = "fence.json"
REQUEST_TIMEOUT = 2.0  # s: EPOCH_END, FETCH and JOIN to a leader that does not answer
FETCH_BYTES = 1 << 20
JOIN_LAG = 64 * 1024


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
    """Keeps one partition's log a copy of its leader's (see the module docstring)."""

    def __init__(self, host, peers: Peers, topic: str, partition: int, q, *,
                 fetch_bytes: int = FETCH_BYTES, join_lag: int = JOIN_LAG):
        self.host = host
        self.peers = peers
        self.topic = topic
        self.partition = partition
        self.q = q
        self.fetch_bytes = fetch_bytes
        self.join_lag = join_lag
        self.state = None
        self.core: FollowerCore | None = None
        self._chunk: tuple[int, Frame] | None = None  # (request id, DATA) the core may append
        self._tasks: set[asyncio.Task] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._fence_path = os.path.join(q.path, FENCE_FILE)
        self.stats = {"pushes": 0, "appends": 0, "fetches": 0, "truncations": 0, "joins": 0,
                      "restarts": 0}

    @property
    def epoch(self) -> int:
        """The fence: the highest epoch seen (persisted before anything of it is taken)."""
        return self.core.fence if self.core is not None else 0

    @property
    def opened(self) -> bool:
        """`open` is done: requests may be taken."""
        return self.core is not None

    @property
    def end(self) -> tuple[int, int]:
        return self.q.written_end, self.q.written_count

    async def open(self) -> FollowerLog:
        fence = await asyncio.to_thread(read_json, self._fence_path, {})
        fence = fence.get("epoch", 0) if isinstance(fence, dict) else 0
        self.core = FollowerCore(fence=max(fence, self.q.last_epoch), end=self.end,
                                 last_epoch=self.q.last_epoch, join_lag=self.join_lag)
        return self

    async def close(self) -> None:
        self.core.close()
        self._run()
        for timer in self._timers:
            timer.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the partition state (the host calls `follow` with every state it sees) ----

    def follow(self, state) -> None:
        """The partition's state changed: catch up while this node is not in the ISR."""
        self.state = state
        me = self.host.node_id
        outside = state.leader is not None and state.leader != me and me not in state.isr
        self.core.follow(state.leader, state.epoch, outside)
        self._run()

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
        start = (h["offset"], h["count"])
        try:
            end = batch_end(h["offset"], h["count"], frame.payload[:h["n"] * wire.ENTRY_SIZE])
        except clog_entry.CorruptEntryError:
            end = start  # appended alone: the log's check names the bad entry
        self.core.push(Push(h["leader"], h["epoch"], start, end, h["n"], tuple(h["commit"]),
                            (h, frame.payload, answer)))
        self._run()

    # ---- doing what the core says ----

    def _run(self) -> None:
        core = self.core
        while steps := core.take():
            for kind, args in steps:
                getattr(self, "_" + kind)(*args)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answer(self, pushes, result) -> None:
        kind = result[0]
        if kind == "ack":
            reply = (Kind.ACK, {"end": list(result[1])}, b"")
        elif kind == "stale":
            reply = error(wire.E_STALE_EPOCH, f"epoch < {result[1]}", epoch=result[1])
        elif kind == "gap":
            reply = error(wire.E_GAP, f"push starts past our end {list(result[1])}",
                          end=list(result[1]))
        elif kind == "failed":
            log.warning("follower_reconcile_failed", topic=self.topic,
                        partition=self.partition, error=result[1])
            reply = error(wire.E_FAILED, result[1], end=list(result[2]))
        else:
            e = result[1]
            if not isinstance(e, DiskFullError):
                log.warning("follower_push_refused", topic=self.topic,
                            partition=self.partition, error=str(e))
            reply = _answer_error(e, result[2])
        for p in pushes:
            p.token[2](reply)

    def _commit(self, pos) -> None:
        self.q.commit_to(*pos)

    def _append(self, group) -> None:
        """A group of pushes to the log as one raw batch (straight to the write worker when
        its slot is free: no task, no future)."""
        self.stats["pushes"] += len(group)
        tokens = [p.token for p in group]
        entries, data = _joined(tokens)
        try:
            checked = _checksums_match(tokens)
        except BadBatch as e:
            self.core.written(self.end, self.q.last_epoch, e)
            return
        if group[0].n:
            self.stats["appends"] += 1
        first = group[0]
        self.q.append_raw_then(first.start[0], first.start[1], entries, data,
                               self._appended, records_checked=checked)

    def _appended(self, e: BaseException | None) -> None:
        self.core.written(self.end, self.q.last_epoch, e, isinstance(e, Diverged))
        self._run()

    def _fence(self, epoch: int) -> None:
        async def job():
            try:
                await asyncio.to_thread(write_json_atomic, self._fence_path, {"epoch": epoch})
            except OSError as e:
                self.core.fenced(epoch, e)
            else:
                self.core.fenced(epoch)
            self._run()
        self._spawn(job())

    def _retry(self, delay: float) -> None:
        def fire():
            self._timers.discard(timer)
            self.core.retry()
            self._run()
        timer = asyncio.get_running_loop().call_later(delay, fire)
        self._timers.add(timer)

    def _level(self, leader: str, epoch: int) -> None:
        """The log is level with (leader, epoch): nothing to do but take its pushes."""

    async def _request(self, rid: int, leader: str, kind: Kind, header: dict) -> Frame | None:
        """A request to the leader with a deadline; None (the core told) when it failed."""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                r = await self.peers.get(leader).request(kind, header)
        except (TimeoutError, PeerError, OSError) as e:
            reason = f"{leader}: no answer to {kind.name} in {REQUEST_TIMEOUT} s" \
                if isinstance(e, TimeoutError) else f"{leader}: {e}"
            log.info("follower_request_failed", topic=self.topic, partition=self.partition,
                     request=kind.name, error=reason)
            self.core.request_failed(rid, reason)
            self._run()
            return None
        if r.kind is Kind.ERROR:
            code, seen = r.header.get("code"), r.header.get("epoch")
            if code == wire.E_OUT_OF_RANGE and kind is Kind.FETCH and "start" in r.header:
                self.core.out_of_range(rid, tuple(r.header["start"]))
            else:
                log.info("follower_request_refused", topic=self.topic,
                         partition=self.partition, request=kind.name,
                         error=f"{code}: {r.header.get('message')}")
                self.core.request_failed(rid, f"{code}: {r.header.get('message')}",
                                         seen if isinstance(seen, int) else None)
            self._run()
            return None
        return r

    def _base(self, epoch: int) -> dict:
        return {"topic": self.topic, "partition": self.partition, "epoch": epoch}

    def _epoch_end(self, rid: int, leader: str, epoch: int, last_epoch: int) -> None:
        async def job():
            r = await self._request(rid, leader, Kind.EPOCH_END,
                                    {**self._base(epoch), "last_epoch": last_epoch})
            if r is None:
                return
            if r.kind is not Kind.POSITION:
                self.core.request_failed(rid, f"EPOCH_END answered {r.kind.name}")
            else:
                h = r.header
                found = h.get("epoch", last_epoch)  # a leader of before KIP-279: an offset
                try:
                    own = await self.q.epoch_end(found) if found < self.q.last_epoch else self.end
                except Exception as e:  # noqa: BLE001 - the log closed or failed
                    self.core.request_failed(rid, f"own epoch end: {e!r}")
                else:
                    self.core.epoch_answer(rid, found, (h["offset"], h["count"]), own)
            self._run()
        self._spawn(job())

    def _log_job(self, op, done, counted: str | None = None) -> None:
        """Run the log job `op()` (a coroutine function), then tell the core by `done(end,
        last_epoch[, error])`; `counted`: the stat it adds to when it succeeds."""
        async def job():
            try:
                await op()
            except Exception as e:  # noqa: BLE001 - the core decides what a failure means
                log.info("follower_log_job_failed", topic=self.topic, partition=self.partition,
                         job=op.__name__, error=repr(e))
                done(self.end, self.q.last_epoch, e)
            else:
                if counted:
                    self.stats[counted] += 1
                done(self.end, self.q.last_epoch)
            self._run()
        self._spawn(job())

    def _truncate(self, pos) -> None:
        log.info("follower_truncate", topic=self.topic, partition=self.partition,
                 end=list(self.end), to=list(pos))

        async def truncate():
            await self.q.truncate_to(*pos)
        self._log_job(truncate, self.core.truncated, "truncations")

    def _fetch(self, rid: int, leader: str, epoch: int, pos) -> None:
        async def job():
            r = await self._request(rid, leader, Kind.FETCH, {
                **self._base(epoch), "node": self.host.node_id, "offset": pos[0],
                "count": pos[1], "max_bytes": self.fetch_bytes})
            if r is None:
                return
            h = r.header
            self.stats["fetches"] += 1
            self._chunk = (rid, r) if h["n"] else None
            self.core.fetched(rid, (h["offset"], h["count"]), h["n"], tuple(h["end"]),
                              tuple(h["commit"]))
            self._run()
        self._spawn(job())

    def _append_fetched(self, rid: int) -> None:
        chunk, self._chunk = self._chunk, None
        if chunk is None or chunk[0] != rid:  # (never: the core asks for the chunk it has)
            self.core.written(self.end, self.q.last_epoch, ValueError("no fetched chunk"))
            return
        h, payload = chunk[1].header, chunk[1].payload
        n = h["n"] * wire.ENTRY_SIZE

        async def append_fetched():
            await self.q.append_raw(h["offset"], h["count"], payload[:n], payload[n:])
        self._log_job(append_fetched, self.core.written)

    def _restart(self, start) -> None:
        log.warning("follower_restarting_at_leader_start", topic=self.topic,
                    partition=self.partition, end=list(self.end), start=list(start))

        async def restart():
            await self.q.restart_at(*start)
        self._log_job(restart, self.core.restarted, "restarts")

    def _join(self, rid: int, leader: str, epoch: int, pos) -> None:
        async def job():
            started = time.monotonic()
            r = await self._request(rid, leader, Kind.JOIN, {
                **self._base(epoch), "node": self.host.node_id, "offset": pos[0],
                "count": pos[1]})
            if r is None:
                return
            if r.kind is Kind.OK:
                self.stats["joins"] += 1
                log.info("follower_joined", topic=self.topic, partition=self.partition,
                         leader=leader, epoch=r.header.get("epoch"),
                         ms=round((time.monotonic() - started) * 1000, 1))
                self.core.joined(rid)
            else:
                self.core.request_failed(rid, f"JOIN answered {r.kind.name}")
            self._run()
        self._spawn(job())


def _joined(tokens) -> tuple:
    """The group's entries and data (one push: slices of its frame's payload, no copy)."""
    if len(tokens) == 1:
        h, payload, _ = tokens[0]
        n = h["n"] * wire.ENTRY_SIZE
        return memoryview(payload)[:n], memoryview(payload)[n:]
    return (b"".join(memoryview(p)[:g["n"] * wire.ENTRY_SIZE] for g, p, _ in tokens),
            b"".join(memoryview(p)[g["n"] * wire.ENTRY_SIZE:] for g, p, _ in tokens))
