"""Message trace (nsqd/tracing.py, trace/): events recorded by real nsqd processes for a
real client (nsqclient's Connection, pynsq), searched over HTTP; the switches; the store
across a restart, its retention, and a store that cannot be written."""

from __future__ import annotations

import asyncio
import os
import pickle
import sqlite3
import struct
import threading
import time
import types

import pytest

from nsqclient.conn import Connection
from nsqtrace.events import NO_MESSAGE
from nsqtrace.store import CHUNK_EVENTS, RUN_GAP, RUN_WIDTH, TraceStore, search
from nsqtrace.writer import EventWriter
from nsqwire import commands as c
from servers import NsqdProcess, http
from nodes import nothing_arrives, take


def ok(node, method: str, path: str, body: bytes | None = None):
    status, data = http(node, method, path, body)
    assert status == 200, (path, status, data)
    return data


async def events_of(node, query: str, count: int, timeout: float = 10.0) -> list[dict]:
    """The events a search finds, once it finds `count` of them (the writer batches)."""
    deadline = time.monotonic() + timeout
    while True:
        status, data = await asyncio.to_thread(http, node, "GET", f"/trace/search?{query}")
        found = [] if status == 404 else [e for m in data["messages"] for e in m["events"]] + \
            data["other"]
        found.sort(key=lambda e: e["time_ns"])
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def settled(node, timeout: float = 20.0) -> dict:
    """/stats `trace` once no event waits in the buffer or in a batch being written. (It
    waited for the buffer only, then 0.2 s: on a loaded machine a batch of 200 took
    longer to reach the ES sink, and its events were neither written nor dropped yet.)"""
    deadline = time.monotonic() + timeout
    while True:
        t = ok(node, "GET", "/stats?format=json")["trace"]
        if t["buffered"] == 0 and t["writing"] == 0:
            return t
        if time.monotonic() > deadline:
            raise AssertionError(f"trace events never written: {t}")
        await asyncio.sleep(0.05)


async def conn(node, **identify) -> Connection:
    return await Connection("127.0.0.1", node.tcp_port).connect(identify or None)


@pytest.fixture
def traced(tmp_path):
    procs = []

    def start(*extra):
        proc = NsqdProcess(str(tmp_path / "nsqd"), "--msg-timeout", "1s", *extra).start()
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        p.kill()


async def test_a_message_timeline_has_each_event_when_it_happens(traced):
    node = traced()
    ok(node, "POST", "/message/trace/enable?topic=orders")
    pub = await conn(node)
    await pub.pub("orders", b"order 12345")
    a = await conn(node)
    await a.sub("orders", "billing", rdy=1)
    first = (await take(a))[0]  # attempt 1, left to time out (--msg-timeout 1s)
    a.rdy(0)
    b = await conn(node)
    await b.sub("orders", "billing", rdy=1)
    second = (await take(b, timeout=10))[0]  # attempt 2, at another client
    assert second.id == first.id
    second.req(0)
    await take(b)  # attempt 3
    await b.close()  # in flight at a client that leaves: given back
    a.rdy(1)
    fourth = (await take(a))[0]
    fourth.fin()
    msg_id = first.id.decode()
    events = await events_of(node, f"msg_id={msg_id}", 9)
    assert [(e["kind"], e["attempts"]) for e in events] == [
        ("PUB", 0), ("DELIVER", 1), ("TIMEOUT", 1), ("DELIVER", 2), ("REQ", 2), ("DELIVER", 3),
        ("REQ", 3), ("DELIVER", 4), ("FIN", 4)]
    assert events[1]["detail"] != events[3]["detail"]  # delivered to two clients
    assert [events[4]["detail"], events[6]["detail"]] == ["0", "client gone"]
    assert events[0]["detail"].startswith("127.0.0.1:") and events[0]["channel"] == ""
    assert all(e["channel"] == "billing" for e in events[1:])
    assert all(e["msg_id"] == msg_id and e["topic"] == "orders" and e["partition"] == 0
               for e in events)
    data = ok(node, "GET", f"/trace/search?msg_id={msg_id}")
    [timeline] = data["messages"]
    assert timeline["finished"] and timeline["story"].startswith(
        "published by 127.0.0.1:") and "timed out on billing -> delivered to" in \
        timeline["story"] and timeline["story"].endswith("finished on billing")
    assert timeline["events"][2]["after_ms"] >= 900  # the timeout came after --msg-timeout
    got = ok(node, "GET", f"/message/get?topic=orders&msg_id={msg_id}")
    assert got["body"] == "order 12345" and got["msg_id"] == msg_id
    assert ok(node, "GET", f"/message/get?topic=orders&partition=0&offset={got['offset']}") == got
    await pub.close()
    await a.close()


