"""The replication protocol's frames, sans-I/O: bytes in, frames out, and back.

Frame: `[u32 size][u8 kind][u32 request id][u16 header length][header][payload]`,
big-endian; `size` counts everything after itself and is at most `MAX_FRAME`. The header
is compact JSON, but for the hot kinds PUSH and ACK: fixed binary layouts (`PUSH_HEAD`,
`ACK_HEAD`), decoded to the same dicts. `VERSION` (in HELLO and its OK) names this
format; a peer of another version is refused at HELLO. A `Decoder` takes bytes in any
pieces and gives whole frames; it holds at most one unfinished frame (never more than
`MAX_FRAME` + 4 bytes plus the piece just fed) and raises `BadFrame` on anything that is
not a frame, after which the connection is closed. `check` validates a request's header
fields against `REQUESTS`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import IntEnum

VERSION = 2  # 1: JSON headers for every kind (HELLO without a version)
MAX_FRAME = 64 * 1024 * 1024 + 64 * 1024
MAX_HEADER = 65535
PREFIX = struct.Struct(">IBIH")  # size, kind, request id, header length
FIXED = PREFIX.size - 4  # bytes after `size` before the header


class Kind(IntEnum):
    HELLO = 1
    PUSH = 2
    FETCH = 3
    EPOCH_END = 4
    JOIN = 5
    CHANNELS = 6
    PING = 7
    PUBLISH = 8  # a node's forwarded publish (nsqd/forward.py), not replication
    OK = 64
    ACK = 65
    DATA = 66
    POSITION = 67
    ERROR = 68
    WRITTEN = 69  # PUBLISH's answer: what the leader wrote



# error codes (ERROR {code, message, end?, epoch?})
E_BAD_FRAME = "E_BAD_FRAME"
E_BAD_CLUSTER = "E_BAD_CLUSTER"
E_BAD_VERSION = "E_BAD_VERSION"
E_STALE_EPOCH = "E_STALE_EPOCH"
E_NOT_LEADER = "E_NOT_LEADER"
E_NOT_REPLICA = "E_NOT_REPLICA"
E_GAP = "E_GAP"
E_BAD_BATCH = "E_BAD_BATCH"
E_DISK_FULL = "E_DISK_FULL"
E_OUT_OF_RANGE = "E_OUT_OF_RANGE"
E_FAILED = "E_FAILED"

_INT = "int"
_STR = "str"
_POS = "pos"  # [offset, count]
_DICT = "dict"

_PARTITION = {"topic": _STR, "partition": _INT, "epoch": _INT}
REQUESTS: dict[Kind, dict[str, str]] = {
    Kind.HELLO: {"cluster": _STR, "node": _STR},
    Kind.PUSH: {**_PARTITION, "leader": _STR, "offset": _INT, "count": _INT, "n": _INT,
                "data_len": _INT, "commit": _POS},
    Kind.FETCH: {**_PARTITION, "node": _STR, "offset": _INT, "count": _INT, "max_bytes": _INT},
    Kind.EPOCH_END: {**_PARTITION, "last_epoch": _INT},
    Kind.JOIN: {**_PARTITION, "node": _STR, "offset": _INT, "count": _INT},
    Kind.CHANNELS: {**_PARTITION, "channels": _DICT},
    Kind.PING: {},
    Kind.PUBLISH: {"topic": _STR, "partition": _INT, "n": _INT},  # source: any str
}
ENTRY_SIZE = 64


class BadFrame(Exception):
    """The peer sent something that is not a valid frame (its fault, not ours). `frames`:
    the whole frames that came before it in the same `feed` (answer them first)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.frames: list[Frame] = []


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    rid: int
    header: dict
    payload: bytes = b""


