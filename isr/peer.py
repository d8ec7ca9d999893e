"""The client side of the replication port: one pipelined connection per peer NODE.

`Peer.request` writes a frame at once and returns the response frame; responses carry
their request's id (they may come in any order: the server answers each when it is
ready). The connection (and its HELLO)
is made by the first request; a broken connection fails every pending request with
`PeerError` and the next request connects again. `Peers` keeps one `Peer` per node id
for a whole node (every partition shares it). An ERROR response is returned as a frame:
the caller decides what it means.
"""

from __future__ import annotations

import asyncio

import structlog

from . import wire
from .wire import Decoder, Frame, Kind

log = structlog.get_logger("isr.peer")

READ_CHUNK = 1 << 18
MAX_UNSENT = 128 * 1024 * 1024  # bytes waiting in the socket buffer before we give up


class PeerError(Exception):
    """The connection to a peer failed (connect, send, receive or a bad frame)."""


class Peer:
    """A pipelined connection to one node's replication port."""

    def __init__(self, host, node_id: str, connect_timeout: float = 2.0):
        self.host = host
        self.node_id = node_id
        self.connect_timeout = connect_timeout
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._connecting: asyncio.Future | None = None
        self._reader_task: asyncio.Task | None = None
        self._rid = 0
        self._closed = False

    async def request(self, kind: Kind, header: dict, payload: bytes = b"") -> Frame:
        if self._writer is None:
            await self._connect()
        return await self._send_now(kind, header, payload)

    def send(self, kind: Kind, header: dict | bytes, payload: bytes | tuple = b"") -> asyncio.Future:
        """Queue a request on a connected peer without awaiting (keeps the order of
        calls); raises `PeerError` when not connected. `header` may come encoded
        (`wire.dumps`: a batch pushed to several followers encodes it once); the payload's
        parts are written as they are, not joined."""
        return self._send_now(kind, header, payload)

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def connect(self) -> None:
        if self._writer is None:
            await self._connect()

    def _send_now(self, kind, header, payload) -> asyncio.Future:
        w = self._writer
        if w is None:
            raise PeerError(f"{self.node_id}: not connected")
        if w.transport.get_write_buffer_size() > MAX_UNSENT:
            self._broken(PeerError(f"{self.node_id}: {MAX_UNSENT} bytes unsent"))
            raise PeerError(f"{self.node_id}: peer does not read")
        self._rid = self._rid % 0xFFFFFFFF + 1  # 1 .. 2**32 - 1; 0 is HELLO's
        fut = asyncio.get_running_loop().create_future()
        self._pending[self._rid] = fut
        head = header if isinstance(header, bytes) else wire.dumps(header)
        w.writelines(wire.frame_parts(kind, self._rid, head,
                                      payload if isinstance(payload, tuple) else (payload,)))
        return fut

    async def _connect(self) -> None:
        if self._closed:
            raise PeerError(f"{self.node_id}: closed")
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            if self._writer is None:
                raise PeerError(f"{self.node_id}: connect failed")
            return
        self._connecting = asyncio.get_running_loop().create_future()
        try:
            address = self.host.peer_address(self.node_id)
            if address is None:
                raise PeerError(f"{self.node_id}: no address")
            h, _, p = address.rpartition(":")
            reader, writer = await asyncio.wait_for(asyncio.open_connection(h, int(p)),
                                                    self.connect_timeout)
            writer.write(wire.encode(Kind.HELLO, 0, {"cluster": self.host.cluster_id,
                                                     "node": self.host.node_id}))
            decoder = Decoder()
            frames: list[Frame] = []
            while not frames:
                chunk = await asyncio.wait_for(reader.read(READ_CHUNK), self.connect_timeout)
                if not chunk:
                    raise PeerError(f"{self.node_id}: closed during HELLO")
                frames = decoder.feed(chunk)
            if frames[0].kind is not Kind.OK:
                writer.close()
                raise PeerError(f"{self.node_id}: HELLO refused: {frames[0].header}")
            self._writer = writer
            self._reader_task = asyncio.create_task(self._read(reader, decoder, frames[1:]))
        except (TimeoutError, OSError, wire.BadFrame, ValueError) as e:
            raise PeerError(f"{self.node_id}: {e!r}") from None
        finally:
            self._connecting.set_result(None)
            self._connecting = None

    async def _read(self, reader, decoder, early) -> None:
        try:
            for f in early:
                self._answer(f)
            while True:
                chunk = await reader.read(READ_CHUNK)
                if not chunk:
                    raise PeerError(f"{self.node_id}: connection closed")
                for f in decoder.feed(chunk):
                    self._answer(f)
        except (OSError, PeerError, wire.BadFrame) as e:
            self._broken(e if isinstance(e, PeerError) else PeerError(f"{self.node_id}: {e!r}"))

    def _answer(self, frame: Frame) -> None:
        fut = self._pending.pop(frame.rid, None)
        if fut is None:
            raise PeerError(f"{self.node_id}: answer {frame.rid} to no request")
        if not fut.done():
            fut.set_result(frame)

    def _broken(self, error: PeerError) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            log.info("peer_disconnected", node=self.node_id, reason=str(error))
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: a caller that gave up must not log it
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def disconnect(self) -> None:
        self._broken(PeerError(f"{self.node_id}: disconnected"))

    async def close(self) -> None:
        self._closed = True
        task = self._reader_task
        self.disconnect()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)


class Peers:
    """One `Peer` per node id, shared by every partition of this node."""

    def __init__(self, host):
        self.host = host
        self._peers: dict[str, Peer] = {}

    def get(self, node_id: str) -> Peer:
        peer = self._peers.get(node_id)
        if peer is None:
            peer = self._peers[node_id] = Peer(self.host, node_id)
        return peer

    async def close(self) -> None:
        peers, self._peers = self._peers, {}
        await asyncio.gather(*(p.close() for p in peers.values()))
