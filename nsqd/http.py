"""The HTTP API (port 4151): classic nsqd v1.3.0 endpoints, byte for byte where
tests/data/nsqd-v1.3.0.json records them, plus /metrics and the partition argument.

One catch-all aiohttp route dispatches through ROUTES, so unknown paths answer
404 `{"message":"NOT_FOUND"}` and known paths with another method 405
`{"message":"METHOD_NOT_ALLOWED"}` (with `Allow`), as httprouter does for nsqd.

Responses follow nsqd's V1 decorator: a string body is sent as
`text/plain; charset=utf-8`, nothing as an empty body without Content-Type, a
dict or list as compact JSON (`application/json; charset=utf-8`, `<>&` escaped
as Go does); errors are `{"message":"CODE"}` with the classic status; every V1
answer carries `X-NSQ-Content-Type: nsq; version=1.0`. v1.3.0 answers this way
whether or not `Accept: application/vnd.nsq; version=1.0` is sent (the reference
records both), and so do we by default. For tools written against older nsqd,
`--http-legacy-envelope` wraps the JSON answers to requests without that header in
the legacy `{"status_code","status_txt","data"}` envelope (text answers stay text).

Bodies are read with a bound: never more than the limit + 1 bytes are buffered
(max_msg_size for /pub and PUT /config, max_body_size for /mpub), and a
Content-Length above the limit is refused before reading.

/pub and /mpub take the same durable path as TCP PUB/MPUB/DPUB (Topic.publish:
the partition's DiskQueue.append is awaited before `OK`); `defer=` uses the same
ext header as DPUB (message.defer_ext), with DPUB's limit (--max-req-timeout).

Ours, beyond classic:
- `partition=` on /pub, /mpub and the /channel/* actions (default: round-robin over
  the partitions led here for publishing, every partition for channel actions); an
  unparsable partition, or one outside the topic's 0..partition_num-1, is 400
  `BAD_PARTITION` (TCP: E_BAD_PARTITION); one in range that this node does not lead is
  400 `E_FAILED_ON_NOT_LEADER` (TCP's code). With --disable-auto-create, /pub and /mpub
  of a missing topic are 404 `E_TOPIC_NOT_EXIST`.
- `POST /topic/create?topic=&partition_num=N` (1..1024, else 400 `INVALID_PARTITION_NUM`)
  makes a topic of N partitions, all led here; an existing topic with another count is
  409 `TOPIC_PARTITION_NUM_CONFLICT` (the log line gives both counts).
- Cluster mode (`--etcd-endpoints`, cluster.py): /topic/create, /topic/delete,
  /topic/pause, /topic/unpause and /channel/delete act on etcd (cluster-wide; 503
  `CLUSTER_UNAVAILABLE` or `TOPIC_CREATE_FAILED` while etcd is away; a pause is the
  topic's switch in etcd, answered once applied here, followed by whichever node leads
  it, so a failover keeps it), /info adds `node_id` and `cluster_id`,
  /stats a `cluster` object. A channel change (pause, unpause, empty, setorder,
  setoffset) on a replicated partition is answered once every ISR follower stored the
  channel's state, so a failover right after keeps it; 503 `NOT_REPLICATED` when the
  partition stopped being led here meanwhile.
- Storage failures: 503 `EXITING` when the log is closing (as classic), 503
  `PUB_FAILED`/`MPUB_FAILED` for other write errors (disk full), 413 `MSG_TOO_BIG`
  when a body exceeds what one record can hold; an action whose state could not be
  stored for want of space (pause, empty, setoffset on a full disk) is 507 `DISK_FULL`.
- A body that cannot be read (truncated chunked body) is 400 `BAD_BODY` (classic:
  500 INTERNAL_ERROR); any bug is 500 `INTERNAL_ERROR` and is logged.
- A half-close ends what the client sends, not what it reads, and a malformed request
  costs one log line, never a traceback (httpconn.py).
- Storage faults (nsqd/README.md, "Faults stay inside their partition"): 503
  `TOPIC_CREATE_FAILED` / `CHANNEL_CREATE_FAILED` / `PUB_FAILED` / `MPUB_FAILED`; /ping is
  500 with the health text when unhealthy; POST /topic/reopen?topic=T[&partition=N] (503
  `REOPEN_FAILED` while a partition still fails).
- /mpub parses the body before it creates the topic (classic creates it first), so
  a refused /mpub leaves no new topic behind; the errors and their order are classic.
- /topic/empty empties what the topic holds for channels that do not exist yet
  (Partition.empty); a channel keeps its messages, as in classic nsqd.
- GET /config/<option> answers any option by its flag name (durations in ns as Go
  prints time.Duration); PUT accepts nsqlookupd_tcp_addresses (the node dials the new
  lookupds and drops the others, as classic). PUT log_level is refused with INVALID_OPTION:
  structlog loggers are cached on first use (logs.py), so a level change would
  not reach them.
- GET /stats and GET /metrics: statshttp.py.
- Cluster mode: /channel/create (and a SUB) that makes a channel answers once every
  partition's leader made it (503 `CHANNEL_CREATE_FAILED` after 5 s); GET
  /channel/made?topic=&channel= answers `{"partitions": [...]}`, the partitions led here
  on which the channel is made with its start on the ISR, which the creating node (or
  nsqlookupd) asks each leader (cluster.py, wait_made).
- POST /channel/setoffset?topic=&channel=[&partition=], body `timestamp:<s>|offset:<n>|
  count:<n>|end`: moves the channel's cursor (replay.py; its errors carry extra keys).
- `/pub?trace_id=` (the record's trace id, message trace); /trace/search, /message/get and
  /message/trace/enable|disable are tracehttp.py's, added to ROUTES at start.
- GET /topic/offsets and /topic/read (a partition's history by time window, raw records
  from the committed part, for spark/) are readhttp.py's, added to ROUTES at start.
- /channel/config (`max_attempts`) and /channel/dead, /channel/dead/message|requeue|purge
  (a channel's dead letters) are deadhttp.py's, added to ROUTES at start.

Who may change state (Gate, checked after routing and before any handler, so a refused
call changes nothing):
- `--admin-secret-file`: every call but a GET needs `Authorization: Bearer <secret>`
  (nsqwire/adminkey.py: 401 `ADMIN_KEY_REQUIRED`, 403 `ADMIN_KEY_INVALID`), except the
  paths in PUBLISH: publishing is data, as open as classic nsqd's HTTP /pub (the auth
  server governs TCP PUB, as classic). A new route is an admin route unless it is a GET
  (which must not change state) or is added to PUBLISH.
- `--https-address`: the same API over TLS (--tls-cert, --tls-key and the other --tls-*
  flags of the TCP port). With `--tls-required=true` as well, the plain listener refuses
  every call but a GET (publishing included) with 403 `{"message": "TLS_REQUIRED",
  "https_port": N}`, Go nsqd's answer: keys and messages travel encrypted; reads stay
  on plain HTTP, which other nodes, nsqlookupd and nsqadmin poll.
"""

