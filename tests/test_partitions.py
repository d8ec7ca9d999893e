"""Several partitions of a topic on one node, and only those it leads (nsqd/assignment.py).

Real nsqd processes for what a client sees (create over HTTP, PUB/SUB per partition,
classic PUB and SUB over every partition, kill -9); an nsqd in the test's own loop for
what only the cluster driver can cause: `NSQD.apply_assignment` taking partitions away
and giving them back (no HTTP endpoint exists for it: the driver calls it in-process).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections import Counter

import aiohttp
import pytest

from nodes import connect, take, until
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c
from nsqwire.ids import decode_msg_id, msg_id_partition
from servers import NsqdProcess

N = 4


def http(address: str, method: str, path: str, body: bytes | None = None):
    req = urllib.request.Request(f"http://{address}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def topic_stats(address: str, topic: str) -> dict:
    status, body = http(address, "GET", f"/stats?format=json&topic={topic}")
    assert status == 200
    return json.loads(body)["topics"][0]


def counts(address: str, topic: str) -> list[int]:
    return [p.get("committed_count", 0) for p in topic_stats(address, topic)["partitions"]]


def partition_of(msg) -> int:
    return msg_id_partition(decode_msg_id(msg.id))


@pytest.fixture
def proc(tmp_path):
    p = NsqdProcess(str(tmp_path / "nsqd")).start()
    yield p
    p.kill()


async def drain(conn: Connection, count: int, timeout: float = 10.0) -> list:
    """The next `count` messages, each FIN'd as it comes."""
    got = []
    for _ in range(count):
        (m,) = await take(conn, 1, timeout)
        m.fin()
        got.append(m)
    return got


async def sub(conn: Connection, topic: str, channel: str, partition=None, rdy: int = 0):
    await conn.command(c.cmd_sub(topic, channel, partition))
    if rdy:
        conn.rdy(rdy)


def test_topic_create_bounds_and_conflict(proc):
    a = proc.http_address
    for bad in ("0", "1025", "-1", "x"):
        status, body = http(a, "POST", f"/topic/create?topic=t&partition_num={bad}")
        assert (status, json.loads(body)) == (400, {"message": "INVALID_PARTITION_NUM"}), bad
    assert http(a, "POST", "/topic/create?topic=t&partition_num=4")[0] == 200
    assert http(a, "POST", "/topic/create?topic=t&partition_num=4")[0] == 200  # same: fine
    assert http(a, "POST", "/topic/create?topic=t")[0] == 200  # classic create: as it is
    status, body = http(a, "POST", "/topic/create?topic=t&partition_num=2")
    assert (status, json.loads(body)) == (409, {"message": "TOPIC_PARTITION_NUM_CONFLICT"})
    t = topic_stats(a, "t")
    assert t["partition_num"] == 4
    assert [(p["partition"], p["leader"]) for p in t["partitions"]] == [(n, True) for n in range(4)]


