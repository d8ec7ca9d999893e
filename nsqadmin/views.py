"""What each page shows, as plain JSON-able dicts: the /api/ answers are exactly these, and
pages.py renders the same dicts as HTML, so the page and the API never disagree.

Every function reads the Source's current Snapshot and History (no I/O) except
trace_view, dead_view, dead_letter_view and half_view, which ask the nodes (never cached).
"""

from __future__ import annotations

import asyncio
import base64
import re
import string
import time

from nsqwire.ids import decode_msg_id

from .history import channel_key, partition_key, topic_key
from .model import HALF_FIELDS, Snapshot
from .times import BadTime, parse_time

REPLICATION_NOTE = {
    "classic": "classic mode (nsqlookupd without etcd): no replication, each partition lives "
               "on the one nsqd that holds it; leaders, ISR, catch-up and epochs exist only "
               "in cluster mode (--etcd-endpoints)",
    "nsqd": "a classic nsqd without nsqlookupd (--nsqd-http-address): no replication, so no "
            "ISR, catch-up or epoch; each partition is led by the nsqd that holds it",
}
TOMBSTONE_NOTE = {
    "cluster": "tombstones do not exist in cluster mode: a node leaves by its etcd lease",
    "nsqd": "tombstones need an nsqlookupd (--lookupd-http-address)",
}
TRACE_BODIES = 20  # bodies fetched for one search (one /message/get each)
DEAD_PAGE = 100  # dead letters on one page unless `limit` says otherwise
MAX_DEAD_PAGE = 500


