"""HTTP endpoints of message trace (added to http.py's ROUTES at start):

- `POST /message/trace/enable|disable?topic=[&channel=]`: the switches (tracing.py); the
  topic need not exist yet. Stored before the answer. In cluster mode written to etcd
  (the topic's meta or the channel's `trace`), which every leader follows: 404
  `TOPIC_NOT_FOUND` / `CHANNEL_NOT_FOUND` when etcd has no such one, 503
  `CLUSTER_UNAVAILABLE` while etcd is away.
- `GET /trace/search?msg_id=|trace_id=|topic=[&channel=&since=&until=&limit=]`: the events
  in time order, grouped into each message's timeline (nsqtrace.timeline). `msg_id` is the
  16 hex characters clients see; `since`/`until` unix seconds (fractions allowed) or ISO
  8601; `limit` 1..10000 events (default 1000). Bad arguments 400; a msg_id or trace_id
  with no events 404 with a JSON body saying so. The store is trace.sqlite, or
  Elasticsearch with `--trace-es-url` (503 `TRACE_STORE_UNAVAILABLE` while unreachable).
- `GET /message/get?topic=&[partition=]&msg_id=|offset=`: one message from the log, found
  through the commitlog (a msg_id alone names its partition): header fields, ext header,
  body (UTF-8 text, or base64 with `body_encoding`).
"""

from __future__ import annotations

import asyncio
import base64
import datetime

from aiohttp import web

from nsqtrace.events import msg_id_hex, parse_msg_id
from nsqtrace.timeline import timelines
from nsqtrace.writer import StoreUnavailable
from nsqwire.httpapi import V1_HEADER
from nsqwire.ids import PARTITION_SHIFT
from nsqwire.protocol import valid_channel_name

from .cluster import ClusterUnavailable
from .http import HTTPError, arg, partition_arg, query, topic_arg

MAX_LIMIT = 10_000


async def _switch(nsqd, request, on: bool):
    params = query(request)
    topic = topic_arg(params)
    channel = arg(params, "channel")
    if channel is not None and not valid_channel_name(channel):
        raise HTTPError(400, "INVALID_CHANNEL")
    try:
        found = await nsqd.tracer.switch(topic, channel, on)
    except ClusterUnavailable:
        raise HTTPError(503, "CLUSTER_UNAVAILABLE") from None
    if not found:  # cluster mode: etcd has no such topic or channel
        raise HTTPError(404, "TOPIC_NOT_FOUND" if channel is None else "CHANNEL_NOT_FOUND")
    return "OK"


async def do_trace_enable(nsqd, request):
    return await _switch(nsqd, request, True)


async def do_trace_disable(nsqd, request):
    return await _switch(nsqd, request, False)


