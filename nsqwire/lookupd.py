"""The nsqlookupd TCP protocol V1 (port 4160), sans-I/O, both halves.

An nsqd connects, sends the magic `"  V1"`, then text lines: `IDENTIFY` followed by a
4-byte big-endian size and a JSON body (broadcast_address, tcp_port, http_port,
version, hostname), `REGISTER topic [channel]`, `UNREGISTER topic [channel]`, `PING`.
Every answer is a 4-byte big-endian size and the data, with no frame type: `OK`, the
lookupd's JSON for IDENTIFY, or an error text `E_* ...`. Every error closes the
connection (Go nsqlookupd v1.3.0 makes them all fatal).

Server half: LookupParser (bytes in, commands out; it also keeps the one protocol
state, whether the peer has identified, so "REGISTER before IDENTIFY" is decided here).
Client half: the cmd_* encoders and ResponseReader (size-prefixed answers out of bytes).

Error texts are Go nsqlookupd's (lookup_protocol_v1.go): names are quoted '%s', and
"insufficient number of params". Ours beyond it: a line is bounded (1,024 bytes) and an
IDENTIFY body too (a size <= 0 or above the limit is E_BAD_BODY; Go allocates what the
size says, and a negative one panics).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from .errors import ProtocolError, _raw, line_too_long
from .protocol import decode_json, valid_channel_name, valid_topic_name

MAGIC_V1 = b"  V1"
MAX_LINE_LENGTH = 1024
MAX_IDENTIFY_BODY = 64 * 1024
MAX_RESPONSE = 1024 * 1024  # what a client accepts as one answer

_SIZE = struct.Struct(">i")
# IDENTIFY fields and the JSON type Go's json.Unmarshal accepts for each (PeerInfo).
IDENTIFY_FIELDS = {"broadcast_address": str, "hostname": str, "version": str,
                   "tcp_port": int, "http_port": int}

OK = b"OK"


# ---------------------------------------------------------------- commands


@dataclass(slots=True)
class Identify:
    """A peer's info: every IDENTIFY_FIELDS key, with its type; the required ones set."""
    info: dict


@dataclass(slots=True)
class Register:
    topic: str
    channel: str | None = None


@dataclass(slots=True)
class Unregister:
    topic: str
    channel: str | None = None


@dataclass(slots=True)
class Ping:
    pass


Command = Identify | Register | Unregister | Ping


# ---------------------------------------------------------------- server half


def encode_response(data: bytes) -> bytes:
    """`[4-byte size][data]`: how nsqlookupd answers everything, errors included."""
    return _SIZE.pack(len(data)) + data


def error_response(exc: ProtocolError) -> bytes:
    return encode_response(exc.text.encode("utf-8", "surrogateescape"))


def bad_protocol() -> ProtocolError:
    return ProtocolError("E_BAD_PROTOCOL")


def peer_info(body: bytes) -> dict:
    """The IDENTIFY body as Go's json.Unmarshal into PeerInfo reads it: an object (or
    null), known fields of the right type (others ignored), then the required ones set.
    Raises ProtocolError E_BAD_BODY."""
    try:
        doc = decode_json(body)
    except ValueError:
        raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
    info = {}
    for name, kind in IDENTIFY_FIELDS.items():
        value = doc.get(name)
        if value is None:
            value = kind()
        elif kind is int and (isinstance(value, bool) or not isinstance(value, int)
                              or not -2**63 <= value < 2**63):
            raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        elif kind is str and not isinstance(value, str):
            raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")
        info[name] = value
    if not (info["broadcast_address"] and info["tcp_port"] and info["http_port"]
            and info["version"]):
        raise ProtocolError("E_BAD_BODY", "IDENTIFY missing fields")
    return info


def _topic_channel(command: str, params: list[bytes]) -> tuple[str, str | None]:
    """getTopicChan: a valid topic, and a channel when one is given (empty: none)."""
    if not params:
        raise ProtocolError("E_INVALID", f"{command} insufficient number of params")
    topic = _raw(params[0])
    channel = _raw(params[1]) if len(params) >= 2 else ""
    if not valid_topic_name(topic):
        raise ProtocolError("E_BAD_TOPIC", f"{command} topic name '{topic}' is not valid")
    if channel and not valid_channel_name(channel):
        raise ProtocolError("E_BAD_CHANNEL", f"{command} channel name '{channel}' is not valid")
    return topic, channel or None


_MAGIC, _LINE, _BODY_SIZE, _BODY = range(4)
_WHITESPACE = b" \t\r\n\v\f"


