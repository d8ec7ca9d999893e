"""Cluster-wide message trace on nsqlookupd (both modes): each nsqd keeps its own events,
so after a leader change a message's events are split between nodes; these endpoints ask
them all and answer as one node would.

    GET /trace/search?msg_id=|trace_id=|topic=[&channel=&since=&until=&limit=]
        every live nsqd's own /trace/search, in parallel, NODE_TIMEOUT_S each; the events
        merged in time order, the oldest `limit` kept, then grouped into each message's
        timeline (nsqtrace.timeline, the node's own builder; classic mode: per node, as
        each classic nsqd numbers its messages on its own). Adds `nodes` (asked) and
        `unreachable` (those that did not answer: still 200 with the others' events).
        400 as the node's (checked here, before anyone is asked); 404 MSG_NOT_FOUND /
        TRACE_ID_NOT_FOUND when no node has an event of that id; 503 NO_NODE_ANSWERED
        when every node failed (or there is none).
    GET /message/get?topic=&[partition=]&msg_id=|offset=
        cluster mode: the partition's leader's answer (a msg_id alone names its
        partition: its high bits); classic: the topic's producers are asked in parallel
        and the first 200 wins. The node's status and body, with `node` added.

The nodes: cluster mode's live nodes of the etcd view, classic mode's active registered
nsqds (their broadcast address and HTTP port).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import structlog

from nsqtrace.events import NO_MESSAGE, parse_msg_id
from nsqtrace.query import QueryError, parse_message_get, parse_search
from nsqtrace.timeline import timelines
from nsqwire.httpapi import go_json_pieces

from .http import HTTPError

log = structlog.get_logger("nsqlookupd.tracesearch")

NODE_TIMEOUT_S = 3.0
_STEP_KEYS = ("after_ms", "since_first_ms", "what")  # what timelines() adds to an event


def _checked(parse, params):
    """Checked as the node checks them (nsqtrace.query), before any node is asked."""
    try:
        return parse(params)
    except QueryError as e:
        raise HTTPError(400, e.code) from None


def nodes(lookupd) -> list[str]:
    """`host:http_port` of every nsqd to ask, sorted."""
    if lookupd.cluster is None:
        found = {f"{p['broadcast_address']}:{p['http_port']}"
                 for p in lookupd.db.nodes(time.time())}
    else:
        view = lookupd.cluster.directory.view
        found = {n.http for n in view.nodes.values()} if view is not None else set()
    return sorted(found)


async def _get(session, node: str, path: str, query: dict) -> tuple[int, dict]:
    """(status, JSON body) of one node; (0, {"error": why}) when it did not answer."""
    return _decoded(*await _fetch(session, node, path, query))


async def _fetch(session, node: str, path: str, query: dict) -> tuple[int, bytes | dict]:
    """(status, raw body) of one node; (0, {"error": why}) when it did not answer."""
    try:
        async with session.get(f"http://{node}{path}", params=query) as r:
            return r.status, await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return 0, {"error": f"{type(e).__name__}: {e}"[:200]}


def _decoded(status: int, raw: bytes | dict) -> tuple[int, dict]:
    """_fetch's answer with its body decoded: (0, {"error": why}) when it is not JSON."""
    if isinstance(raw, dict):
        return status, raw
    try:
        body = json.loads(raw) if raw else {}
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        return status, body
    except ValueError as e:
        return 0, {"error": f"{type(e).__name__}: {e}"[:200]}


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=NODE_TIMEOUT_S))


def _raw_event(step: dict) -> dict:
    """A node's timeline step back to the store's event (ids as integers), for merging."""
    event = {k: v for k, v in step.items() if k not in _STEP_KEYS}
    event["msg_id"] = parse_msg_id(step["msg_id"]) if step["msg_id"] else NO_MESSAGE
    event["trace_id"] = int(step["trace_id"])
    return event


def node_events(answer: dict) -> list[dict]:
    """The events of one node's search answer (KeyError, TypeError, ValueError: not one)."""
    steps = [s for m in answer["messages"] for s in m["events"]] + list(answer["other"])
    return [_raw_event(step) for step in steps]


def merge(per_node: list[list[dict]], limit: int) -> list[dict]:
    """The events of every node in time order (ties: by node), each once, the oldest
    `limit`. Nodes given one Elasticsearch store (--trace-es-url) each answer with every
    node's events: an event is the same one when its node, time, kind, message, channel
    and offset are."""
    seen: set[tuple] = set()
    events = []
    for e in (e for evs in per_node for e in evs):
        key = (e.get("node"), e["time_ns"], e.get("kind"), e.get("msg_id"), e.get("channel"),
               e.get("offset"))
        if key not in seen:
            seen.add(key)
            events.append(e)
    events.sort(key=lambda e: (e["time_ns"], e.get("node", "")))
    return events[:limit]