async def test_unknown_ids_are_404_and_bad_arguments_400(traced):
    node = traced()
    status, data = http(node, "GET", "/trace/search?msg_id=00000000000000ff")
    assert status == 404 and data["message"] == "MSG_NOT_FOUND" and "00000000000000ff" in \
        data["detail"]
    status, data = http(node, "GET", "/trace/search?trace_id=99")
    assert status == 404 and data["message"] == "TRACE_ID_NOT_FOUND"
    for bad in ("", "msg_id=12", "msg_id=zzzzzzzzzzzzzzzz", "trace_id=x", "topic=a%20b",
                "topic=t&limit=0", "topic=t&since=yesterday", f"trace_id={1 << 64}"):
        status, data = http(node, "GET", f"/trace/search?{bad}")
        assert status == 400, (bad, status, data)
    ok(node, "POST", "/pub?topic=t", b"x")
    assert http(node, "GET", "/message/get?topic=t&msg_id=0000000000000009")[0] == 404
    assert http(node, "GET", "/message/get?topic=t&partition=0&offset=1")[0] == 400
    assert http(node, "GET", "/message/get?topic=t")[0] == 400
    assert http(node, "GET", "/message/get?topic=nope&msg_id=0000000000000000")[0] == 404
    assert http(node, "POST", "/pub?topic=t&trace_id=-1", b"x")[0] == 400
    assert http(node, "POST", "/message/trace/enable")[0] == 400


async def test_off_by_default_and_per_channel_switch(traced):
    node = traced("--msg-timeout", "60s")
    pub = await conn(node)
    await pub.pub("quiet", b"1")
    ok(node, "POST", "/message/trace/enable?topic=quiet&channel=c1")
    c1, c2 = await conn(node), await conn(node)
    await c1.sub("quiet", "c1", rdy=5)
    await c2.sub("quiet", "c2", rdy=5)
    await pub.pub("quiet", b"2")
    for m in await take(c1, 2) + await take(c2, 1):  # c2 begins at the end: only "2"
        m.fin()
    events = await events_of(node, "topic=quiet", 4)
    await asyncio.sleep(0.5)
    events = await events_of(node, "topic=quiet", 4)
    # no PUB (the topic is off), c1's DELIVER and FIN of both messages, nothing of c2
    assert sorted((e["kind"], e["channel"]) for e in events) == [
        ("DELIVER", "c1"), ("DELIVER", "c1"), ("FIN", "c1"), ("FIN", "c1")]
    assert len(await events_of(node, "topic=quiet&channel=c2", 1, timeout=0.5)) == 0
    ok(node, "POST", "/message/trace/disable?topic=quiet&channel=c1")
    await pub.pub("quiet", b"3")
    for m in await take(c1):
        m.fin()
    await asyncio.sleep(0.5)
    assert len(await events_of(node, "topic=quiet", 5, timeout=0.5)) == 4
    for x in (pub, c1, c2):
        await x.close()


async def test_trace_ids_from_pub_trace_mpub_trace_pub_ext_and_http(traced):
    node = traced("--trace-all")
    pub = await conn(node, extend_support=True)
    reply = await pub.command(c.cmd_pub_trace("tr", 1 << 63 | 5, b"a", 0))
    okay, msg_id, trace_id, offset, size = struct.unpack(">2sQQqI", reply)
    assert (okay, trace_id, offset) == (b"OK", 1 << 63 | 5, 0) and size > 0
    await pub.command(c.cmd_pub_ext("tr", {"##trace_id": "42"}, b"b", 0))
    ok(node, "POST", "/pub?topic=tr&trace_id=42", b"c")
    assert [e["kind"] for e in await events_of(node, f"trace_id={1 << 63 | 5}", 1)] == ["PUB"]
    by_42 = await events_of(node, "trace_id=42", 2)
    assert [e["detail"].split(":")[0] for e in by_42] == ["127.0.0.1", "http"]
    assert len({e["msg_id"] for e in by_42}) == 2
    got = ok(node, "GET", f"/message/get?topic=tr&msg_id={msg_id:016x}")
    assert got["trace_id"] == str(1 << 63 | 5) and got["body"] == "a" and got["size"] == size
    reply = await pub.command(c.cmd_mpub_trace("tr", [(7, b"m1"), (8, b"m2"), (7, b"m3")], 0))
    okay, first_id, trace_id, offset, size = struct.unpack(">2sQQqI", reply)
    assert (okay, trace_id) == (b"OK", 7) and offset > 0 and size > 0
    by_7 = await events_of(node, "trace_id=7", 2)
    assert [ok(node, "GET", f"/message/get?topic=tr&msg_id={int(e['msg_id'], 16):016x}")["body"]
            for e in by_7] == ["m1", "m3"] and int(by_7[0]["msg_id"], 16) == first_id
    (by_8,) = await events_of(node, "trace_id=8", 1)
    assert ok(node, "GET", f"/message/get?topic=tr&msg_id={by_8['msg_id']}")["body"] == "m2"
    await pub.close()


