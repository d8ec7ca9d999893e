"""Server frames of protocol V2, sans-I/O: `[4-byte size][4-byte type][data]`.

`size` counts the type and the data. Type 0 is a response, 1 an error, 2 a
message, whose data is `[8-byte timestamp ns][2-byte attempts][16-byte id][body]`;
to a client that negotiated `extend_support`, the ext version byte follows the id in every
message frame: 4, then `[2-byte length][JSON header]`; or 0 alone when there is no header
(Youzan's layout, see ext.py); to a SUB_ADVANCED client `[8-byte offset][4-byte size]` of
the record after that (before the body). All integers big-endian. The server builds every
frame it sends here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from .ext import EXT_VERSION_JSON, EXT_VERSION_NONE, delivered

MAGIC_V2 = b"  V2"  # what a client sends first

FRAME_RESPONSE = 0
FRAME_ERROR = 1
FRAME_MESSAGE = 2

MAX_ATTEMPTS = 0xFFFF  # the wire field is 16 bits: more attempts are sent as this

_FRAME_HEADER = struct.Struct(">ii")  # size (type + data), type
_MESSAGE_HEAD = struct.Struct(">iiqH")  # size, type, timestamp ns, attempts; then the id
_MESSAGE_OVERHEAD = _MESSAGE_HEAD.size - 4 + 16  # what the size field counts besides the body
_EXT_HEAD = struct.Struct(">BH")  # ext version, header length
_NO_EXT = bytes([EXT_VERSION_NONE])  # version 0 has no length after it
_OFFSET = struct.Struct(">qI")  # a SUB_ADVANCED client's record offset and size
_TRACE_REPLY = struct.Struct(">2sQQqI")


def encode_response(data: bytes) -> bytes:
    return _FRAME_HEADER.pack(len(data) + 4, FRAME_RESPONSE) + data


def encode_error(text: bytes | str) -> bytes:
    """An error frame; str text is sent with surrogateescape (raw client bytes come back as sent)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogateescape")
    return _FRAME_HEADER.pack(len(text) + 4, FRAME_ERROR) + text


def encode_messages(messages: Iterable, extended: bool = False, offsets: bool = False) -> bytes:
    """Message frames for objects with `timestamp`, `attempts`, `wire_id` (the 16 id bytes)
    and `body`, in one join; `extended` (an extend_support client): with the extension
    header made from their `ext` and `trace_id` (ext.delivered); `offsets` (a SUB_ADVANCED
    client): `[8-byte offset][4-byte size]` of the record (`offset`, `end`) before the body
    (size 0 when `end` is unknown: a message brought back from a delay store)."""
    pack = _MESSAGE_HEAD.pack
    parts = []
    add = parts.append
    extra = _OFFSET.size if offsets else 0
    for m in messages:
        body = m.body
        attempts = m.attempts
        if attempts > MAX_ATTEMPTS:
            attempts = MAX_ATTEMPTS
        if not extended:
            add(pack(len(body) + _MESSAGE_OVERHEAD + extra, FRAME_MESSAGE, m.timestamp, attempts))
            add(m.wire_id)
        else:
            header = delivered(m.ext, m.trace_id) if m.ext or m.trace_id else b""
            ext_head = _EXT_HEAD.pack(EXT_VERSION_JSON, len(header)) if header else _NO_EXT
            add(pack(len(body) + len(header) + len(ext_head) + _MESSAGE_OVERHEAD + extra,
                     FRAME_MESSAGE,
                     m.timestamp, attempts))
            add(m.wire_id)
            add(ext_head)
            add(header)
        if offsets:
            add(_OFFSET.pack(m.offset, max(m.end - m.offset, 0)))
        add(body)
    return b"".join(parts)


def pub_trace_reply(msg_id: int, trace_id: int, offset: int, size: int) -> bytes:
    """Response data for PUB_TRACE: OK + 8-byte id + 8-byte trace id + 8-byte offset + 4-byte size."""
    return _TRACE_REPLY.pack(b"OK", msg_id, trace_id, offset, size)


OK = encode_response(b"OK")
HEARTBEAT = encode_response(b"_heartbeat_")
CLOSE_WAIT = encode_response(b"CLOSE_WAIT")
