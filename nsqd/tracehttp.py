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
  Elasticsearch with `--trace-es-url`: 503 `TRACE_STORE_UNAVAILABLE` (with a `detail`
  saying why) while it is unreachable, or a file SQLite cannot read.
- `GET /message/get?topic=&[partition=]&msg_id=|offset=`: one message from the log, found
  through the commitlog (a msg_id alone names its partition): header fields, ext header,
  body (UTF-8 text, or base64 with `body_encoding`).
"""

from __future__ import annotations

import base64

from aiohttp import web

from diskqueue.queue import QueueClosedError
from nsqtrace.events import msg_id_hex
from nsqtrace.query import QueryError, parse_message_get, parse_search
from nsqtrace.timeline import timelines
from nsqtrace.store import StoreUnavailable
from nsqwire.httpapi import V1_HEADER, go_json, go_json_pieces
from nsqwire.protocol import valid_channel_name

from .errors import ClusterUnavailable, http_error
from .httpargs import HTTPError, arg, query, topic_arg

async def _switch(nsqd, request, on: bool):
    params = query(request)
    topic = topic_arg(params)
    channel = arg(params, "channel")
    if channel is not None and not valid_channel_name(channel):
        raise HTTPError(400, "INVALID_CHANNEL")
    try:
        found = await nsqd.tracer.switch(topic, channel, on)
    except ClusterUnavailable as e:
        raise HTTPError(*http_error(e)) from None
    if not found:  # cluster mode: etcd has no such topic or channel
        raise HTTPError(404, "TOPIC_NOT_FOUND" if channel is None else "CHANNEL_NOT_FOUND")
    return "OK"


async def do_trace_enable(nsqd, request):
    return await _switch(nsqd, request, True)


async def do_trace_disable(nsqd, request):
    return await _switch(nsqd, request, False)


def _checked(parse, request):
    """The request's arguments through nsqtrace.query (400 with its code when bad)."""
    try:
        return parse(query(request))
    except QueryError as e:
        raise HTTPError(400, e.code) from None


def _not_found(code: str, what: str) -> web.Response:
    """404 with the code (as every error here) and a sentence saying what was not found."""
    return web.json_response({"message": code, "detail": what}, status=404, headers=V1_HEADER)


async def do_trace_search(nsqd, request):
    q = _checked(parse_search, request)
    status, body = await nsqd.tracer.searching(_search_answer, nsqd.tracer, q)
    return web.Response(status=status, body=body, content_type="application/json",
                        charset="utf-8", headers=V1_HEADER)


def _search_answer(tracer, q) -> tuple[int, bytes]:
    """The search's status and JSON body. Blocking, on the tracer's search thread: the
    store's work, the timelines and the encoding of up to 10,000 events (a few hundred ms
    of CPU at that limit) stay off the event loop, and no step holds the GIL for long."""
    msg_id, trace_id = q.msg_id, q.trace_id
    try:
        found = tracer.search(msg_id=msg_id, trace_id=trace_id, topic=q.topic,
                              channel=q.channel, since_ns=q.since_ns, until_ns=q.until_ns,
                              limit=q.limit)
    except StoreUnavailable as e:  # Elasticsearch unreachable, or a file SQLite cannot read
        return 503, go_json({"message": "TRACE_STORE_UNAVAILABLE", "detail": str(e)})
    if not found and msg_id is not None:
        return 404, go_json({"message": "MSG_NOT_FOUND", "detail": (
            f"no trace events of message {msg_id_hex(msg_id)} "
            "(its topic not traced then, the id unknown, or past retention)")})
    if not found and trace_id is not None:
        return 404, go_json({"message": "TRACE_ID_NOT_FOUND",
                             "detail": f"no trace events with trace id {trace_id}"})
    messages, other = timelines(found)
    return 200, b"".join(go_json_pieces({"count": len(found), "limit": q.limit,
                                         "messages": messages, "other": other},
                                        "messages", "other"))


async def do_message_get(nsqd, request):
    q = _checked(parse_message_get, request)
    name, number, msg_id, offset = q.topic, q.partition, q.msg_id, q.offset
    if number is None:
        raise HTTPError(400, "MISSING_ARG_PARTITION")
    topic = nsqd.topics.get(name)
    if topic is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    part = topic.partitions.get(number)
    if part is None:
        raise HTTPError(400, "BAD_PARTITION" if number >= topic.assignment.partition_num
                        else "E_FAILED_ON_NOT_LEADER")
    queue = part.queue
    try:  # the commitlog is searched on the write worker, never on the loop (diskqueue)
        entry = await (queue.find("msg_id", msg_id) if msg_id is not None
                       else queue.find("offset", offset))
        if entry is None or entry.offset >= queue.committed_end or (
                offset is not None and offset >= entry.end_offset):
            return _not_found("MSG_NOT_FOUND", "no such message in the partition's log")
        reader = queue.reader(entry.offset, read_ahead=max(entry.size, 4096))
        try:
            records = await reader.read(entry.msg_count)
        except OSError:  # its segment went with retention
            return _not_found("MSG_NOT_FOUND", "the message's segment is gone (retention)")
        finally:
            reader.close()
    except QueueClosedError:  # the partition closed meanwhile (it moved, or the node stops)
        raise HTTPError(503, "EXITING") from None
    for rec in records:
        if rec.msg_id == msg_id or (offset is not None and rec.offset == offset):
            return _record(name, number, rec)
    if offset is not None:
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
