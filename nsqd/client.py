"""Client: the state of one TCP connection, as a consumer and as a producer.

Owns its negotiated settings, RDY, the in-flight messages it holds (a dict keyed by
the 16 id bytes sent on the wire, in delivery order, which is deadline order since
one client has one msg_timeout; TOUCH moves a message to the end), counters for /stats, and the outgoing
byte stream, compressed when negotiated.

A client consumes one channel per partition it subscribed to (`channels`, partition ->
channel): one for `SUB topic ch n`; for `SUB topic ch` (`all_partitions`), the channel on
every partition of the topic this node leads, joined and left as the assignment changes.
A message's partition is in its id's top bits (nsqwire/ids.py): FIN, REQ and TOUCH are
routed by it. With several channels, RDY is shared fairly: while another of its channels
has messages waiting, a channel takes at most ceil(RDY / channels) of the client's
in-flight room (`room_in`); alone with messages, it takes all of it.

Output buffering, as classic nsqd negotiates it: message frames wait in a buffer
until it holds output_buffer_size bytes, the client can take no more (in flight
reached RDY), or output_buffer_timeout passes; any other frame goes out at once,
after what the buffer holds. A timeout of 0 (the client sent -1) sends each
delivery at once.

Answers given with `answer` join the same buffer and go out at the end of the loop's
turn (`TurnFlush`): tcp.py gives the OKs of a connection that still has publishes in
flight this way, so the OKs of its publishes written by one batch, and anything else it
is sent in that turn, leave in one write (one system call) instead of one each. Order is
kept: any frame written later sends them first.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib

import structlog

from nsqwire.frames import encode_messages
from nsqwire.ids import PARTITION_SHIFT, encode_msg_id

from .identify import ClientSettings

log = structlog.get_logger("nsqd.client")


class TurnFlush:
    """The clients given answers in this turn of the event loop, flushed together at its
    end: one `call_soon` per turn for the whole server, not one per answer."""

    def __init__(self):
        self._clients: list = []

    def add(self, client) -> None:
        if not self._clients:
            asyncio.get_running_loop().call_soon(self._flush)
        self._clients.append(client)

    def _flush(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            client._answering = False
            try:
                client.flush()
            except Exception:  # one client's broken stream never holds back the others
                log.exception("answer_flush_failed", client=client.remote_address)


class Client:
    def __init__(self, client_id: int, remote_address: str, settings: ClientSettings,
                 turn_flush: TurnFlush | None = None):
        self.id = client_id
        self.remote_address = remote_address
        self.settings = settings
        self.ready_count = 0
        self.writable = True  # False while the transport's buffer is above its high mark
        self.in_flight: dict = {}
        self.channels: dict = {}  # partition -> Channel consumed
        self.channel = None  # the one channel when it consumes exactly one, else None
        self.all_partitions = False  # SUB without a partition: follows the led partitions
        self.frame_offsets = False  # SUB_ADVANCED: frames carry the record's offset and size
        self.topic_name = ""
        self.channel_name = ""
        self._wake_turn = 0
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
        self._buffered: list[bytes] = []  # message frames and answers not sent yet
        self._turn_flush = turn_flush or TurnFlush()
        self._answering = False  # in `_turn_flush`: the buffer goes out at the turn's end
        self._buffered_bytes = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        self.bytes_out = 0  # handed to the transport; minus its buffer: what the kernel took

    # ---- subscriptions ---------------------------------------------------

    def subscribe(self, channel) -> None:
        self.channels[channel.partition] = channel
        self.channel = channel if len(self.channels) == 1 else None
        channel.add_client(self)

    def unsubscribe(self, channel) -> None:
        """Leave one partition's channel; its messages in flight here go back to it."""
        if self.channels.get(channel.partition) is channel:
            del self.channels[channel.partition]
        self.channel = next(iter(self.channels.values())) if len(self.channels) == 1 else None
        channel.remove_client(self)
        self.wake_channels()

    def channel_of(self, msg):
        """The channel a message in flight here came from (by its id's partition)."""
        return self.channel or self.channels[msg.msg_id >> PARTITION_SHIFT]

    def finish(self, msgs: list) -> None:
        """FIN'd messages (taken out of `in_flight`) to their channels."""
        channel = self.channel
        if channel is not None:
            channel.finish_many(msgs)
            return
        by_partition: dict[int, list] = {}
        for m in msgs:
            by_partition.setdefault(m.msg_id >> PARTITION_SHIFT, []).append(m)
        self.wake_channels()  # first, in turn: the channel of these FINs is not always first
        for number, done in by_partition.items():
            self.channels[number].finish_many(done)

    def wake_channels(self) -> None:
        """Room freed: every channel consumed may deliver (in turn, so none is always first)."""
        channel = self.channel
        if channel is not None:
            channel.wake()
            return
        channels = list(self.channels.values())
        if channels:
            k = self._wake_turn = (self._wake_turn + 1) % len(channels)
            for c in channels[k:] + channels[:k]:
                c.wake()

    def room_in(self, channel, room: int) -> int:
        """The in-flight room `channel` may fill, of the client's `room`, with several
        channels (see the module docstring)."""
        if room <= 0:
            return room
        if not any(c is not channel and not c.paused and c.depth > 0
                   for c in self.channels.values()):
            return room
        share = -(-self.ready_count // len(self.channels))
        number = channel.partition
        mine = sum(1 for m in self.in_flight.values() if m.msg_id >> PARTITION_SHIFT == number)
        return min(room, share - mine)

    def in_flight_of(self, partition: int) -> list:
        """Messages in flight here from `partition`."""
        if self.channel is not None and self.channel.partition == partition:
            return list(self.in_flight.values())
        return [m for m in self.in_flight.values() if m.msg_id >> PARTITION_SHIFT == partition]

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

    def answer(self, frame: bytes) -> None:
        """Send a response frame at the end of this turn of the loop, in one write with
        whatever else this client is sent in the turn (after the frames buffered before it)."""
        self._buffered.append(frame)
        self._buffered_bytes += len(frame)
        if not self._answering:
            self._answering = True
            self._turn_flush.add(self)

    def flush(self) -> None:
        """Send the buffered message frames (and answers) now."""
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
            channel.watch_timeouts()
            self._buffer_messages(encode_messages(msgs, self.settings.extend_support,
                                                 self.frame_offsets),
                                  channel.ordered is not None)

    def _buffer_messages(self, data: bytes, now: bool = False) -> None:
        """`now`: an ordered channel's message (nothing follows it before its FIN)."""
        timeout_ms = self.settings.output_buffer_timeout_ms
        if timeout_ms <= 0 or now:
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