async def test_switches_and_store_survive_a_restart_and_time_window(traced):
    node = traced()
    ok(node, "POST", "/message/trace/enable?topic=kept")
    ok(node, "POST", "/pub?topic=kept", b"before")
    await events_of(node, "topic=kept", 1)
    middle = time.time()
    await asyncio.sleep(0.05)
    assert node.stop() == 0
    node.start()
    ok(node, "POST", "/pub?topic=kept", b"after")  # still traced: the switch was stored
    events = await events_of(node, "topic=kept", 2)
    assert [e["kind"] for e in events] == ["PUB", "PUB"]
    later = await events_of(node, f"topic=kept&since={middle}", 1)
    assert len(later) == 1 and later[0]["time_ns"] == events[1]["time_ns"]
    earlier = await events_of(node, f"topic=kept&until={middle}", 1)
    assert len(earlier) == 1 and earlier[0]["time_ns"] == events[0]["time_ns"]
    ok(node, "POST", "/message/trace/disable?topic=kept")
    node.stop()
    node.start()
    ok(node, "POST", "/pub?topic=kept", b"untraced")
    await asyncio.sleep(0.5)
    assert len(await events_of(node, "topic=kept", 3, timeout=0.5)) == 2


async def test_delay_queue_and_drops(traced):
    # messages stay in flight while the events are looked for (an ES store shows them late)
    node = traced("--trace-all", "--delay-threshold", "100ms", "--msg-timeout", "30s")
    pub = await conn(node)
    await pub.pub("slow", b"x")
    sub = await conn(node)
    await sub.sub("slow", "ch", rdy=1)
    m = (await take(sub))[0]
    m.req(300)  # past --delay-threshold: to the delay store, back when due
    again = (await take(sub, timeout=10))[0]
    events = await events_of(node, f"msg_id={m.id.decode()}", 6)
    assert [e["kind"] for e in events] == ["PUB", "DELIVER", "REQ", "DELAY_IN", "DELAY_OUT",
                                           "DELIVER"]
    assert 0 <= int(events[3]["detail"]) <= 300  # due in ms (0: it was due already)
    ok(node, "POST", "/channel/empty?topic=slow&channel=ch")  # `again` is in flight: dropped
    drops = [e for e in await events_of(node, "topic=slow", 8) if e["kind"] == "DROP"]
    assert [(e["msg_id"], e["detail"]) for e in drops] == [
        (again.id.decode(), "channel emptied"), ("", "channel emptied")]
    await pub.pub("slow", b"y")
    held = (await take(sub))[0]  # in flight when its channel goes
    ok(node, "POST", "/channel/delete?topic=slow&channel=ch")
    drops = [e for e in await events_of(node, "topic=slow", 12) if e["kind"] == "DROP"]
    assert [(e["msg_id"], e["detail"]) for e in drops[2:]] == [
        (held.id.decode(), "channel deleted"), ("", "channel deleted")]
    ok(node, "POST", "/topic/delete?topic=slow")
    deadline = time.monotonic() + 10
    while not (gone := [e for e in await events_of(node, "topic=slow", 13)
                        if e["detail"] == "topic deleted"]):
        assert time.monotonic() < deadline, "no DROP for the topic's delete"
        await asyncio.sleep(0.1)
    assert gone[0]["kind"] == "DROP" and gone[0]["offset"] > 0
    await pub.close()
    await sub.close()


async def test_retention_that_drops_segments_is_a_drop(traced):
    node = traced("--trace-all", "--segment-bytes", "2048", "--retention-max-bytes", "4096",
                  "--retention-check-interval", "100ms")
    for i in range(40):
        ok(node, "POST", "/pub?topic=aged", b"m%03d-" % i + b"x" * 200)
    deadline = time.monotonic() + 20
    while not (drops := [e for e in await events_of(node, "topic=aged", 41, timeout=0.5)
                         if e["kind"] == "DROP"]):
        assert time.monotonic() < deadline, "retention made no DROP event"
    (drop,) = drops[:1]
    assert drop["detail"].startswith("retention: offsets 0 to ") and drop["offset"] > 0
    assert drop["msg_id"] == "" and drop["channel"] == ""


