"""`RpcServer`: the node's replication port (`--rpc-address`).

One task reads each connection. Every request runs as its own task as soon as it is read
(so PUSHes of many partitions on one connection overlap), and each answer is written as
soon as it is ready, with its request's id (a slow partition never holds back another's
answers; the order of one partition's PUSHes is kept by its FollowerLog). At most
`MAX_IN_FLIGHT` requests of a connection are unanswered before it stops reading, and it
stops reading while its unsent answers pass `MAX_UNSENT` (bounded memory). The first
frame must be HELLO of this cluster. A frame that does not decode or a request that does
not check is answered with one ERROR E_BAD_FRAME, then the connection is closed. PUSH and
CHANNELS go to `host.follower_log`, FETCH, EPOCH_END and JOIN to `host.leader_log`
(absent: E_NOT_REPLICA / E_NOT_LEADER); each answers with `(kind, header, payload)`. A
PUSH whose FollowerLog is open goes to `FollowerLog.push` straight from the read (no task
of its own: the hot path). A
handler that raises answers E_FAILED; the server never dies of a request. A handler runs
to its end even if its connection closes (a JOIN's CAS is never cut in half); `stop`
cancels them.
"""

from __future__ import annotations

import asyncio

import structlog

from . import wire
from .wire import BadFrame, Decoder, Frame, Kind

ARRIVAL_S = 0.5  # how long a request waits for its partition's side to open (< repl timeout)
log = structlog.get_logger("isr.rpc")

MAX_IN_FLIGHT = 256
MAX_UNSENT = 16 * 1024 * 1024
READ_CHUNK = 1 << 18

Answer = tuple[Kind, dict, bytes]


async def _arrival(lookup, topic: str, partition: int):
    """`lookup(topic, partition)`, waiting up to ARRIVAL_S for it: a node that has not applied
    the view yet (a topic just created, a leader just elected) is given the time to open its
    side before the request is refused (the leader would drop a follower for that)."""
    target = lookup(topic, partition)
    deadline = asyncio.get_running_loop().time() + ARRIVAL_S
    while target is None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
        target = lookup(topic, partition)
    return target


def error(code: str, message: str, **extra) -> Answer:
    return Kind.ERROR, {"code": code, "message": message, **extra}, b""


FOLLOWER_KINDS = frozenset({Kind.PUSH, Kind.CHANNELS})


class RpcServer:
    """Serves the replication requests of peers to this node's partitions."""

    def __init__(self, host, address: str = "0.0.0.0:4250"):
        self.host = host
        self.address = address
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._handlers: set[asyncio.Task] = set()
        self.port = 0

    async def start(self) -> None:
        h, _, p = self.address.rpartition(":")
        self._server = await asyncio.start_server(self._serve, h, int(p), limit=READ_CHUNK)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("rpc_listening", address=f"{h}:{self.port}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = [*self._connections, *self._handlers]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            await _Connection(self, reader, writer).receive()
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._connections.discard(task)

    async def _dispatch(self, frame: Frame) -> Answer:
        h = frame.header
        try:
            if frame.kind is Kind.PING:
                return Kind.OK, {}, b""
            if frame.kind is Kind.HELLO:
                return error(wire.E_BAD_FRAME, "HELLO twice")
            if frame.kind in FOLLOWER_KINDS:
                target = await _arrival(self.host.follower_log, h["topic"], h["partition"])
                if target is None:
                    return error(wire.E_NOT_REPLICA, f"no replica of {h['topic']}/{h['partition']}")
            else:
                target = await _arrival(self.host.leader_log, h["topic"], h["partition"])
                if target is None:
                    return error(wire.E_NOT_LEADER, f"not the leader of {h['topic']}/{h['partition']}")
            return await target.handle(frame)
        except Exception as e:  # noqa: BLE001 - a request never takes the server down
            log.warning("rpc_request_failed", kind=frame.kind.name, error=repr(e))
            return error(wire.E_FAILED, repr(e))


class _Connection:
    """One peer's connection: reads its requests, writes each answer when it is ready (the
    answers ready in one turn of the loop in one write)."""

    def __init__(self, server: RpcServer, reader, writer):
        self.server = server
        self.reader = reader
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.hello = False
        self._unsent: list[bytes] = []  # answers to write at the end of this loop turn

    async def receive(self) -> None:
        decoder = Decoder()
        while True:
            if self.writer.transport.get_write_buffer_size() > MAX_UNSENT:
                await self.writer.drain()
            chunk = await self.reader.read(READ_CHUNK)
            if not chunk:
                return
            bad = None
            try:
                frames = decoder.feed(chunk)
            except BadFrame as e:
                frames, bad = e.frames, e
            for frame in frames:
                await self.slots.acquire()
                if not self._take(frame):
                    self._flush()
                    await self.writer.drain()
                    return
            if bad is not None:
                log.warning("rpc_bad_frame", peer=self.peer, reason=str(bad))
                self._answer(0, error(wire.E_BAD_FRAME, str(bad)), slot=False)
                self._flush()
                await self.writer.drain()
                return

    def _take(self, frame: Frame) -> bool:
        """Answer one frame now or start its handler; False when the connection must close."""
        try:
            wire.check(frame)
        except BadFrame as e:
            log.warning("rpc_bad_frame", peer=self.peer, reason=str(e))
            self._answer(frame.rid, error(wire.E_BAD_FRAME, str(e)))
            return False
        if not self.hello:
            if frame.kind is not Kind.HELLO:
                self._answer(frame.rid, error(wire.E_BAD_FRAME, "the first frame must be HELLO"))
                return False
            cluster = self.server.host.cluster_id
            if frame.header["cluster"] != cluster:
                self._answer(frame.rid, error(wire.E_BAD_CLUSTER, f"this is cluster {cluster!r}"))
                return False
            self.hello = True
            self._answer(frame.rid, (Kind.OK, {"node": self.server.host.node_id}, b""))
            return True
        if frame.kind is Kind.PUSH:  # the hot path: straight to its partition, no task
            h = frame.header
            follower = self.server.host.follower_log(h["topic"], h["partition"])
            if follower is not None:
                try:
                    pushed = follower.push(frame)
                except Exception as e:  # noqa: BLE001 - a request never takes the server down
                    log.warning("rpc_request_failed", kind=frame.kind.name, error=repr(e))
                    self._answer(frame.rid, error(wire.E_FAILED, repr(e)))
                    return True
                pushed.add_done_callback(lambda fut: self._pushed(frame.rid, fut))
                return True
        task = asyncio.ensure_future(self.server._dispatch(frame))
        self.server._handlers.add(task)
        task.add_done_callback(lambda t: self._done(frame.rid, t))
        return True

    def _done(self, rid: int, task: asyncio.Task) -> None:
        self.server._handlers.discard(task)
        if task.cancelled():
            self.slots.release()
            return
        self._answer(rid, task.result())

    def _pushed(self, rid: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            self.slots.release()
            return
        self._answer(rid, fut.result())

    def _answer(self, rid: int, answer: Answer, slot: bool = True) -> None:
        if slot:
            self.slots.release()
        if self.writer.is_closing():
            return
        kind, header, payload = answer
        if not self._unsent:  # the answers ready in one turn of the loop go in one write
            asyncio.get_running_loop().call_soon(self._flush)
        self._unsent.append(wire.encode(kind, rid, header, payload))

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        if self.writer.is_closing():
            return
        try:
            self.writer.write(b"".join(unsent))
        except (OSError, RuntimeError):
            pass
