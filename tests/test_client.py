"""The partition-aware client (nsqclient Producer and Consumer) against real nsqd.

Real nsqd processes where a crash matters (kill -9 mid-stream); nsqd nodes in the test's
own loop where a leader must move (`apply_assignment`, the cluster driver's in-process
call); a real classic nsqlookupd for LookupdSource. The partition map comes from a
StaticLookup the test changes by hand, as a cluster lookupd will when leaders move.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import defaultdict

import pytest
from structlog.testing import capture_logs

from nodes import until
from nsqclient.conn import Connection
from nsqclient.consumer import Consumer
from nsqclient.lookup import LookupdSource, LookupFailed, StaticLookup, TopicNotFound
from nsqwire.partitioning import partition_of
from nsqclient.producer import Producer, PublishError
from nsqwire import commands as c
from nsqwire.ids import SEQUENCE_MASK, decode_msg_id, msg_id_partition
from servers import NsqdProcess, NsqlookupdProcess, free_port

N = 4


def http(address: str, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{address}{path}", data=b"" if method == "POST" else None,
                                 method=method, headers={"Accept": "application/vnd.nsq; version=1.0"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read() or b"null")


def committed(address: str, topic: str) -> list[int]:
    _, stats = http(address, "GET", f"/stats?format=json&topic={topic}")
    return [p.get("committed_count", 0) for p in stats["topics"][0]["partitions"]]


def partition(m) -> int:
    return msg_id_partition(decode_msg_id(m.id))


def sequence(m) -> int:
    return decode_msg_id(m.id) & SEQUENCE_MASK


async def read_partition(host: str, port: int, topic: str, n: int, count: int) -> list:
    """Every message of partition n (`count` of them), in log order, through SUB t ch n."""
    conn = await Connection(host, port).connect()
    await conn.command(c.cmd_sub(topic, "audit", n))
    conn.rdy(1000)
    got = [await asyncio.wait_for(conn.messages.get(), 10) for _ in range(count)]
    for m in got:
        m.fin()
    await conn.close()
    assert {partition(m) for m in got} <= {n}
    return sorted(got, key=sequence)


@pytest.fixture
def proc(tmp_path):
    p = NsqdProcess(str(tmp_path / "nsqd")).start()
    status, _ = http(p.http_address, "POST", f"/topic/create?topic=t&partition_num={N}")
    assert status == 200
    yield p
    p.kill()


def static_all(address: str, partitions: int = N) -> StaticLookup:
    s = StaticLookup()
    s.set("t", partitions, {n: address for n in range(partitions)})
    return s


async def test_keys_land_in_their_partition_and_keyless_go_round(proc):
    p = Producer(lookup=static_all(proc.tcp_address))
    keys = [f"user-{i}" for i in range(40)]
    await asyncio.gather(*(p.publish("t", f"{k}|{j}".encode(), key=k)
                           for k in keys for j in range(3)))
    await p.publish_many("t", [b"user-7|m0", b"user-7|m1"], key="user-7")
    assert committed(proc.http_address, "t") == [
        sum(3 + 2 * (k == "user-7") for k in keys if partition_of(k, N) == n) for n in range(N)]
    before = committed(proc.http_address, "t")
    for i in range(8):
        await p.publish("t", b"nokey|%d" % i)
    await p.publish_many("t", [b"nokey|a", b"nokey|b"])  # one MPUB, whole in one partition
    assert [a - b for a, b in zip(committed(proc.http_address, "t"), before)] == [4, 2, 2, 2]
    assert len(p._conns) == 1  # one connection to the one leader, reused
    await p.close()

    for n, count in enumerate(committed(proc.http_address, "t")):
        for m in await read_partition("127.0.0.1", proc.tcp_port, "t", n, count):
            key = m.body.split(b"|")[0]
            if key != b"nokey":
                assert partition_of(key, N) == n, m.body


@pytest.mark.parametrize("idempotent", [False, True])
async def test_per_key_order_across_kill9(proc, idempotent):
    """Eight keys publish 120 messages each; nsqd is killed -9 and restarted mid-stream.
    Every acknowledged message is there and each key's messages are stored in call order.
    Not idempotent, all called at once: a retry's duplicate only right after its original
    (the producer sends a key's next message only after the previous one's answer).
    Idempotent, each key's calls one after another (the producer would carry calls made at
    once in one request): stored exactly once each, in order."""
    p = Producer(lookup=static_all(proc.tcp_address), max_retry_time=30, max_attempts=100,
                 idempotent=idempotent)
    acked = defaultdict(list)

    async def one(key: str, j: int):
        await p.publish("t", f"{key}|{j}".encode(), key=key)
        acked[key].append(j)

    async def key_stream(key: str):
        if idempotent:
            for j in range(120):
                await one(key, j)
        else:
            await asyncio.gather(*(one(key, j) for j in range(120)))

    streams = asyncio.gather(*(key_stream(f"k{i}") for i in range(8)))
    await until(lambda: sum(map(len, acked.values())) >= 300, 20)
    proc.kill()
    killed_at = sum(map(len, acked.values()))
    await asyncio.sleep(0.3)
    await asyncio.to_thread(proc.start)
    await asyncio.wait_for(streams, 60)
    assert killed_at < 960 and p.retries > 0
    await p.close()

    stored = defaultdict(list)
    for n, count in enumerate(committed(proc.http_address, "t")):
        for m in await read_partition("127.0.0.1", proc.tcp_port, "t", n, count):
            key, j = m.body.decode().split("|")
            assert partition_of(key, N) == n
            stored[key].append(int(j))
    for key, seq in acked.items():
        assert seq == list(range(120))
        assert stored[key] == sorted(stored[key]), key  # order per key intact
        assert sorted(set(stored[key])) == seq, key  # every acknowledged one, nothing else
        if idempotent:
            assert stored[key] == seq, key  # and each once


async def test_calls_made_at_once_go_as_one_named_request_and_a_gap_takes_a_new_name(proc):
    """Idempotent (the default): 50 calls of one key at once are carried in few requests
    (one in flight a partition), stored once each and in call order, under one producer.
    A lane whose sequence the partition does not expect (a gap: refused, never written)
    sends its request again under a new producer id."""
    p = Producer(lookup=static_all(proc.tcp_address))
    await asyncio.gather(*(p.publish("t", b"k|%d" % j, key="k") for j in range(50)))
    n = partition_of("k", N)
    _, doc = http(proc.http_address, "GET", "/stats?format=json&topic=t")
    part = doc["topics"][0]["partitions"][n]
    assert part["producers"] == 1 and part["group_commit"]["batches"] < 50
    lane = p._lanes[("t", n)]
    first_id = lane.producer_id
    lane.sequence += 3  # the partition expects 3 fewer: its next request leaves a gap
    await p.publish("t", b"k|50", key="k")
    assert lane.producer_id != first_id and lane.sequence == 1
    await p.close()
    got = await read_partition("127.0.0.1", proc.tcp_port, "t", n, 51)
    assert [m.body for m in got] == [b"k|%d" % j for j in range(51)]
    _, doc = http(proc.http_address, "GET", "/stats?format=json&topic=t")
    assert doc["topics"][0]["partitions"][n]["producers"] == 2


async def test_bad_partition_and_missing_topic_are_retried_then_clear(tmp_path):
    proc = NsqdProcess(str(tmp_path / "nsqd"), "--disable-auto-create").start()
    try:
        http(proc.http_address, "POST", f"/topic/create?topic=t&partition_num={N}")
        lookup = static_all(proc.tcp_address, partitions=8)  # stale: the topic has 4
        key = next(k for k in (f"k{i}" for i in range(100)) if partition_of(k, 8) >= N)
        p = Producer(lookup=lookup, max_attempts=3, backoff=0.01)
        t0 = time.monotonic()
        with pytest.raises(PublishError, match="after 3 attempts.*E_BAD_PARTITION"):
            await p.publish("t", b"x", key=key)
        assert time.monotonic() - t0 < 2

        p = Producer(lookup=lookup, backoff=0.05)
        task = asyncio.ensure_future(p.publish("t", b"fixed", key=key))
        await until(lambda: p.retries >= 2)
        lookup.set("t", N, {n: proc.tcp_address for n in range(N)})  # the map is fixed
        await asyncio.wait_for(task, 10)
        assert committed(proc.http_address, "t")[partition_of(key, N)] == 1

        lookup.set("new", 2, {0: proc.tcp_address, 1: proc.tcp_address})
        task = asyncio.ensure_future(p.publish("new", b"n", key="a"))
        await until(lambda: p.retries >= 4)  # E_TOPIC_NOT_EXIST, looked up and retried
        http(proc.http_address, "POST", "/topic/create?topic=new&partition_num=2")
        await asyncio.wait_for(task, 10)

        retries = p.retries  # refusals that a new lookup cannot fix are raised at once
        with pytest.raises(PublishError, match="refused: E_BAD_(MESSAGE|BODY)"):
            await p.publish("t", b"")
        with pytest.raises(PublishError, match="invalid topic name"):
            await p.publish("bad topic!", b"x")
        assert p.retries == retries
        await p.close()
        with pytest.raises(PublishError, match="closed"):
            await p.publish("t", b"x")
    finally:
        proc.kill()


async def start_node(tmp_path, name: str):
    from nsqd.main import build
    from nsqd.options import Options

    n = build(Options(tcp_address="127.0.0.1:0", http_address="127.0.0.1:0",
                      data_path=str(tmp_path / name), log_level="warning"))
    await n.start()
    return n


async def following_a(a, b, lookup: StaticLookup, got: list) -> Consumer:
    """Node a leads every partition of topic t, node b none, and `lookup` says so; returns
    a consumer that follows `lookup` (messages into `got`), subscribed to each partition."""
    await a.apply_assignment("t", N, range(N))
    await b.apply_assignment("t", N, ())
    lookup.set("t", N, {n: f"127.0.0.1:{a.tcp_port}" for n in range(N)})
    consumer = await Consumer("t", "ch", handler=got.append, max_in_flight=10,
                              lookup=lookup, lookup_interval=60, backoff=0.05).start()
    await until(lambda: len(consumer.subscriptions) == N)
    return consumer


async def test_leader_moves_producer_and_consumer_follow(tmp_path):
    """Partition 1 moves from node a to node b: the producer gets E_FAILED_ON_NOT_LEADER
    and retries, the consumer's subscription to it is closed by a; both follow the new map."""
    a, b = await start_node(tmp_path, "a"), await start_node(tmp_path, "b")
    try:
        lookup, got = StaticLookup(), []
        consumer = await following_a(a, b, lookup, got)
        _, stats = await asyncio.to_thread(  # the node runs in this loop: never block it
            http, f"127.0.0.1:{a.http_port}", "GET", "/stats?format=json&topic=t")
        clients = stats["topics"][0]["channels"][0]["clients"]
        assert sorted(cl["ready_count"] for cl in clients) == [2, 2, 3, 3]  # 10 spread over 4

        producer = Producer(lookup=lookup, backoff=0.05)
        keys = [f"k{i}" for i in range(20)]
        for k in keys:
            await producer.publish("t", f"{k}|0".encode(), key=k)
        await until(lambda: len(got) == len(keys))

        await b.apply_assignment("t", N, {1})
        await a.apply_assignment("t", N, {0, 2, 3})
        moved = [k for k in keys if partition_of(k, N) == 1]
        task = asyncio.gather(*(producer.publish("t", f"{k}|1".encode(), key=k) for k in keys))
        await until(lambda: producer.retries >= 1)  # E_FAILED_ON_NOT_LEADER seen
        await asyncio.sleep(0.2)
        lookup.set("t", N, {n: f"127.0.0.1:{(b if n == 1 else a).tcp_port}" for n in range(N)})
        await asyncio.wait_for(task, 10)
        await until(lambda: len(got) == 2 * len(keys), 10)
        second = [m for m in got if m.body.endswith(b"|1")]
        assert sorted(m.body.split(b"|")[0].decode() for m in second) == sorted(keys)
        from_b = {m.body.split(b"|")[0].decode() for m in second if m.conn.port == b.tcp_port}
        assert from_b == set(moved) and moved
        assert {(t[0].tcp_port, t[1]) for t in consumer.subscriptions} == {
            (a.tcp_port, 0), (b.tcp_port, 1), (a.tcp_port, 2), (a.tcp_port, 3)}
        await producer.close()
        await consumer.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_subscription_lost_while_another_closes_does_not_stop_the_consumer(tmp_path):
    """Partitions 0 and 1 move to node b at once, and the second of the two subscriptions is
    lost (its connection closed) while the consumer closes the first: the consumer follows
    on to b without a failure. Its follow loop used to die there of a KeyError (the lost
    one was already forgotten), and the consumer got nothing more, without a word: a
    jepsen etcd-pause run counted 710 acknowledged messages never delivered that way."""
    a, b = await start_node(tmp_path, "a"), await start_node(tmp_path, "b")
    try:
        await a.apply_assignment("t", N, range(N))
        await b.apply_assignment("t", N, ())
        moved = {n: f"127.0.0.1:{(b if n in (0, 1) else a).tcp_port}" for n in range(N)}
        closing = []

        class Moving(StaticLookup):
            """Answers the moved map once armed, and closes the subscription the consumer
            will close second just as the consumer starts closing the first."""
            armed = False

            async def lookup(self, topic, access="w"):
                if self.armed:
                    self.armed = False
                    self.set("t", N, moved)
                    stale = [t for t in consumer.subscriptions if t[1] in (0, 1)]
                    closing.append(asyncio.ensure_future(consumer.subscriptions[stale[-1]].close()))
                return await super().lookup(topic, access)

        lookup, got = Moving(), []
        consumer = await following_a(a, b, lookup, got)
        with capture_logs() as logs:
            lookup.armed = True
            consumer._wake.set()  # look up now, as a lost subscription makes it
            await until(lambda: closing and closing[0].done())
            await asyncio.sleep(0.2)
        assert [e for e in logs if e["event"] == "consumer_follow_failed"] == []
        await b.apply_assignment("t", N, {0, 1})
        await a.apply_assignment("t", N, {2, 3})
        await until(lambda: {(t[0].tcp_port, t[1]) for t in consumer.subscriptions} == {
            (b.tcp_port, 0), (b.tcp_port, 1), (a.tcp_port, 2), (a.tcp_port, 3)}, 10)
        producer = Producer(lookup=lookup, backoff=0.05)
        keys = [f"k{i}" for i in range(20)]
        for k in keys:
            await producer.publish("t", k.encode(), key=k)
        await until(lambda: len(got) == len(keys), 10)
        assert not consumer._task.done()
        await producer.close()
        await consumer.close()
    finally:
        await a.stop()
        await b.stop()


