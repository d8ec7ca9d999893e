"""Publish forwarding (nsqd/forward.py): a publish without a partition to a node that leads
none of its topic's partitions is written by a leader and answered with its answer; a
publish naming a partition this node does not lead is refused, naming the leader.

Real processes: etcd, one nsqlookupd, three nsqd; the topic has 2 partitions of one
replica each, so one node leads none of them."""

from __future__ import annotations

import asyncio
import struct

import pytest

from cluster import Cluster, http_json, wait_until
from servers import http
from nsqclient.conn import Connection, NSQError
from isr import wire
from isr.wire import Decoder, Kind
from nsqd.forward import PublishRequest, decode, encode
from nsqwire import commands as c
from nsqwire.partitioning import partition_of


def wire_round_trip(header: dict, payload: bytes):
    """The header and payload as the leader reads them off the wire."""
    (frame,) = Decoder().feed(wire.encode(Kind.PUBLISH, 9, header, payload))
    wire.check(frame)
    return frame.header, bytes(frame.payload)


def test_a_request_is_decoded_as_it_was_encoded():
    req = PublishRequest([b"a", b"", b"ccc"], b"\x01\x02", 7, (1, 2, 2**64 - 1),
                         (b"x", b"", b"zz"))
    header, payload = wire_round_trip(*encode("t", 1, req, "127.0.0.1:5"))
    assert (header["topic"], header["partition"], header["source"]) == ("t", 1, "127.0.0.1:5")
    assert decode(header, payload) == req
    plain = PublishRequest([b"one"])
    assert decode(*wire_round_trip(*encode("t", 0, plain, ""))) == plain
    named = PublishRequest([b"one"], b"{}", producer=("till-7", 2**63 - 1))
    assert decode(*wire_round_trip(*encode("t", 0, named, ""))) == named
    header, payload = wire_round_trip(*encode("t", 0, req, ""))
    for bad in (payload[:-1], payload + b"\0", b"", payload[:20]):
        with pytest.raises(ValueError):
            decode(header, bad)
    with pytest.raises(ValueError):
        decode({**header, "n": 0}, b"")


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    cluster = Cluster(str(tmp_path_factory.mktemp("fwd")), 3, 1).start()
    status, body = cluster.create_topic("f", 2)
    assert status == 200, body
    leaders = wait_until(lambda: len(cluster.leaders("f")) == 2 and cluster.leaders("f"), 10,
                         "both partitions led")
    cluster.spare = next(n for n in cluster.nsqds if n.tcp_address not in leaders.values())
    yield cluster
    cluster.stop()


async def connect(address: str) -> Connection:
    host, port = address.rsplit(":", 1)
    return await Connection(host, int(port)).connect()


def committed(cl, topic: str, leaders: dict[int, str] | None = None) -> dict[int, int]:
    """partition -> messages committed, as each partition's leader says (`leaders`: these
    partitions and leaders; all, as /lookup says, by default)."""
    out = {}
    for n, leader in sorted((leaders or cl.leaders(topic)).items()):
        status, doc = http_json("GET", f"http://{cl.nsqd_at(leader).http_address}"
                                       f"/stats?format=json&topic={topic}")
        assert status == 200, doc
        for t in doc["topics"]:
            for pt in t.get("partitions", []):
                if pt["partition"] == n and pt["leader"]:
                    out[n] = pt["committed_count"]
    return out


async def test_a_publish_to_a_node_that_leads_none_is_written_by_a_leader(cl):
    """PUB, MPUB, DPUB and PUB_TRACE over TCP and /pub, /mpub over HTTP, to the node that
    leads no partition: each answered as a leader answers, spread over both partitions."""
    conn = await connect(cl.spare.tcp_address)
    try:
        for i in range(4):
            assert await conn.command(c.cmd_pub("f", b"tcp-%d" % i)) == b"OK"
        assert await conn.command(c.cmd_mpub("f", [b"m1", b"m2", b"m3"])) == b"OK"
        assert await conn.command(c.cmd_dpub("f", 10, b"deferred")) == b"OK"
        reply = await conn.command(c.cmd_pub_trace("f", 99, b"traced"))
        ok, first_id, trace_id, offset, size = struct.unpack(">2sQQQI", reply)
        assert (ok, trace_id) == (b"OK", 99) and size > 0 and first_id > 0
    finally:
        await conn.close()
    assert http(cl.spare, "POST", "/pub?topic=f", b"http-1") == (200, "OK")
    assert http(cl.spare, "POST", "/mpub?topic=f", b"h2\nh3") == (200, "OK")
    counts = committed(cl, "f")  # 12 messages in 9 requests, round-robin over 2 partitions
    assert sorted(counts) == [0, 1] and sum(counts.values()) == 12 and min(counts.values()) >= 4
    status, stats = http(cl.spare, "GET", "/stats?format=json")
    assert (stats["cluster"]["forwarded"], stats["cluster"]["forward_failed"]) == (9, 0)