from __future__ import annotations

import dataclasses
import json
import functools
import socket
import ssl

import structlog
from aiohttp import web

from diskqueue.errors import NotCommitted
from diskqueue.queue import QueueClosedError

from . import replay, stats
from .httpargs import (HTTPError, arg, bool_arg, defer_arg, parse_mpub_binary, parse_mpub_text,
                       partition_arg, producer_arg, query, read_body, strict_bool_arg, topic_arg,
                       topic_channel_args)
from .httpconn import Server
from .forward import PublishRequest
from .message import defer_ext
from .assignment import MAX_PARTITIONS
from .errors import (BadSequence, ClusterUnavailable, NameError_, PartitionNotFound,
                     PartitionNotLed, StorageError, TopicConflict, http_error)
from .health import is_disk_full
from .options import _DURATIONS, lookupd_host_port, parse_duration_ms
from isr.leader import NotWritable
from nsqwire import adminkey
from nsqwire.httpapi import V1_HEADER, go_json, v1_answer
from nsqwire.protocol import valid_topic_name

log = structlog.get_logger("nsqd.http")


# ---- encoding ----------------------------------------------------------------


def respond_legacy(status: int, data) -> web.Response:
    """Older nsqd's envelope: {"status_code", "status_txt", "data"}, the same status."""
    if status == 200 and isinstance(data, str):
        return respond_v1(status, data)
    if status == 200 and isinstance(data, bytes):  # JSON already
        body = b'{"status_code":200,"status_txt":"OK","data":' + data + b"}"
    else:
        body = go_json({"status_code": status, "status_txt": "OK" if status == 200 else str(data),
                        "data": data if status == 200 else None})
    return web.Response(status=status, body=body, content_type="application/json",
                        charset="utf-8")


