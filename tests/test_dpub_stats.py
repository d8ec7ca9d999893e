"""A deferred publish counts in `deferred_count`, not in `depth`, as soon as it is
published, also in a channel no client reads (classic nsqd puts a DPUB in each channel's
deferred queue at once). When it comes due it moves to `depth`.

Ours, written down in nsqd/README.md: a channel takes the DPUBs at the head of its unread
log without a client; one behind a message still unread counts in `depth` until that
message is read (holding plain messages for want of a client would cost memory).
"""

import asyncio
import json

import aiohttp

from nodes import connect, take
from nsqclient.conn import Connection
from servers import NsqdProcess


async def channel_stats(http_port: int, topic: str, channel: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{http_port}/stats?format=json&topic={topic}") as r:
            doc = json.loads(await r.read())
    t = doc["topics"][0]
    return next(c for c in t["channels"] if c["channel_name"] == channel)


async def counts(http_port, topic="t", channel="c") -> tuple[int, int]:
    c = await channel_stats(http_port, topic, channel)
    return c["depth"], c["deferred_count"]


async def eventually(http_port, expected, timeout=5.0, **names):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (got := await counts(http_port, **names)) != expected:
        assert loop.time() < deadline, f"(depth, deferred_count) is {got}, not {expected}"
        await asyncio.sleep(0.02)


async def test_a_dpub_to_a_channel_without_clients_is_deferred_at_once(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c")  # the channel exists; its client sends no RDY
    pub = await connect(n)
    await pub.dpub("t", 800, b"soon")  # in memory (under --delay-threshold)
    await pub.dpub("t", 3_600_000, b"in an hour")  # in the disk delay queue
    await eventually(n.http_port, (0, 2))
    await eventually(n.http_port, (1, 1), timeout=5)  # "soon" came due
    c.rdy(1)
    assert [m.body for m in await take(c)] == [b"soon"]


async def test_a_dpub_behind_an_unread_message_counts_in_depth_until_read(node):
    n = await node()
    ch = await connect(n)
    await ch.sub("t", "c")
    pub = await connect(n)
    await pub.pub("t", b"plain")
    await pub.dpub("t", 3_600_000, b"later")
    await eventually(n.http_port, (2, 0))
    ch.rdy(1)
    (msg,) = await take(ch)
    assert msg.body == b"plain"
    msg.fin()
    await eventually(n.http_port, (0, 1))


async def test_deferred_again_after_a_restart(tmp_path):
    """Unread DPUBs count as deferred from the start of the next run too."""
    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        c = await Connection("127.0.0.1", proc.tcp_port).connect()
        await c.sub("t", "c")
        await c.close()
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        for i in range(3):
            await pub.dpub("t", 3_600_000, b"later %d" % i)
        await pub.close()
        await eventually(proc.http_port, (0, 3))
        proc.kill()
        proc.start()
        await eventually(proc.http_port, (0, 3))
    finally:
        proc.kill()