async def test_consumer_fin_req_and_close_drains(proc):
    attempts, done, release = defaultdict(int), [], asyncio.Event()

    async def handler(m):
        attempts[m.body] += 1
        if m.body == b"fail-once" and m.attempts == 1:
            raise RuntimeError("first try fails")
        if m.body.startswith(b"slow"):
            await release.wait()
        done.append(m.body)

    p = Producer(lookup=static_all(proc.tcp_address))
    for body in (b"ok1", b"fail-once", b"ok2"):
        await p.publish("t", body)
    consumer = await Consumer("t", "ch", handler=handler, max_in_flight=4,
                              lookup=static_all(proc.tcp_address), backoff=0.05).start()
    await until(lambda: len(done) == 3)
    assert attempts[b"fail-once"] == 2  # REQ on the exception, delivered again
    for i in range(3):
        await p.publish("t", b"slow%d" % i)
    await until(lambda: sum(attempts[b"slow%d" % i] for i in range(3)) == 3)
    closing = asyncio.ensure_future(consumer.close())
    await asyncio.sleep(0.2)
    assert not closing.done()  # waits for the handlers running
    release.set()
    await asyncio.wait_for(closing, 10)
    assert sorted(done[3:]) == [b"slow0", b"slow1", b"slow2"]
    _, stats = http(proc.http_address, "GET", "/stats?format=json&topic=t")
    ch = stats["topics"][0]["channels"][0]
    assert (ch["depth"], ch["in_flight_count"], ch["client_count"]) == (0, 0, 0)
    await p.close()