def respond_v1(status: int, data, extra: dict | None = None) -> web.Response:
    """nsqd's RespondV1: str as text, None as an empty body, anything else as JSON; an
    error's `extra` fields beside its message."""
    body, content_type = v1_answer(status, data, extra)
    if content_type is None:
        return web.Response(status=status, headers=V1_HEADER)
    return web.Response(status=status, body=body, content_type=content_type, charset="utf-8",
                        headers=V1_HEADER)


# ---- the node's operations ------------------------------------------------------


async def _get_topic(nsqd, name: str, failed_code: str = "TOPIC_CREATE_FAILED"):
    try:
        topic = await nsqd.get_topic(name)
    except NameError_:
        raise HTTPError(400, "INVALID_TOPIC") from None
    except StorageError:  # logged by the node
        raise HTTPError(503, failed_code) from None
    if topic is None:  # --disable-auto-create
        raise HTTPError(404, "E_TOPIC_NOT_EXIST")
    return topic


async def publish(nsqd, command: str, name: str, bodies: list[bytes], partition: int | None,
                  ext: bytes = b"", trace_id: int = 0, source: str = "",
                  producer: tuple[str, int] | None = None) -> None:
    if not nsqd.serving.is_set():  # a cluster node's first view of etcd (NSQD.serving)
        await nsqd.serving.wait()
    if (partition is not None and name not in nsqd.topics and partition != 0
            and nsqd.cluster is None):  # a topic made here has one: refused before it is made
        raise HTTPError(400, "BAD_PARTITION")  # (in a cluster, etcd may have it with more)
    topic = await _get_topic(nsqd, name, f"{command}_FAILED")
    if not bodies:
        return
    if topic.starting(partition):
        await nsqd.until_led(topic, partition)
    forwarder = nsqd.cluster.forwarder if nsqd.cluster is not None else None
    try:
        try:
            await topic.publish(bodies, partition, ext, trace_id=trace_id, source=source,
                                producer=producer)
        except PartitionNotLed:  # leading none of the topic's: a leader writes it
            if forwarder is None or partition is not None:
                raise
            await forwarder.publish(name, PublishRequest(bodies, ext, trace_id,
                                                         producer=producer), source)
    except PartitionNotLed as e:
        if forwarder is not None:
            forwarder.named(name, e)
        raise HTTPError(*http_error(e), {"leader": e.leader} if e.leader else None) from None
    except (PartitionNotFound, NotWritable, NotCommitted, BadSequence) as e:
        raise HTTPError(*http_error(e)) from None  # NotCommitted: written, outcome unknown
    except QueueClosedError:
        raise HTTPError(503, "EXITING") from None
    except ValueError:
        raise HTTPError(413, "MSG_TOO_BIG") from None
    except Exception as e:
        log.error("publish_failed", topic=name, partition=partition, error=str(e))
        raise HTTPError(503, f"{command}_FAILED") from None


async def _existing_topic(nsqd, name: str):
    """The topic, or 404. In cluster mode one this node does not have yet is the one etcd
    has (a topic just made elsewhere that names this node a leader: served at once)."""
    topic = nsqd.topics.get(name)
    if topic is None and nsqd.cluster is not None and valid_topic_name(name):
        try:
            topic = await nsqd.cluster.topic(name, create=False)
        except ClusterUnavailable as e:
            raise HTTPError(*http_error(e)) from None
    if topic is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    return topic


def _partitions(topic, params) -> list:
    number = partition_arg(params)
    if number is None:
        return [topic.partitions[n] for n in sorted(topic.partitions)]
    p = topic.partitions.get(number)
    if p is None:
        raise HTTPError(400, "BAD_PARTITION")
    return [p]


def _held_partitions(topic, params, default: list[int]) -> list[int]:
    """`partition=` if this node holds it (serving or not), else `default` when absent."""
    number = partition_arg(params)
    if number is None:
        return default
    if number not in topic.partitions and number not in topic.failed:
        raise HTTPError(400, "BAD_PARTITION")
    return [number]