async def test_setoffset_is_a_replay(traced):
    node = traced("--msg-timeout", "60s")
    ok(node, "POST", "/message/trace/enable?topic=again&channel=ch")
    for body in (b"a", b"b"):
        ok(node, "POST", "/pub?topic=again", body)
    sub = await conn(node)
    await sub.sub("again", "ch", rdy=5)
    for m in await take(sub, 2):
        m.fin()
    ok(node, "POST", "/channel/setoffset?topic=again&channel=ch", b"offset:0")
    again = await take(sub, 2)
    assert [m.body for m in again] == [b"a", b"b"]
    events = await events_of(node, "topic=again", 7)
    replay = [e for e in events if e["kind"] == "REPLAY"]
    assert len(replay) == 1 and replay[0]["offset"] == 0 and replay[0]["channel"] == "ch"
    after = [e["kind"] for e in events if e["time_ns"] > replay[0]["time_ns"]]
    assert after == ["DELIVER", "DELIVER"]
    await sub.close()


async def test_store_that_cannot_be_written_loses_no_message_and_counts_events(traced):
    node = traced("--trace-all", "--trace-buffer", "50", "--msg-timeout", "60s")
    ok(node, "POST", "/pub?topic=jam", b"first")  # the store exists
    await settled(node)
    blocker = sqlite3.connect(str(node.data_path) + "/trace.sqlite", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # nobody else writes until it ends
    sub = await conn(node)
    await sub.sub("jam", "ch", rdy=100)
    pub = await conn(node)
    started = time.monotonic()
    for i in range(300):
        await pub.pub("jam", b"m%d" % i)
    publish_s = time.monotonic() - started
    got = []
    for _ in range(301):
        got += await take(sub, timeout=20)
        got[-1].fin()
    assert sorted(m.body for m in got) == sorted([b"first"] + [b"m%d" % i for i in range(300)])
    await asyncio.sleep(2.5)  # past the store's 1 s lock timeout
    stuck = ok(node, "GET", "/stats?format=json")["trace"]
    blocker.execute("ROLLBACK")
    blocker.close()
    t = await settled(node)
    assert stuck["dropped_full"] > 0 and publish_s < 10, (stuck, publish_s)
    # every event made is written or counted as dropped: PUB, DELIVER, FIN of 301 messages
    assert t["written"] + t["dropped"] == 3 * 301, t
    assert t["dropped_failed"] > 0 and "locked" in t["error"]
    metrics = ok(node, "GET", "/metrics")
    assert f'nsqd_trace_events_dropped_total{{reason="buffer_full"}} {t["dropped_full"]}' in metrics
    since = time.time()
    ok(node, "POST", "/pub?topic=jam", b"later")  # the store takes events again
    (await take(sub))[0].fin()
    assert [e["kind"] for e in await events_of(node, f"topic=jam&since={since}", 3)] == [
        "PUB", "DELIVER", "FIN"]
    t = await settled(node)
    assert t["error"] is None and t["written"] + t["dropped"] == 3 * 302
    await pub.close()
    await sub.close()


async def test_a_store_file_sqlite_cannot_read_loses_no_message_and_search_says_why(
        traced, tmp_path):
    """A trace.sqlite that is not a database (a disk's garbage, a wrong file): messages
    flow, every event is counted as dropped with SQLite's reason in /stats, and a search
    answers 503 TRACE_STORE_UNAVAILABLE saying why (it was 500 INTERNAL_ERROR)."""
    (tmp_path / "nsqd").mkdir()
    (tmp_path / "nsqd" / "trace.sqlite").write_bytes(b"not sqlite " * 10_000)
    node = traced("--trace-all")
    sub = await conn(node)
    await sub.sub("broken", "ch", rdy=10)
    for i in range(5):
        ok(node, "POST", "/pub?topic=broken", b"m%d" % i)
    got = await take(sub, 5)
    for m in got:
        m.fin()
    assert sorted(m.body for m in got) == [b"m%d" % i for i in range(5)]
    t = await settled(node)
    assert (t["written"], t["dropped_failed"]) == (0, 3 * 5), t
    assert "not a database" in t["error"], t
    status, data = http(node, "GET", "/trace/search?topic=broken")
    assert status == 503 and data["message"] == "TRACE_STORE_UNAVAILABLE", (status, data)
    assert "not a database" in data["detail"], data
    assert http(node, "GET", "/ping")[0] == 200
    await sub.close()


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # exited; its parent, killed, cannot reap it yet
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


async def test_the_store_process_is_restarted_when_killed_and_ends_with_the_node(traced):
    node = traced("--trace-all")
    ok(node, "POST", "/pub?topic=p", b"one")
    await events_of(node, "topic=p", 1)
    [child] = node.trace_store_pids()
    os.kill(child, 9)
    assert gone(child)
    ok(node, "POST", "/pub?topic=p", b"two")  # its batch is kept and sent to a new child
    assert [e["kind"] for e in await events_of(node, "topic=p", 2)] == ["PUB", "PUB"]
    t = await settled(node)
    assert t["error"] is None and t["written"] == 2 and t["dropped"] == 0, t
    [again] = node.trace_store_pids()
    assert again != child
    node.proc.kill()  # kill -9 of the node: the child sees the end of its input and exits
    assert gone(again)


async def test_pynsq_classic_client_is_traced(traced):
    import nsq
    import tornado.ioloop  # noqa: F401  (pynsq runs on tornado, inside this asyncio loop)

    node = traced()
    ok(node, "POST", "/message/trace/enable?topic=classic")
    got = []

    def handler(message):
        got.append(message.id.decode() if isinstance(message.id, bytes) else message.id)
        return True

    reader = nsq.Reader(topic="classic", channel="py", message_handler=handler,
                        nsqd_tcp_addresses=[node.tcp_address], max_in_flight=5)
    writer = nsq.Writer([node.tcp_address])
    try:
        for _ in range(100):
            if writer.conns:
                break
            await asyncio.sleep(0.05)
        done = asyncio.get_running_loop().create_future()
        writer.pub("classic", b"hello", lambda conn, data: done.set_result(data))
        assert await asyncio.wait_for(done, 10) == b"OK"
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.05)
        events = await events_of(node, f"msg_id={got[0]}", 3)
        assert [e["kind"] for e in events] == ["PUB", "DELIVER", "FIN"]
    finally:
        reader.close()
        for c_ in list(writer.conns.values()):
            c_.close()


