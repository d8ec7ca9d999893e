"""The client side of the replication port: one pipelined connection per peer NODE.

`Peer.request` writes a frame at once and returns the response frame; responses carry
their request's id (they may come in any order: the server answers each when it is
ready). `Peer.send_callback` is the hot path's form (PUSH): no future, the answer (or the
`PeerError` that ended the connection) goes to a callback called straight from the
connection's `data_received`. The connection (an `asyncio.Protocol`, no reader task) and
its HELLO are made by the first request; a peer that answers HELLO with another
`wire.VERSION` is refused (`PeerError`, logged). A broken connection fails every pending
request with `PeerError` and the next request connects again. `Peers` keeps one `Peer`
per node id for a whole node (every partition shares it). An ERROR response is returned
as a frame: the caller decides what it means.
"""

from __future__ import annotations

import asyncio

import structlog

from . import wire
from .wire import BadFrame, Decoder, Frame, Kind

log = structlog.get_logger("isr.peer")

MAX_UNSENT = 128 * 1024 * 1024  # bytes waiting in the socket buffer before we give up


class PeerError(Exception):
    """The connection to a peer failed (connect, send, receive or a bad frame)."""


class _Connection(asyncio.Protocol):
    """The bytes of one connection to a peer: the first frame answers HELLO (`hello`), every
    later one goes to `Peer._answer`."""

    def __init__(self, peer: Peer):
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.decoder = Decoder()
        self.hello: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        bad = None
        try:
            frames = self.decoder.feed(data)
        except BadFrame as e:
            frames, bad = e.frames, e
        try:
            for f in frames:
                if not self.hello.done():
                    self.hello.set_result(f)
                elif self.transport is self.peer._transport:
                    self.peer._answer(f)
            if bad is not None:
                raise PeerError(f"{self.peer.node_id}: {bad!r}")
        except PeerError as e:
            self.transport.close()
            self.peer._broken(e, self.transport)

    def connection_lost(self, exc) -> None:
        error = PeerError(f"{self.peer.node_id}: connection closed"
                          + (f" ({exc!r})" if exc else ""))
        if not self.hello.done():
            self.hello.set_exception(error)
            self.hello.exception()  # retrieved: the connect may have given up already
        self.peer._broken(error, self.transport)


class Peer:
    """A pipelined connection to one node's replication port."""

    def __init__(self, host, node_id: str, connect_timeout: float = 2.0):
        self.host = host
        self.node_id = node_id
        self.connect_timeout = connect_timeout
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, object] = {}  # request id -> Future or callback
        self._connecting: asyncio.Future | None = None
        self._rid = 0
        self._closed = False

    async def request(self, kind: Kind, header: dict, payload: bytes = b"") -> Frame:
        if self._transport is None:
            await self._connect()
        return await self.send(kind, header, payload)

    def send(self, kind: Kind, header: dict | bytes, payload: bytes | tuple = b"") -> asyncio.Future:
        """Queue a request on a connected peer without awaiting (keeps the order of
        calls); raises `PeerError` when not connected. `header` may come encoded
        (`wire.encode_header`: a batch pushed to several followers encodes it once); the
        payload's parts are written as they are, not joined."""
        fut = asyncio.get_running_loop().create_future()
        self._send_now(kind, header, payload, fut)
        return fut

    def send_callback(self, kind: Kind, header: dict | bytes, payload, answered) -> None:
        """`send` without a future: `answered(Frame | PeerError)` is called once, from the
        connection's read (or when it breaks)."""
        self._send_now(kind, header, payload, answered)

    @property
    def connected(self) -> bool:
        return self._transport is not None

    async def connect(self) -> None:
        if self._transport is None:
            await self._connect()

    def _send_now(self, kind, header, payload, waiter) -> None:
        t = self._transport
        if t is None:
            raise PeerError(f"{self.node_id}: not connected")
        if t.get_write_buffer_size() > MAX_UNSENT:
            self._broken(PeerError(f"{self.node_id}: {MAX_UNSENT} bytes unsent"), t)
            raise PeerError(f"{self.node_id}: peer does not read")
        self._rid = self._rid % 0xFFFFFFFF + 1  # 1 .. 2**32 - 1; 0 is HELLO's
        head = header if isinstance(header, bytes) else wire.encode_header(kind, header)
        parts = wire.frame_parts(kind, self._rid, head,
                                 payload if isinstance(payload, tuple) else (payload,))
        self._pending[self._rid] = waiter
        t.writelines(parts)

    async def _connect(self) -> None:
        if self._closed:
            raise PeerError(f"{self.node_id}: closed")
        if self._connecting is not None:
            await asyncio.shield(self._connecting)
            if self._transport is None:
                raise PeerError(f"{self.node_id}: connect failed")
            return
        self._connecting = asyncio.get_running_loop().create_future()
        transport = None
        try:
            address = self.host.peer_address(self.node_id)
            if address is None:
                raise PeerError(f"{self.node_id}: no address")
            h, _, p = address.rpartition(":")
            async with asyncio.timeout(self.connect_timeout):
                transport, conn = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self), h, int(p))
            transport.write(wire.encode(Kind.HELLO, 0, {"cluster": self.host.cluster_id,
                                                        "node": self.host.node_id,
                                                        "version": wire.VERSION}))
            async with asyncio.timeout(self.connect_timeout):
                frame = await asyncio.shield(conn.hello)
            if frame.kind is not Kind.OK:
                raise PeerError(f"{self.node_id}: HELLO refused: {frame.header}")
            version = frame.header.get("version", 1)
            if version != wire.VERSION:
                log.warning("peer_bad_version", node=self.node_id, version=version,
                            ours=wire.VERSION)
                raise PeerError(f"{self.node_id}: speaks wire version {version!r}, this node "
                                f"{wire.VERSION}")
            self._transport, transport = transport, None
        except (TimeoutError, OSError, BadFrame, ValueError) as e:
            raise PeerError(f"{self.node_id}: {e!r}") from None
        finally:
            if transport is not None:
                transport.close()
            self._connecting.set_result(None)
            self._connecting = None

    def _answer(self, frame: Frame) -> None:
        waiter = self._pending.pop(frame.rid, None)
        if waiter is None:
            raise PeerError(f"{self.node_id}: answer {frame.rid} to no request")
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(frame)
        else:
            waiter(frame)

    def _broken(self, error: PeerError, transport=None) -> None:
        """The connection ended (`transport`: that one only, None: the current one)."""
        if transport is not None and transport is not self._transport:
            return
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            log.info("peer_disconnected", node=self.node_id, reason=str(error))
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_exception(error)
                    waiter.exception()  # retrieved: a caller that gave up must not log it
            else:
                waiter(error)

    def disconnect(self) -> None:
        self._broken(PeerError(f"{self.node_id}: disconnected"))

    async def close(self) -> None:
        self._closed = True
        self.disconnect()


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
