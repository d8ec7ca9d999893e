"""One publish path (issue 8, item 3): PUB, MPUB, DPUB, PUB_EXT and MPUB_EXT all take
ClientConnection._publish, so every rule holds for every one of them and pipelining works
whatever the command (to a new topic too), answered in command order."""

from __future__ import annotations

import asyncio

from nodes import connect
from nsqwire import commands as c
from nsqwire import protocol as p
from test_auth import auth_server  # noqa: F401  (the fixture)

PUBLISHES = {
    "PUB": lambda topic: c.cmd_pub(topic, b"pub"),
    "MPUB": lambda topic: c.cmd_mpub(topic, [b"mpub1", b"mpub2"]),
    "DPUB": lambda topic: c.cmd_dpub(topic, 0, b"dpub"),
    "PUB_EXT": lambda topic: c.cmd_pub_ext(topic, {"k": "v"}, b"pub_ext"),
    "MPUB_EXT": lambda topic: c.cmd_mpub_ext(topic, [({}, b"mpub_ext1"), ({"a": 1}, b"mpub_ext2")]),
}
BODIES = {"PUB": [b"pub"], "MPUB": [b"mpub1", b"mpub2"], "DPUB": [b"dpub"],
          "PUB_EXT": [b"pub_ext"], "MPUB_EXT": [b"mpub_ext1", b"mpub_ext2"]}


async def exchange(port: int, data: bytes, count: int, timeout: float = 5) -> list:
    """Send raw bytes; return the first `count` frames (heartbeats left out)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(p.MAGIC_V2 + data)
    frames = c.FrameParser()
    got = []
    try:
        while len(got) < count:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            frames.feed(chunk)
            got += [f for f in frames.frames() if f != (p.FRAME_RESPONSE, b"_heartbeat_")]
    finally:
        writer.close()
    return got


async def bodies_of(node, topic: str) -> list[bytes]:
    q = node.topics[topic].partition(0).queue
    reader = q.reader(q.start_offset)
    try:
        return [r.body for r in await reader.read(1000)]
    finally:
        reader.close()


async def test_publishes_pipelined_behind_one_to_a_new_topic_are_answered_in_order(node):
    n = await node()
    data = b"".join(make("new") for make in PUBLISHES.values())  # the first one makes the topic
    data += b"".join(make("other") for make in PUBLISHES.values()) + c.cmd_pub("new", b"last")
    got = await exchange(n.tcp_port, data, 11)
    assert got == [(p.FRAME_RESPONSE, b"OK")] * 11
    expected = [b for name in PUBLISHES for b in BODIES[name]]
    assert await bodies_of(n, "new") == expected + [b"last"]
    assert await bodies_of(n, "other") == expected


async def test_an_error_is_answered_after_the_publishes_before_it_and_stops_what_follows(node):
    n = await node()
    await (await connect(n)).pub("t", b"made")
    data = c.cmd_pub("t", b"1") + c.cmd_mpub("t", [b"2", b"3"]) + c.cmd_pub("t", b"x", 7)
    got = await exchange(n.tcp_port, data + c.cmd_pub("t", b"never"), 4)
    assert got == [(p.FRAME_RESPONSE, b"OK")] * 2 + [
        (p.FRAME_ERROR, b"E_BAD_PARTITION PUB topic partition 7 is not valid")]
    assert await bodies_of(n, "t") == [b"made", b"1", b"2", b"3"]


async def test_tls_required_holds_for_every_publish(node):
    n = await node(tls_required=1)
    for name, make in PUBLISHES.items():
        got = await exchange(n.tcp_port, make("t"), 1)
        assert got == [(p.FRAME_ERROR,
                        f"E_INVALID cannot {name} in current state (TLS required)".encode())]
    assert "t" not in n.topics


async def test_auth_holds_for_every_publish(node, auth_server):  # noqa: F811
    server, address = await auth_server(ttl=0)  # asked again before every publish
    n = await node(auth_http_address=[address])
    auth = c.cmd_auth(b"s3cret")
    for name, make in PUBLISHES.items():
        got = await exchange(n.tcp_port, make("t"), 1)
        assert got == [(p.FRAME_ERROR, f"E_AUTH_FIRST AUTH required before {name}".encode())]
        got = await exchange(n.tcp_port, auth + make("u"), 2)  # only topic "t" is granted
        assert got[1] == (p.FRAME_ERROR, f'E_UNAUTHORIZED AUTH failed for {name} on "u" ""'.encode())
        calls = server.calls
        got = await exchange(n.tcp_port, auth + make("t") + make("t"), 3)
        assert got[1:] == [(p.FRAME_RESPONSE, b"OK")] * 2
        assert server.calls == calls + 3  # AUTH, then the expired grant renewed per publish
    assert "u" not in n.topics
    assert await bodies_of(n, "t") == [b for name in PUBLISHES for b in BODIES[name] * 2]


async def test_the_answers_of_pipelined_publishes_leave_in_one_write(node):
    """The OKs of one connection's publishes written by one batch go out together, in one
    write per turn of the loop (not one system call each), and still in command order."""
    n = await node()
    await (await connect(n)).pub("t", b"made")
    reader, writer = await asyncio.open_connection("127.0.0.1", n.tcp_port)
    writer.write(p.MAGIC_V2)
    port = writer.get_extra_info("sockname")[1]
    conn = None
    while conn is None:  # the server's side of this connection, once it is accepted
        await asyncio.sleep(0.01)
        conn = next((x for x in n.connections
                     if x.client.remote_address.endswith(f":{port}")), None)
    sends = []
    send = conn.client._send
    conn.client._send = lambda data: (sends.append(data), send(data))
    writer.write(b"".join(c.cmd_pub("t", b"%d" % i) for i in range(64)))
    frames = c.FrameParser()
    got = []
    while len(got) < 64:
        frames.feed(await asyncio.wait_for(reader.read(65536), 5))
        got += [f for f in frames.frames() if f[1] != b"_heartbeat_"]
    writer.close()
    assert got == [(p.FRAME_RESPONSE, b"OK")] * 64
    assert len(sends) <= 3, f"{len(sends)} writes for 64 answers"
    assert await bodies_of(n, "t") == [b"made"] + [b"%d" % i for i in range(64)]