def test_store_retention_by_age_and_size(tmp_path):
    path = str(tmp_path / "trace.sqlite")
    store = TraceStore(path, "n")
    now = time.time_ns()
    old = [(now - 3600 * 10**9 + i, "PUB", "t", 0, "", i, 0, i, 0, "") for i in range(1000)]
    new = [(now + i, "PUB", "t", 0, "", 1000 + i, 0, i, 0, "") for i in range(1000)]
    store.write(old)
    store.write(new)
    assert store.retain(max_age_s=60, max_bytes=None, now_ns=now) == 1000
    assert [e["msg_id"] for e in search(path, topic="t", limit=5)] == [1000, 1001, 1002, 1003,
                                                                        1004]
    store.write([(now + 5000 + i, "FIN", "t", 0, "c", 5000 + i, 0, i, 1, "x" * 200)
                 for i in range(20000)])
    before = store.used_bytes()
    store.retain(max_age_s=None, max_bytes=before // 4, now_ns=now)
    assert store.used_bytes() <= before // 4
    left = search(path, topic="t", limit=100000)
    assert left and left[-1]["msg_id"] == 24999  # the newest stay
    store.close()
    assert search(str(tmp_path / "none.sqlite"), msg_id=1) == []


def test_store_writes_batches_larger_than_one_chunk_whole_and_in_order(tmp_path):
    path = str(tmp_path / "trace.sqlite")
    store = TraceStore(path, "it's n")
    now = time.time_ns()
    count = 2 * CHUNK_EVENTS + 7  # two whole chunks and a short one
    store.write([(now + i, "PUB", "t", 1, "", i, (1 << 64) - 1 if i == count - 1 else 0, i, 0,
                  "a") for i in range(count)])
    store.close()
    events = search(path, topic="t", limit=count + 1)
    assert [e["msg_id"] for e in events] == list(range(count))
    assert {e["node"] for e in events} == {"it's n"}
    assert events[-1]["trace_id"] == (1 << 64) - 1
    assert [e["msg_id"] for e in search(path, trace_id=(1 << 64) - 1)] == [count - 1]
    for i in (0, CHUNK_EVENTS - 1, CHUNK_EVENTS, count - 1):  # each side of a chunk's edge
        assert [e["msg_id"] for e in search(path, msg_id=i)] == [i]


def test_search_by_id_finds_every_chunk_that_holds_it_whatever_its_runs(tmp_path):
    """A chunk's ids are kept as runs: ids far apart, ids of two topics, a gap just past
    RUN_GAP and a run wider than RUN_WIDTH; events about no message in between."""
    path = str(tmp_path / "trace.sqlite")
    store = TraceStore(path, "n")
    wide = list(range(10**6, 10**6 + 2 * RUN_WIDTH + 1, RUN_GAP))  # every step a whole gap
    ids = [5, 6, 7 + RUN_GAP + 1, 1 << 50 | 3, *wide]
    t = 1000
    first = [(t + i, "PUB", "a", 0, "", m, 0, i, 0, "") for i, m in enumerate(ids)]
    first.append((t + 99, "DROP", "a", 0, "c", NO_MESSAGE, 0, 9, 0, "emptied"))
    first.append((t + 100, "PUB", "b", 0, "", 6, 0, 0, 0, ""))  # the same id, another topic
    store.write(first)
    store.write([(t + 200 + i, "FIN", "a", 0, "c", m, 0, i, 1, "") for i, m in enumerate(ids)])
    store.close()
    for m in ids:
        assert [(e["kind"], e["topic"]) for e in search(path, msg_id=m, topic="a")] == [
            ("PUB", "a"), ("FIN", "a")]
    assert [(e["kind"], e["topic"]) for e in search(path, msg_id=6)] == [
        ("PUB", "a"), ("PUB", "b"), ("FIN", "a")]
    for absent in (4, 8, 7 + RUN_GAP, wide[0] + 1, wide[-1] + 1, NO_MESSAGE):
        assert search(path, msg_id=absent) == []
    assert [e["kind"] for e in search(path, topic="a", channel="c", since_ns=t + 99,
                                      until_ns=t + 201)] == ["DROP", "FIN"]


def test_a_chunk_that_names_an_object_is_refused_not_loaded(tmp_path):
    """Chunks are pickles read by the node's searches: one naming any global (here
    os.system) raises, and nothing is called."""
    path = str(tmp_path / "trace.sqlite")
    store = TraceStore(path, "n")
    store.write([(1, "PUB", "t", 0, "", 1, 0, 0, 0, "")])
    store.close()
    marker = tmp_path / "ran"
    evil = pickle.dumps([(1, "PUB", "t", 0, "", 1, 0, 0, 0, _Call(f"touch {marker}"))])
    db = sqlite3.connect(path)
    db.execute("UPDATE chunks SET events = ?", (evil,))
    db.commit()
    db.close()
    with pytest.raises(pickle.UnpicklingError, match="not a trace chunk"):
        search(path, msg_id=1)
    assert not marker.exists()


def test_a_writer_with_tracing_off_sleeps_until_tracing_is_wanted(tmp_path):
    """A node that never traced has no store and its writer thread waits without waking
    (it woke 20 times a second); `want_store` wakes it, and the first event is written."""
    path = str(tmp_path / "trace.sqlite")
    writer = EventWriter(path, "n")
    writer.start()
    try:
        status = f"/proc/self/task/{writer._thread.native_id}/status"

        def wakes() -> int:
            with open(status) as f:
                return next(int(line.split()[1]) for line in f
                            if line.startswith("voluntary_ctxt_switches"))

        time.sleep(0.2)
        before = wakes()
        time.sleep(1.0)
        assert wakes() - before <= 2
        assert not os.path.exists(path)
        writer.want_store()
        writer.add((time.time_ns(), "PUB", "t", 0, "", 1, 0, 0, 0, "x"))
        deadline = time.monotonic() + 10
        while writer.written < 1:
            assert time.monotonic() < deadline, writer.stats()
            time.sleep(0.05)
    finally:
        writer.close()
    assert [e["kind"] for e in search(path, msg_id=1)] == ["PUB"]


class _Call:
    """Unpickled, runs a shell command: what a hostile chunk would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


async def test_untraced_publish_and_consume_make_no_events_at_all(traced):
    node = traced()
    pub, sub = await conn(node), await conn(node)
    await sub.sub("plain", "ch", rdy=10)
    for i in range(10):
        await pub.pub("plain", b"%d" % i)
    for m in await take(sub, 10):
        m.fin()
    await nothing_arrives(sub)
    t = await settled(node)
    assert t["written"] == 0 and t["dropped"] == 0 and t["topics"] == []
    assert not os.path.exists(os.path.join(node.data_path, "trace.sqlite"))  # never made
    await pub.close()
    await sub.close()


async def following(node, check, timeout: float = 10.0) -> None:
    """Until the node's /stats `trace` passes `check`."""
    deadline = time.monotonic() + timeout
    while not check(ok(node, "GET", "/stats?format=json")["trace"]):
        assert time.monotonic() < deadline, "the node did not follow etcd's trace switch"
        await asyncio.sleep(0.05)


async def test_cluster_switch_is_in_etcd_and_every_leader_follows_it(tmp_path, etcd_server):
    from isr.etcd import Etcd
    from isr.metadata import Metadata
    from isr.placement import place
    from isr.state import ChannelMeta, TopicMeta

    etcd = Etcd(etcd_server.endpoint)
    meta = Metadata(etcd, "tr")
    nodes = [NsqdProcess(str(tmp_path / f"n{i}"), "--etcd-endpoints", etcd_server.endpoint,
                         "--cluster-id", "tr", "--etcd-lease-ttl", "2s").start() for i in range(2)]
    try:
        for _ in range(250):
            ids = sorted((await meta.read()).nodes)
            if len(ids) == 2:
                break
            await asyncio.sleep(0.02)
        placement = place(ids, 2, 1)
        await meta.create_topic("ct", TopicMeta(partitions=2), placement)
        await meta.create_channel("ct", "ch", ChannelMeta())
        leader = {n: next(x for x in nodes if x.tcp_address == r[0])
                  for n, r in enumerate(placement)}
        assert leader[0] is not leader[1]
        assert http(nodes[0], "POST", "/message/trace/enable?topic=nope")[0] == 404
        assert http(nodes[0], "POST", "/message/trace/enable?topic=ct&channel=nope")[0] == 404
        ok(nodes[0], "POST", "/message/trace/enable?topic=ct")  # asked of one node
        assert (await meta.read()).topics["ct"].meta.trace
        assert "ct" in ok(nodes[0], "GET", "/stats?format=json")["trace"]["topics"]  # applied
        await following(nodes[1], lambda t: "ct" in t["topics"])  # the other follows etcd
        ids_by_partition = {}
        for n in (0, 1):
            deadline = time.monotonic() + 15
            while True:  # the leader serves once it applied the view
                status, answer = http(leader[n], "POST", f"/pub?topic=ct&partition={n}", b"m%d" % n)
                if status == 200:
                    break
                assert time.monotonic() < deadline, (status, answer)
                await asyncio.sleep(0.05)
            [e] = await events_of(leader[n], "topic=ct", 1)
            assert (e["kind"], e["partition"]) == ("PUB", n)  # the other node followed etcd
            ids_by_partition[n] = e["msg_id"]
        ok(nodes[1], "POST", "/message/trace/disable?topic=ct")
        ok(nodes[1], "POST", "/message/trace/enable?topic=ct&channel=ch")
        view = (await meta.read()).topics["ct"]
        assert not view.meta.trace and view.channels["ch"].trace
        for node in nodes:
            await following(node, lambda t: t["topics"] == [] and t["channels"] == ["ct/ch"])
        for n in (0, 1):
            ok(leader[n], "POST", f"/pub?topic=ct&partition={n}", b"untraced")
        sub = await conn(leader[0])
        await sub.sub("ct", "ch", rdy=5)
        msgs = await take(sub, 2)
        for m in msgs:
            m.fin()
        events = await events_of(leader[0], "topic=ct", 5)
        # no PUB of the second messages (the topic is off), the channel's DELIVER and FIN
        assert sorted(e["kind"] for e in events) == ["DELIVER", "DELIVER", "FIN", "FIN", "PUB"]
        await sub.close()
    finally:
        for node in nodes:
            node.kill()
        await etcd.close()


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_store_is_searched_then_converted_when_opened(tmp_path, version):
    """A store an earlier version made (tests/data/trace-store-v1.sql, and -v2.sql on top
    of it: a row per event, 36 events of 12 messages): searched as it is, then converted
    by the first open."""
    path = str(tmp_path / "trace.sqlite")
    old = sqlite3.connect(path)
    for v in range(1, version + 1):
        with open(os.path.join(os.path.dirname(__file__), "data", f"trace-store-v{v}.sql")) as f:
            old.executescript(f.read())
    assert old.execute("PRAGMA user_version").fetchone()[0] == (0 if version == 1 else 2)
    old.close()
    expected = search(path, topic="orders", limit=100)
    assert len(expected) == 18  # the old rows, not converted yet
    by_trace = search(path, trace_id=(1 << 64) - 6)
    assert [e["kind"] for e in by_trace] == ["PUB", "DELIVER", "FIN"]
    store = TraceStore(path, "127.0.0.1:4150")
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = "
                                           "'table'")} == {"chunks", "msg_runs", "trace_keys",
                                                           "topic_chunks"}
    assert search(path, topic="orders", limit=100) == expected
    assert search(path, trace_id=(1 << 64) - 6) == by_trace
    assert search(path, msg_id=by_trace[0]["msg_id"]) == by_trace
    then = search(path, topic="audit", limit=100)[-1]["time_ns"]
    store.write([(then + 1, "PUB", "audit", 0, "", 99, 0, 5, 0, "x"),
                 (then + 2, "PUB", "orders", 0, "", 98, 0, 6, 0, "x")])
    audit = search(path, topic="audit", limit=100)
    assert len(audit) == 19 and audit[-1]["msg_id"] == 99
    assert [e["msg_id"] for e in search(path, topic="audit", since_ns=then, limit=5)] == [
        audit[-2]["msg_id"], 99]
    store.close()
    chunks = db.execute("SELECT count(*) FROM chunks").fetchone()[0]
    again = TraceStore(path, "127.0.0.1:4150")  # opened again: nothing converted twice
    assert db.execute("SELECT count(*) FROM chunks").fetchone()[0] == chunks
    again.close()
    db.close()


