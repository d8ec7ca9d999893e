"""nsqclient's pure parts: the partition of a key (vectors other languages must match,
an independent murmur3 written here from the algorithm, spread), /lookup answers of every
shape (malformed ones are a clear LookupFailed, never another exception), routing, RDY
spread and per-key ordering."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from nsqclient.conn import Connection
from nsqclient.consumer import spread_rdy, targets
from nsqclient.lookup import LookupFailed, Node, StaticLookup, TopicMap, TopicNotFound, parse_lookup
from nsqwire.partitioning import partition_of
from nsqclient.producer import KeyOrder, NoLeader, route

# (key, murmur3 x86 32-bit seed 0 unsigned, partition for n = 2, 4, 16, 1024): nsqclient/README.md
VECTORS = [
    (b"", 0, [0, 0, 0, 0]),
    (b"a", 0x3C2569B2, [0, 2, 2, 434]),
    (b"abc", 0xB3DD93FA, [0, 2, 10, 1018]),
    (b"hello", 0x248BFA47, [1, 3, 7, 583]),
    (b"order-42", 0x4B11A18E, [0, 2, 14, 398]),
    ("ключ", 0x9A592042, [0, 2, 2, 66]),
    (b"The quick brown fox jumps over the lazy dog", 0x2E4FF723, [1, 3, 3, 803]),
]


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32, from the published algorithm, to check mmh3 independently."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & mask  # noqa: E731
    h = seed
    whole = len(data) // 4 * 4
    for (k,) in struct.iter_unpack("<I", data[:whole]):
        k = rotl(k * c1 & mask, 15) * c2 & mask
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & mask
    tail = data[whole:]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= rotl(k * c1 & mask, 15) * c2 & mask
    h ^= len(data)
    h = (h ^ (h >> 16)) * 0x85EBCA6B & mask
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & mask
    return h ^ (h >> 16)


@pytest.mark.parametrize("key,hashed,parts", VECTORS)
def test_partition_vectors(key, hashed, parts):
    raw = key.encode() if isinstance(key, str) else key
    assert murmur3_32(raw) == hashed
    assert [partition_of(key, n) for n in (2, 4, 16, 1024)] == parts
    assert partition_of(key, 1) == 0


@settings(max_examples=300)
@given(st.binary(max_size=64), st.integers(1, 1024))
def test_partition_matches_the_algorithm(key, n):
    assert partition_of(key, n) == murmur3_32(key) % n
    assert partition_of(bytearray(key), n) == partition_of(key, n)


def test_partition_bad_input():
    with pytest.raises(ValueError):
        partition_of(b"k", 0)
    with pytest.raises(TypeError):
        partition_of(42, 4)


def test_partition_spread():
    for n in (4, 16):
        counts = Counter(partition_of(f"user-{i}", n) for i in range(40_000))
        assert sorted(counts) == list(range(n))
        expected = 40_000 / n
        assert all(abs(v - expected) < 0.06 * expected for v in counts.values()), counts


def producer(host="127.0.0.1", port=4150, **extra):
    return {"remote_address": f"{host}:{port}", "hostname": "h", "broadcast_address": host,
            "tcp_port": port, "http_port": port + 1, "version": "1.3.0", **extra}


CLUSTER = {"channels": ["c"], "producers": [producer(port=4150), producer(port=4250)],
           "partitions": {"0": producer(port=4150), "1": producer(port=4250),
                          "3": producer(port=4150)},
           "meta": {"partition_num": 4, "replica": 1, "ordered": True, "extend_support": False}}


def test_lookup_cluster_answer_bare_and_legacy():
    bare = parse_lookup("t", 200, json.dumps(CLUSTER).encode())
    a, b = Node("127.0.0.1", 4150), Node("127.0.0.1", 4250)
    assert bare == TopicMap("t", 4, True, {0: a, 1: b, 3: a}, (a, b))  # 2 is leaderless
    legacy = {"status_code": 200, "status_txt": "OK", "data": CLUSTER}
    assert parse_lookup("t", 200, json.dumps(legacy).encode()) == bare


def test_lookup_classic_answer():
    doc = {"channels": [], "producers": [producer(port=1), producer(port=2), producer(port=1)]}
    m = parse_lookup("t", 200, json.dumps(doc).encode())
    assert m.partition_num is None and m.leaders == {}
    assert m.producers == (Node("127.0.0.1", 1), Node("127.0.0.1", 2))
    legacy = json.dumps({"status_code": 200, "status_txt": "OK", "data": doc}).encode()
    assert parse_lookup("t", 200, legacy) == m


def test_lookup_not_found_both_shapes():
    with pytest.raises(TopicNotFound):
        parse_lookup("t", 404, b'{"message": "TOPIC_NOT_FOUND"}')
    with pytest.raises(TopicNotFound):
        parse_lookup("t", 200, b'{"status_code": 404, "status_txt": "TOPIC_NOT_FOUND", "data": null}')
    with pytest.raises(LookupFailed, match="503: NOT_MASTER"):
        parse_lookup("t", 503, b'{"message": "NOT_MASTER", "master_http_address": null}')


def bad(**change):
    doc = json.loads(json.dumps(CLUSTER))
    for k, v in change.items():
        if v is ...:
            del doc[k]
        else:
            doc[k] = v
    return json.dumps(doc).encode()


@pytest.mark.parametrize("status,body,says", [
    (200, b"", "not JSON"),
    (200, b"\xff\xfe", "not JSON"),
    (200, b"[1, 2]", "not a JSON object"),
    (200, b"null", "not a JSON object"),
    (500, b"<html>oops</html>", "not JSON"),
    (500, b'{"message": "INTERNAL_ERROR"}', "500: INTERNAL_ERROR"),
    (200, bad(producers={}), "producers is not a list"),
    (200, bad(producers=[1]), "producers\\[0\\] is not an object"),
    (200, bad(producers=[{"tcp_port": 1}]), "no broadcast_address"),
    (200, bad(producers=[producer(tcp_port="4150")]), "no valid tcp_port"),
    (200, bad(producers=[producer(tcp_port=70000)]), "no valid tcp_port"),
    (200, bad(producers=[producer(tcp_port=True)]), "no valid tcp_port"),
    (200, bad(partitions=[]), "partitions is not an object"),
    (200, bad(meta=...), "without meta"),
    (200, bad(meta={"partition_num": 0}), "partition_num"),
    (200, bad(meta={"partition_num": "4"}), "partition_num"),
    (200, bad(meta={"partition_num": 2000}), "partition_num"),
    (200, bad(partitions={"4": producer()}), "not in 0..3"),
    (200, bad(partitions={"-1": producer()}), "not in 0..3"),
    (200, bad(partitions={"x": producer()}), "not in 0..3"),
    (200, bad(partitions={"0": "127.0.0.1:4150"}), "partitions\\[0\\] is not an object"),
    (200, b'{"status_code": 200, "status_txt": "OK", "data": []}', "not a JSON object"),
])
def test_lookup_malformed_is_a_clear_error(status, body, says):
    with pytest.raises(LookupFailed, match=says):
        parse_lookup("t", status, body)


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=200), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["producers", "partitions", "meta", "partition_num", "0", "1",
                         "broadcast_address", "tcp_port", "status_code", "data", "message"]),
        inner, max_size=5), max_leaves=20).map(lambda d: json.dumps(d).encode())),
       st.sampled_from([200, 404, 500]))
def test_lookup_any_bytes_give_a_map_or_lookup_failed(body, status):
    try:
        m = parse_lookup("t", status, body)
    except LookupFailed:
        return
    assert isinstance(m, TopicMap)
    assert all(0 <= n < m.partition_num for n in m.leaders)


def test_route():
    a, b = Node("a", 1), Node("b", 2)
    m = TopicMap("t", 4, False, {0: a, 1: b, 3: a}, (a, b))
    assert [route(m, None, turn) for turn in range(4)] == [(0, a), (1, b), (3, a), (0, a)]
    key = next(k for k in (f"k{i}".encode() for i in range(100)) if partition_of(k, 4) == 1)
    assert route(m, key, 7) == (1, b)
    hole = next(k for k in (f"k{i}".encode() for i in range(100)) if partition_of(k, 4) == 2)
    with pytest.raises(NoLeader, match="partition 2"):
        route(m, hole, 0)
    with pytest.raises(NoLeader):
        route(TopicMap("t", 2, False, {}, ()), None, 0)
    classic = TopicMap("t", None, producers=(a, b))
    assert [route(classic, None, t) for t in range(3)] == [(None, a), (None, b), (None, a)]
    assert route(classic, b"k", 0) == route(classic, b"k", 5)  # a key sticks to one producer


def test_targets_and_rdy_spread():
    a, b = Node("a", 1), Node("b", 2)
    assert targets(TopicMap("t", 4, False, {0: a, 2: b}, (a, b))) == {(a, 0), (b, 2)}
    assert targets(TopicMap("t", None, producers=(a, b))) == {(a, None), (b, None)}
    assert spread_rdy(10, 4) == [3, 3, 2, 2]
    assert spread_rdy(2, 4) == [1, 1, 1, 1]
    assert spread_rdy(1, 1) == [1]
    assert sum(spread_rdy(1000, 16)) == 1000


async def test_static_lookup():
    s = StaticLookup()
    with pytest.raises(TopicNotFound):
        await s.lookup("t", "w")
    s.set("t", 2, {0: "127.0.0.1:5", 1: "[::1]:6"})
    m = await s.lookup("t", "w")
    assert m.leaders == {0: Node("127.0.0.1", 5), 1: Node("[::1]", 6)}
    for leaders in ({2: "h:1"}, {0: "nohost"}, {0: "h:0"}, {0: "h:x"}):
        with pytest.raises(ValueError):
            s.set("t", 2, leaders)


async def test_key_order_is_first_come_first_served_per_key():
    order, seen = KeyOrder(), []

    async def one(key, i, hold):
        async with order.hold(key):
            seen.append((key, i, "in"))
            await asyncio.sleep(hold)
            seen.append((key, i, "out"))

    await asyncio.gather(one("a", 0, 0.05), one("a", 1, 0), one("b", 0, 0), one("a", 2, 0))
    a = [(i, e) for k, i, e in seen if k == "a"]
    assert a == [(0, "in"), (0, "out"), (1, "in"), (1, "out"), (2, "in"), (2, "out")]
    assert seen.index(("b", 0, "out")) < seen.index(("a", 0, "out"))  # b did not wait for a
    assert len(order) == 0


async def test_a_connection_reset_by_the_server_ends_the_connection_quietly():
    """A node killed mid-connection resets it: the read loop ends as at EOF (closed set,
    a waiting command fails with ConnectionError), and its task holds no exception that
    asyncio would log as never retrieved."""
    async def reset(reader, writer):
        await reader.read(4)  # the magic
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await Connection("127.0.0.1", port).connect()
        waiting = asyncio.ensure_future(conn.command(b"NOP\n"))
        await asyncio.wait_for(conn.closed.wait(), 5)
        with pytest.raises(ConnectionError):
            await waiting
        await asyncio.sleep(0)
        assert conn._reader_task.done() and conn._reader_task.exception() is None
    finally:
        server.close()
        await server.wait_closed()


async def test_a_cancel_that_lands_in_close_is_not_swallowed():
    """A task cancelled while it closes a connection (cleanup in a `finally`, as the
    producer does on its way out) stays cancelled: close() used to swallow that
    CancelledError with the reader task's, so the task went on, and a harness waiting for
    its tasks to end on Ctrl-C waited for good."""
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    went_on = []
    try:
        conn = await Connection("127.0.0.1", port).connect()

        async def user():
            try:
                await asyncio.sleep(10)
            finally:
                await conn.close()
                went_on.append(True)  # must not run: the task was cancelled in close()

        task = asyncio.ensure_future(user())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0)  # user() is in close(), waiting for the reader task
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)
        assert went_on == []
    finally:
        server.close()
        await server.wait_closed()