class NotFound(Exception):
    """A topic, channel or node that the cluster does not have: a 404 page or answer."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class BadQuery(Exception):
    """A search whose arguments are wrong before any node is asked: a 400 with this text."""


def _age(snap: Snapshot) -> float:
    return round(time.time() - snap.taken_at, 1) if snap.taken_at else -1


def cluster_view(source) -> dict:
    snap = source.snapshot
    lookupds = []
    for lk in snap.lookupds:
        c = (lk.get("info") or {}).get("cluster") or {}
        lookupds.append({
            "address": lk["address"], "error": lk.get("error", ""),
            "version": (lk.get("info") or {}).get("version", ""),
            "is_master": c.get("is_master"), "master": c.get("master_http_address"),
            "etcd_connected": c.get("etcd_connected"), "view": c.get("view"),
            "nodes": c.get("nodes"), "topics": c.get("topics"),
            "leaderless": c.get("leaderless") or [], "elections": c.get("elections"),
            "problems": c.get("problems") or []})
    nodes = []
    for n in snap.nodes.values():
        nodes.append({
            "http": n.http, "tcp": n.tcp, "node_id": n.node_id, "hostname": n.hostname,
            "version": n.version, "health": n.health, "error": n.error,
            "partitions_led": n.partitions_led, "topics": len(n.topics), "clients": n.clients,
            "etcd_connected": n.etcd_connected, "lease_ok": n.lease_ok, "load": n.load})
    etcd = None
    if snap.mode == "cluster":
        views = [lk["etcd_connected"] for lk in lookupds] + \
            [n["etcd_connected"] for n in nodes if n["etcd_connected"] is not None]
        etcd = {"connected": sum(1 for v in views if v), "asked": len(views),
                "healthy": bool(views) and all(views)}
    load = snap.load or {}
    return {"mode": snap.mode, "taken_at": snap.taken_at, "age_s": _age(snap),
            "poll_seconds": round(source.poll_seconds, 3), "lookupds": lookupds,
            "nodes": nodes, "etcd": etcd, "load_available": snap.load is not None,
            "load_note": snap.load_note, "balanced": load.get("stable"),
            "heaviest_topics": load.get("topn_topics") or [], "topics": len(snap.topics),
            "problems": snap.problems}


def topics_view(source) -> dict:
    snap, hist = source.snapshot, source.history
    return {"mode": snap.mode, "age_s": _age(snap), "problems": snap.problems, "topics": [
        {"name": t.name, "partitions": t.partition_num or len(t.partitions),
         "channels": len(t.channels), "messages": t.messages, "depth": t.depth,
         "rate": round(hist.rate(topic_key(t.name)), 2), "paused": t.paused,
         "ordered": t.ordered, "traced": t.traced, "nodes": len(t.nodes)}
        for t in snap.topics.values()]}


def _topic(snap: Snapshot, name: str):
    t = snap.topics.get(name)
    if t is None:
        raise NotFound("TOPIC_NOT_FOUND", f"no topic {name!r} in the cluster")
    return t


def topic_view(source, name: str) -> dict:
    snap, hist = source.snapshot, source.history
    t = _topic(snap, name)
    ids = snap.node_by_id
    partitions = []
    for p in t.partitions:
        key = partition_key(t.name, p.number, p.leader)
        partitions.append({
            **vars(p), "rate": round(hist.rate(key), 2),
            "isr_http": [ids[i].http if i in ids else "" for i in p.isr],
            "rates": [round(r, 2) for r in hist.rates(key)], "depths": hist.depths(key)})
    channels = [{"name": c.name, "depth": c.depth, "in_flight": c.in_flight,
                 "deferred": c.deferred, "delayed": c.delayed, "requeued": c.requeued,
                 "timed_out": c.timed_out, "confirmed_count": c.confirmed_count,
                 "clients": len(c.clients), "paused": c.paused, "ordered": c.ordered,
                 "traced": c.traced, "rate": round(hist.rate(channel_key(t.name, c.name)), 2)}
                for c in t.channels.values()]
    return {"mode": snap.mode, "age_s": _age(snap), "name": t.name,
            "partition_num": t.partition_num, "ordered": t.ordered, "paused": t.paused,
            "traced": t.traced, "messages": t.messages, "depth": t.depth,
            "rate": round(hist.rate(topic_key(t.name)), 2), "nodes": t.nodes,
            "rates": [round(r, 2) for r in hist.rates(topic_key(t.name))],
            "depths": hist.depths(topic_key(t.name)), "partitions": partitions,
            **{k: getattr(t, k) for k in HALF_FIELDS}, "channels": channels,
            "replication_note": REPLICATION_NOTE.get(snap.mode, ""),
            "partitions_note": "" if t.partitions else
            "no node reports a partition of this topic it leads (no nsqd holds it yet, "
            "or its leaders did not answer the last poll)"}


def _channel(snap: Snapshot, topic: str, channel: str):
    t = _topic(snap, topic)
    c = t.channels.get(channel)
    if c is None:
        raise NotFound("CHANNEL_NOT_FOUND", f"no channel {channel!r} in topic {topic!r}")
    return t, c


def channel_view(source, topic: str, channel: str) -> dict:
    snap, hist = source.snapshot, source.history
    t, c = _channel(snap, topic, channel)
    keep = ("client_id", "hostname", "remote_address", "user_agent", "state", "ready_count",
            "in_flight_count", "message_count", "finish_count", "requeue_count",
            "connect_ts", "node", "desired_tag")
    clients = [{k: cl[k] for k in keep if k in cl} for cl in c.clients]
    return {"mode": snap.mode, "age_s": _age(snap), "topic": t.name, "name": c.name,
            "depth": c.depth, "in_flight": c.in_flight, "deferred": c.deferred,
            "delayed": c.delayed, "requeued": c.requeued, "timed_out": c.timed_out,
            "confirmed_count": c.confirmed_count, "dead": c.dead,
            "max_attempts": c.max_attempts, "paused": c.paused, "ordered": c.ordered,
            "traced": c.traced, "topic_traced": t.traced,
            "rate": round(hist.rate(channel_key(t.name, c.name)), 2),
            "rates": [round(r, 2) for r in hist.rates(channel_key(t.name, c.name))],
            "depths": hist.depths(channel_key(t.name, c.name)),
            "clients": clients, "partitions": [dict(vars(cp)) for cp in c.parts]}


def node_view(source, http: str) -> dict:
    snap = source.snapshot
    n = snap.nodes.get(http)
    if n is None:
        raise NotFound("NODE_NOT_FOUND", f"no node {http!r} (nodes are named by their HTTP "
                                         "address)")
    led = [dict(vars(p)) for t in snap.topics.values() for p in t.partitions
           if p.leader == http]
    following = [{"topic": t, "partition": p} for t, p in n.following]
    clients = [{"topic": t.name, "channel": c.name, **{k: cl.get(k) for k in (
        "client_id", "hostname", "remote_address", "user_agent", "ready_count",
        "in_flight_count", "message_count", "finish_count")}}
        for t in snap.topics.values() for c in t.channels.values()
        for cl in c.clients if cl["node"] == http]
    return {"mode": snap.mode, "age_s": _age(snap), **vars(n),
            "led": led, "following": following, "client_list": clients,
            "tombstone_note": TOMBSTONE_NOTE.get(snap.mode, ""),
            "replication_note": REPLICATION_NOTE.get(snap.mode, "")}


def _dead_id(raw: str, what: str) -> str:
    """A dead letter's id as nsqd spells it (16 lowercase hex characters), or BadQuery."""
    text = raw.strip().lower()
    try:
        decode_msg_id(text.encode())
    except ValueError:
        raise BadQuery(f"bad {what} {raw!r}: a dead letter's id, 16 hex characters") from None
    return text