async def test_publish_per_partition_spread_and_consume_all(proc):
    a = proc.http_address
    assert http(a, "POST", f"/topic/create?topic=t&partition_num={N}")[0] == 200
    pub = await Connection("127.0.0.1", proc.tcp_port).connect()
    for n in range(N):  # explicit partitions: n + 1 messages in partition n
        for k in range(n + 1):
            await pub.command(c.cmd_pub("t", f"p{n}-{k}".encode(), n))
    assert counts(a, "t") == [1, 2, 3, 4]
    for k in range(8):  # classic PUB: round-robin, 2 more each
        await pub.pub("t", f"rr-{k}".encode())
    assert counts(a, "t") == [3, 4, 5, 6]
    await pub.mpub("t", [b"m1", b"m2", b"m3"])  # one request: whole in the next partition
    assert counts(a, "t") == [6, 4, 5, 6]
    status, body = http(a, "POST", "/pub?topic=t&partition=2", b"h2")
    assert status == 200
    assert counts(a, "t") == [6, 4, 6, 6]

    # Errors: out of range is E_BAD_PARTITION (fatal, as it was), on TCP and HTTP.
    for cmd in (c.cmd_pub("t", b"x", N), c.cmd_mpub("t", [b"x"], 9)):
        bad = await Connection("127.0.0.1", proc.tcp_port).connect()
        with pytest.raises(NSQError, match="E_BAD_PARTITION"):
            await bad.command(cmd)
        await bad.close()
    await pub.pub("t", b"still-open")
    status, body = http(a, "POST", f"/pub?topic=t&partition={N}", b"x")
    assert (status, json.loads(body)) == (400, {"message": "BAD_PARTITION"})
    total = sum(counts(a, "t"))
    assert total == 23

    # Classic SUB: every partition on one connection, exact counts, FIN/REQ by id.
    consumer = await Connection("127.0.0.1", proc.tcp_port).connect({"msg_timeout": 10_000})
    await sub(consumer, "t", "ch", rdy=100)
    got = await take(consumer, total)
    assert len({m.id for m in got}) == total
    assert Counter(map(partition_of, got)) == Counter(
        dict(enumerate(counts(a, "t"))))
    requeued = list({partition_of(m): m for m in got}.values())  # one of each partition
    assert sorted(map(partition_of, requeued)) == list(range(N))
    for m in got:
        if m in requeued:
            m.req(0)
        else:
            m.fin()
    again = await take(consumer, N)
    assert sorted(m.body for m in again) == sorted(m.body for m in requeued)
    assert all(m.attempts == 2 for m in again)
    for m in again:
        m.fin()
    await until(lambda: sum(ch["in_flight_count"] + ch["depth"] for ch in
                            topic_stats(a, "t")["channels"]) == 0)
    assert consumer.errors == []
    st = topic_stats(a, "t")
    assert st["channels"][0]["client_count"] == 1
    assert all(p["channels"] == ["ch"] for p in st["partitions"])

    # SUB to one partition: only its messages.
    one = await Connection("127.0.0.1", proc.tcp_port).connect()
    await sub(one, "t", "one", 3, rdy=100)
    with pytest.raises(NSQError, match="E_BAD_PARTITION"):
        bad = await Connection("127.0.0.1", proc.tcp_port).connect()
        await sub(bad, "t", "one", N)
    await pub.command(c.cmd_pub("t", b"to3", 3))
    await pub.command(c.cmd_pub("t", b"to1", 1))
    (m,) = await take(one, 1)
    assert (m.body, partition_of(m)) == (b"to3", 3)
    for conn in (pub, consumer, one):
        await conn.close()


async def test_kill9_keeps_partitions_and_acknowledged_messages(proc):
    a = proc.http_address
    assert http(a, "POST", f"/topic/create?topic=k&partition_num={N}")[0] == 200
    pub = await Connection("127.0.0.1", proc.tcp_port).connect()
    consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
    await sub(consumer, "k", "ch")
    bodies = [f"m{i}".encode() for i in range(200)]
    for i, b in enumerate(bodies):
        if i % 3:
            await pub.pub("k", b)
        else:
            await pub.command(c.cmd_pub("k", b, i % N))
    before = counts(a, "k")
    proc.kill()
    proc.start()
    assert counts(a, "k") == before
    st = topic_stats(a, "k")
    assert st["partition_num"] == N and all(p["leader"] for p in st["partitions"])
    consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
    await sub(consumer, "k", "ch", rdy=50)
    got = await drain(consumer, len(bodies))
    assert sorted(m.body for m in got) == sorted(bodies)
    await consumer.close()
    await pub.close()


async def test_disable_auto_create(tmp_path):
    p = NsqdProcess(str(tmp_path / "d"), "--disable-auto-create").start()
    try:
        conn = await Connection("127.0.0.1", p.tcp_port).connect()
        with pytest.raises(NSQError, match="E_TOPIC_NOT_EXIST"):
            await conn.pub("nope", b"x")
        status, body = http(p.http_address, "POST", "/pub?topic=nope", b"x")
        assert (status, json.loads(body)) == (404, {"message": "E_TOPIC_NOT_EXIST"})
        assert http(p.http_address, "POST", "/topic/create?topic=yes&partition_num=2")[0] == 200
        await conn.pub("yes", b"x")  # the publish connection survived its error
        with pytest.raises(NSQError, match="E_TOPIC_NOT_EXIST"):
            s = await Connection("127.0.0.1", p.tcp_port).connect()
            await sub(s, "nope", "ch")
        await conn.close()
    finally:
        p.kill()


# ---- the assignment, changed in-process as the cluster driver will ----------