async def test_a_named_request_is_forwarded_to_its_producers_partition_and_written_once(cl):
    """An idempotent producer's /pub through the node that leads none, sent three times:
    forwarded each time to the partition its producer id hashes to, written once."""
    before = committed(cl, "f")
    for _ in range(3):
        assert http(cl.spare, "POST", "/pub?topic=f&producer_id=curl-1&sequence=0",
                    b"once") == (200, "OK")
    after = committed(cl, "f")
    n = partition_of("curl-1", 2)
    assert [after.get(k, 0) - before.get(k, 0) for k in (n, 1 - n)] == [1, 0]


async def test_a_publish_naming_a_partition_led_elsewhere_names_its_leader(cl):
    leaders = cl.leaders("f")
    conn = await connect(cl.spare.tcp_address)
    try:
        with pytest.raises(NSQError) as e:
            await conn.command(c.cmd_pub("f", b"x", partition=1))
        assert str(e.value).startswith("E_FAILED_ON_NOT_LEADER")
        assert f"partition 1 is led by {leaders[1]}" in str(e.value)
        assert await conn.command(c.cmd_pub("f", b"after")) == b"OK"  # not fatal
    finally:
        await conn.close()
    status, body = http(cl.spare, "POST", "/pub?topic=f&partition=0", b"x")
    assert (status, body) == (400, {"message": "E_FAILED_ON_NOT_LEADER", "leader": leaders[0]})


async def test_publishes_through_a_node_go_on_when_a_leader_is_killed(cl):
    """The leader of partition 0 is SIGKILLed: publishes to the node that leads nothing
    keep being answered OK (the dead leader's connection fails before anything is sent,
    so the request goes to the other partition's leader), each within a few seconds.
    (Runs last: the module's cluster keeps one node down.)"""
    leaders = cl.leaders("f")
    before = committed(cl, "f")
    cl.nsqd_at(leaders[0]).kill()
    conn = await connect(cl.spare.tcp_address)
    slowest = 0.0
    try:
        for i in range(40):
            began = asyncio.get_running_loop().time()
            assert await conn.command(c.cmd_pub("f", b"k-%d" % i)) == b"OK"
            slowest = max(slowest, asyncio.get_running_loop().time() - began)
    finally:
        await conn.close()
    assert slowest < 5, slowest
    after = committed(cl, "f", {1: leaders[1]})  # the dead leader wrote none of them
    assert after[1] - before[1] == 40
    print(f"\nslowest forwarded PUB while a leader was down: {slowest * 1000:.0f} ms")


async def test_forwarded_publishes_acknowledged_through_a_failover_are_all_kept(tmp_path):
    """R=3 over 4 nodes: the node that holds no replica forwards every publish. Its leader
    is SIGKILLed while 4 connections publish through it: every publish answered OK is
    consumed afterwards (none lost); the others got an error (not writable, outcome
    unknown, not leader) and went on."""
    from test_replication import consume_all  # the partition-aware consumer, until all came

    cl = Cluster(str(tmp_path), 4, 1).start()
    try:
        status, body = cl.create_topic("ff", 1, replicas=3)
        assert status == 200, body
        s = await cl.until_states("ff", lambda s: len(s[0].isr) == 3, 10, "3 in sync")
        spare = next(n for n in cl.nsqds if n.tcp_address not in s[0].isr)
        acked: set[bytes] = set()
        errors: list[str] = []
        stop = asyncio.Event()

        async def publisher(w: int) -> None:
            conn, i = None, 0
            while not stop.is_set():
                try:
                    conn = conn or await connect(spare.tcp_address)
                    body = b"%d-%d" % (w, i)
                    i += 1
                    if await conn.command(c.cmd_pub("ff", body)) == b"OK":
                        acked.add(body)
                except NSQError as e:
                    errors.append(str(e).split(" ", 1)[0])
                except ConnectionError:
                    conn = None

        tasks = [asyncio.create_task(publisher(w)) for w in range(4)]
        await asyncio.sleep(1.0)
        leader = cl.nsqd_at(s[0].leader)
        leader.kill()
        await cl.until_states("ff", lambda s: s[0].leader not in (None, leader.tcp_address),
                              15, "a new leader")
        before = len(acked)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
        assert len(acked) > before > 0  # publishing went on through the new leader
        seen = await consume_all(cl, "ff", acked, 30)
        lost = acked - seen.keys()
        print(f"\nforwarded through a failover: acked {len(acked)}, errors "
              f"{sorted(set(errors))} x{len(errors)}, lost {len(lost)}")
        assert not lost, sorted(lost)[:10]
    finally:
        cl.stop()
