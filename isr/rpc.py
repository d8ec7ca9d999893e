"""`RpcServer`: the node's replication port (`--rpc-address`).

One task reads each connection and one writes it. Every request runs as its own task as
soon as it is read (so PUSHes of many partitions on one connection overlap), and the
answers go out in request order. At most `MAX_IN_FLIGHT` requests of a connection are
unanswered before it stops reading (bounded memory: that many requests plus one frame in
the decoder). The first frame must be HELLO of this cluster. A frame that does not decode
or a request that does not check is answered with one ERROR E_BAD_FRAME, then the
connection is closed. PUSH and CHANNELS go to `host.follower_log`, FETCH, EPOCH_END and
JOIN to `host.leader_log` (absent: E_NOT_REPLICA / E_NOT_LEADER); each answers with
`(kind, header, payload)`. A handler that raises answers E_FAILED; the server never dies
of a request.
"""

from __future__ import annotations

import asyncio

import structlog

from . import wire
from .wire import BadFrame, Decoder, Frame, Kind

ARRIVAL_S = 0.5  # how long a request waits for its partition's side to open (< repl timeout)
log = structlog.get_logger("isr.rpc")

MAX_IN_FLIGHT = 256
READ_CHUNK = 1 << 18
_CLOSE = object()

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
        for t in list(self._connections):
            t.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._connections.add(task)
        answers: asyncio.Queue = asyncio.Queue(MAX_IN_FLIGHT)
        sender = asyncio.create_task(self._send(writer, answers))
        peer = writer.get_extra_info("peername")
        try:
            await self._receive(reader, answers, peer)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            try:
                await answers.put(_CLOSE)
                await sender
            except asyncio.CancelledError:
                sender.cancel()
            writer.close()
            self._connections.discard(task)

    async def _receive(self, reader, answers: asyncio.Queue, peer) -> None:
        decoder = Decoder()
        hello = [False]
        while True:
            chunk = await reader.read(READ_CHUNK)
            if not chunk:
                return
            bad = None
            try:
                frames = decoder.feed(chunk)
            except BadFrame as e:
                frames, bad = e.frames, e
            for frame in frames:
                if not await self._take(frame, answers, hello, peer):
                    return
            if bad is not None:
                log.warning("rpc_bad_frame", peer=peer, reason=str(bad))
                await answers.put(_done(0, error(wire.E_BAD_FRAME, str(bad))))
                return

    async def _take(self, frame: Frame, answers: asyncio.Queue, hello: list, peer) -> bool:
        """Queue the answer to one frame; False when the connection must close."""
        try:
            wire.check(frame)
        except BadFrame as e:
            log.warning("rpc_bad_frame", peer=peer, reason=str(e))
            await answers.put(_done(frame.rid, error(wire.E_BAD_FRAME, str(e))))
            return False
        if not hello[0]:
            if frame.kind is not Kind.HELLO:
                await answers.put(_done(frame.rid, error(
                    wire.E_BAD_FRAME, "the first frame must be HELLO")))
                return False
            if frame.header["cluster"] != self.host.cluster_id:
                await answers.put(_done(frame.rid, error(
                    wire.E_BAD_CLUSTER, f"this is cluster {self.host.cluster_id!r}")))
                return False
            hello[0] = True
            await answers.put(_done(frame.rid, (Kind.OK, {"node": self.host.node_id}, b"")))
            return True
        await answers.put((frame.rid, asyncio.ensure_future(self._dispatch(frame))))
        return True

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

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, answers: asyncio.Queue) -> None:
        try:
            while True:
                item = await answers.get()
                if item is _CLOSE:
                    await writer.drain()
                    return
                rid, fut = item
                kind, header, payload = await fut
                writer.write(wire.encode(kind, rid, header, payload))
                if answers.empty():
                    await writer.drain()
        except (OSError, ConnectionError):
            pass


def _done(rid: int, answer: Answer):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(answer)
    return rid, fut