async def post(node, path: str, body: bytes = b"") -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{node.http_port}{path}", data=body) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text.startswith("{") else text)


async def test_partition_taken_away_and_given_back(node):
    n = await node()
    await n.apply_assignment("t", N, range(N))
    all_sub = await connect(n, msg_timeout=60_000)
    await sub(all_sub, "t", "ch", rdy=10)
    one = await connect(n)
    await sub(one, "t", "ch2", 1, rdy=10)
    pub = await connect(n)
    for k in range(N):
        await pub.command(c.cmd_pub("t", f"a{k}".encode(), k))
    got = await take(all_sub, N)
    held = {partition_of(m): m for m in got}
    held[0].fin()
    (m1,) = await take(one, 1)
    assert m1.body == b"a1"

    await n.apply_assignment("t", N, {0, 2, 3})  # partition 1 taken away
    await asyncio.wait_for(one.closed.wait(), 5)  # its one-partition consumer lost it
    assert any(e.startswith("E_FAILED_ON_NOT_LEADER") for e in one.errors), one.errors
    with pytest.raises(NSQError, match="E_FAILED_ON_NOT_LEADER"):
        await pub.command(c.cmd_pub("t", b"x", 1))
    await pub.command(c.cmd_pub("t", b"b2", 2))  # non-fatal: the connection goes on
    for k in range(6):
        await pub.pub("t", f"rr{k}".encode())  # classic PUB: only led partitions
    assert 1 not in n.topics["t"].partitions
    status, body = await post(n, "/pub?topic=t&partition=1", b"x")
    assert (status, body) == (400, {"message": "E_FAILED_ON_NOT_LEADER"})
    fresh = await take(all_sub, 7)
    assert {partition_of(m) for m in fresh} <= {0, 2, 3}
    for m in fresh:
        m.fin()
    held[2].fin()
    held[3].fin()
    # FIN of a message of the partition taken away: fatal E_FAILED_ON_NOT_LEADER.
    with pytest.raises(NSQError, match="E_FAILED_ON_NOT_LEADER"):
        s = await connect(n)
        await sub(s, "t", "ch", 1)
    held[1].fin()
    await asyncio.wait_for(all_sub.closed.wait(), 5)
    assert any("E_FAILED_ON_NOT_LEADER" in e for e in all_sub.errors)

    # Given back: a new all-partitions subscriber gets the message of partition 1 that
    # was in flight when it went (it comes back from the checkpoint), and joins later ones.
    await n.apply_assignment("t", N, range(N))
    again = await connect(n)
    await sub(again, "t", "ch", rdy=10)
    (m,) = await take(again, 1)
    assert (m.body, partition_of(m), m.attempts) == (b"a1", 1, 2)
    m.fin()
    await n.apply_assignment("t", 6, range(6))  # more partitions: the subscriber joins them
    await pub.command(c.cmd_pub("t", b"p5", 5))
    (m,) = await take(again, 1)
    assert (m.body, partition_of(m)) == (b"p5", 5)
    m.fin()
    await n.apply_assignment("t", 6, {5})  # all but 5 leave the subscription
    await pub.command(c.cmd_pub("t", b"p5b", 5))
    (m,) = await take(again, 1)
    assert m.body == b"p5b"
    m.fin()
    assert sorted(n.topics["t"].partitions) == [5]
    for conn in (pub, again):
        await conn.close()


async def test_a_sub_answered_during_a_takeover_joins_the_channel_made_after_it(node):
    """A classic SUB answered while the node takes the topic's partition over (the
    assignment being stored: not led yet, so no channel to join) consumes the partition's
    channel of its name when that is made afterwards, as the cluster driver makes the
    channels etcd has. (Before, nothing joined it: the client was subscribed to nothing, a
    flaky failure of the cluster's pause-failover test.)"""
    n = await node()
    await n.apply_assignment("late", 1, set())  # the topic, no partition led here
    flush, stored, release = n.meta.flush, asyncio.Event(), asyncio.Event()

    async def held_flush():
        stored.set()
        await release.wait()
        await flush()

    n.meta.flush = held_flush
    taking = asyncio.create_task(n.apply_assignment("late", 1, {0}))
    await asyncio.wait_for(stored.wait(), 5)  # opened, its channels made; not led yet
    consumer = await connect(n)
    await sub(consumer, "late", "c", rdy=10)  # OK: every partition, none led yet
    n.meta.flush = flush
    release.set()
    await taking
    assert n.topics["late"].partitions[0].channels == {}
    await n.get_channel("late", "c", 0, register=False)  # the cluster driver's channel pass
    pub = await connect(n)
    await pub.pub("late", b"after the takeover")
    (m,) = await take(consumer, 1)
    assert m.body == b"after the takeover"
    m.fin()
    for conn in (pub, consumer):
        await conn.close()


async def test_a_publish_waits_while_its_partitions_leadership_starts(node):
    """A partition whose leadership here is starting (in cluster mode: its writer not in
    place yet, or its epoch being taken; set here as the replication driver sets it) holds
    a PUB (TCP and HTTP, named partition or any) until it is led, then writes it; past
    the commit timeout the publish is refused E_FAILED_ON_NOT_WRITABLE, not left waiting.
    (A topic of one replica is a replicated log in cluster mode: a publish right after it
    was made, or taken over, was refused in that window.)"""
    from nsqd.topic import NotLed, Solo
    n = await node(commit_timeout_ms=1500)
    await n.apply_assignment("t", 2, {0, 1})
    parts = n.topics["t"].partitions
    for p in parts.values():
        p.writer = NotLed("test: its leadership is starting", starting=True)
    conn = await connect(n)
    named = asyncio.ensure_future(conn.command(c.cmd_pub("t", b"named", 1)))
    anyone = asyncio.ensure_future(post(n, "/pub?topic=t", b"any"))
    await asyncio.sleep(0.3)
    assert not named.done() and not anyone.done()
    for p in parts.values():
        p.writer = Solo(p.queue)
    assert await asyncio.wait_for(named, 5) == b"OK"
    assert await asyncio.wait_for(anyone, 5) == (200, "OK")
    parts[0].writer = NotLed("test: its leadership is starting", starting=True)
    started = time.monotonic()
    with pytest.raises(NSQError, match="E_FAILED_ON_NOT_WRITABLE"):
        await conn.command(c.cmd_pub("t", b"never", 0))
    assert 1.4 < time.monotonic() - started < 5
    assert await conn.command(c.cmd_pub("t", b"other", 1)) == b"OK"  # not fatal


async def test_assignment_survives_restart(node, tmp_path):
    n = await node()
    await n.apply_assignment("r", 8, {1, 6})
    await n.stop()
    n2 = await node()
    t = n2.topics["r"]
    assert (t.assignment.partition_num, sorted(t.assignment.leading)) == (8, [1, 6])
    assert sorted(t.partitions) == [1, 6]


async def test_publish_through_assignment_changes_loses_nothing(node):
    """Publishers race partitions closed and reopened: every acknowledged message is
    there once every partition is led again, and no partition is left half-open."""
    n = await node()
    await n.apply_assignment("race", N, range(N))
    acked: list[bytes] = []
    stop = asyncio.Event()

    async def publisher(i: int) -> None:
        conn = await connect(n)
        k = 0
        while not stop.is_set():
            body = f"{i}-{k}".encode()
            k += 1
            try:
                if k % 2:
                    await conn.pub("race", body)
                else:
                    await conn.command(c.cmd_pub("race", body, k % N))
            except NSQError as e:
                assert "E_FAILED_ON_NOT_LEADER" in str(e) or "E_PUB_FAILED" in str(e), e
                continue
            acked.append(body)
        await conn.close()

    tasks = [asyncio.create_task(publisher(i)) for i in range(4)]
    for leading in ({0, 1}, {2, 3}, {0, 3}, set(), {1}, set(range(N)), {2}, set(range(N))):
        await n.apply_assignment("race", N, leading)
        await asyncio.sleep(0.03)
    stop.set()
    await asyncio.gather(*tasks)
    t = n.topics["race"]
    assert sorted(t.writable) == list(range(N)) and not t.failed
    assert sum(p.queue.committed_count for p in t.partitions.values()) == len(acked)
    consumer = await connect(n)
    await sub(consumer, "race", "ch", rdy=200)
    got = await drain(consumer, len(acked))
    assert sorted(m.body for m in got) == sorted(acked)
    await consumer.close()


async def test_rdy_is_shared_fairly(node):
    """RDY 1 over 4 partitions with backlogs: no partition starves. Counted once each
    partition delivered one message (its channel read its backlog: under a loaded machine
    a first read may take longer than the others' first deliveries)."""
    n = await node()
    await n.apply_assignment("fair", N, range(N))
    pub = await connect(n)
    for k in range(N):
        await pub.command(c.cmd_mpub("fair", [b"x"] * 80, k))
    consumer = await connect(n)
    await sub(consumer, "fair", "ch", rdy=1)
    warm = set()
    for _ in range(80):
        if len(warm) == N:
            break
        (m,) = await take(consumer, 1)
        warm.add(partition_of(m))
        m.fin()
    assert len(warm) == N, warm
    seen = Counter()
    for _ in range(40):
        (m,) = await take(consumer, 1)
        seen[partition_of(m)] += 1
        m.fin()
    assert set(seen) == set(range(N)), seen
    assert min(seen.values()) >= 5, seen
    await pub.close()
    await consumer.close()