def _time_ns(params, name: str) -> int | None:
    raw = arg(params, name)
    if raw is None:
        return None
    try:
        return int(float(raw) * 1e9)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise HTTPError(400, f"INVALID_{name.upper()}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp() * 1e9)


def _msg_id(params) -> int | None:
    raw = arg(params, "msg_id")
    if raw is None:
        return None
    try:
        return parse_msg_id(raw)
    except ValueError:
        raise HTTPError(400, "INVALID_MSG_ID") from None


def _not_found(code: str, what: str) -> web.Response:
    """404 with the code (as every error here) and a sentence saying what was not found."""
    return web.json_response({"message": code, "detail": what}, status=404, headers=V1_HEADER)


async def do_trace_search(nsqd, request):
    params = query(request)
    msg_id = _msg_id(params)
    trace_id = arg(params, "trace_id")
    if trace_id is not None:
        if not trace_id.isdigit() or int(trace_id) >= 1 << 64 or int(trace_id) == 0:
            raise HTTPError(400, "INVALID_TRACE_ID")
        trace_id = int(trace_id)
    topic = topic_arg(params) if arg(params, "topic") is not None else None
    if msg_id is None and trace_id is None and topic is None:
        raise HTTPError(400, "MISSING_ARG_MSG_ID_TRACE_ID_OR_TOPIC")
    channel = arg(params, "channel")
    if channel is not None and not valid_channel_name(channel):
        raise HTTPError(400, "INVALID_CHANNEL")
    since, until = _time_ns(params, "since"), _time_ns(params, "until")
    raw_limit = arg(params, "limit") or "1000"
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
        raise HTTPError(400, "INVALID_LIMIT")
    try:
        found = await asyncio.to_thread(
            nsqd.tracer.search, msg_id=msg_id, trace_id=trace_id, topic=topic,
            channel=channel, since_ns=since, until_ns=until, limit=int(raw_limit))
    except StoreUnavailable:  # --trace-es-url: Elasticsearch cannot be reached
        raise HTTPError(503, "TRACE_STORE_UNAVAILABLE") from None
    if not found and msg_id is not None:
        return _not_found("MSG_NOT_FOUND", f"no trace events of message {msg_id_hex(msg_id)} "
                          "(its topic not traced then, the id unknown, or past retention)")
    if not found and trace_id is not None:
        return _not_found("TRACE_ID_NOT_FOUND", f"no trace events with trace id {trace_id}")
    messages, other = timelines(found)
    return {"count": len(found), "limit": int(raw_limit), "messages": messages, "other": other}


async def do_message_get(nsqd, request):
    params = query(request)
    name = topic_arg(params)
    msg_id = _msg_id(params)
    raw_offset = arg(params, "offset")
    if (msg_id is None) == (raw_offset is None):
        raise HTTPError(400, "MISSING_ARG_MSG_ID_OR_OFFSET")
    if raw_offset is not None and not raw_offset.isdigit():
        raise HTTPError(400, "INVALID_OFFSET")
    number = partition_arg(params)
    if number is None:
        if msg_id is None:
            raise HTTPError(400, "MISSING_ARG_PARTITION")
        number = msg_id >> PARTITION_SHIFT
    elif msg_id is not None and msg_id >> PARTITION_SHIFT != number:
        raise HTTPError(400, "MSG_ID_NOT_IN_PARTITION")
    topic = nsqd.topics.get(name)
    if topic is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    part = topic.partitions.get(number)
    if part is None:
        raise HTTPError(400, "BAD_PARTITION" if number >= topic.assignment.partition_num
                        else "E_FAILED_ON_NOT_LEADER")
    queue = part.queue
    clog = queue.commitlog
    entry = (clog.find_by_msg_id(msg_id) if msg_id is not None
             else clog.find_by_offset(int(raw_offset)))
    if entry is None or entry.offset >= queue.committed_end or (
            raw_offset is not None and int(raw_offset) >= entry.end_offset):
        return _not_found("MSG_NOT_FOUND", "no such message in the partition's log")
    reader = queue.reader(entry.offset, read_ahead=max(entry.size, 4096))
    try:
        records = await reader.read(entry.msg_count)
    except OSError:  # its segment went with retention
        return _not_found("MSG_NOT_FOUND", "the message's segment is gone (retention)")
    finally:
        reader.close()
    for rec in records:
        if rec.msg_id == msg_id or (raw_offset is not None and rec.offset == int(raw_offset)):
            return _record(name, number, rec)
    if raw_offset is not None:
        raise HTTPError(400, "OFFSET_NOT_A_MESSAGE_START")
    return _not_found("MSG_NOT_FOUND", "no such message in the partition's log")


def _record(topic: str, partition: int, rec) -> dict:
    out = {"topic": topic, "partition": partition, "msg_id": msg_id_hex(rec.msg_id),
           "trace_id": str(rec.trace_id), "offset": rec.offset, "size": rec.size,
           "timestamp": rec.timestamp, "attempts": rec.attempts,
           "ext": rec.ext.decode("utf-8", "replace")}
    try:
        out["body"] = rec.body.decode("utf-8")
        out["body_encoding"] = "utf-8"
    except UnicodeDecodeError:
        out["body"] = base64.b64encode(rec.body).decode()
        out["body_encoding"] = "base64"
    return out


ROUTES = {
    "/message/trace/enable": {"POST": do_trace_enable},
    "/message/trace/disable": {"POST": do_trace_disable},
    "/trace/search": {"GET": do_trace_search},
    "/message/get": {"GET": do_message_get},
}