def _existing_channels(topic, params, channel_name: str) -> list:
    channels = [p.channels[channel_name] for p in _partitions(topic, params)
                if channel_name in p.channels]
    if not channels:
        raise HTTPError(404, "CHANNEL_NOT_FOUND")
    return channels


async def _persist_topic(nsqd, topic) -> None:
    nsqd._store_topic(topic)
    await nsqd.meta.flush()


async def _persist_channels(nsqd, channels) -> None:
    """Store the channels' changed state here and, in a replicated partition, on every ISR
    follower, before the answer: an admin change survives a failover right after it."""
    for c in channels:
        nsqd._store_channel(c)
    await nsqd.meta.flush()
    try:
        for c in channels:
            await nsqd.replicate_channel(c)
    except NotWritable as e:  # changed here only: a failover may undo it
        raise HTTPError(503, "NOT_REPLICATED") from e


# ---- handlers: (nsqd, request) -> str | None | JSON data; errors raise HTTPError ----


async def do_info(nsqd, request):
    o = nsqd.options
    return {
        "version": nsqd.version,
        "broadcast_address": o.broadcast_address,
        "hostname": socket.gethostname(),
        "http_port": nsqd.http_port,
        "tcp_port": nsqd.tcp_port,
        "start_time": int(nsqd.start_time),
        "max_heartbeat_interval": o.max_heartbeat_interval_ms * 1_000_000,
        "max_output_buffer_size": o.max_output_buffer_size,
        "max_output_buffer_timeout": o.max_output_buffer_timeout_ms * 1_000_000,
        "max_deflate_level": o.max_deflate_level,
        **({"node_id": nsqd.cluster.node_id, "cluster_id": nsqd.cluster.cluster_id}
           if nsqd.cluster is not None else {}),
    }


async def do_pub(nsqd, request):
    o = nsqd.options
    body = await read_body(request, o.max_msg_size)
    if body is None:
        raise HTTPError(413, "MSG_TOO_BIG")
    if not body:
        raise HTTPError(400, "MSG_EMPTY")
    params = query(request)
    name = topic_arg(params)
    defer_ms = defer_arg(params, o.max_req_timeout_ms)
    partition = partition_arg(params)
    trace_id = arg(params, "trace_id") or "0"  # ours: the record's trace id (message trace)
    if not (trace_id.isdigit() and int(trace_id) < 1 << 64):
        raise HTTPError(400, "INVALID_TRACE_ID")
    await publish(nsqd, "PUB", name, [body], partition, defer_ext(defer_ms, nsqd.clock()),
                  int(trace_id), f"http://{request.remote}", producer_arg(params))
    return "OK"


async def do_mpub(nsqd, request):
    o = nsqd.options
    if request.content_length is not None and request.content_length > o.max_body_size:
        raise HTTPError(413, "BODY_TOO_BIG")
    params = query(request)
    name = topic_arg(params)
    partition = partition_arg(params)
    binary = bool_arg(params, "binary", False, True)  # unrecognized values mean binary
    body = await read_body(request, o.max_body_size)
    if body is None:
        raise HTTPError(413, "BODY_TOO_BIG")
    if binary:
        bodies = parse_mpub_binary(body, o.max_msg_size, o.max_body_size)
    else:
        bodies = parse_mpub_text(body, o.max_msg_size)
    await publish(nsqd, "MPUB", name, bodies, partition, source=f"http://{request.remote}",
                  producer=producer_arg(params))
    return "OK"


async def do_topic_create(nsqd, request):
    """Classic create; ours: `partition_num` (the module docstring), `sync_every`
    (messages per sync; 1 = every batch, durable) and `sync_timeout` (a duration) give the
    topic its own sync policy (`syncdisk` is taken for `sync_every`, as nsqlookupd's
    partitioned /topic/create spells it). Made even with --disable-auto-create."""
    q = query(request)
    sync = _sync_args(nsqd, q)
    name = topic_arg(q)
    raw = arg(q, "partition_num")
    partition_num = (None if raw is None
                     else _bounded(raw, int, 1, MAX_PARTITIONS, "INVALID_PARTITION_NUM"))
    ordered = strict_bool_arg(q, "ordered", "INVALID_ARG_ORDERED")
    try:
        topic = await nsqd.create_topic(name, partition_num, ordered)
    except TopicConflict as e:
        log.info("topic_create_conflict", topic=name, error=str(e))
        raise HTTPError(*http_error(e)) from None
    except StorageError:  # logged by the node
        raise HTTPError(503, "TOPIC_CREATE_FAILED") from None
    if sync is not None:
        topic.set_sync(sync)
        await _persist_topic(nsqd, topic)
    return None


