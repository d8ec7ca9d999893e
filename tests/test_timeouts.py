"""The timeout scan (nsqd/timeouts.py) through a real in-process nsqd over real sockets: it
visits exactly the channels something may come due in, and every timeout still happens."""

import asyncio
import time

from nodes import connect, nothing_arrives, take, until
from test_delay import DAY_MS, FakeClock


def scanned(n) -> set:
    return {(c.topic_name, c.partition, c.name) for c in n.timeouts.channels}


async def test_idle_channels_are_not_scanned(node):
    n = await node()
    topic = await n.create_topic("t", 20)
    for i in range(20):
        await topic.publish([b"m%d" % i], i)
    c = await connect(n)
    await c.sub("t", "c", rdy=0)  # a channel on each of the 20 partitions, none delivering
    assert len(list(n.topics["t"].channels())) == 20
    await asyncio.sleep(0.3)
    assert scanned(n) == set()
    assert n.timeouts.scan(time.monotonic()) == 0


async def test_a_channel_is_scanned_while_a_message_is_in_flight(node):
    n = await node()
    c = await connect(n, msg_timeout=1000)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"x")
    (m,) = await take(c)
    assert scanned(n) == {("t", 0, "c")}
    (back,) = await take(c, timeout=3)  # timed out: the scan found it
    assert (back.id, back.attempts) == (m.id, 2)
    assert n.topics["t"].partitions[0].channels["c"].timeout_count == 1
    back.fin()
    await until(lambda: scanned(n) == set())
    await pub.pub("t", b"y")  # in again with the next delivery
    (m,) = await take(c)
    assert scanned(n) == {("t", 0, "c")}
    m.fin()
    await until(lambda: scanned(n) == set())


async def test_a_deferred_message_is_scanned_until_it_is_delivered(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"x")
    (m,) = await take(c)
    m.req(400)
    ch = n.topics["t"].partitions[0].channels["c"]
    await until(lambda: len(ch.deferred) == 1)
    await asyncio.sleep(0.2)  # scans pass while it waits: it stays in
    assert scanned(n) == {("t", 0, "c")} and len(ch.deferred) == 1
    (again,) = await take(c)
    assert again.attempts == 2
    again.fin()
    await until(lambda: scanned(n) == set())


async def test_a_delay_store_is_scanned_while_it_holds_messages(node):
    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=0)  # the channel, with no room: the DPUB goes to the store
    ch = n.topics["t"].partitions[0].channels["c"]
    assert scanned(n) == set()
    pub = await connect(n)
    await pub.dpub("t", 3 * DAY_MS, b"in three days")
    await until(lambda: ch.delay.waiting == 1)
    await asyncio.sleep(0.3)
    assert scanned(n) == {("t", 0, "c")}, "waiting in the store: the channel stays in"
    await n.stop()

    n = await node(clock)  # the store opened again holds it: scanned from the start
    ch = n.topics["t"].partitions[0].channels["c"]
    await until(lambda: ch.delay.waiting == 1)
    assert scanned(n) == {("t", 0, "c")}
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    await nothing_arrives(c)
    clock.advance(3 * 86_400 + 1)
    (m,) = await take(c)
    assert m.body == b"in three days"
    m.fin()
    await until(lambda: ch.delayed_count == 0 and scanned(n) == set())


async def test_a_closed_channel_leaves_the_scan(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"x")
    await take(c)
    ch = n.topics["t"].partitions[0].channels["c"]
    assert ch in n.timeouts.channels
    assert await n.delete_channel("t", "c")
    n.timeouts.scan(time.monotonic())
    assert ch not in n.timeouts.channels
