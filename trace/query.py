"""The arguments of /trace/search and /message/get, checked once for nsqd and nsqlookupd.

Sans-I/O: `params` is a parsed query string (name -> list of values, the first counts);
a bad argument raises QueryError whose `code` is the 400 answer's `message`. nsqlookupd
checks a request with the same rules before it asks any node, then forwards `forward()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nsqwire.httpapi import parse_time_ns
from nsqwire.ids import MAX_PARTITION, PARTITION_SHIFT
from nsqwire.protocol import valid_channel_name, valid_topic_name

from .events import parse_msg_id

MAX_LIMIT = 10_000
DEFAULT_LIMIT = 1000


class QueryError(ValueError):
    """A bad argument: `code` is the 400 answer's message (INVALID_MSG_ID, ...)."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


def _arg(params: dict, name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None


def _time_ns(params: dict, name: str) -> int | None:
    """Unix seconds (fractions allowed) or ISO 8601 (UTC when no zone is given)."""
    raw = _arg(params, name)
    if raw is None:
        return None
    try:
        return parse_time_ns(raw)
    except ValueError:
        raise QueryError(f"INVALID_{name.upper()}") from None


def _msg_id(params: dict) -> int | None:
    raw = _arg(params, "msg_id")
    if raw is None:
        return None
    try:
        return parse_msg_id(raw)
    except ValueError:
        raise QueryError("INVALID_MSG_ID") from None


def _topic(params: dict) -> str:
    topic = _arg(params, "topic")
    if topic is None:
        raise QueryError("MISSING_ARG_TOPIC")
    if not valid_topic_name(topic):
        raise QueryError("INVALID_TOPIC")
    return topic


def _forward(params: dict, names: tuple[str, ...]) -> dict[str, str]:
    return {name: value for name in names if (value := _arg(params, name)) is not None}


@dataclass(frozen=True, slots=True)
class Search:
    """GET /trace/search: at least one of msg_id, trace_id, topic (each an index)."""
    msg_id: int | None
    trace_id: int | None
    topic: str | None
    channel: str | None
    since_ns: int | None
    until_ns: int | None
    limit: int
    forward: dict  # the arguments as given, for the nodes nsqlookupd asks


def parse_search(params: dict) -> Search:
    msg_id = _msg_id(params)
    raw_trace = _arg(params, "trace_id")
    if raw_trace is not None and (not raw_trace.isdigit()
                                  or not 0 < int(raw_trace) < 1 << 64):
        raise QueryError("INVALID_TRACE_ID")
    topic = _topic(params) if _arg(params, "topic") is not None else None
    if msg_id is None and raw_trace is None and topic is None:
        raise QueryError("MISSING_ARG_MSG_ID_TRACE_ID_OR_TOPIC")
    channel = _arg(params, "channel")
    if channel is not None and not valid_channel_name(channel):
        raise QueryError("INVALID_CHANNEL")
    since, until = _time_ns(params, "since"), _time_ns(params, "until")
    raw_limit = _arg(params, "limit") or str(DEFAULT_LIMIT)
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
        raise QueryError("INVALID_LIMIT")
    limit = int(raw_limit)
    forward = _forward(params, ("msg_id", "trace_id", "topic", "channel", "since", "until"))
    return Search(msg_id, int(raw_trace) if raw_trace is not None else None, topic, channel,
                  since, until, limit, {**forward, "limit": str(limit)})


@dataclass(frozen=True, slots=True)
class MessageGet:
    """GET /message/get: a message id or an offset; `partition` None only when an offset
    came without one (a classic lookupd asks every producer; a node refuses it)."""
    topic: str
    partition: int | None
    msg_id: int | None
    offset: int | None
    forward: dict


def parse_message_get(params: dict) -> MessageGet:
    topic = _topic(params)
    msg_id = _msg_id(params)
    raw_offset = _arg(params, "offset")
    if (msg_id is None) == (raw_offset is None):
        raise QueryError("MISSING_ARG_MSG_ID_OR_OFFSET")
    if raw_offset is not None and not raw_offset.isdigit():
        raise QueryError("INVALID_OFFSET")
    raw = _arg(params, "partition")
    if raw is not None and (not raw.isdigit() or int(raw) > MAX_PARTITION):
        raise QueryError("BAD_PARTITION")
    partition = int(raw) if raw is not None else None
    if msg_id is not None:
        if partition is None:
            partition = msg_id >> PARTITION_SHIFT  # a message id names its partition
        elif msg_id >> PARTITION_SHIFT != partition:
            raise QueryError("MSG_ID_NOT_IN_PARTITION")
    forward = {"topic": topic, **({"partition": str(partition)} if partition is not None
                                  else {}), **_forward(params, ("msg_id", "offset"))}
    return MessageGet(topic, partition, msg_id, int(raw_offset) if raw_offset is not None
                      else None, forward)
