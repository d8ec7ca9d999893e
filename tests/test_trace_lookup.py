"""nsqlookupd's cluster-wide trace (nsqlookupd/tracesearch.py) with real processes: a
message whose events are split between two nsqd by a leader change is one timeline
through nsqlookupd; a node that does not answer is named; 404, 400; /message/get routed to
the leader; classic mode's search over the registered nsqd."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request

from cluster import Cluster, http_json, wait_until
from nodes import take
from nsqclient.conn import Connection
from servers import NsqdProcess, NsqlookupdProcess


def get(proc, path: str) -> tuple[int, dict]:
    return http_json("GET", f"http://{proc.http_address}{path}", timeout=15)


def pub(node, path: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://{node.http_address}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def aget(proc, path: str) -> tuple[int, dict]:
    return await asyncio.to_thread(get, proc, path)


def events(body: dict) -> list[dict]:
    return [e for m in body.get("messages", ()) for e in m["events"]]


async def until_events(proc, query: str, count: int, timeout: float = 20) -> dict:
    """The search's answer once it holds `count` events (each node's writer batches)."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = await aget(proc, f"/trace/search?{query}")
        if status == 200 and len(events(body)) >= count:
            return body
        assert time.monotonic() < deadline, (query, status, body)
        await asyncio.sleep(0.2)


async def consumer(node, topic: str, channel: str) -> Connection:
    conn = await Connection("127.0.0.1", node.tcp_port).connect()
    await conn.sub(topic, channel, rdy=1)
    return conn


async def test_leader_change_one_timeline_from_two_nodes(tmp_path):
    c = Cluster(str(tmp_path), 3, 1, "--msg-timeout", "60s").start()
    lookupd = c.lookupds[0]
    try:
        assert c.create_topic("tl", 1, replicas=3)[0] == 200
        assert http_json("POST", f"http://{lookupd.http_address}/channel/create"
                                 "?topic=tl&channel=ch")[0] == 200
        old = c.nsqd_at(wait_until(lambda: c.leaders("tl").get(0), 15, "a leader"))
        assert pub(old, "/message/trace/enable?topic=tl", b"") == 200
        for n in c.nsqds:  # every node follows etcd's switch (any may lead next)
            wait_until(lambda: "tl" in get(n, "/stats?format=json")[1]["trace"]["topics"], 15,
                       "the trace switch followed")
        wait_until(lambda: pub(old, "/pub?topic=tl&partition=0", b"order 12345") == 200, 15,
                   "the leader takes the publish")
        first = await consumer(old, "tl", "ch")
        [m] = await take(first, timeout=15)  # delivered by the old leader, never finished
        msg_id = m.id.decode()
        await until_events(old, f"msg_id={msg_id}", 2)  # PUB, DELIVER in the old one's store
        old.kill()
        new = c.nsqd_at(wait_until(lambda: (c.leaders("tl").get(0) or old.tcp_address)
                                   != old.tcp_address and c.leaders("tl")[0], 30,
                                   "a new leader"))
        second = await consumer(new, "tl", "ch")
        deadline = time.monotonic() + 30
        while True:  # the new leader serves once it caught up; a message again, at attempt 1+
            try:
                [again] = await take(second, timeout=2)
                break
            except asyncio.TimeoutError:
                assert time.monotonic() < deadline, "the new leader never delivered it"
        assert again.id == m.id and again.body == b"order 12345"
        again.fin()
        await until_events(new, f"msg_id={msg_id}", 2)  # DELIVER, FIN in the new one's store
        old.start()  # back, so its store answers
        wait_until(lambda: len(c.live_nodes()) == 3, 20, "the old leader back")

        body = await until_events(lookupd, f"msg_id={msg_id}", 4)
        [timeline] = body["messages"]
        evs = timeline["events"]
        assert [e["kind"] for e in evs] == ["PUB", "DELIVER", "DELIVER", "FIN"], evs
        assert [e["node"] for e in evs] == [old.tcp_address] * 2 + [new.tcp_address] * 2
        assert [e["time_ns"] for e in evs] == sorted(e["time_ns"] for e in evs)
        assert timeline["finished"] and timeline["msg_id"] == msg_id
        assert timeline["story"].startswith("published by") and \
            timeline["story"].endswith("finished on ch")
        assert evs[2]["since_first_ms"] > 0 and body["unreachable"] == []
        assert sorted(body["nodes"]) == sorted(n.http_address for n in c.nsqds)
        # each node alone has half of it
        for node in (old, new):
            assert len(events(get(node, f"/trace/search?msg_id={msg_id}")[1])) == 2
        # limit applies after the merge: the oldest events of every node
        status, body = await aget(lookupd, f"/trace/search?msg_id={msg_id}&limit=3")
        assert status == 200 and [e["kind"] for e in events(body)] == ["PUB", "DELIVER", "DELIVER"]
        # search by topic and time window finds the same four
        since = evs[0]["time_ns"] / 1e9 - 1
        status, body = await aget(lookupd, f"/trace/search?topic=tl&since={since}")
        assert status == 200 and len(events(body)) == 4

        # /message/get through nsqlookupd: routed to the partition's leader
        status, got = await aget(lookupd, f"/message/get?topic=tl&msg_id={msg_id}")
        assert status == 200 and got["body"] == "order 12345", got
        assert got["node"] == new.http_address
        status, got2 = await aget(lookupd, f"/message/get?topic=tl&partition=0"
                                           f"&offset={got['offset']}")
        assert status == 200 and got2["msg_id"] == msg_id
        assert (await aget(lookupd, "/message/get?topic=tl&msg_id=00000000000fffff"))[0] == 404
        assert (await aget(lookupd, "/message/get?topic=nope&msg_id=00000000000fffff"))[0] == 404
        assert (await aget(lookupd, "/message/get?topic=tl"))[0] == 400

        # 404 and 400
        status, body = await aget(lookupd, "/trace/search?msg_id=00000000000fffff")
        assert status == 404 and body["message"] == "MSG_NOT_FOUND" and body["detail"]
        for bad in ("msg_id=zz", "limit=5", "topic=tl&limit=0", "trace_id=x",
                    "topic=tl&since=yesterday", "topic=b@d"):
            status, body = await aget(lookupd, f"/trace/search?{bad}")
            assert status == 400, (bad, body)

        # a node that does not answer is named, the others still answer
        third = next(n for n in c.nsqds if n not in (old, new))
        third.proc.send_signal(signal.SIGSTOP)
        try:
            status, body = await aget(lookupd, f"/trace/search?msg_id={msg_id}")
        finally:
            third.proc.send_signal(signal.SIGCONT)
        assert status == 200 and body["unreachable"] == [third.http_address], body
        assert len(events(body)) == 4
        await first.close()
        await second.close()
    finally:
        c.stop()


