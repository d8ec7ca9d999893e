"""A request's arguments and body as nsqd's HTTP API reads them (classic names and codes):
each bad one is an HTTPError, answered `{"message": code}` with its status (400, 413 for a
body or message too large, 408 for a body that stopped coming). Shared by every HTTP module
of the node (http.py, readhttp.py, tracehttp.py)."""

from __future__ import annotations

import asyncio
import re

from aiohttp import ClientError, web
from aiohttp.http_exceptions import HttpProcessingError

from nsqwire.ext import checked_producer
from nsqwire import httpapi
from nsqwire.httpapi import parse_query
from nsqwire.protocol import MAX_PARTITION, valid_channel_name, valid_topic_name

_BOOLS = {"true": True, "1": True, "false": False, "0": False}
_INT = re.compile(r"[+-]?[0-9]+")
_BODY_ERRORS = (ClientError, HttpProcessingError, ConnectionError, asyncio.IncompleteReadError,
                OSError)


class HTTPError(Exception):
    """An answer `{"message": code, **extra}` with an HTTP status."""

    def __init__(self, status: int, code: str, extra: dict | None = None):
        super().__init__(code)
        self.status = status
        self.code = code
        self.extra = extra



# ---- request arguments --------------------------------------------------------


def query(request: web.Request) -> dict[str, list[str]]:
    try:
        return parse_query(request.rel_url.raw_query_string)
    except ValueError:
        raise HTTPError(400, "INVALID_REQUEST") from None


def arg(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None


def strict_bool_arg(params, name: str, code: str) -> bool:
    """A true|false|1|0 argument (absent: False), else 400 `code`."""
    text = (arg(params, name) or "false").lower()
    if text not in ("true", "false", "1", "0"):
        raise HTTPError(400, code)
    return text in ("true", "1")


def topic_arg(params) -> str:
    """getTopicFromQuery: the topic name, present and valid."""
    name = arg(params, "topic")
    if name is None:
        raise HTTPError(400, "MISSING_ARG_TOPIC")
    if not valid_topic_name(name):
        raise HTTPError(400, "INVALID_TOPIC")
    return name


def topic_channel_args(params) -> tuple[str, str]:
    """http_api.GetTopicChannelArgs."""
    topic = arg(params, "topic")
    if topic is None:
        raise HTTPError(400, "MISSING_ARG_TOPIC")
    if not valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    channel = arg(params, "channel")
    if channel is None:
        raise HTTPError(400, "MISSING_ARG_CHANNEL")
    if not valid_channel_name(channel):
        raise HTTPError(400, "INVALID_ARG_CHANNEL")
    return topic, channel


def partition_arg(params) -> int | None:
    raw = arg(params, "partition")
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) > MAX_PARTITION:
        raise HTTPError(400, "BAD_PARTITION")
    return int(raw)


def producer_arg(params) -> tuple[str, int] | None:
    """An idempotent producer's `producer_id` and `sequence` (both or neither), or None."""
    producer_id, sequence = arg(params, "producer_id"), arg(params, "sequence")
    if producer_id is None and sequence is None:
        return None
    try:
        return checked_producer(producer_id, sequence)
    except ValueError:
        raise HTTPError(400, "INVALID_PRODUCER") from None


def defer_arg(params, max_ms: int) -> int:
    raw = arg(params, "defer")
    if raw is None:
        return 0
    if not _INT.fullmatch(raw):
        raise HTTPError(400, "INVALID_DEFER")
    value = int(raw)
    if not 0 <= value <= max_ms:
        raise HTTPError(400, "INVALID_DEFER")
    return value


def bool_arg(params, name: str, default: bool, unknown: bool) -> bool:
    raw = arg(params, name)
    if raw is None:
        return default
    return _BOOLS.get(raw, unknown)


async def read_body(request: web.Request, limit: int) -> bytes | None:
    """The body, or None when it is longer than `limit` (at most limit + 1 bytes are read).
    One that has not arrived whole within httpapi.BODY_S is 408 BODY_TIMEOUT (aiohttp then reads
    and drops the rest for up to 10 s, its lingering time, and closes the connection), so a
    client that stops sending never holds its request for longer."""
    if request.content_length is not None and request.content_length > limit:
        return None
    buf = bytearray()
    try:
        async with asyncio.timeout(httpapi.BODY_S):
            while len(buf) <= limit:
                chunk = await request.content.read(limit + 1 - len(buf))
                if not chunk:
                    break
                buf += chunk
    except TimeoutError:
        raise HTTPError(408, "BODY_TIMEOUT") from None
    except _BODY_ERRORS as e:  # truncated or malformed body, or the peer went away
        raise HTTPError(400, "BAD_BODY") from e
    return None if len(buf) > limit else bytes(buf)


def parse_mpub_binary(body: bytes, max_msg_size: int, max_body_size: int) -> list[bytes]:
    """nsqd's readMPUB: [4-byte count] then [4-byte size][bytes] each; errors are 413."""
    if len(body) < 4:
        raise HTTPError(413, "BAD_BODY")
    count = int.from_bytes(body[:4], "big", signed=True)
    if count <= 0 or count > (max_body_size - 4) // 5:
        raise HTTPError(413, "BAD_BODY")
    out = []
    pos = 4
    for _ in range(count):
        if pos + 4 > len(body):
            raise HTTPError(413, "BAD_MESSAGE")
        size = int.from_bytes(body[pos:pos + 4], "big", signed=True)
        if size <= 0 or size > max_msg_size:
            raise HTTPError(413, "BAD_MESSAGE")
        pos += 4
        if pos + size > len(body):
            raise HTTPError(413, "BAD_MESSAGE")
        out.append(body[pos:pos + size])
        pos += size
    return out


def parse_mpub_text(body: bytes, max_msg_size: int) -> list[bytes]:
    """Newline-separated messages; empty lines are skipped (as nsqd since 0.2.22)."""
    out = []
    for line in body.split(b"\n"):
        if not line:
            continue
        if len(line) > max_msg_size:
            raise HTTPError(413, "MSG_TOO_BIG")
        out.append(line)
    return out
