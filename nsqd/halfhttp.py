"""Half messages over HTTP (nsqd/halves.py), for the partitions led here. Added to
http.py's ROUTES at start; every answer is JSON.

- `POST /half?topic=[&partition=]&check_url=URL` + the body: a half message, stored and
  replicated, delivered by no channel until it is committed -> {"id", "partition"}. Its
  producer answers check-backs at `check_url` (http or https): a POST of {"partition",
  "id", "checks"} answered {"decision": "commit" | "rollback"}.
- `POST /half/commit?topic=&id=` and `POST /half/rollback?topic=&id=` -> {"state"}: the
  first decision holds; sent again it is answered the same.
- `GET /half?topic=[&partition=]` -> {"partitions": [{partition, waiting: [{id, checks,
  written_ms}], committed, rolled_back, checks, expired}]}.

Errors: 400 MISSING_ARG_CHECK_URL, INVALID_CHECK_URL, INVALID_ID, BAD_PARTITION; 404
TOPIC_NOT_FOUND, HALF_NOT_FOUND, PARTITION_NOT_HERE; 409 HALF_DECIDED (the other decision
was taken); 503 NOT_WRITABLE.
"""

from __future__ import annotations

import random

from diskqueue.errors import NotCommitted
from isr.leader import NotWritable
from nsqtrace.events import parse_msg_id
from nsqwire.ext import check_url_ok
from nsqwire.ids import PARTITION_SHIFT

from .errors import HalfDecided, HalfFailed, HalfNotFound, PartitionNotFound, http_error
from .http import HTTPError, _existing_topic, _get_topic, _partitions, read_body
from .httpargs import arg, partition_arg, query, topic_arg

REFUSALS = (HalfNotFound, HalfDecided, HalfFailed, PartitionNotFound, NotWritable, NotCommitted)


def _url(params) -> str:
    url = arg(params, "check_url")
    if not url:
        raise HTTPError(400, "MISSING_ARG_CHECK_URL")
    if not check_url_ok(url):
        raise HTTPError(400, "INVALID_CHECK_URL")
    return url


def _id(params) -> int:
    try:
        return parse_msg_id(arg(params, "id") or "")
    except ValueError:
        raise HTTPError(400, "INVALID_ID") from None


def _refused(e: Exception) -> HTTPError:
    """The HTTP answer of a half command that raised `e` (the table's, nsqd/errors.py)."""
    return HTTPError(*http_error(e))


async def do_half(nsqd, request):
    params = query(request)
    url = _url(params)
    body = await read_body(request, nsqd.options.max_msg_size)
    if body is None:
        raise HTTPError(413, "MSG_TOO_BIG")
    if not body:
        raise HTTPError(400, "MSG_EMPTY")
    if not nsqd.serving.is_set():  # a cluster node's first view of etcd (NSQD.serving)
        await nsqd.serving.wait()
    topic = await _get_topic(nsqd, topic_arg(params), "HALF_FAILED")  # made, as /pub does
    number = partition_arg(params)
    if topic.starting(number):
        await nsqd.until_led(topic, number)
    parts = [p for p in _partitions(topic, params) if p.writable]
    if not parts:
        raise HTTPError(503, "NOT_WRITABLE")
    part = random.choice(parts)
    try:
        appended = await part.halves.publish(body, url)
    except REFUSALS as e:
        raise _refused(e) from None
    return {"id": f"{appended.first_id:016x}", "partition": part.number}


async def _decide(nsqd, request, commit: bool):
    params = query(request)
    topic = await _existing_topic(nsqd, topic_arg(params))
    msg_id = _id(params)
    part = topic.partitions.get(msg_id >> PARTITION_SHIFT)
    if part is None:
        raise HTTPError(404, "PARTITION_NOT_HERE")
    try:
        return {"state": await part.halves.decide(msg_id, commit)}
    except REFUSALS as e:
        raise _refused(e) from None


async def do_half_commit(nsqd, request):
    return await _decide(nsqd, request, True)


async def do_half_rollback(nsqd, request):
    return await _decide(nsqd, request, False)


async def do_half_list(nsqd, request):
    params = query(request)
    topic = await _existing_topic(nsqd, topic_arg(params))
    out = []
    for part in _partitions(topic, params):
        h = part.halves
        try:
            await h.ready()
        except HalfFailed as e:
            raise _refused(e) from None
        out.append({"partition": part.number,
                    "waiting": [{"id": f"{w.msg_id:016x}", "checks": w.checks,
                                 "written_ms": int(w.written_s * 1000), "check_url": w.url}
                                for w in h.table.waiting()],
                    "committed": h.committed, "rolled_back": h.rolled_back,
                    "checks": h.checks, "expired": h.expired})
    return {"partitions": out}


ROUTES = {
    "/half": {"GET": do_half_list, "POST": do_half},
    "/half/commit": {"POST": do_half_commit},
    "/half/rollback": {"POST": do_half_rollback},
}
