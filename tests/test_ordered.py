"""Ordered consumption on one node (nsqd/ordered.py): one message of a partition-channel out
at a time whatever RDY says, REQ with a delay redelivers at once, a timeout redelivers the
same message first, an ordered topic takes only SUB_ORDERED and keyed (partitioned)
publishes, setorder, and order kept across a consumer restart and kill -9 of nsqd."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from nodes import connect, nothing_arrives, take
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c
from ordercheck import OrderCheck, body
from servers import NsqdProcess


async def http(port: int, path: str, data: bytes = b"") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}{path}", data=data) as r:
            return r.status, await r.read()


async def channel_ordered(n, topic: str, channel: str) -> bool:
    """/stats: the channel's `ordered` flag (of its partition 0)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{n.http_port}/stats?format=json"
                               f"&topic={topic}&channel={channel}") as r:
            stats = await r.json(content_type=None)
    return stats["topics"][0]["channels"][0]["partitions"][0]["ordered"]


async def sub_ordered(conn: Connection, topic: str, channel: str, partition: int = 0,
                      rdy: int = 10) -> None:
    await conn.command(c.cmd_sub_ordered(topic, channel, partition))
    conn.rdy(rdy)


async def next_of(*conns: Connection, timeout: float = 5.0):
    """The next message any of `conns` receives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for conn in conns:
            if not conn.messages.empty():
                return conn.messages.get_nowait()
        await asyncio.sleep(0.01)
    raise TimeoutError("no message")


async def test_one_message_in_flight_whatever_rdy_and_however_many_clients(node):
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(6)])
    a, b = await connect(n), await connect(n)
    await sub_ordered(a, "t", "c", rdy=50)
    await sub_ordered(b, "t", "c", rdy=50)
    got = []
    while len(got) < 6:
        m = await next_of(a, b)
        await asyncio.sleep(0.3)
        assert a.messages.empty() and b.messages.empty(), "a second message went out"
        got.append(m.body)
        m.fin()
    assert got == [b"m%d" % i for i in range(6)]


async def test_each_next_message_leaves_at_once_not_after_the_output_buffer_timeout(node):
    """The one message out is sent at once (nothing follows it before its FIN), not after
    the client's output_buffer_timeout (250 ms by default: 40 messages would take 10 s)."""
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(40)])
    con = await connect(n)
    await sub_ordered(con, "t", "c", rdy=100)
    t0 = time.monotonic()
    for i in range(40):
        (m,) = await take(con, 1)
        assert m.body == b"m%d" % i
        m.fin()
    assert time.monotonic() - t0 < 4


async def test_a_plain_channel_is_not_limited_until_sub_ordered(node):
    """The check that the limit is the ordered rule's: a plain SUB gets RDY's worth."""
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(5)])
    plain = await connect(n)
    await plain.sub("t", "c", rdy=5)
    assert len(await take(plain, 5)) == 5


async def test_req_with_a_delay_redelivers_the_same_message_first_at_once(node):
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"first", b"second"])
    con = await connect(n)
    await sub_ordered(con, "t", "c")
    (m,) = await take(con, 1)
    t0 = time.monotonic()
    m.req(60_000)
    (again,) = await take(con, 1, timeout=3)
    assert time.monotonic() - t0 < 2
    assert again.body == b"first" and again.attempts == 2 and again.id == m.id
    again.fin()
    (nxt,) = await take(con, 1)
    assert nxt.body == b"second"
    nxt.fin()




async def test_a_timeout_redelivers_the_same_message_before_the_next(node):
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"a", b"b"])
    con = await connect(n, msg_timeout=1000)
    await sub_ordered(con, "t", "c")
    (m,) = await take(con, 1)
    (again,) = await take(con, 1, timeout=5)  # not finished: it times out and comes back
    assert again.body == b"a" and again.attempts == 2
    again.fin()
    assert [x.body for x in await take(con, 1)] == [b"b"]


async def test_an_ordered_topic_takes_only_sub_ordered_and_partitioned_publishes(node):
    n = await node()
    status, _ = await http(n.http_port, "/topic/create?topic=o&partition_num=2&ordered=true")
    assert status == 200
    plain = await connect(n, heartbeat_interval=1000)
    try:
        await plain.command(c.cmd_sub("o", "c", 0))
        raise AssertionError("a plain SUB of an ordered topic was taken")
    except NSQError as e:
        assert "E_SUB_ORDER_IS_MUST" in str(e)
    pub = await connect(n)
    try:
        await pub.command(c.cmd_pub("o", b"x"))
        raise AssertionError("a PUB without a partition was taken by an ordered topic")
    except NSQError as e:
        assert "E_BAD_PARTITION" in str(e)
    status, answer = await http(n.http_port, "/pub?topic=o", b"x")
    assert status == 400 and b"BAD_PARTITION" in answer
    pub = await connect(n)  # E_BAD_PARTITION is fatal, as for a partition out of range
    await pub.command(c.cmd_pub("o", b"x", 1))
    con = await connect(n)
    await sub_ordered(con, "o", "c", partition=1)
    assert [m.body for m in await take(con, 1)] == [b"x"]
    assert (await http(n.http_port, "/channel/setorder?topic=o&channel=c&order=false"))[0] == 400


