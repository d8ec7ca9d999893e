"""Connection: one asyncio TCP connection to an nsqd, speaking protocol V2.

The base of the partition-aware client, and what our tests and benchmarks use.
Publishing commands wait for their response in order (responses come back
in command order); message frames go to `messages`, an asyncio.Queue, or to
an `on_messages` callback that receives each batch read from the socket.
"""

from __future__ import annotations

import asyncio
from collections import deque

from nsqwire import commands as c, protocol as p


class NSQError(Exception):
    """An E_* error frame answered to one of our commands."""


class Message:
    """`offset` and `size`: the record's place in its partition (SUB_ADVANCED), else None."""

    __slots__ = ("conn", "timestamp", "attempts", "id", "body", "offset", "size")

    def __init__(self, conn: "Connection", timestamp: int, attempts: int, msg_id: bytes,
                 body: bytes, offset: int | None = None, size: int | None = None):
        self.conn = conn
        self.timestamp = timestamp
        self.attempts = attempts
        self.id = msg_id
        self.body = body
        self.offset = offset
        self.size = size

    def fin(self) -> None:
        self.conn.send(c.cmd_fin(self.id))

    def req(self, delay_ms: int = 0, error: str = "") -> None:
        """Requeue; `error` says why (kept with the message if the channel buries it)."""
        self.conn.send(c.cmd_req(self.id, delay_ms, error))

    def touch(self) -> None:
        self.conn.send(c.cmd_touch(self.id))


class Connection:
    def __init__(self, host: str, port: int, on_messages=None):
        self.host = host
        self.port = port
        self.on_messages = on_messages
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.errors: list[str] = []
        self._waiters: deque[asyncio.Future] = deque()
        self._reader_task: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.closed = asyncio.Event()
        self.frame_offsets = False  # set by sub_advanced: frames carry offset and size

    async def connect(self, identify: dict | None = None) -> "Connection":
        reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(p.MAGIC_V2)
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
        if identify is not None:
            await self.command(c.cmd_identify(identify))
        return self

    def send(self, data: bytes) -> None:
        self._writer.write(data)

    async def command(self, data: bytes) -> bytes:
        """Send a command that has a response; return it, or raise NSQError
        (ConnectionError when the connection is closed, before or meanwhile)."""
        if self.closed.is_set():
            raise ConnectionError("connection closed")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._writer.write(data)
        return await fut

    async def pub(self, topic: str, body: bytes) -> None:
        await self.command(c.cmd_pub(topic, body))

    async def mpub(self, topic: str, bodies: list[bytes]) -> None:
        await self.command(c.cmd_mpub(topic, bodies))

    async def dpub(self, topic: str, defer_ms: int, body: bytes) -> None:
        await self.command(c.cmd_dpub(topic, defer_ms, body))

    async def sub(self, topic: str, channel: str, rdy: int = 0) -> None:
        await self.command(c.cmd_sub(topic, channel))
        if rdy:
            self.rdy(rdy)

    async def sub_advanced(self, topic: str, channel: str, partition: int,
                           start: str | None = None, rdy: int = 0) -> None:
        """SUB_ADVANCED: start (`timestamp:<s>`, `offset:<n>`, `count:<n>`, `end`) applies
        when this is the channel's first client; messages then carry `offset` and `size`."""
        self.frame_offsets = True
        await self.command(c.cmd_sub_advanced(topic, channel, partition, start))
        if rdy:
            self.rdy(rdy)

    def rdy(self, count: int) -> None:
        self._writer.write(c.cmd_rdy(count))

    async def close(self) -> None:
        """Close the socket and wait for the reader task to end. A cancellation of the
        caller meanwhile still raises: only the reader's own end is not an error here."""
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.wait([self._reader_task])

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        frames = c.FrameParser()
        try:
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                frames.feed(data)
                batch = []
                for kind, payload in frames.frames():
                    if kind == p.FRAME_MESSAGE and self.frame_offsets:
                        ts, attempts, msg_id, _, offset, size, body = c.parse_offset_message(payload)
                        batch.append(Message(self, ts, attempts, msg_id, body, offset, size))
                    elif kind == p.FRAME_MESSAGE:
                        ts, attempts, msg_id, body = c.parse_message(payload)
                        batch.append(Message(self, ts, attempts, msg_id, body))
                    elif payload == b"_heartbeat_":
                        self._writer.write(c.cmd_nop())
                    elif kind == p.FRAME_ERROR:
                        self._answer_error(payload.decode(errors="replace"))
                    else:
                        self._answer(payload)
                if batch:
                    if self.on_messages is not None:
                        self.on_messages(batch)
                    else:
                        for m in batch:
                            self.messages.put_nowait(m)
        except (ConnectionError, OSError):
            pass  # reset by the peer (a node killed): the end of the connection, as EOF is
        finally:
            self.closed.set()
            while self._waiters:
                fut = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))

    def _answer(self, payload: bytes) -> None:
        if self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(payload)

    def _answer_error(self, text: str) -> None:
        # FIN/REQ/TOUCH failures answer no waiter: they are recorded, not raised
        if text.startswith(("E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED")) or not self._waiters:
            self.errors.append(text)
            return
        fut = self._waiters.popleft()
        if not fut.done():
            fut.set_exception(NSQError(text))