async def test_lookupd_source_against_a_classic_lookupd(tmp_path):
    lookupd = NsqlookupdProcess(str(tmp_path)).start()
    proc = NsqdProcess(str(tmp_path / "nsqd"), "--lookupd-tcp-address", lookupd.tcp_address).start()
    dead = f"127.0.0.1:{free_port()}"
    try:
        source = LookupdSource([dead, lookupd.http_address], timeout=1)
        with pytest.raises(TopicNotFound):
            await source.lookup("c", "w")
        http(proc.http_address, "POST", "/topic/create?topic=c")
        await until(lambda: _registered(lookupd, "c"), 10)
        m = await source.lookup("c", "w")
        assert (m.partition_num, [n.tcp_port for n in m.producers]) == (None, [proc.tcp_port])
        await source.close()

        got = []
        p = Producer([dead, lookupd.http_address])
        consumer = await Consumer("c", "ch", [lookupd.http_address], handler=got.append,
                                  backoff=0.05).start()
        for i in range(5):
            await p.publish("c", b"m%d" % i, key="k" if i % 2 else None)
        await until(lambda: len(got) == 5)
        assert sorted(m.body for m in got) == [b"m0", b"m1", b"m2", b"m3", b"m4"]
        await p.close()
        await consumer.close()

        t0 = time.monotonic()
        with pytest.raises(LookupFailed, match=dead):
            await LookupdSource([dead, f"127.0.0.1:{free_port()}"], timeout=1).lookup("c", "w")
        assert time.monotonic() - t0 < 3
    finally:
        proc.kill()
        lookupd.kill()


def _registered(lookupd, topic: str) -> bool:
    try:
        status, body = http(lookupd.http_address, "GET", f"/lookup?topic={topic}")
    except OSError:
        return False
    return status == 200 and bool(body.get("producers"))