def _sync_args(nsqd, q) -> tuple[int, int] | None:
    every = arg(q, "sync_every")
    if every is None:
        every = arg(q, "syncdisk")
    timeout = arg(q, "sync_timeout")
    if every is None and timeout is None:
        return None
    o = nsqd.options
    every_n = (o.sync_every if every is None
               else _bounded(every, int, 1, 1_000_000, "INVALID_SYNC_EVERY"))
    timeout_ms = (o.sync_timeout_ms if timeout is None
                  else _bounded(timeout, parse_duration_ms, 0, 3_600_000, "INVALID_SYNC_TIMEOUT"))
    return every_n, timeout_ms


def _bounded(text: str, parse, low: int, high: int, code: str) -> int:
    """`parse(text)` when it lies in [low, high]; else 400 `code`."""
    try:
        value = parse(text)
    except ValueError:
        raise HTTPError(400, code) from None
    if not low <= value <= high:
        raise HTTPError(400, code)
    return value


async def do_topic_delete(nsqd, request):
    name = arg(query(request), "topic")
    if name is None:
        raise HTTPError(400, "MISSING_ARG_TOPIC")
    in_etcd = False
    if nsqd.cluster is not None:  # cluster-wide: every node deletes it (cluster.py)
        try:
            in_etcd = await nsqd.cluster.delete_topic(name)
        except ClusterUnavailable as e:
            raise HTTPError(*http_error(e)) from None
    if not await nsqd.delete_topic(name) and not in_etcd:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    return None


async def do_topic_empty(nsqd, request):
    topic = await _existing_topic(nsqd, topic_arg(query(request)))
    await topic.empty()
    await _persist_topic(nsqd, topic)
    return None


async def _topic_pause(nsqd, request, pause: bool):
    name = arg(query(request), "topic")
    if name is None:
        raise HTTPError(400, "MISSING_ARG_TOPIC")
    topic = await _existing_topic(nsqd, name)
    if nsqd.cluster is not None:  # etcd's switch, which whichever node leads follows
        try:
            if not await nsqd.cluster.set_switch(name, None, "paused", pause):
                raise HTTPError(404, "TOPIC_NOT_FOUND")
        except ClusterUnavailable as e:
            raise HTTPError(*http_error(e)) from None
        return None
    if pause:
        topic.pause()
    else:
        topic.unpause()
    await _persist_topic(nsqd, topic)
    return None


async def do_topic_pause(nsqd, request):
    return await _topic_pause(nsqd, request, True)


async def do_topic_unpause(nsqd, request):
    return await _topic_pause(nsqd, request, False)


async def _topic_channel(nsqd, request):
    params = query(request)
    topic_name, channel_name = topic_channel_args(params)
    return params, await _existing_topic(nsqd, topic_name), channel_name


async def do_channel_create(nsqd, request):
    params, topic, channel_name = await _topic_channel(nsqd, request)
    numbers = _held_partitions(topic, params, sorted({*topic.partitions, *topic.failed}))
    cluster = nsqd.cluster if not channel_name.endswith("#ephemeral") else None
    # cluster mode: a create answers once every partition's leader made the channel
    creating = cluster is not None and (not numbers or any(
        channel_name not in topic.partitions[n].channels
        for n in numbers if n in topic.partitions))
    try:
        if cluster is not None and not numbers:  # leads nothing of it: etcd's all the same
            await cluster.ensure_channel(topic.name, channel_name)
        for n in numbers:
            await nsqd.get_channel(topic.name, channel_name, n)
        if creating:
            await cluster.wait_made(topic.name, channel_name)
    except NameError_:
        raise HTTPError(400, "INVALID_ARG_CHANNEL") from None
    except StorageError as e:  # logged by the node; cluster mode: etcd away, not made
        log.warning("channel_create_failed", topic=topic.name, channel=channel_name,
                    error=str(e))
        raise HTTPError(503, "CHANNEL_CREATE_FAILED") from None
    return None