def _holders(c) -> list[str]:
    """The nodes serving the channel's partitions (each leads those it reports)."""
    return sorted({cp.node for cp in c.parts})


def _failure(node: str, status: int, answer) -> dict:
    message = answer.get("message", "") if isinstance(answer, dict) else str(answer or "")
    return {"node": node, "status": status, "message": message}


async def dead_view(source, topic: str, channel: str, params: dict) -> dict:
    """A page of the channel's dead letters: every holder's /channel/dead, merged in
    partition order (each partition is one node's, in its log order), from the one after
    `after`, at most `limit`. `next`: the id to ask `after` for the next page (None: this
    is the last). `count` is of them all; `errors`: the holders that did not answer 200."""
    t, c = _channel(source.snapshot, topic, channel)
    after = _dead_id(params["after"], "after") if params.get("after") else None
    limit = str(params.get("limit") or DEAD_PAGE)
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_DEAD_PAGE:
        raise BadQuery(f"bad limit {limit!r}: 1..{MAX_DEAD_PAGE}")
    limit = int(limit)
    query = {"topic": topic, "channel": channel, "limit": str(limit + 1)}
    if after:
        query["after"] = after
    nodes = _holders(c)
    answers = await asyncio.gather(*(source.get(n, "/channel/dead", query) for n in nodes))
    letters, count, loading, errors = {}, 0, [], []
    for node, (status, answer) in zip(nodes, answers):
        if status != 200 or not isinstance(answer, dict):
            errors.append(_failure(node, status, answer))
            continue
        count += answer.get("count", 0)
        loading += answer.get("loading") or []
        for d in answer.get("dead_letters") or ():
            letters.setdefault(d["id"], {**d, "node": node})
    merged = sorted(letters.values(), key=lambda d: d["partition"])  # stable: log order
    shown = merged[:limit]
    return {"mode": source.snapshot.mode, "topic": t.name, "channel": c.name,
            "max_attempts": c.max_attempts, "after": after, "limit": limit, "count": count,
            "dead_letters": shown, "next": shown[-1]["id"] if len(merged) > limit else None,
            "loading": sorted(loading), "errors": errors}


async def dead_letter_view(source, topic: str, channel: str, raw_id: str) -> dict:
    """One dead letter with its whole body and header: the first holder that has it."""
    t, c = _channel(source.snapshot, topic, channel)
    letter_id = _dead_id(raw_id, "dead letter id")
    query = {"topic": topic, "channel": channel, "id": letter_id}
    nodes = _holders(c)
    answers = await asyncio.gather(*(source.get(n, "/channel/dead/message", query)
                                     for n in nodes))
    for node, (status, answer) in zip(nodes, answers):
        if status == 200 and isinstance(answer, dict):
            return {"topic": t.name, "channel": c.name, "node": node, **answer}
    why = "; ".join(f"{f['node']}: {f['status'] or 'no answer'} {f['message']}".strip()
                    for f in (_failure(n, s, a) for n, (s, a) in zip(nodes, answers)))
    raise NotFound("DEAD_LETTER_NOT_FOUND", f"no dead letter {letter_id} in {topic}/{channel}"
                                            + (f" ({why})" if why else ""))


async def half_view(source, topic: str) -> dict:
    """The topic's half messages waiting for their decision: each partition's /half asked
    of its leader (as the last poll saw it), in partition order, each in log order.
    `partitions`: each one's counts as its leader answered; `errors`: the leaders that did
    not answer 200."""
    t = _topic(source.snapshot, topic)
    led = [(p.leader, p.number) for p in t.partitions if p.leader]
    answers = await asyncio.gather(*(source.get(node, "/half", {"topic": topic,
                                                                "partition": str(n)})
                                     for node, n in led))
    waiting, partitions, errors = [], [], []
    for (node, _), (status, answer) in zip(led, answers):
        if status != 200 or not isinstance(answer, dict):
            errors.append(_failure(node, status, answer))
            continue
        for p in answer.get("partitions") or ():
            partitions.append({"partition": p["partition"], "node": node,
                               "waiting": len(p["waiting"]), "committed": p["committed"],
                               "rolled_back": p["rolled_back"], "checks": p["checks"],
                               "expired": p["expired"]})
            waiting += [{**w, "partition": p["partition"], "node": node}
                        for w in p["waiting"]]
    return {"mode": source.snapshot.mode, "topic": t.name, "count": len(waiting),
            "waiting": waiting, "partitions": partitions, "errors": errors}