def dumps(header: dict) -> bytes:
    """A frame's header as compact JSON (ValueError beyond MAX_HEADER)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"header of {len(head)} bytes")
    return head


# PUSH header: epoch, offset, count, commit offset, commit count (u64 each), partition, n,
# data_len, crc (u32 each), has_crc, topic length, leader length (u8 each); then the topic
# and the leader, UTF-8. ACK header: the end's offset and count (u64 each).
PUSH_HEAD = struct.Struct(">QQQQQIIIIBBB")
ACK_HEAD = struct.Struct(">QQ")
_MAX_INT = (1 << 63) - 1


def _push_head(h: dict) -> bytes:
    try:
        topic, leader = h["topic"].encode(), h["leader"].encode()
        commit, crc = h["commit"], h.get("crc")
        return PUSH_HEAD.pack(h["epoch"], h["offset"], h["count"], commit[0], commit[1],
                              h["partition"], h["n"], h["data_len"], crc or 0, crc is not None,
                              len(topic), len(leader)) + topic + leader
    except (KeyError, TypeError, IndexError, AttributeError, struct.error) as e:
        raise ValueError(f"PUSH header {h!r}: {e!r}") from None


def _push_fields(raw: bytes) -> dict:
    size = PUSH_HEAD.size
    if len(raw) < size:
        raise BadFrame(f"PUSH header of {len(raw)} bytes")
    (epoch, offset, count, c_offset, c_count, partition, n, data_len, crc, has_crc,
     topic_len, leader_len) = PUSH_HEAD.unpack_from(raw)
    if len(raw) != size + topic_len + leader_len:
        raise BadFrame(f"PUSH header of {len(raw)} bytes, its names need {topic_len} + {leader_len}")
    if max(epoch, offset, count, c_offset, c_count) > _MAX_INT or has_crc > 1:
        raise BadFrame("PUSH header: a field out of range")
    try:
        topic = raw[size:size + topic_len].decode()
        leader = raw[size + topic_len:].decode()
    except UnicodeDecodeError:
        raise BadFrame("PUSH header: a name is not UTF-8") from None
    h = {"topic": topic, "partition": partition, "epoch": epoch, "leader": leader,
         "offset": offset, "count": count, "n": n, "data_len": data_len,
         "commit": [c_offset, c_count]}
    if has_crc:
        h["crc"] = crc
    return h


def _ack_head(h: dict) -> bytes:
    try:
        return ACK_HEAD.pack(*h["end"])
    except (KeyError, TypeError, struct.error) as e:
        raise ValueError(f"ACK header {h!r}: {e!r}") from None


def _ack_fields(raw: bytes) -> dict:
    if len(raw) != ACK_HEAD.size:
        raise BadFrame(f"ACK header of {len(raw)} bytes")
    return {"end": list(ACK_HEAD.unpack(raw))}


# PUBLISH header: partition, n (u32 each), trace_id (u64), flags (u8: 1 trace ids, 2 exts in
# the payload, 4 an idempotent producer's name), topic, source and ext lengths (u16 each);
# then those three, the ext raw; then, with flag 4, [u8 length][producer id][u64 sequence].
# WRITTEN header: first_id, count, offset, end_offset (u64 each), duplicate (u8: 1 when an
# idempotent producer's request was answered again, not written).
PUBLISH_HEAD = struct.Struct(">IIQBHHH")
WRITTEN_HEAD = struct.Struct(">QQQQB")
_WRITTEN = ("first_id", "count", "offset", "end_offset", "duplicate")
_SEQUENCE = struct.Struct(">Q")


def _publish_head(h: dict) -> bytes:
    try:
        topic, source, ext = h["topic"].encode(), h["source"].encode(), bytes(h["ext"])
        flags = (1 if h["trace_ids"] else 0) | (2 if h["exts"] else 0)
        tail = b""
        if h.get("producer") is not None:
            producer_id = h["producer"][0].encode()
            flags |= 4
            tail = (bytes([len(producer_id)]) + producer_id
                    + _SEQUENCE.pack(h["producer"][1]))
        return PUBLISH_HEAD.pack(h["partition"], h["n"], h["trace_id"], flags, len(topic),
                                 len(source), len(ext)) + topic + source + ext + tail
    except (KeyError, TypeError, AttributeError, ValueError, struct.error) as e:
        raise ValueError(f"PUBLISH header {h!r}: {e!r}") from None


def _publish_fields(raw: bytes) -> dict:
    size = PUBLISH_HEAD.size
    if len(raw) < size:
        raise BadFrame(f"PUBLISH header of {len(raw)} bytes")
    partition, n, trace_id, flags, topic_len, source_len, ext_len = PUBLISH_HEAD.unpack_from(raw)
    ext_end = size + topic_len + source_len + ext_len
    producer = None
    if flags & 4 and len(raw) > ext_end:
        id_end = ext_end + 1 + raw[ext_end]
        if len(raw) == id_end + _SEQUENCE.size:
            try:
                producer = (bytes(raw[ext_end + 1:id_end]).decode(),
                            _SEQUENCE.unpack_from(raw, id_end)[0])
            except UnicodeDecodeError:
                raise BadFrame("PUBLISH header: a producer id is not UTF-8") from None
    if flags > 7 or (producer is None and (flags & 4 or len(raw) != ext_end)):
        raise BadFrame(f"PUBLISH header of {len(raw)} bytes does not match its lengths")
    try:
        topic = bytes(raw[size:size + topic_len]).decode()
        source = bytes(raw[size + topic_len:size + topic_len + source_len]).decode()
    except UnicodeDecodeError:
        raise BadFrame("PUBLISH header: a name is not UTF-8") from None
    return {"topic": topic, "partition": partition, "n": n, "trace_id": trace_id,
            "trace_ids": bool(flags & 1), "exts": bool(flags & 2), "source": source,
            "ext": bytes(raw[size + topic_len + source_len:ext_end]), "producer": producer}


def _written_head(h: dict) -> bytes:
    try:
        return WRITTEN_HEAD.pack(*(h[k] for k in _WRITTEN))
    except (KeyError, TypeError, struct.error) as e:
        raise ValueError(f"WRITTEN header {h!r}: {e!r}") from None


def _written_fields(raw: bytes) -> dict:
    if len(raw) != WRITTEN_HEAD.size:
        raise BadFrame(f"WRITTEN header of {len(raw)} bytes")
    fields = dict(zip(_WRITTEN, WRITTEN_HEAD.unpack(raw)))
    fields["duplicate"] = bool(fields["duplicate"])
    return fields


_BINARY = {Kind.PUSH: (_push_head, _push_fields), Kind.ACK: (_ack_head, _ack_fields),
           Kind.PUBLISH: (_publish_head, _publish_fields),
           Kind.WRITTEN: (_written_head, _written_fields)}


def encode_header(kind: Kind, header: dict) -> bytes:
    """A frame's header as it goes on the wire: binary for PUSH, ACK, PUBLISH and WRITTEN,
    else compact JSON
    (ValueError for a header its kind cannot carry)."""
    codec = _BINARY.get(kind)
    if codec is not None:
        return codec[0](header)
    return dumps(header)


def frame_parts(kind: Kind, rid: int, head: bytes, parts: tuple) -> tuple:
    """One frame as its parts, none copied: (prefix + `head`, *parts). `head` is the header
    as `encode_header` gives it, so a frame sent to several peers encodes its header once."""
    size = FIXED + len(head) + sum(len(x) for x in parts)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    return (PREFIX.pack(size, kind, rid, len(head)) + head, *parts)


def encode(kind: Kind, rid: int, header: dict, payload: bytes | tuple = b"") -> bytes:
    """One frame as bytes (the header as `encode_header` gives it); `payload` may be a
    tuple of parts (joined with the rest in one copy)."""
    parts = payload if isinstance(payload, tuple) else (payload,)
    return b"".join(frame_parts(kind, rid, encode_header(kind, header), parts))


def error(rid: int, code: str, message: str, **extra) -> bytes:
    return encode(Kind.ERROR, rid, {"code": code, "message": message, **extra})


class Decoder:
    """Bytes in (`feed`), frames out. Raises `BadFrame`; unusable after it."""

    __slots__ = ("_buf", "_pos", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME):
        self._buf = bytearray()
        self._pos = 0
        self.max_frame = max_frame

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: bytes) -> list[Frame]:
        """Every whole frame that `data` completes, in order. The frames that `data` holds
        whole while nothing is buffered are not copied: their payloads are memoryviews of
        `data` (so is every payload bytes-like, not always `bytes`)."""
        buf = self._buf
        frames = []
        try:
            if self._pos == len(buf) and type(data) is bytes:
                buf.clear()
                self._pos = 0
                end = self._parse(frames, data, 0)
                if end < len(data):
                    buf += memoryview(data)[end:]
                return frames
            buf += data
            self._pos = self._parse(frames, buf, self._pos)
        except BadFrame as e:
            e.frames = frames
            raise
        if self._pos > 65536 and self._pos * 2 > len(buf):
            del buf[:self._pos]
            self._pos = 0
        return frames

    def _parse(self, frames: list, buf, pos: int) -> int:
        """Append the whole frames of `buf` from `pos` to `frames`; the position after them.
        `buf` is the caller's `bytes` (payloads are views of it) or our bytearray (copied:
        it changes)."""
        view = memoryview(buf)
        copy = type(buf) is not bytes
        try:
            while True:
                avail = len(buf) - pos
                if avail < 4:
                    return pos
                (size,) = struct.unpack_from(">I", buf, pos)
                if size < FIXED or size > self.max_frame:
                    raise BadFrame(f"frame size {size}")
                if avail >= PREFIX.size:
                    _, kind, rid, hlen = PREFIX.unpack_from(buf, pos)
                    if FIXED + hlen > size:
                        raise BadFrame(f"header length {hlen} beyond frame size {size}")
                    try:
                        kind = Kind(kind)
                    except ValueError:
                        raise BadFrame(f"unknown kind {kind}") from None
                if avail < 4 + size:
                    return pos
                start = pos + PREFIX.size
                pos += 4 + size
                head = bytes(view[start:start + hlen])
                payload = view[start + hlen:pos]
                frames.append(Frame(kind, rid, _header(kind, head),
                                    bytes(payload) if copy else payload))
        finally:
            if copy:
                view.release()  # (a bytearray with an export cannot be resized)


def _header(kind: Kind, raw: bytes) -> dict:
    codec = _BINARY.get(kind)
    if codec is not None:
        return codec[1](raw)
    try:
        header = json.loads(raw) if raw else {}
    except (ValueError, RecursionError) as e:
        raise BadFrame(f"header is not JSON: {e}") from None
    if type(header) is not dict:
        raise BadFrame("header is not a JSON object")
    return header


def _valid(v, rule: str) -> bool:
    if rule == _INT:
        return type(v) is int and 0 <= v < 1 << 63
    if rule == _STR:
        return type(v) is str and 0 < len(v) <= 256
    if rule == _POS:
        return type(v) is list and len(v) == 2 and all(_valid(x, _INT) for x in v)
    if rule == _DICT:
        return type(v) is dict
    return False


def check(frame: Frame) -> None:
    """A request's header has every field of its kind, well typed; its payload fits
    (PUSH: n*64 + data_len bytes; PUBLISH: its messages, checked by its handler; other
    requests: none). Else `BadFrame`."""
    rules = REQUESTS.get(frame.kind)
    if rules is None:
        raise BadFrame(f"{frame.kind.name} is not a request")
    h = frame.header
    for name, rule in rules.items():
        if not _valid(h.get(name), rule):
            raise BadFrame(f"{frame.kind.name}: bad or missing {name!r}")
    if frame.kind is Kind.PUSH:
        if h["n"] * ENTRY_SIZE + h["data_len"] != len(frame.payload):
            raise BadFrame(f"PUSH payload of {len(frame.payload)} bytes, header says "
                           f"{h['n']} entries + {h['data_len']} bytes")
    elif frame.payload and frame.kind is not Kind.PUBLISH:
        raise BadFrame(f"{frame.kind.name} carries no payload")