async def do_channel_made(nsqd, request):
    """Ours (cluster mode): the partitions led here on which the channel is made, its
    start on the ISR (Cluster.made_here): what the node that creates a channel asks each
    leader before it answers (Cluster.wait_made)."""
    params = query(request)
    topic_name, channel_name = topic_channel_args(params)
    if nsqd.cluster is not None:
        return {"partitions": nsqd.cluster.made_here(topic_name, channel_name)}
    topic = nsqd.topics.get(topic_name)
    return {"partitions": sorted(n for n, p in (topic.writable.items() if topic else ())
                                 if channel_name in p.channels)}


async def do_topic_reopen(nsqd, request):
    """Ours: open a topic's partition again without a restart (see the module docstring)."""
    params = query(request)
    topic = await _existing_topic(nsqd, topic_arg(params))
    numbers = _held_partitions(topic, params, sorted(topic.errors()))
    failed = [n for n in numbers if await nsqd.reopen(topic, n) is not None]
    if failed:
        raise HTTPError(503, "REOPEN_FAILED")
    return None


async def do_channel_delete(nsqd, request):
    params, topic, channel_name = await _topic_channel(nsqd, request)
    channels = _existing_channels(topic, params, channel_name)
    if nsqd.cluster is not None:  # cluster-wide: every leader deletes it (cluster.py)
        try:
            await nsqd.cluster.delete_channel(topic.name, channel_name)
        except ClusterUnavailable as e:
            raise HTTPError(*http_error(e)) from None
    for c in channels:
        await nsqd.delete_channel(topic.name, channel_name, c.partition)
    return None


async def do_channel_empty(nsqd, request):
    params, topic, channel_name = await _topic_channel(nsqd, request)
    channels = _existing_channels(topic, params, channel_name)
    for c in channels:
        c.empty()
        await c.empty_delayed()
    await _persist_channels(nsqd, channels)
    return None


async def do_channel_setoffset(nsqd, request):
    """Ours: move the channel's cursor; body `timestamp:<s>|offset:<n>|count:<n>|end` (replay.py)."""
    params, topic, channel_name = await _topic_channel(nsqd, request)
    try:
        channels = replay.channels_to_move(topic, partition_arg(params), channel_name)
        kind, value = replay.parse_target((await read_body(request, replay.MAX_TARGET_BYTES)
                                           or b"").decode("utf-8", "replace"))
        return await replay.set_offsets(nsqd, channels, kind, value)
    except replay.ReplayError as e:
        body, content_type = v1_answer(e.status, e.code, e.extra)
        return web.Response(status=e.status, body=body, content_type=content_type,
                            charset="utf-8", headers=V1_HEADER)


async def do_channel_delay_empty(nsqd, request):
    """Ours: drop every message in the channel's disk delay queue -> {"count": dropped}."""
    params, topic, channel_name = await _topic_channel(nsqd, request)
    count = 0
    for c in _existing_channels(topic, params, channel_name):
        count += await c.empty_delayed()
    return {"count": count}


async def do_channel_delay_requeue(nsqd, request):
    """Ours: make every delayed message of the channel due now -> {"count": requeued}."""
    params, topic, channel_name = await _topic_channel(nsqd, request)
    count = 0
    for c in _existing_channels(topic, params, channel_name):
        count += await c.requeue_delayed_now()
    return {"count": count}


async def _channel_pause(nsqd, request, pause: bool):
    params, topic, channel_name = await _topic_channel(nsqd, request)
    channels = _existing_channels(topic, params, channel_name)
    for c in channels:
        if pause:
            c.pause()
        else:
            c.unpause()
    await _persist_channels(nsqd, channels)
    return None


async def do_channel_setorder(nsqd, request):
    """Ours: `order=true|false` turns a channel's ordered rule (nsqd/ordered.py) on or off;
    an ordered topic's channels stay ordered (400 `ORDERED_TOPIC`)."""
    params, topic, channel_name = await _topic_channel(nsqd, request)
    order = strict_bool_arg(params, "order", "INVALID_ARG_ORDER")
    if not order and topic.assignment.ordered:
        raise HTTPError(400, "ORDERED_TOPIC")
    channels = _existing_channels(topic, params, channel_name)
    for c in channels:
        c.set_ordered(order)
    await _persist_channels(nsqd, channels)
    return None