def test_topic_search_reads_chunks_in_time_order_whatever_the_write_order(tmp_path):
    """A topic's events are its chunks': the oldest `limit` in time order, even when a
    later batch holds earlier times (a clock stepped back), with channel and window."""
    path = str(tmp_path / "trace.sqlite")
    store = TraceStore(path, "n")

    def batch(times, topic="t", channel="c"):
        store.write([(ts, "FIN", topic, 0, channel, ts, 0, 0, 1, "") for ts in times])

    batch(range(100, 200))
    batch(range(200, 300), channel="d")
    batch(range(60, 70), topic="other")
    batch([*range(50, 60), *range(300, 310)])  # written last: earlier and later times
    store.close()
    times = [e["time_ns"] for e in search(path, topic="t", limit=15)]
    assert times == [*range(50, 60), *range(100, 105)]
    assert [e["time_ns"] for e in search(path, topic="t", since_ns=195, until_ns=302,
                                         channel="c")] == [195, 196, 197, 198, 199, 300, 301]
    assert len(search(path, topic="t", limit=10_000)) == 220
    assert search(path, topic="t", since_ns=60, until_ns=70) == []
    assert [e["time_ns"] for e in search(path, topic="other")] == list(range(60, 70))


async def test_a_switch_stats_show_is_applied_before_it_is_stored(node):
    """What /stats shows as traced makes events at once: a topic switched on gets its
    events before the switch's metadata write is awaited (that write can wait behind
    another; a publish in that window went untraced while /stats said "on")."""
    from nodes import connect

    n = await node()
    pub = await connect(n)
    await pub.pub("sw", b"before")  # the topic is open, not traced
    stored, flush = asyncio.Event(), n.meta.flush

    async def slow_flush():
        await stored.wait()
        await flush()
    n.meta.flush = slow_flush
    switching = asyncio.create_task(n.tracer.switch("sw", None, True))
    while "sw" not in n.tracer.state()["topics"]:
        await asyncio.sleep(0)
    await pub.pub("sw", b"during")  # the switch is not stored yet
    stored.set()
    assert await switching is True
    deadline = time.monotonic() + 10
    while not (found := await asyncio.to_thread(n.tracer.search, topic="sw")):
        assert time.monotonic() < deadline, "no event written"
        await asyncio.sleep(0.1)
    assert [(e["kind"], e["offset"] > 0) for e in found] == [("PUB", True)]  # "during" only
    await pub.close()


