"""Reads of a partition's history over HTTP, for readers that are not channels (the Spark
data source, ../spark): no cursor moves, nothing is delivered or finished. Added to
http.py's ROUTES at start.

- `GET /topic/offsets?topic=[&partition=][&since=&until=]`: the window [since, until) of
  each partition held here (led, followed, or a single node's), as record boundaries found
  by the commitlog's timestamp search (DiskQueue.locate: a binary search, never a scan):
  `start`/`start_count` (the first record written at or after `since`), `end`/`end_count`
  (the first at or after `until`; the committed end without `until`), `count`,
  `first_ts`/`last_ts` (ns, of the first and last write request in the window; null when
  empty), `retention_start`/`retention_start_count` (the oldest record kept),
  `committed_end`/`committed_count`, `before_retention` (true when the window starts
  before the oldest record kept and older records were dropped: the window has lost its
  head), `role` (leader, follower or single) and, in cluster mode, `replicas` (the HTTP
  addresses of the partition's live ISR, leader first). `since`/`until`: unix seconds
  (fractions allowed) or ISO 8601 (UTC when no zone); `since_ns`/`until_ns` as integers,
  for exact bounds. Without `partition=`: {"partitions": [...]}, one per partition held.
- `GET /topic/read?topic=&partition=&offset=[&end=]`: the raw records (the segment format,
  diskqueue/README.md) of the committed part only, from the first record starting at or
  after `offset` up to (without) the first starting at or after `end` (default: the
  committed end when the request came). A chunked response, one chunk of at most
  CHUNK_BYTES per read; each read (`pread` and the framing walk) runs on the partition's
  read worker, as a channel's reads do, never on the event loop. The response may end
  early (this replica's committed end is behind `end`, or an error after the first byte):
  the reader knows from the offset after the last whole record it got, and asks again
  from there, here or at another replica. The header `X-NSQ-Start` is the offset of the
  first record sent. A reader that takes no chunk within TAKE_S is dropped without the
  answer's end, so a stalled reader holds its connection, a coroutine and a segment's
  descriptor for TAKE_S at most.

Errors (JSON `{"message": CODE, ...}`): 400 MISSING_ARG_TOPIC, INVALID_TOPIC,
BAD_PARTITION, MISSING_ARG_PARTITION, INVALID_OFFSET, INVALID_END, INVALID_SINCE,
INVALID_UNTIL, UNTIL_BEFORE_SINCE; 404 TOPIC_NOT_FOUND, PARTITION_NOT_HERE (this node
neither leads nor follows it); 410 OFFSET_BEFORE_RETENTION (with `retention_start`); 416
OFFSET_NOT_COMMITTED (past this replica's committed end, with `committed_end`); 503
EXITING.
"""

from __future__ import annotations

import asyncio
import os

import structlog
from aiohttp import web

from diskqueue.queue import NotABoundary, QueueClosedError
from diskqueue.record import FIXED_LENGTH, MAX_RECORD, PREFIX
from nsqwire.httpapi import V1_HEADER
from nsqwire.httpapi import parse_time_ns as wire_time_ns

from .httpargs import HTTPError, arg, partition_arg, query, topic_arg
from .httpconn import cut

log = structlog.get_logger("nsqd.readhttp")

CHUNK_BYTES = 1 << 20  # the most one read (and one chunk of the answer) holds
TAKE_S = 30.0  # a reader takes each chunk within this, or its connection is closed
_unpack_prefix = PREFIX.unpack_from


class ReadError(Exception):
    """An answer `{"message": code, **extra}` with an HTTP status."""

    def __init__(self, status: int, code: str, **extra):
        super().__init__(code)
        self.status, self.code, self.extra = status, code, extra


def _error(e: ReadError) -> web.Response:
    return web.json_response({"message": e.code, **e.extra}, status=e.status,
                             headers=V1_HEADER)


# ---- arguments --------------------------------------------------------------------------


def parse_time_ns(text: str, name: str) -> int:
    """nsqwire's time (unix seconds or ISO 8601), or 400 INVALID_<NAME>."""
    try:
        return wire_time_ns(text)
    except ValueError:
        raise ReadError(400, f"INVALID_{name.upper()}", detail=f"{name} {text[:40]!r}: unix "
                        "seconds or ISO 8601") from None


