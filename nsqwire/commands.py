"""NSQ TCP protocol V2, client side, sans-I/O: commands out as bytes, frames in.

The cmd_* functions encode one command each; FrameParser splits what the
server sends into (frame_type, data) and parse_message reads a message frame.
Our client (nsqclient), the tests and the benchmarks share this one codec; the
frame layouts and constants are frames.py's.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_FRAME_HEADER = struct.Struct(">ii")  # size (type + data), type
_MESSAGE_FIELDS = struct.Struct(">qH16s")  # timestamp ns, attempts, id


def _arg(a: bytes | str | int) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, str):
        return a.encode()
    return b"%d" % a


def encode_command(name: bytes, *args: bytes | str | int, body: bytes | None = None) -> bytes:
    """`NAME arg ...\\n`, then `[4-byte size][body]` when a body is given."""
    line = b" ".join([name, *map(_arg, args)]) + b"\n"
    if body is None:
        return line
    return line + _U32.pack(len(body)) + body


def _opt(partition: int | None) -> tuple[int, ...]:
    return () if partition is None else (partition,)


def _mpub_body(bodies: list[bytes]) -> bytes:
    parts = [_U32.pack(len(bodies))]
    for body in bodies:
        parts.append(_U32.pack(len(body)))
        parts.append(body)
    return b"".join(parts)


def _ext_body(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _U16.pack(len(raw)) + raw + body


def cmd_identify(data: dict) -> bytes:
    return encode_command(b"IDENTIFY", body=json.dumps(data).encode())


def cmd_auth(secret: bytes) -> bytes:
    return encode_command(b"AUTH", body=secret)


def cmd_sub(topic: str, channel: str, partition: int | None = None) -> bytes:
    return encode_command(b"SUB", topic, channel, *_opt(partition))


def cmd_sub_ordered(topic: str, channel: str, partition: int) -> bytes:
    return encode_command(b"SUB_ORDERED", topic, channel, partition)


def cmd_sub_advanced(topic: str, channel: str, partition: int, start: str | None = None) -> bytes:
    return encode_command(b"SUB_ADVANCED", topic, channel, partition, *(() if start is None else (start,)))


def cmd_pub(topic: str, body: bytes, partition: int | None = None) -> bytes:
    return encode_command(b"PUB", topic, *_opt(partition), body=body)


def cmd_half(topic: str, body: bytes, check_url: str, partition: int | None = None) -> bytes:
    """Ours: a half message (nsqd/halves.py), answered `OK <16 hex id>`."""
    return encode_command(b"HALF", topic, -1 if partition is None else partition, check_url,
                          body=body)


def cmd_decide(topic: str, msg_id: str, commit: bool) -> bytes:
    """Ours: COMMIT or ROLLBACK of the half message `msg_id` (16 hex characters)."""
    return encode_command(b"COMMIT" if commit else b"ROLLBACK", topic, msg_id)


def cmd_mpub(topic: str, bodies: list[bytes], partition: int | None = None) -> bytes:
    return encode_command(b"MPUB", topic, *_opt(partition), body=_mpub_body(bodies))


def cmd_dpub(topic: str, defer_ms: int, body: bytes, partition: int | None = None) -> bytes:
    return encode_command(b"DPUB", topic, defer_ms, *_opt(partition), body=body)


def cmd_pub_ext(topic: str, header: dict, body: bytes, partition: int | None = None) -> bytes:
    return encode_command(b"PUB_EXT", topic, *_opt(partition), body=_ext_body(header, body))


def cmd_mpub_ext(topic: str, messages: list[tuple[dict, bytes]], partition: int | None = None) -> bytes:
    bodies = [_ext_body(header, body) for header, body in messages]
    return encode_command(b"MPUB_EXT", topic, *_opt(partition), body=_mpub_body(bodies))


def cmd_pub_trace(topic: str, trace_id: int, body: bytes, partition: int | None = None) -> bytes:
    return encode_command(b"PUB_TRACE", topic, *_opt(partition), body=trace_id.to_bytes(8, "big") + body)


def cmd_mpub_trace(topic: str, messages: list[tuple[int, bytes]], partition: int | None = None) -> bytes:
    """MPUB_TRACE: each message is (trace id, body)."""
    bodies = [trace_id.to_bytes(8, "big") + body for trace_id, body in messages]
    return encode_command(b"MPUB_TRACE", topic, *_opt(partition), body=_mpub_body(bodies))


def cmd_rdy(count: int) -> bytes:
    return b"RDY %d\n" % count


def cmd_fin(msg_id: bytes) -> bytes:
    return b"FIN " + msg_id + b"\n"


def cmd_req(msg_id: bytes, timeout_ms: int, reason: str = "") -> bytes:
    """REQ; `reason` (ours): the consumer's error, kept with the message if it is buried
    (one line: a newline in it is sent as a space)."""
    if not reason:
        return b"REQ %s %d\n" % (msg_id, timeout_ms)
    return b"REQ %s %d %s\n" % (msg_id, timeout_ms,
                                reason.replace("\n", " ").replace("\r", " ").encode())


def cmd_touch(msg_id: bytes) -> bytes:
    return b"TOUCH " + msg_id + b"\n"


def cmd_cls() -> bytes:
    return b"CLS\n"


def cmd_nop() -> bytes:
    return b"NOP\n"


class FrameParser:
    """Client side: feed() the bytes read, then iterate frames() for (frame_type, data).

    A frame larger than max_frame_size raises ValueError before it is buffered.
    """

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._pos = 0

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def frames(self) -> Iterator[tuple[int, bytes]]:
        buf = self._buf
        while len(buf) - self._pos >= 8:
            pos = self._pos
            size, frame_type = _FRAME_HEADER.unpack_from(buf, pos)
            if not 4 <= size <= self.max_frame_size:
                raise ValueError(f"invalid frame size {size}")
            end = pos + 4 + size
            if len(buf) < end:
                return
            self._pos = end
            yield frame_type, bytes(buf[pos + 8:end])


def parse_message(data: bytes) -> tuple[int, int, bytes, bytes]:
    """Message frame data -> (timestamp_ns, attempts, msg_id, body)."""
    if len(data) < _MESSAGE_FIELDS.size:
        raise ValueError(f"message frame data of {len(data)} bytes")
    timestamp_ns, attempts, msg_id = _MESSAGE_FIELDS.unpack_from(data)
    return timestamp_ns, attempts, msg_id, data[_MESSAGE_FIELDS.size:]


_EXT_HEAD = struct.Struct(">BH")  # ext version, header length


def parse_ext_message(data: bytes) -> tuple[int, int, bytes, int, bytes, bytes]:
    """Message frame data sent to an extend_support client -> (timestamp_ns, attempts,
    msg_id, ext_version, header, body); version 0 has no length and no header (b"")."""
    fields = _MESSAGE_FIELDS.size
    if len(data) < fields + 1:
        raise ValueError(f"message frame data of {len(data)} bytes")
    timestamp_ns, attempts, msg_id = _MESSAGE_FIELDS.unpack_from(data)
    if data[fields] == 0:
        return timestamp_ns, attempts, msg_id, 0, b"", data[fields + 1:]
    start = fields + _EXT_HEAD.size
    if len(data) < start:
        raise ValueError(f"message frame data of {len(data)} bytes")
    version, length = _EXT_HEAD.unpack_from(data, fields)
    if len(data) < start + length:
        raise ValueError(f"ext header of {length} bytes in {len(data)} bytes")
    return timestamp_ns, attempts, msg_id, version, data[start:start + length], data[start + length:]


_OFFSET = struct.Struct(">qI")  # record offset and size (SUB_ADVANCED)


def parse_offset_message(data: bytes, extended: bool = False) -> tuple[int, int, bytes, bytes, int,
                                                                          int, bytes]:
    """Message frame data sent to a SUB_ADVANCED client -> (timestamp_ns, attempts, msg_id,
    header, offset, size, body): the record's offset and size follow the id (and the ext
    header, b"" unless `extended`)."""
    if extended:
        ts, attempts, msg_id, _version, header, rest = parse_ext_message(data)
    else:
        ts, attempts, msg_id, rest = parse_message(data)
        header = b""
    if len(rest) < _OFFSET.size:
        raise ValueError(f"no offset in message frame data of {len(data)} bytes")
    offset, size = _OFFSET.unpack_from(rest)
    return ts, attempts, msg_id, header, offset, size, rest[_OFFSET.size:]