async def test_classic_mode_searches_every_registered_nsqd(tmp_path):
    lookupd = NsqlookupdProcess(str(tmp_path / "logs")).start()
    status, body = get(lookupd, "/trace/search?trace_id=4242")  # no nsqd yet
    assert status == 503 and body["message"] == "NO_NODE_ANSWERED"
    assert get(lookupd, "/trace/search?trace_id=42x")[0] == 400  # checked before asking
    nodes = [NsqdProcess(str(tmp_path / f"n{i}"), "--lookupd-tcp-address", lookupd.tcp_address,
                         "--trace-all").start() for i in range(2)]
    try:
        for i, node in enumerate(nodes):
            assert pub(node, "/pub?topic=ct&trace_id=4242", b"m%d" % i) == 200
        wait_until(lambda: len(get(lookupd, "/nodes")[1]["producers"]) == 2, 15,
                   "both nsqd registered")
        # each nsqd numbers its own messages: the same id on two nodes is two messages
        deadline = time.monotonic() + 20
        while True:
            status, body = await aget(lookupd, "/trace/search?trace_id=4242")
            if status == 200 and len(body["messages"]) == 2:
                break
            assert time.monotonic() < deadline, (status, body)
            await asyncio.sleep(0.2)
        assert sorted(m["events"][0]["node"] for m in body["messages"]) == \
            sorted(n.tcp_address for n in nodes)
        assert all(m["trace_id"] == "4242" for m in body["messages"])
        assert body["unreachable"] == []
        msg_id = body["messages"][0]["msg_id"]
        status, got = await aget(lookupd, f"/message/get?topic=ct&msg_id={msg_id}")
        assert status == 200 and got["body"] in ("m0", "m1")
        assert (await aget(lookupd, "/trace/search?trace_id=99"))[0] == 404
        assert (await aget(lookupd, "/trace/search?trace_id=0"))[0] == 400
        nodes[1].proc.send_signal(signal.SIGSTOP)  # registered still, and silent
        try:
            status, body = await aget(lookupd, "/trace/search?trace_id=4242")
        finally:
            nodes[1].proc.send_signal(signal.SIGCONT)
        assert status == 200 and body["unreachable"] == [nodes[1].http_address]
        assert [m["events"][0]["node"] for m in body["messages"]] == [nodes[0].tcp_address]
    finally:
        for p in nodes + [lookupd]:
            p.kill()


def test_merge_orders_every_nodes_events_and_limits_after():
    from nsqlookupd.tracesearch import merge, node_events
    from nsqtrace.timeline import timelines

    def answer(node, *times):
        evs = [{"node": node, "time_ns": t, "kind": "DELIVER", "topic": "t", "partition": 0,
                "channel": "c", "msg_id": 5, "trace_id": 0, "offset": 0, "attempts": 1,
                "detail": "x"} for t in times]
        messages, other = timelines(evs)
        return {"count": len(evs), "messages": messages, "other": other}

    a, b = node_events(answer("a:1", 10, 30)), node_events(answer("b:1", 20, 40))
    merged = merge([a, b], 3)
    assert [(e["node"], e["time_ns"]) for e in merged] == [("a:1", 10), ("b:1", 20), ("a:1", 30)]
    [timeline] = timelines(merged)[0]
    assert timeline["msg_id"] == "0000000000000005" and len(timeline["events"]) == 3
    # nodes sharing one store (Elasticsearch) both answer with every event: each counts once
    shared = merge([a + b, b + a], 10)
    assert [(e["node"], e["time_ns"]) for e in shared] == [
        ("a:1", 10), ("b:1", 20), ("a:1", 30), ("b:1", 40)]
    try:
        node_events({"messages": [{"no events": 1}], "other": []})
        raise AssertionError("a malformed answer was taken")
    except KeyError:
        pass