def _time_arg(params, name: str) -> int | None:
    exact = arg(params, f"{name}_ns")
    if exact is not None:
        if not exact.lstrip("-").isdigit():
            raise ReadError(400, f"INVALID_{name.upper()}", detail=f"{name}_ns is an integer")
        return int(exact)
    text = arg(params, name)
    return None if text is None else parse_time_ns(text, name)


def _offset_arg(params, name: str, required: bool) -> int | None:
    raw = arg(params, name)
    if raw is None:
        if required:
            raise ReadError(400, f"MISSING_ARG_{name.upper()}")
        return None
    if not raw.isdigit() or int(raw) >= 1 << 63:
        raise ReadError(400, f"INVALID_{name.upper()}")
    return int(raw)


# ---- which queue ------------------------------------------------------------------------


def held(nsqd, name: str) -> dict[int, tuple[object, str]]:
    """partition -> (its DiskQueue, role) for every partition of `name` held here."""
    out = {}
    replication = nsqd.cluster.replication if nsqd.cluster is not None else None
    topic = nsqd.topics.get(name)
    if topic is not None:
        for n, p in topic.partitions.items():
            role = "leader" if replication is not None else "single"
            out[n] = (p.queue, role)
    if replication is not None:
        for (t, n), f in list(replication.followers.items()):
            if t == name and n not in out:
                out[n] = (f.q, "follower")
    return out


def _one(nsqd, params) -> tuple[str, int, object, str]:
    name = topic_arg(params)
    number = partition_arg(params)
    if number is None:
        raise ReadError(400, "MISSING_ARG_PARTITION")
    partitions = held(nsqd, name)
    if not partitions:
        raise ReadError(404, "TOPIC_NOT_FOUND")
    if number not in partitions:
        raise ReadError(404, "PARTITION_NOT_HERE", partition=number)
    q, role = partitions[number]
    return name, number, q, role


def replicas(nsqd, name: str, number: int) -> list[str]:
    """The HTTP addresses of the partition's live ISR members, leader first ([] when not in
    cluster mode or the view is not read)."""
    view = nsqd.cluster.mirror.view if nsqd.cluster is not None else None
    tv = view.topics.get(name) if view is not None else None
    state = tv.partitions.get(number) if tv is not None else None
    if state is None:
        return []
    ids = ([state.leader] if state.leader else []) + [i for i in state.isr if i != state.leader]
    return [view.nodes[i].http for i in ids if i in view.nodes]


# ---- GET /topic/offsets -----------------------------------------------------------------


async def window(q, since: int | None, until: int | None) -> dict:
    """The window [since, until) of one partition's log (see the module docstring)."""
    retention = (q.start_offset, q.start_count)
    if since is None:
        start, before = await q.locate("offset", retention[0]), False
    else:
        start = await q.locate("timestamp", since)
        before = start.clipped == "retention"
    end = await q.locate("end") if until is None else await q.locate("timestamp", until)
    if until is not None and end.clipped == "retention":
        before = True
    if end.offset < start.offset:
        end = start
    first_ts = last_ts = None
    if end.offset > start.offset:
        first, last = await q.find("offset", start.offset), await q.find("offset", end.offset - 1)
        first_ts = first.timestamp if first is not None else None
        last_ts = last.timestamp if last is not None else None
    return {"start": start.offset, "start_count": start.count, "end": end.offset,
            "end_count": end.count, "count": end.count - start.count,
            "first_ts": first_ts, "last_ts": last_ts,
            "retention_start": retention[0], "retention_start_count": retention[1],
            "committed_end": q.committed_end, "committed_count": q.committed_count,
            "before_retention": before}


