"""Client: the state of one TCP connection, as a consumer and as a producer.

Owns its negotiated settings, RDY, the in-flight messages it holds (a dict keyed by
the 16 id bytes sent on the wire, in delivery order, which is deadline order since
one client has one msg_timeout; TOUCH moves a message to the end), counters for /stats, and the outgoing
byte stream, compressed when negotiated.

Output buffering, as classic nsqd negotiates it: message frames wait in a buffer
until it holds output_buffer_size bytes, the client can take no more (in flight
reached RDY), or output_buffer_timeout passes; any other frame goes out at once,
after what the buffer holds. A timeout of 0 (the client sent -1) sends each
delivery at once.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib

from nsqwire.frames import encode_messages
from nsqwire.ids import encode_msg_id

from .identify import ClientSettings


class Client:
    def __init__(self, client_id: int, remote_address: str, settings: ClientSettings):
        self.id = client_id
        self.remote_address = remote_address
        self.settings = settings
        self.ready_count = 0
        self.writable = True  # False while the transport's buffer is above its high mark
        self.in_flight: dict = {}
        self.channel = None
        self.topic_name = ""
        self.connect_ts = time.time()
        self.message_count = 0
        self.finish_count = 0
        self.requeue_count = 0
        self.pub_counts: dict[str, int] = {}
        self.authorizations: list | None = None  # None: no AUTH done
        self.auth_identity = ""
        self.auth_secret = b""
        self.auth_expires = 0.0  # time.monotonic() after which AUTH is asked again
        self.tls = False
        self._transport = None
        self._compress = None
        self._buffered: list[bytes] = []  # message frames not sent yet
        self._buffered_bytes = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self.bytes_out = 0  # handed to the transport; minus its buffer: what the kernel took

    @property
    def msg_timeout(self) -> float:
        return self.settings.msg_timeout_ms / 1000

    def attach(self, transport) -> None:
        self._transport = transport

    def use_deflate(self, level: int) -> None:
        obj = zlib.compressobj(level, zlib.DEFLATED, -15)
        self._compress = lambda data: obj.compress(data) + obj.flush(zlib.Z_SYNC_FLUSH)

    def use_snappy(self) -> None:
        import snappy

        stream = snappy.StreamCompressor()
        self._compress = stream.add_chunk

    def write(self, data: bytes) -> None:
        """Send a frame now, after the message frames buffered before it."""
        if self._buffered:
            data = self._take_buffered() + data
        self._send(data)

    def flush(self) -> None:
        """Send the buffered message frames now."""
        if self._buffered:
            self._send(self._take_buffered())

    def _take_buffered(self) -> bytes:
        data = b"".join(self._buffered)
        self._buffered.clear()
        self._buffered_bytes = 0
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        return data

    def _send(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        if self._compress is not None:
            data = self._compress(data)
        self.bytes_out += len(data)
        self._transport.write(data)

    def deliver(self, channel, msgs: list, now: float) -> None:
        """Put messages in flight at this client and send them in one write."""
        deadline = now + self.msg_timeout
        in_flight = self.in_flight
        sample = self.settings.sample_rate
        if sample:
            kept = []
            for m in msgs:
                if random.randrange(100) < sample:
                    kept.append(m)
                else:
                    channel.finish(m)  # sampled out: classic nsqd drops it for this channel
            msgs = kept
        for m in msgs:
            m.attempts += 1
            m.deadline = deadline
            m.client = self
            m.delivered_at = now  # TOUCH extends up to max_msg_timeout after this delivery
            wire_id = m.wire_id = encode_msg_id(m.msg_id)
            in_flight[wire_id] = m
        self.message_count += len(msgs)
        if msgs:
            self._buffer_messages(encode_messages(msgs, self.settings.extend_support))

    def _buffer_messages(self, data: bytes) -> None:
        timeout_ms = self.settings.output_buffer_timeout_ms
        if timeout_ms <= 0:
            self.write(data)
            return
        self._buffered.append(data)
        self._buffered_bytes += len(data)
        if (self._buffered_bytes >= self.settings.output_buffer_size
                or len(self.in_flight) >= self.ready_count):
            self.flush()
        elif self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(timeout_ms / 1000,
                                                                      self.flush)

    def touch(self, msg, now: float, max_msg_timeout: float) -> bool:
        """Extend a message's deadline (up to max_msg_timeout after this delivery of it)."""
        deadline = min(now + self.msg_timeout, msg.delivered_at + max_msg_timeout)
        if deadline <= msg.deadline:
            return True
        msg.deadline = deadline
        del self.in_flight[msg.wire_id]
        self.in_flight[msg.wire_id] = msg
        return True