async def do_channel_pause(nsqd, request):
    return await _channel_pause(nsqd, request, True)


async def do_channel_unpause(nsqd, request):
    return await _channel_pause(nsqd, request, False)


# Classic config names that differ from our option names.
_CONFIG_NAMES = {"nsqlookupd_tcp_addresses": "lookupd_tcp_address"}
_DURATION_FIELDS = {v: k for k, v in _DURATIONS.items()}  # field_ms -> flag name


def config_value(options, name: str):
    """An option by its classic config name (durations in ns), or raise INVALID_OPTION."""
    field = _CONFIG_NAMES.get(name, name)
    if field in _DURATIONS:
        return getattr(options, _DURATIONS[field]) * 1_000_000
    if field in _DURATION_FIELDS or field not in {f.name for f in dataclasses.fields(options)}:
        raise HTTPError(400, "INVALID_OPTION")
    return getattr(options, field)


async def do_config(nsqd, request, name: str):
    o = nsqd.options
    if request.method == "PUT":
        body = await read_body(request, o.max_msg_size)
        if not body:  # too long (None) or empty
            raise HTTPError(413, "INVALID_VALUE")
        if name != "nsqlookupd_tcp_addresses":
            raise HTTPError(400, "INVALID_OPTION")
        try:
            value = json.loads(body)
        except ValueError:
            raise HTTPError(400, "INVALID_VALUE") from None
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise HTTPError(400, "INVALID_VALUE")
        try:
            for address in value:
                lookupd_host_port(address)
        except ValueError:
            raise HTTPError(400, "INVALID_VALUE") from None
        if value and nsqd.cluster is not None:  # cluster mode has no classic lookupds
            raise HTTPError(400, "INVALID_VALUE")
        o.lookupd_tcp_address = value
        nsqd.lookup.set_addresses(value)
        log.info("config_changed", option=name, value=value)
    return config_value(o, name)


# ---- routing ---------------------------------------------------------------------

ROUTES = {
    "/info": {"GET": do_info},
    "/pub": {"POST": do_pub},
    "/mpub": {"POST": do_mpub},
    "/topic/create": {"POST": do_topic_create},
    "/topic/delete": {"POST": do_topic_delete},
    "/topic/empty": {"POST": do_topic_empty},
    "/topic/pause": {"POST": do_topic_pause},
    "/topic/unpause": {"POST": do_topic_unpause},
    "/topic/reopen": {"POST": do_topic_reopen},
    "/channel/create": {"POST": do_channel_create},
    "/channel/made": {"GET": do_channel_made},
    "/channel/delete": {"POST": do_channel_delete},
    "/channel/empty": {"POST": do_channel_empty},
    "/channel/pause": {"POST": do_channel_pause},
    "/channel/setorder": {"POST": do_channel_setorder},
    "/channel/unpause": {"POST": do_channel_unpause},
    "/channel/setoffset": {"POST": do_channel_setoffset},
    "/channel/delay/empty": {"POST": do_channel_delay_empty},
    "/channel/delay/requeue": {"POST": do_channel_delay_requeue},
}
_CONFIG_METHODS = ("GET", "PUT")
# state-changing calls that need no admin key: data (a half message and its decision too)
PUBLISH = frozenset({"/pub", "/mpub", "/half", "/half/commit", "/half/rollback"})


@dataclasses.dataclass
class Gate:
    """Which state-changing calls a node takes (the module docstring): `secret` the admin
    key ("" none); `https_port` the HTTPS listener's (0 none), and `tls_required` whether
    the plain listener then refuses them."""

    secret: str = ""
    https_port: int = 0
    tls_required: bool = False

    def refusal(self, request: web.BaseRequest) -> tuple[int, str, dict | None] | None:
        """(status, code, extra) refusing `request`, or None to take it."""
        if request.method == "GET":
            return None
        if self.tls_required and self.https_port and not request.secure:
            return 403, "TLS_REQUIRED", {"https_port": self.https_port}
        refused = adminkey.refusal(self.secret, request.method, request.path,
                                   request.headers.get(adminkey.HEADER), PUBLISH)
        return None if refused is None else (*refused, None)