async def do_topic_offsets(nsqd, request):
    params = query(request)
    try:
        since, until = _time_arg(params, "since"), _time_arg(params, "until")
        if since is not None and until is not None and until < since:
            raise ReadError(400, "UNTIL_BEFORE_SINCE")
        name = topic_arg(params)
        if partition_arg(params) is None:
            partitions = sorted(held(nsqd, name).items())
            if not partitions:
                raise ReadError(404, "TOPIC_NOT_FOUND")
        else:
            name, number, q, role = _one(nsqd, params)
            partitions = [(number, (q, role))]
        answers = []
        for number, (q, role) in partitions:
            found = await window(q, since, until)
            answers.append({"topic": name, "partition": number, "role": role, **found,
                            "replicas": replicas(nsqd, name, number)})
    except ReadError as e:
        return _error(e)
    except QueueClosedError:
        raise HTTPError(503, "EXITING") from None
    return answers[0] if partition_arg(params) is not None else {"partitions": answers}


# ---- GET /topic/read --------------------------------------------------------------------


def _read_chunk(state: dict, path: str, pos: int, size: int, limit: int) -> tuple[bytes, bool]:
    """On the read worker: up to `size` bytes at `pos` of the segment file `path`, cut to
    whole records, stopping before the first record starting at or past `limit`.
    Returns (bytes, done). Raises ValueError on bad framing."""
    if state.get("path") != path:
        if state.get("fd") is not None:
            os.close(state["fd"])
        state["fd"], state["path"] = os.open(path, os.O_RDONLY), path
    data = os.pread(state["fd"], size, pos)
    p, n, at = 0, len(data), limit - state["base_offset"]
    while p + 8 <= n:
        if p >= at:
            return data[:p], True
        length = _unpack_prefix(data, p)[1]
        if not FIXED_LENGTH <= length <= MAX_RECORD:
            raise ValueError(f"bad record length {length} at offset {state['base_offset'] + p}")
        if p + 8 + length > n:
            break
        p += 8 + length
    return data[:p], p >= at


async def stream(request, q, start: int, limit: int) -> web.StreamResponse:
    """Send the records from `start` (a boundary) to `limit` (committed), chunk by chunk."""
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                       "X-NSQ-Start": str(start), **V1_HEADER})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    state: dict = {}
    pos, size = start, CHUNK_BYTES
    try:
        while pos < limit:
            path, base, seg_end = q.segment_of(pos)
            seg_end = min(seg_end, q.committed_end)
            if seg_end <= pos:
                break
            state["base_offset"] = pos
            data, done = await q.read_worker.run(loop, _read_chunk, state, path, pos - base,
                                                 min(size, seg_end - pos), limit)
            if not data:  # one record longer than the chunk: read it whole next
                if size >= MAX_RECORD + 8 or size >= seg_end - pos:
                    raise ValueError(f"no whole record at {pos}")
                size = min(MAX_RECORD + 8, size * 4)
                continue
            size = CHUNK_BYTES
            async with asyncio.timeout(TAKE_S):
                await resp.write(data)
            pos += len(data)
            if done:
                break
    except ConnectionError:  # the reader went away
        return resp
    except TimeoutError:
        log.warning("read_stream_cut", offset=pos, reason=f"no chunk taken within {TAKE_S:g} s")
        cut(request, stalled=True)
        return resp
    except Exception as e:  # the reader sees the answer end early and asks again
        log.warning("read_stream_failed", offset=pos, error=repr(e))
        cut(request)
        return resp
    finally:
        if state.get("fd") is not None:
            os.close(state["fd"])
    await resp.write_eof()
    return resp


async def do_topic_read(nsqd, request):
    params = query(request)
    try:
        offset = _offset_arg(params, "offset", True)
        end = _offset_arg(params, "end", False)
        name, number, q, role = _one(nsqd, params)
        committed = q.committed_end
        if offset < q.start_offset:
            raise ReadError(410, "OFFSET_BEFORE_RETENTION", retention_start=q.start_offset)
        if offset > committed:
            raise ReadError(416, "OFFSET_NOT_COMMITTED", committed_end=committed)
        try:
            start = (await q.locate("offset", offset)).offset
        except NotABoundary as e:
            start = e.after
        limit = committed if end is None else min(end, committed)
    except ReadError as e:
        return _error(e)
    except QueueClosedError:
        raise HTTPError(503, "EXITING") from None
    return await stream(request, q, start, max(limit, start))


ROUTES = {
    "/topic/offsets": {"GET": do_topic_offsets},
    "/topic/read": {"GET": do_topic_read},
}