def _timelines(events: list[dict], per_node: bool) -> tuple[list[dict], list[dict]]:
    """timelines() of the merged events. A message id names one message in a cluster (its
    replicas share it); in classic mode each nsqd numbers its own, so the same id on two
    nodes is two messages: grouped per node, the timelines in the order of their first
    event."""
    if not per_node:
        return timelines(events)
    by_node: dict[str, list[dict]] = {}
    for e in events:
        by_node.setdefault(e.get("node", ""), []).append(e)
    messages, other = [], []
    for evs in by_node.values():
        m, o = timelines(evs)
        messages += m
        other += o
    messages.sort(key=lambda m: m["events"][0]["time_ns"])
    other.sort(key=lambda e: e["time_ns"])
    return messages, other


async def do_trace_search(lookupd, params):
    search = _checked(parse_search, params)
    asked = nodes(lookupd)
    async with _session() as session:
        results = await asyncio.gather(*(_fetch(session, n, "/trace/search", search.forward)
                                         for n in asked))
    return await asyncio.to_thread(_search_answer, search, asked, results,
                                   lookupd.cluster is None)


def _search_answer(search, asked: list[str], results: list, per_node: bool) -> bytes:
    """The nodes' answers decoded, merged and grouped, as the JSON body (raises HTTPError).
    Blocking, in a thread: at 10,000 events a node this is tens of ms of CPU per node,
    which the loop that answers lookups must never wait for."""
    answers, unreachable, missing = [], [], []
    for node, (status, body) in zip(asked, (_decoded(s, raw) for s, raw in results)):
        if status == 200:
            try:
                answers.append(node_events(body))
                continue
            except (KeyError, TypeError, ValueError):
                body = {"error": "not a search answer"}
        if status == 404:
            missing.append(body)
        else:
            unreachable.append(node)
            log.warning("trace_search_node_failed", node=node, status=status,
                        error=body.get("error") or body.get("message"))
    if not answers and not missing:
        raise HTTPError(503, "NO_NODE_ANSWERED", nodes=asked, unreachable=unreachable)
    limit = search.limit
    events = merge(answers, limit)
    if not events and missing:  # an id no answering node knows: the node's 404, named nodes
        raise HTTPError(404, missing[0].get("message", "NOT_FOUND"),
                        detail=missing[0].get("detail", ""), nodes=asked,
                        unreachable=unreachable)
    messages, other = _timelines(events, per_node=per_node)
    return b"".join(go_json_pieces({"count": len(events), "limit": limit, "messages": messages,
                                    "other": other, "nodes": asked, "unreachable": unreachable},
                                   "messages", "other"))


def _leader(lookupd, topic: str, partition: int | None) -> str:
    """The HTTP address of the partition's live leader (cluster mode)."""
    view = lookupd.cluster.directory.view
    if view is None:
        raise HTTPError(503, "CLUSTER_VIEW_NOT_READY")
    t = view.topics.get(topic)
    if t is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    if partition is None:
        raise HTTPError(400, "MISSING_ARG_PARTITION")
    state = t.partitions.get(partition)
    if state is None:
        raise HTTPError(400, "BAD_PARTITION")
    node = view.nodes.get(state.leader)
    if node is None:
        raise HTTPError(503, "NO_LIVE_LEADER", partition=partition)
    return node.http


async def do_message_get(lookupd, params):
    get = _checked(parse_message_get, params)
    topic, partition, query = get.topic, get.partition, get.forward
    if lookupd.cluster is not None:
        asked = [_leader(lookupd, topic, partition)]
    else:
        asked = sorted({f"{p['broadcast_address']}:{p['http_port']}"
                        for p in lookupd.db.producers(topic, time.time())})
        if not asked:
            raise HTTPError(404, "TOPIC_NOT_FOUND")
    async with _session() as session:
        results = await asyncio.gather(*(_get(session, n, "/message/get", query) for n in asked))
    for node, (status, body) in zip(asked, results):
        if status == 200:
            return {**body, "node": node}
    unreachable = [n for n, (status, _) in zip(asked, results) if status == 0]
    answered = [(n, s, b) for n, (s, b) in zip(asked, results) if s != 0]
    if not answered:
        raise HTTPError(502, "NODE_UNREACHABLE", unreachable=unreachable)
    # classic: a node without the message says 404; prefer an answer that says more
    node, status, body = min(answered, key=lambda a: a[1] == 404)
    extra = {k: v for k, v in body.items() if k != "message"}
    raise HTTPError(status, body.get("message", "NODE_ERROR"), **extra, node=node,
                    unreachable=unreachable)


ROUTES = {
    "/trace/search": {"GET": do_trace_search},
    "/message/get": {"GET": do_message_get},
}