_HEX_ID = re.compile(r"[0-9a-fA-F]{16}")
_PRINTABLE = set(string.printable) - set("\x0b\x0c")


def body_view(record: dict) -> dict:
    """A message body shown as text when it is printable, else as hex."""
    raw = record.get("body", "")
    data = base64.b64decode(raw) if record.get("body_encoding") == "base64" else \
        raw.encode("utf-8")
    try:
        text = data.decode("utf-8")
        printable = all(ch in _PRINTABLE or ord(ch) > 159 for ch in text)
    except UnicodeDecodeError:
        printable = False
    if printable:
        return {"body_text": text, "body_hex": None, "size": len(data)}
    return {"body_text": None, "body_hex": data.hex(" "), "size": len(data)}


def trace_query(params: dict, now: float) -> dict:
    """The search's arguments for the nodes (since/until as unix seconds), or BadQuery."""
    q = {k: str(params.get(k) or "").strip() for k in
         ("msg_id", "trace_id", "topic", "channel", "since", "until", "limit")}
    q = {k: v for k, v in q.items() if v}
    if not any(k in q for k in ("msg_id", "trace_id", "topic")):
        raise BadQuery("give a message id, a trace id, or a topic (with a time window)")
    if "msg_id" in q and not _HEX_ID.fullmatch(q["msg_id"]):
        raise BadQuery(f"bad message id {q['msg_id']!r}: 16 hex characters, as clients see it")
    if "trace_id" in q and not q["trace_id"].isdigit():
        raise BadQuery(f"bad trace id {q['trace_id']!r}: a decimal number")
    try:
        for k in ("since", "until"):
            if k in q:
                q[k] = f"{parse_time(q[k], now, k):.3f}"
    except BadTime as e:
        raise BadQuery(str(e)) from None
    if "since" in q and "until" in q and float(q["since"]) > float(q["until"]):
        raise BadQuery("the window ends before it starts (since is after until)")
    if "limit" in q and (not q["limit"].isdigit() or not 1 <= int(q["limit"]) <= 10000):
        raise BadQuery(f"bad limit {q['limit']!r}: 1..10000")
    return q


def _traced_now(snap: Snapshot, q: dict) -> bool | None:
    """Whether the searched topic (or its channel) is traced now: None when the search
    names no topic the cluster has (by id, or an unknown topic)."""
    t = snap.topics.get(q.get("topic", ""))
    if t is None:
        return None
    c = t.channels.get(q.get("channel", ""))
    return t.traced or (c is not None and c.traced)


async def trace_view(source, params: dict) -> tuple[int, dict]:
    """(status, answer) of a search: the nodes' timelines, each with its body."""
    q = trace_query(params, time.time())
    status, body = await source.trace_search(q)
    out = {"query": q, "status": status, "messages": [], "other": [], "count": 0,
           "nodes": [], "unreachable": [], "message": "", "detail": "",
           "traced": _traced_now(source.snapshot, q)}
    if status != 200:
        out["message"] = body.get("message", "") if isinstance(body, dict) else str(body)
        out["detail"] = body.get("detail", "") if isinstance(body, dict) else ""
        out["unreachable"] = body.get("unreachable", []) if isinstance(body, dict) else []
        return status, out
    for k in ("count", "other", "nodes", "unreachable", "limit"):
        out[k] = body.get(k, out.get(k))
    messages = body.get("messages") or []

    async def with_body(m: dict) -> dict:
        params = {"topic": m.get("topic", ""), "msg_id": m.get("msg_id", "")}
        if m.get("partition") is not None:
            params["partition"] = str(m["partition"])
        st, rec = await source.message_get(params)
        extra = body_view(rec) if st == 200 else {"body_text": None, "body_hex": None,
                                                  "body_error": f"{st} {rec.get('message')}"}
        return {**m, **extra}

    out["messages"] = list(await asyncio.gather(*(with_body(m)
                                                  for m in messages[:TRACE_BODIES])))
    out["messages"] += messages[TRACE_BODIES:]
    return 200, out
