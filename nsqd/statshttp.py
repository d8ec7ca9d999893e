"""/stats and /metrics over HTTP: the walk of every partition a read makes. Added to
http.py's ROUTES at start.

- `GET /stats[?format=json][&topic=][&channel=][&include_clients=][&include_mem=]`: classic
  nsqd's stats (stats.py builds the document, text or JSON).
- `GET /metrics`: the same numbers in Prometheus text (metrics.py).

Both are built and encoded in pieces with the loop's turns between (pace.py), one walk at
a time on a node (`NSQD.walking`). /metrics is sent as it is made, in chunks (send_text),
within SEND_S, one answer at a time (`NSQD.metrics_sending`), so a reader that takes it
slowly holds back only other /metrics reads, never /stats. A read that waits WALK_WAIT_S
for its turn is answered 503 BUSY.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from aiohttp import web

from nsqwire.httpapi import go_json_pieces

from . import metrics, pace, stats
from .httpargs import HTTPError, arg, bool_arg, query
from .httpconn import cut

log = structlog.get_logger("nsqd.statshttp")

WALK_WAIT_S = 10.0  # a read waits this long for the walk ahead, then 503 BUSY
SEND_S = 30.0  # a reader takes a whole answer within this, or its connection is closed
CHUNK_CHARS = 256 * 1024  # text sent a chunk at a time


async def node_stats(nsqd, topic: str = "", channel: str = "", include_clients: bool = True,
                     include_mem: bool = True) -> dict:
    """stats.node_stats, its topics walked with the loop's turns between them (pace.py)."""
    await nsqd.disk.read()
    conns = stats.connections(nsqd)
    topics = await pace.collect(stats.topic_entries(nsqd, conns, topic, channel,
                                                    include_clients))
    return stats.node_stats(nsqd, topics, conns, topic, include_clients, include_mem)


@contextlib.asynccontextmanager
async def turn(lock: asyncio.Lock):
    """Hold `lock`, waiting at most WALK_WAIT_S for it; else 503 BUSY.

    A walk of every partition holds its whole document until answered (at 10,000
    partitions, tens of MB), and paced walks overlap, so ten reads at once held ten
    (3,000 partitions: +92 MB of RSS, against +18 MB one at a time): walks take turns on
    `NSQD.walking`. A /metrics answer holds its document while it is sent, up to SEND_S
    to a slow reader: those take turns on `NSQD.metrics_sending`, outside the walk. So at
    most two documents are made or streamed at once, and a reader that does not read
    delays no /stats."""
    try:
        async with asyncio.timeout(WALK_WAIT_S):
            await lock.acquire()
    except TimeoutError:
        raise HTTPError(503, "BUSY") from None
    try:
        yield
    finally:
        lock.release()


async def do_stats(nsqd, request):
    params = query(request)
    async with turn(nsqd.walking):
        doc = await node_stats(
            nsqd, topic=arg(params, "topic") or "", channel=arg(params, "channel") or "",
            include_clients=bool_arg(params, "include_clients", True, True),
            include_mem=bool_arg(params, "include_mem", True, True))
        if arg(params, "format") == "json":  # bytes: JSON already, encoded a topic at a time
            return b"".join(await pace.collect(go_json_pieces(doc, "topics")))
        return stats.render_text(doc)


async def do_metrics(nsqd, request):
    async with turn(nsqd.metrics_sending):
        async with turn(nsqd.walking):
            doc = await node_stats(nsqd, include_clients=True, include_mem=False)
        return await send_text(request, metrics.render(doc), metrics.CONTENT_TYPE)


async def send_text(request, pieces, content_type: str) -> web.StreamResponse:
    """Answer the text of `pieces` as it is made, in chunks (at 10,000 partitions /metrics
    is 47 MB: never held whole). A reader that has not taken it all within SEND_S, or that
    went away, or a piece that failed, has its connection closed without the last chunk,
    so it cannot take a cut answer for a whole one."""
    resp = web.StreamResponse(headers={"Content-Type": content_type})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    stalled = False
    try:
        async with asyncio.timeout(SEND_S):
            async for chunk in pace.paced(pace.chunks(pieces, CHUNK_CHARS)):
                await resp.write(chunk)
    except (TimeoutError, ConnectionError) as e:
        log.warning("stats_send_cut", path=request.path, error=repr(e))
        stalled = isinstance(e, TimeoutError)
    except Exception:  # a bug costs this answer, never the server
        log.exception("stats_send_failed", path=request.path)
    else:
        await resp.write_eof()
        return resp
    cut(request, stalled)
    return resp


ROUTES = {
    "/stats": {"GET": do_stats},
    "/metrics": {"GET": do_metrics},
}