async def test_message_get_searches_the_commitlog_off_the_loop(node, monkeypatch):
    """/message/get finds its message with the queue's `find`, an exclusive job of the write
    worker. It searched the commitlog with `pread`s on the loop, beside the write thread,
    which may close that file meanwhile: a full run's replication test got a 500 (EBADF)
    from a node that had just become the partition's leader."""
    n = await node()
    address = types.SimpleNamespace(http_address=f"127.0.0.1:{n.http_port}")
    for body in (b"first", b"second", b"third"):
        status, _ = await asyncio.to_thread(http, address, "POST", "/pub?topic=t", body)
        assert status == 200
    loop_thread, on_loop, real = threading.get_ident(), [], os.pread

    def pread(fd, size, offset):
        if threading.get_ident() == loop_thread:
            on_loop.append((fd, size, offset))
        return real(fd, size, offset)

    monkeypatch.setattr(os, "pread", pread)
    status, got = await asyncio.to_thread(
        http, address, "GET", "/message/get?topic=t&partition=0&msg_id=0000000000000001")
    assert status == 200 and got["body"] == "second", got
    status, again = await asyncio.to_thread(
        http, address, "GET", f"/message/get?topic=t&partition=0&offset={got['offset']}")
    assert status == 200 and again == got
    assert on_loop == []