class LookupParser:
    """Server side of V1: feed() what was read, then next_command() until None.

    Invariants: at most MAX_LINE_LENGTH (+ the IDENTIFY body limit) unparsed bytes are
    kept, since every size is checked before its bytes are awaited; every error is a
    fatal ProtocolError, and it is sticky (the connection is to be closed after sending
    it); `identified` turns True with the one IDENTIFY a connection may send."""

    def __init__(self, max_line_length: int = MAX_LINE_LENGTH,
                 max_body: int = MAX_IDENTIFY_BODY) -> None:
        self.max_line_length = max_line_length
        self.max_body = max_body
        self.identified = False
        self._buf = bytearray()
        self._state = _MAGIC
        self._need = 0
        self._error: ProtocolError | None = None

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_command(self) -> Command | None:
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except ProtocolError as exc:
            self._error = exc
            raise

    def _next(self) -> Command | None:
        buf = self._buf
        while True:
            if self._state == _MAGIC:
                if len(buf) < 4:
                    return None
                if bytes(buf[:4]) != MAGIC_V1:
                    raise bad_protocol()
                del buf[:4]
                self._state = _LINE
            elif self._state == _LINE:
                end = buf.find(b"\n", 0, self.max_line_length + 1)
                if end < 0:
                    if len(buf) > self.max_line_length:
                        raise line_too_long(self.max_line_length)
                    return None
                line = bytes(buf[:end]).strip(_WHITESPACE)
                del buf[:end + 1]
                command = self._dispatch(line.split(b" "))
                if command is not None:
                    return command
            elif self._state == _BODY_SIZE:
                if len(buf) < 4:
                    return None
                size = _SIZE.unpack_from(buf)[0]
                if not 0 < size <= self.max_body:
                    raise ProtocolError("E_BAD_BODY", f"IDENTIFY invalid body size {size}")
                del buf[:4]
                self._need = size
                self._state = _BODY
            else:  # _BODY
                if len(buf) < self._need:
                    return None
                body = bytes(buf[:self._need])
                del buf[:self._need]
                self._state = _LINE
                info = peer_info(body)
                self.identified = True
                return Identify(info)

    def _dispatch(self, params: list[bytes]) -> Command | None:
        name = params[0]
        if name == b"PING":
            return Ping()
        if name == b"IDENTIFY":
            if self.identified:
                raise ProtocolError("E_INVALID", "cannot IDENTIFY again")
            self._state = _BODY_SIZE
            return None
        if name in (b"REGISTER", b"UNREGISTER"):
            command = name.decode()
            if not self.identified:
                raise ProtocolError("E_INVALID", "client must IDENTIFY")
            topic, channel = _topic_channel(command, params[1:])
            return (Register if name == b"REGISTER" else Unregister)(topic, channel)
        raise ProtocolError("E_INVALID", f"invalid command {_raw(name)}")


# ---------------------------------------------------------------- client half


def cmd_identify(info: dict) -> bytes:
    body = json.dumps(info, separators=(",", ":")).encode()
    return b"IDENTIFY\n" + _SIZE.pack(len(body)) + body


def cmd_register(topic: str, channel: str | None = None) -> bytes:
    return f"REGISTER {topic} {channel}\n".encode() if channel else f"REGISTER {topic}\n".encode()


def cmd_unregister(topic: str, channel: str | None = None) -> bytes:
    return (f"UNREGISTER {topic} {channel}\n".encode() if channel
            else f"UNREGISTER {topic}\n".encode())


PING = b"PING\n"


class LookupdError(Exception):
    """The lookupd answered an `E_*` error (it closes the connection after it)."""


class ResponseReader:
    """Client side: feed() what was read, next_response() gives each whole answer's data
    (or None while incomplete). An answer larger than `max_size` (or negative) is a
    ValueError: the stream is not a lookupd's."""

    def __init__(self, max_size: int = MAX_RESPONSE) -> None:
        self.max_size = max_size
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes read but not yet returned as an answer."""
        return len(self._buf)

    def next_response(self) -> bytes | None:
        buf = self._buf
        if len(buf) < 4:
            return None
        size = _SIZE.unpack_from(buf)[0]
        if not 0 <= size <= self.max_size:
            raise ValueError(f"invalid lookupd response size {size}")
        if len(buf) < 4 + size:
            return None
        data = bytes(buf[4:4 + size])
        del buf[:4 + size]
        return data


def check_response(data: bytes) -> bytes:
    """`data` when it is not an error; raises LookupdError for `E_*` answers."""
    if data.startswith(b"E_"):
        raise LookupdError(data.decode("utf-8", "replace"))
    return data