async def test_setorder_false_turns_a_channel_back_to_plain(node):
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(5)])
    con = await connect(n)
    await sub_ordered(con, "t", "c", rdy=5)
    (m,) = await take(con, 1)
    await nothing_arrives(con, 0.3)
    assert await channel_ordered(n, "t", "c") is True
    assert (await http(n.http_port, "/channel/setorder?topic=t&channel=c&order=false"))[0] == 200
    m.fin()
    assert len(await take(con, 4)) == 4
    assert await channel_ordered(n, "t", "c") is False
    assert (await http(n.http_port, "/channel/setorder?topic=t&channel=c&order=maybe"))[0] == 400


def test_order_kept_across_consumer_restarts_and_nsqd_kill_9(tmp_path):
    """200 messages over 4 keys; the consumer drops its connection (with a message out) and
    nsqd is SIGKILLed and restarted while it consumes. Every message arrives, each key's in
    order once duplicates are dropped (at-least-once: a FIN younger than the last cursor
    save comes back)."""
    proc = NsqdProcess(str(tmp_path / "data")).start()
    keys = [f"k{i}" for i in range(4)]
    sent = {k: 50 for k in keys}
    check = OrderCheck()

    async def consume(count: int, drop_last: bool) -> None:
        con = await Connection("127.0.0.1", proc.tcp_port).connect()
        await sub_ordered(con, "t", "c", rdy=20)
        for i in range(count):
            m = await asyncio.wait_for(con.messages.get(), 10)
            check.observe_body(m.body)
            if drop_last and i == count - 1:
                break  # left in flight: it comes back to the next consumer
            m.fin()
        await asyncio.sleep(0.05)
        await con.close()

    async def run() -> None:
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.mpub("t", [body(k, s) for s in range(50) for k in keys])
        await pub.close()
        await consume(30, drop_last=True)
        await consume(30, drop_last=False)

    try:
        asyncio.run(run())
        proc.kill()
        proc.start()
        asyncio.run(consume(40, drop_last=True))
        proc.kill()
        proc.start()

        async def rest() -> None:
            con = await Connection("127.0.0.1", proc.tcp_port).connect()
            await sub_ordered(con, "t", "c", rdy=20)
            while any(check.top.get(k, -1) < 49 for k in keys):
                m = await asyncio.wait_for(con.messages.get(), 10)
                check.observe_body(m.body)
                m.fin()
            await con.close()

        asyncio.run(rest())
    finally:
        proc.kill()
    check.finish(sent)
    report = check.report()
    assert check.clean, report
    assert report["duplicates"] >= 1, report  # the dropped messages came back


async def test_the_ordered_consumer_runs_one_handler_a_partition_at_a_time(node):
    """nsqclient's Consumer(ordered=True): SUB_ORDERED on each partition (the topic is
    ordered: a plain SUB would be refused), one handler call a partition at a time, in
    order, however slow the handler and whatever max_in_flight."""
    from nsqclient.consumer import Consumer
    from nsqclient.lookup import StaticLookup

    n = await node()
    assert (await http(n.http_port, "/topic/create?topic=o&partition_num=2&ordered=true"))[0] == 200
    pub = await connect(n)
    for p in (0, 1):
        await pub.command(c.cmd_mpub("o", [body(f"p{p}", i) for i in range(20)], p))
    running: dict[str, int] = {"p0": 0, "p1": 0}
    most = {"p0": 0, "p1": 0}
    check = OrderCheck()

    async def handler(m) -> None:
        key = m.body.split(b":")[0].decode()
        running[key] += 1
        most[key] = max(most[key], running[key])
        await asyncio.sleep(0.005)
        check.observe_body(m.body)
        running[key] -= 1

    lookup = StaticLookup()
    lookup.set("o", 2, {0: f"127.0.0.1:{n.tcp_port}", 1: f"127.0.0.1:{n.tcp_port}"})
    consumer = await Consumer("o", "c", handler=handler, max_in_flight=50, lookup=lookup,
                              ordered=True).start()
    try:
        deadline = time.monotonic() + 10
        while check.received < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await consumer.close()
    check.finish({"p0": 20, "p1": 20})
    assert check.clean and check.received == 40, check.report()
    assert most == {"p0": 1, "p1": 1}


def test_partitions_needed():
    from nsqclient.consumer import partitions_needed

    assert partitions_needed(10_000, 0.0013) == 13
    assert partitions_needed(1000, 0.001) == 1
    assert partitions_needed(0, 0.001) == 1
    assert partitions_needed(1001, 0.001) == 2
