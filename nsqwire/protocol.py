"""NSQ TCP protocol V2, server side, sans-I/O: bytes in, commands out.

No sockets, no event loop, no timers. The connection handler feeds what it
reads into a CommandParser, acts on each command, and writes the frames that
frames.py encodes. Here too: the rules for names and JSON, and the checks of a
client's extension header (what the header means is ext.py).

The errors the parser raises, like every error the server sends, are built in
errors.py; message ids are ids.py. The frame encoders and the id helpers are
imported here too, so that `protocol` is the one name a user of the wire needs.
The client half (cmd_* encoders, FrameParser) is commands.py.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, cast

from .ext import RESERVED_HEADER_KEYS, check_url_ok, producer_of, trace_id_of  # noqa: F401
from .frames import (CLOSE_WAIT, FRAME_ERROR, FRAME_MESSAGE, FRAME_RESPONSE, HEARTBEAT,  # noqa: F401
                     MAGIC_V2, OK, encode_error, encode_messages, encode_response, pub_trace_reply)
from .ids import (MAX_PARTITION, MAX_SEQUENCE, MSG_ID_LENGTH, PARTITION_SHIFT,  # noqa: F401
                  decode_msg_id, encode_msg_id, make_msg_id, msg_id_partition, msg_id_sequence)
from .errors import (ProtocolError, _go_quote, _raw, bad_channel, bad_partition, bad_protocol, bad_topic,
                     body_too_big, dpub_timeout_out_of_range, insufficient_parameters, invalid_body_size,
                     invalid_check_url, invalid_command, invalid_ext_body, invalid_json_header, invalid_message_count,
                     invalid_message_size, invalid_mpub_message_size, invalid_msg_id, invalid_parameter_count,
                     invalid_start, line_too_long, message_too_big, unparsable_number)

MAX_NAME_LENGTH: Final = 64

_I32: Final = struct.Struct(">i")
_U16: Final = struct.Struct(">H")


# ---------------------------------------------------------------- names, ids, JSON

_NAME: Final = re.compile(r"[.a-zA-Z0-9_-]+(#ephemeral)?")
_HEADER_KEY = re.compile(r"[0-9a-zA-Z_#-]+")
_START = re.compile(r"(timestamp|offset|count|virtual_queue|msgcount):([0-9]{1,19})")
_START_ALIASES = {"virtual_queue": "offset", "msgcount": "count"}  # Youzan's names
_FIN_RUN: Final = re.compile(rb"(?:FIN [0-9A-Za-z]{16}\n)+")  # see CommandParser.next_fins


def valid_topic_name(name: str) -> bool:
    """1..64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral."""
    return 0 < len(name) <= MAX_NAME_LENGTH and _NAME.fullmatch(name) is not None


@functools.lru_cache(maxsize=4096)  # every PUB names its topic: the same few names, again
def _valid_name(raw: bytes) -> str | None:
    """A topic or channel argument of at most MAX_NAME_LENGTH bytes -> the name, or None
    when it is not a valid one."""
    name = _raw(raw)
    return name if valid_topic_name(name) else None


def valid_channel_name(name: str) -> bool:
    """Same rule as topic names."""
    return valid_topic_name(name)


def parse_consume_start(text: str) -> tuple[str, int | None]:
    """`end`, `timestamp:<unix s>`, `offset:<virtual offset>` or `count:<n>` -> (kind, value);
    Youzan's spellings too: `special:-1` (end), `virtual_queue:<n>`, `msgcount:<n>`."""
    if text in ("end", "special:-1"):
        return "end", None
    m = _START.fullmatch(text)
    if m is None:
        raise ValueError(f"invalid consume start {text!r}")
    return _START_ALIASES.get(m[1], m[1]), int(m[2])


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def decode_json(data: bytes) -> object:
    """JSON as Go's encoding/json reads it: UTF-8 (bad bytes replaced), no
    NaN/Infinity. Raises ValueError for anything it refuses, including nesting
    too deep to decode."""
    try:
        return json.loads(data.decode("utf-8", "replace"), parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _base10(raw: bytes) -> int | None:
    """nsqd's ByteToBase10: ASCII digits only, empty reads as 0; None if not a
    number. Above 19 digits we refuse where Go would silently wrap."""
    if not raw:
        return 0
    if raw.isdigit() and len(raw) <= 19:
        return int(raw)
    return None


# ---------------------------------------------------------------- commands
# Plain slotted dataclasses, not frozen ones: one is built per command received, and a
# frozen dataclass costs six times as much to build (0.67 µs against 0.10 µs here).
# Nothing changes a command after the parser made it.


@dataclass(slots=True)
class Identify:
    body: bytes


@dataclass(slots=True)
class Auth:
    secret: bytes


@dataclass(slots=True)
class Sub:
    topic: str
    channel: str
    partition: int | None = None


@dataclass(slots=True)
class SubOrdered:
    """One message in flight per partition whatever RDY says."""
    topic: str
    channel: str
    partition: int | None = None


@dataclass(slots=True)
class SubAdvanced:
    """`start` has been checked with parse_consume_start."""
    topic: str
    channel: str
    partition: int | None = None
    start: str | None = None


@dataclass(slots=True)
class Pub:
    topic: str
    body: bytes
    partition: int | None = None


@dataclass(slots=True)
class Half:
    """Ours: a half message (nsqd/halves.py), held until COMMIT or ROLLBACK, its producer
    asked at `check_url` when neither comes; `partition` None: any led here."""
    topic: str
    partition: int | None
    check_url: str
    body: bytes


@dataclass(slots=True)
class Decide:
    """Ours: `COMMIT topic id` (commit True) or `ROLLBACK topic id` of a half message."""
    topic: str
    msg_id: bytes
    commit: bool


@dataclass(slots=True)
class Mpub:
    topic: str
    bodies: list[bytes]
    partition: int | None = None


@dataclass(slots=True)
class Dpub:
    topic: str
    defer_ms: int
    body: bytes
    partition: int | None = None


@dataclass(slots=True)
class PubExt:
    """`producer`: the header's (##producer_id, ##sequence), None when it names none."""
    topic: str
    header: dict
    body: bytes
    partition: int | None = None
    producer: tuple[str, int] | None = None


@dataclass(slots=True)
class MpubExt:
    """`producer`: the first message's header's (##producer_id, ##sequence), or None."""
    topic: str
    messages: list[tuple[dict, bytes]]
    partition: int | None = None
    producer: tuple[str, int] | None = None


@dataclass(slots=True)
class PubTrace:
    """Answered with pub_trace_reply() instead of OK."""
    topic: str
    trace_id: int
    body: bytes
    partition: int | None = None


@dataclass(slots=True)
class MpubTrace:
    """Each body came as `[8-byte trace id][message]`; answered with pub_trace_reply() of
    the first message (its id and trace id, the batch's offset and size)."""
    topic: str
    messages: list[tuple[int, bytes]]
    partition: int | None = None


@dataclass(slots=True)
class Rdy:
    """`count` is not range-checked: the limit is the server's (rdy_out_of_range)."""
    count: int


@dataclass(slots=True)
class Fin:
    """`msg_id` is any 16 bytes, as in nsqd: it names an in-flight message only when it
    is the bytes that were sent (otherwise fin_failed, not a fatal error)."""
    msg_id: bytes


@dataclass(slots=True)
class Req:
    """`timeout_ms` is unclamped; nsqd clamps it to 0..max_req_timeout. `reason`: ours, the
    rest of the line after the timeout (the client's error, kept with a dead letter)."""
    msg_id: bytes
    timeout_ms: int
    reason: bytes = b""


@dataclass(slots=True)
class Touch:
    msg_id: bytes


@dataclass(slots=True)
class Cls:
    pass


@dataclass(slots=True)
class Nop:
    pass


Command = (Identify | Auth | Sub | SubOrdered | SubAdvanced | Pub | Mpub | Dpub | PubExt | MpubExt
           | PubTrace | MpubTrace | Half | Decide | Rdy | Fin | Req | Touch | Cls | Nop)

_CLS = Cls()
_NOP = Nop()


# ---------------------------------------------------------------- server-side parser

# the parser's states
_MAGIC: Final = 0
_LINE: Final = 1
_SIZE: Final = 2
_BODY: Final = 3
_MPUB: Final = 4


def _decide(command: str, params: list[bytes], commit: bool) -> "Decide":
    topic = _topic(command, params, 3)
    if len(params[2]) != MSG_ID_LENGTH:
        raise invalid_msg_id()
    return Decide(topic, params[2], commit)


def _topic(command: str, params: list[bytes], needed: int) -> str:
    if len(params) < needed:
        raise insufficient_parameters(command)
    raw = params[1]
    topic = _valid_name(raw) if len(raw) <= MAX_NAME_LENGTH else None
    if topic is None:
        raise bad_topic(command, _raw(raw))
    return topic


def _channel(command: str, params: list[bytes]) -> str:
    raw = params[2]
    channel = _valid_name(raw) if len(raw) <= MAX_NAME_LENGTH else None
    if channel is None:
        raise bad_channel(command, _raw(raw))
    return channel


def _partition(command: str, params: list[bytes], index: int) -> int | None:
    """Optional partition argument; absent, empty or -1 means "any"."""
    if len(params) <= index or params[index] in (b"", b"-1"):
        return None
    raw = params[index]
    if raw.isdigit() and len(raw) <= 5 and int(raw) <= MAX_PARTITION:
        return int(raw)
    raise bad_partition(command, _raw(raw))


def _msg_id(command: str, params: list[bytes], needed: int) -> bytes:
    if len(params) < needed:
        raise insufficient_parameters(command)
    if len(params[1]) != MSG_ID_LENGTH:
        raise invalid_msg_id()
    return params[1]


def _split_ext(command: str, raw: bytes) -> tuple[dict, bytes, tuple[str, int] | None]:
    """[2-byte header length][JSON header][message] -> (header, message, its producer)."""
    if len(raw) <= 2:
        raise invalid_ext_body(command, len(raw), "with ext json header enabled")
    end = 2 + _U16.unpack_from(raw)[0]
    if len(raw) <= end:
        raise invalid_ext_body(command, len(raw), "in ext json header content length")
    try:
        header = decode_json(raw[2:end])
    except ValueError:
        raise invalid_json_header(command, "is not valid JSON") from None
    if not isinstance(header, dict):
        raise invalid_json_header(command, "is not an object")
    for key in header:
        if _HEADER_KEY.fullmatch(key) is None:
            raise invalid_json_header(command, f"key {_go_quote(key)} is not valid")
        if key.startswith("##") and key not in RESERVED_HEADER_KEYS:
            raise invalid_json_header(command, f"key {_go_quote(key)} is reserved")
    try:
        trace_id_of(header)
        producer = producer_of(header)
    except ValueError as e:
        raise invalid_json_header(command, str(e)) from None
    return header, raw[end:], producer


class CommandParser:
    """Server side of protocol V2: feed() the bytes read, then iterate commands().

    Invariants:
    - Bounded memory: once commands() stops, at most
      max(max_line_length, max_msg_size, max_body_size) + 4 unparsed bytes stay
      buffered, because every declared size is checked before its bytes are awaited.
    - Linear time: the newline search resumes where it stopped.
    - Lazy: one command is parsed per iteration step, so state the server
      changes while handling a command applies to the next one.
    - `state_check(name)`, if given, runs for every command line before its
      arguments are examined, so the server's state errors win exactly as in
      nsqd ("cannot RDY in current state" before "RDY could not parse count").
      It rejects by raising ProtocolError.
    - A fatal ProtocolError is sticky. After a non-fatal one the command's
      bytes have been consumed: call commands() again to go on.
    """

    def __init__(self, *, max_msg_size: int = 1048576, max_body_size: int = 5242880,
                 max_line_length: int = 1024, max_defer_ms: int = 3_600_000,
                 state_check: Callable[[str], None] | None = None) -> None:
        self.max_msg_size = max_msg_size
        self.max_body_size = max_body_size
        self.max_line_length = max_line_length
        self.max_defer_ms = max_defer_ms  # nsqd's limit is max_req_timeout; ours is the delay queue's
        self._state_check = state_check
        self._buf: bytes | bytearray = b""  # see feed
        self._pos = 0  # start of the unparsed bytes
        self._scan = 0  # the newline search resumes here
        self._state = _MAGIC
        self._error: ProtocolError | None = None
        # The command whose body is being read (set by _expect_body).
        self._name = ""
        self._check_size: Callable[[int], None] = self._check_message_size
        self._build: Callable = Pub
        self._need = 0
        # MPUB progress.
        self._count = 0
        self._bodies: list[bytes] = []
        self._consumed = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take bytes read. When every byte before them was parsed (a client waiting for
        its answers sends whole commands) they become the buffer as they are, uncopied;
        a rest waiting for more goes on in a bytearray."""
        pos = self._pos
        buf = self._buf
        if pos == len(buf):
            self._buf = bytes(data)
            self._pos = self._scan = 0
            return
        if buf.__class__ is bytes:
            with memoryview(buf) as view:
                buf = self._buf = bytearray(view[pos:])
        else:
            del cast(bytearray, buf)[:pos]
        self._scan = max(0, self._scan - pos)
        self._pos = 0
        buf += data

    def commands(self) -> Iterator[Command]:
        """Yield each whole command buffered; stop when the rest is incomplete."""
        while (command := self.next_command()) is not None:
            yield command

    def next_command(self) -> Command | None:
        """The next whole command buffered, or None while the rest is incomplete."""
        if self._error is not None:
            raise self._error
        if self._pos == len(self._buf):  # no state completes a command without a byte
            return None
        try:
            return self._next()
        except ProtocolError as exc:
            if exc.fatal:
                self._error = exc
            raise

    def next_fins(self, limit: int) -> list[bytes]:
        """The ids of the `FIN <id>\\n` lines next in the buffer, at most `limit`, when their
        ids are 16 ASCII letters or digits (every id our server sends); [] when the next
        command is any other (next_command reads it). The same FIN commands next_command
        would give one at a time, read in one step: a consumer sends one per message."""
        if self._error is not None:
            raise self._error
        if self._state != _LINE:
            return []
        run = _FIN_RUN.match(self._buf, self._pos, self._pos + 21 * limit)
        if run is None:
            return []
        if self._state_check is not None:
            try:
                self._state_check("FIN")
            except ProtocolError as exc:
                if exc.fatal:
                    self._error = exc
                raise
        lines = bytes(run[0])
        self._pos = run.end()
        return [lines[i:i + 16] for i in range(4, len(lines), 21)]

    def _next(self) -> Command | None:
        buf = self._buf
        command: Command | None
        while True:
            state = self._state
            if state == _LINE:
                if buf.startswith(b"PUB ", self._pos):
                    command = self._whole_pub(buf)
                    if command is not None:
                        return command
                line = self._line()
                if line is None:
                    return None
                command = self._dispatch(line)
                if command is not None:
                    return command
            elif state == _BODY:
                start = self._pos
                end = start + self._need
                if len(buf) < end:
                    return None
                self._pos = end
                self._state = _LINE
                return self._build(bytes(buf[start:end]))
            elif state == _SIZE:
                if len(buf) - self._pos < 4:
                    return None
                size = _I32.unpack_from(buf, self._pos)[0]
                self._pos += 4
                self._check_size(size)
            elif state == _MPUB:
                return self._mpub_messages()
            else:
                if len(buf) - self._pos < 4:
                    return None
                if buf[self._pos:self._pos + 4] != MAGIC_V2:
                    raise bad_protocol()
                self._pos += 4
                self._state = _LINE

    def _whole_pub(self, buf: bytes | bytearray) -> Pub | None:
        """A plain `PUB <topic>[ <partition>]\n<size><body>` whole in the buffer (what
        producers send most), read in one step; None when any part of it is missing, has
        more arguments or fails a check: the general path then reads it and raises the
        checks' errors."""
        pos = self._pos
        nl = buf.find(b"\n", pos + 4, pos + self.max_line_length + 1)
        if nl < 0:
            return None
        at = nl + 5
        if len(buf) < at:
            return None
        size: int = _I32.unpack_from(buf, nl + 1)[0]
        end = at + size
        if size <= 0 or size > self.max_msg_size or len(buf) < end:
            return None
        raw, _, partition_raw = bytes(buf[pos + 4:nl]).partition(b" ")
        topic = _valid_name(raw) if len(raw) <= MAX_NAME_LENGTH else None
        if topic is None:
            return None
        partition = None
        if partition_raw:
            try:
                partition = _partition("PUB", [b"PUB", raw, partition_raw], 2)
            except ProtocolError:
                return None
        if self._state_check is not None:
            try:
                self._state_check("PUB")
            except ProtocolError:
                return None
        self._pos = end
        return Pub(topic, bytes(buf[at:end]), partition)

    def _line(self) -> bytes | None:
        buf, pos = self._buf, self._pos
        nl = buf.find(b"\n", max(pos, self._scan))
        if nl < 0:
            if len(buf) - pos > self.max_line_length:
                raise line_too_long(self.max_line_length)
            self._scan = len(buf)
            return None
        if nl - pos > self.max_line_length:
            raise line_too_long(self.max_line_length)
        self._pos = nl + 1
        if nl > pos and buf[nl - 1] == 13:  # optional \r
            nl -= 1
        return bytes(buf[pos:nl])

    def _dispatch(self, line: bytes) -> Command | None:
        params = line.split(b" ")
        name = _raw(params[0])
        if self._state_check is not None:
            self._state_check(name)
        handler = _HANDLERS.get(name)
        if handler is None:
            raise invalid_command(name)
        return handler(self, params)

    def _expect_body(self, name: str, check_size: Callable[[int], None], build: Callable) -> None:
        """A 4-byte size follows the line; check_size vets it, build makes the command."""
        self._name = name
        self._check_size = check_size
        self._build = build
        self._state = _SIZE

    # Size checks, in nsqd's order. Each raises or moves to the next state.

    def _check_message_size(self, size: int) -> None:
        if size <= 0:
            raise invalid_message_size(self._name, size)
        if size > self.max_msg_size:
            raise message_too_big(self._name, size, self.max_msg_size)
        self._need = size
        self._state = _BODY

    def _check_body_size(self, size: int) -> None:
        if size > self.max_body_size:
            raise body_too_big(self._name, size, self.max_body_size)
        if size <= 0:
            raise invalid_body_size(self._name, size)
        self._need = size
        self._state = _BODY

    def _check_mpub_size(self, size: int) -> None:
        if size <= 0:
            raise invalid_body_size(self._name, size)
        if size > self.max_body_size:
            raise body_too_big(self._name, size, self.max_body_size)
        self._count = 0
        self._bodies = []
        self._consumed = 0
        self._state = _MPUB

    def _mpub_messages(self) -> Command | None:
        """Read the MPUB count, then as many (size, bytes) messages as are buffered.

        Like nsqd, messages are framed by the count and their own sizes, not by
        the declared body length (only range-checked): a count larger than the
        body holds waits for more bytes (reference case mpub_count_mismatch).
        Unlike nsqd, the total is capped at max_body_size, so memory stays bounded.
        """
        buf, pos, end, name = self._buf, self._pos, len(self._buf), self._name
        if not self._count:
            if end - pos < 4:
                return None
            count = _I32.unpack_from(buf, pos)[0]
            self._pos = pos = pos + 4
            if count <= 0 or count > (self.max_body_size - 4) // 5:  # 5: a size and one byte
                raise invalid_message_count(name, count)
            self._count = count
            self._consumed = 4
        bodies = self._bodies
        count, consumed = self._count, self._consumed
        max_msg_size, max_body_size = self.max_msg_size, self.max_body_size
        unpack = _I32.unpack_from
        with memoryview(buf) as view:  # one copy per body (a bytearray slice would be two)
            while len(bodies) < count and end - pos >= 4:
                size: int = unpack(buf, pos)[0]
                start = pos + 4
                stop = start + size
                if size <= 0 or size > max_msg_size or consumed + 4 + size > max_body_size:
                    self._consumed = consumed
                    raise self._mpub_size_error(len(bodies), size)
                if stop > end:
                    break
                bodies.append(bytes(view[start:stop]))
                pos = stop
                consumed += 4 + size
        self._pos, self._consumed = pos, consumed
        if len(bodies) < self._count:
            return None
        self._state = _LINE
        return self._build(bodies)

    def _mpub_size_error(self, index: int, size: int) -> ProtocolError:
        """Why the MPUB message at `index`, of `size` bytes, is refused (nsqd's order)."""
        name = self._name
        if size <= 0:
            return invalid_mpub_message_size(name, index, size)
        if size > self.max_msg_size:
            return message_too_big(name, size, self.max_msg_size)
        return body_too_big(name, self._consumed + 4 + size, self.max_body_size)

    # One handler per command, each checking its arguments in nsqd's order.

    def _identify(self, params: list[bytes]) -> None:
        self._expect_body("IDENTIFY", self._check_body_size, Identify)

    def _auth(self, params: list[bytes]) -> None:
        if len(params) != 1:
            raise invalid_parameter_count("AUTH")
        self._expect_body("AUTH", self._check_body_size, Auth)

    def _sub(self, params: list[bytes]) -> Sub:
        topic = _topic("SUB", params, 3)
        return Sub(topic, _channel("SUB", params), _partition("SUB", params, 3))

    def _sub_ordered(self, params: list[bytes]) -> SubOrdered:
        topic = _topic("SUB_ORDERED", params, 3)
        return SubOrdered(topic, _channel("SUB_ORDERED", params), _partition("SUB_ORDERED", params, 3))

    def _sub_advanced(self, params: list[bytes]) -> SubAdvanced:
        topic = _topic("SUB_ADVANCED", params, 3)
        channel = _channel("SUB_ADVANCED", params)
        partition = _partition("SUB_ADVANCED", params, 3)
        start = _raw(params[4]) if len(params) > 4 and params[4] else None
        if start is not None:
            try:
                parse_consume_start(start)
            except ValueError:
                raise invalid_start("SUB_ADVANCED", start) from None
        return SubAdvanced(topic, channel, partition, start)

    def _pub(self, params: list[bytes]) -> None:
        topic = _topic("PUB", params, 2)
        partition = _partition("PUB", params, 2)
        self._expect_body("PUB", self._check_message_size, lambda body: Pub(topic, body, partition))

    def _pub_ext(self, params: list[bytes]) -> None:
        topic = _topic("PUB_EXT", params, 2)
        partition = _partition("PUB_EXT", params, 2)

        def build(body: bytes) -> PubExt:
            header, message, producer = _split_ext("PUB_EXT", body)
            return PubExt(topic, header, message, partition, producer)

        self._expect_body("PUB_EXT", self._check_message_size, build)

    def _pub_trace(self, params: list[bytes]) -> None:
        topic = _topic("PUB_TRACE", params, 2)
        partition = _partition("PUB_TRACE", params, 2)

        def build(body: bytes) -> PubTrace:
            if len(body) <= 8:
                raise invalid_ext_body("PUB_TRACE", len(body), "with trace id enabled")
            return PubTrace(topic, int.from_bytes(body[:8], "big"), body[8:], partition)

        self._expect_body("PUB_TRACE", self._check_message_size, build)

    def _mpub(self, params: list[bytes]) -> None:
        topic = _topic("MPUB", params, 2)
        partition = _partition("MPUB", params, 2)
        self._expect_body("MPUB", self._check_mpub_size, lambda bodies: Mpub(topic, bodies, partition))

    def _mpub_ext(self, params: list[bytes]) -> None:
        topic = _topic("MPUB_EXT", params, 2)
        partition = _partition("MPUB_EXT", params, 2)

        def build(bodies: list[bytes]) -> MpubExt:
            split = [_split_ext("MPUB_EXT", body) for body in bodies]
            if any(producer for _, _, producer in split[1:]):
                raise invalid_json_header("MPUB_EXT", "##producer_id and ##sequence name the "
                                          "request: only its first message may carry them")
            return MpubExt(topic, [(header, message) for header, message, _ in split],
                           partition, split[0][2])

        self._expect_body("MPUB_EXT", self._check_mpub_size, build)

    def _mpub_trace(self, params: list[bytes]) -> None:
        topic = _topic("MPUB_TRACE", params, 2)
        partition = _partition("MPUB_TRACE", params, 2)

        def build(bodies: list[bytes]) -> MpubTrace:
            for body in bodies:
                if len(body) <= 8:
                    raise invalid_ext_body("MPUB_TRACE", len(body), "with trace id enabled")
            return MpubTrace(topic, [(int.from_bytes(b[:8], "big"), b[8:]) for b in bodies],
                             partition)

        self._expect_body("MPUB_TRACE", self._check_mpub_size, build)

    def _half(self, params: list[bytes]) -> None:
        topic = _topic("HALF", params, 4)
        partition = _partition("HALF", params, 2)
        url = params[3].decode("utf-8", "replace")
        if not check_url_ok(url):
            raise invalid_check_url("HALF")
        self._expect_body("HALF", self._check_message_size,
                          lambda body: Half(topic, partition, url, body))

    def _commit(self, params: list[bytes]) -> Decide:
        return _decide("COMMIT", params, True)

    def _rollback(self, params: list[bytes]) -> Decide:
        return _decide("ROLLBACK", params, False)

    def _dpub(self, params: list[bytes]) -> None:
        topic = _topic("DPUB", params, 3)
        defer_ms = _base10(params[2])
        if defer_ms is None:
            raise unparsable_number("DPUB", "timeout", _raw(params[2]))
        if defer_ms > self.max_defer_ms:
            raise dpub_timeout_out_of_range(defer_ms, self.max_defer_ms)
        partition = _partition("DPUB", params, 3)
        self._expect_body("DPUB", self._check_message_size, lambda body: Dpub(topic, defer_ms, body, partition))

    def _rdy(self, params: list[bytes]) -> Rdy:
        if len(params) < 2:
            return Rdy(1)
        count = _base10(params[1])
        if count is None:
            raise unparsable_number("RDY", "count", _raw(params[1]))
        return Rdy(count)

    def _fin(self, params: list[bytes]) -> Fin:
        return Fin(_msg_id("FIN", params, 2))

    def _req(self, params: list[bytes]) -> Req:
        msg_id = _msg_id("REQ", params, 3)
        timeout_ms = _base10(params[2])
        if timeout_ms is None:
            raise unparsable_number("REQ", "timeout", _raw(params[2]))
        return Req(msg_id, timeout_ms, b" ".join(params[3:]))

    def _touch(self, params: list[bytes]) -> Touch:
        return Touch(_msg_id("TOUCH", params, 2))

    def _cls(self, params: list[bytes]) -> Cls:
        return _CLS

    def _nop(self, params: list[bytes]) -> Nop:
        return _NOP


_HANDLERS: Final[dict[str, Callable[[CommandParser, list[bytes]], Command | None]]] = {
    "IDENTIFY": CommandParser._identify,
    "AUTH": CommandParser._auth,
    "SUB": CommandParser._sub,
    "SUB_ORDERED": CommandParser._sub_ordered,
    "SUB_ADVANCED": CommandParser._sub_advanced,
    "PUB": CommandParser._pub,
    "PUB_EXT": CommandParser._pub_ext,
    "PUB_TRACE": CommandParser._pub_trace,
    "MPUB": CommandParser._mpub,
    "MPUB_EXT": CommandParser._mpub_ext,
    "MPUB_TRACE": CommandParser._mpub_trace,
    "DPUB": CommandParser._dpub,
    "HALF": CommandParser._half,
    "COMMIT": CommandParser._commit,
    "ROLLBACK": CommandParser._rollback,
    "RDY": CommandParser._rdy,
    "FIN": CommandParser._fin,
    "REQ": CommandParser._req,
    "TOUCH": CommandParser._touch,
    "CLS": CommandParser._cls,
    "NOP": CommandParser._nop,
}