async def _ping(nsqd, request) -> web.Response:
    """nsqd's PlainText decorator: `OK`, or 500 with the health text."""
    await nsqd.disk.read()
    if nsqd.health != "OK":
        return web.Response(status=500, text=nsqd.health)
    return web.Response(text="OK")


def _allowed(path: str) -> tuple[str, ...] | None:
    if path == "/ping":
        return ("GET",)
    if path.startswith("/config/") and len(path) > len("/config/") and "/" not in path[8:]:
        return _CONFIG_METHODS
    methods = ROUTES.get(path)
    return tuple(methods) if methods else None


async def dispatch(nsqd, gate: Gate, request: web.BaseRequest) -> web.StreamResponse:
    respond = respond_v1
    if nsqd.options.http_legacy_envelope and "version=1.0" not in request.headers.get(
            "Accept", ""):
        respond = respond_legacy
    path = request.path
    allowed = _allowed(path)
    if allowed is None:
        return respond(404, "NOT_FOUND")
    allow = ", ".join(sorted(allowed + ("OPTIONS",)))
    if request.method == "OPTIONS":
        return web.Response(status=200, headers={"Allow": allow})
    if request.method not in allowed:
        resp = respond(405, "METHOD_NOT_ALLOWED")
        resp.headers["Allow"] = allow
        return resp
    refused = gate.refusal(request)
    if refused is not None:
        status, code, extra = refused
        return respond_v1(status, code, extra) if extra and respond is respond_v1 \
            else respond(status, code)
    try:
        if path == "/ping":
            return await _ping(nsqd, request)
        if path.startswith("/config/"):
            data = await do_config(nsqd, request, path[len("/config/"):])
        else:
            data = await ROUTES[path][request.method](nsqd, request)
    except HTTPError as e:
        if e.extra and respond is respond_v1:
            return respond_v1(e.status, e.code, e.extra)
        return respond(e.status, e.code)
    except Exception as e:  # a bug costs one request, never the server
        if is_disk_full(e):  # an action whose state could not be stored: said, not a bug
            log.warning("http_disk_full", path=path, error=str(e))
            return respond(507, "DISK_FULL")
        log.exception("http_handler_failed", path=path, method=request.method)
        return respond(500, "INTERNAL_ERROR")
    if isinstance(data, web.StreamResponse):
        return data
    return respond(200, data)


async def start_http(nsqd, tls: ssl.SSLContext | None = None):
    """Listen on --http-address and, with `tls` (main.build's context of --tls-cert), on
    --https-address; the HTTP port. The admin secret is read here, once."""
    from .tracehttp import ROUTES as TRACE_ROUTES  # /trace/search, /message/*: tracehttp.py
    from .readhttp import ROUTES as READ_ROUTES  # /topic/offsets, /topic/read: readhttp.py
    from .deadhttp import ROUTES as DEAD_ROUTES  # /channel/config, /channel/dead*: deadhttp.py
    from .halfhttp import ROUTES as HALF_ROUTES  # /half, /half/commit|rollback: halfhttp.py
    from .statshttp import ROUTES as STATS_ROUTES  # /stats, /metrics: statshttp.py

    ROUTES.update(TRACE_ROUTES)
    ROUTES.update(READ_ROUTES)
    ROUTES.update(DEAD_ROUTES)
    ROUTES.update(HALF_ROUTES)
    ROUTES.update(STATS_ROUTES)
    stats.install_gc_timer()
    o = nsqd.options
    gate = Gate(adminkey.read_secret(o.admin_secret_file) if o.admin_secret_file else "",
                tls_required=o.tls_required == 1)
    runner = web.ServerRunner(Server(functools.partial(dispatch, nsqd, gate), access_log=None))
    await runner.setup()
    host, port = o.http_host_port
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    if o.https_address:
        host, port = o.https_host_port
        https = web.TCPSite(runner, host, port, ssl_context=tls, reuse_address=True)
        await https.start()
        gate.https_port = https._server.sockets[0].getsockname()[1]
        log.info("https_listening", https_port=gate.https_port)
    return runner, site._server.sockets[0].getsockname()[1]
