"""nsqd in cluster mode (nsqd/cluster.py) against a real etcd and real nsqd processes:
registration under a lease, topics and leaders from etcd, auto-create, cluster-wide
channels, etcd away at start and while running, malformed keys."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from isr import keys
from isr.etcd import Etcd
from isr.metadata import Metadata
from isr.placement import place
from isr.state import NodeInfo, TopicMeta
from nsqclient.conn import Connection, NSQError
from nsqd.nsqd import START_GRACE_S
from nsqwire import commands as c
from servers import NsqdProcess

CLUSTER = "t"


def http(address: str, method: str, path: str):
    req = urllib.request.Request(f"http://{address}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            if r.headers.get_content_type() == "application/json":
                body = json.loads(body)
            return r.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def cluster_stats(node: NsqdProcess) -> dict:
    return http(node.http_address, "GET", "/stats?format=json")[1]["cluster"]


def channels_of(node: NsqdProcess, topic: str) -> set[str]:
    doc = http(node.http_address, "GET", f"/stats?format=json&topic={topic}")[1]
    return {ch["channel_name"] for t in doc["topics"] for ch in t["channels"]}


def start_nodes(tmp_path, etcd_server, count: int, *extra: str) -> list[NsqdProcess]:
    return [NsqdProcess(str(tmp_path / f"n{i}"), "--etcd-endpoints", etcd_server.endpoint,
                        "--cluster-id", CLUSTER, "--etcd-lease-ttl", "2s", *extra).start()
            for i in range(count)]


async def eventually(check, timeout: float = 5.0, what: str = "condition"):
    """Call `check()` (sync or async) until it returns something truthy: that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(0.02)


@pytest.fixture
async def meta(etcd_server):
    etcd = Etcd(etcd_server.endpoint)
    yield Metadata(etcd, CLUSTER)
    await etcd.close()


async def live_nodes(meta: Metadata, count: int) -> list[str]:
    async def read():
        view = await meta.read()
        return sorted(view.nodes) if len(view.nodes) == count else None
    return await eventually(read, what=f"{count} registered nodes")


async def pub(node: NsqdProcess, topic: str, body: bytes, partition: int | None = None):
    conn = await Connection("127.0.0.1", node.tcp_port).connect()
    try:
        return await conn.command(c.cmd_pub(topic, body, partition))
    finally:
        await conn.close()


async def create(meta: Metadata, topic: str, nodes: list[str], partitions: int) -> dict:
    """A topic made in etcd as nsqlookupd would: partition -> leader."""
    placement = place(nodes, partitions, 1)
    await meta.create_topic(topic, TopicMeta(partitions=partitions), placement)
    return {n: r[0] for n, r in enumerate(placement)}


def by_id(nodes: list[NsqdProcess]) -> dict[str, NsqdProcess]:
    return {n.tcp_address: n for n in nodes}


async def test_registers_and_leaves(tmp_path, etcd_server, meta):
    (node,) = start_nodes(tmp_path, etcd_server, 1)
    try:
        key = keys.node(CLUSTER, node.tcp_address)

        async def value():
            kv, _ = await meta.etcd.get(key)
            return kv
        kv = await eventually(value, what="registration")
        info = NodeInfo.decode(kv.value, key, node.tcp_address)
        assert (info.http, info.rpc) == (node.http_address, node.rpc_address)
        assert kv.lease != 0
        status, doc = http(node.http_address, "GET", "/info")
        assert (doc["node_id"], doc["cluster_id"]) == (node.tcp_address, CLUSTER)
        # the lease and the mirror's watch stream come up apart (the watch on a thread of
        # its own): a loaded machine showed the lease ok before the watch was created
        stats = await eventually(
            lambda: (s := cluster_stats(node))["lease_ok"] and s["etcd_connected"] and s)
        assert stats["node_id"] == node.tcp_address
        _, metrics = http(node.http_address, "GET", "/metrics")
        assert b"nsqd_cluster_lease_ok 1" in metrics and b"nsqd_cluster_etcd_connected 1" in metrics

        assert node.stop() == 0  # SIGTERM: the lease is revoked, the key goes at once
        assert (await meta.etcd.get(key))[0] is None

        node.start()
        await eventually(value, what="registration after restart")
        node.kill()
        killed = time.monotonic()
        await asyncio.sleep(0.3)
        assert await value() is not None  # a killed node's key waits for its lease...
        await eventually(lambda: _absent(value), timeout=4.0, what="expiry")
        print(f"\nkey gone {time.monotonic() - killed:.2f}s after kill -9 (TTL 2s)")
    finally:
        node.kill()


async def _absent(value) -> bool:
    return await value() is None


async def test_topic_in_etcd_is_served_by_its_leaders(tmp_path, etcd_server, meta):
    nodes = start_nodes(tmp_path, etcd_server, 3)
    try:
        ids = await live_nodes(meta, 3)
        created = time.monotonic()
        leaders = await create(meta, "orders", ids, 6)

        async def all_writable():
            for n, leader in leaders.items():
                try:
                    await pub(by_id(nodes)[leader], "orders", b"m%d" % n, n)
                except NSQError:
                    return False
            return True
        await eventually(all_writable, what="every leader writable")
        elapsed = time.monotonic() - created
        print(f"\ntopic created in etcd -> writable on every leader: {elapsed * 1000:.0f} ms")
        assert elapsed < 3.0  # target under 1 s; bounded loosely for a loaded machine

        for node in nodes:
            for n, leader in leaders.items():
                if leader == node.tcp_address:
                    assert await pub(node, "orders", b"x", n) == b"OK"
                else:
                    with pytest.raises(NSQError, match="E_FAILED_ON_NOT_LEADER"):
                        await pub(node, "orders", b"x", n)
            with pytest.raises(NSQError, match="E_BAD_PARTITION"):
                await pub(node, "orders", b"x", 6)
            stats = cluster_stats(node)
            assert stats["led"] == {"orders": sorted(n for n, l in leaders.items()
                                                     if l == node.tcp_address)}
    finally:
        for node in nodes:
            node.kill()


async def test_auto_create_and_cluster_wide_channels(tmp_path, etcd_server, meta):
    a, b = start_nodes(tmp_path, etcd_server, 2, "--default-partitions", "4")
    strict = NsqdProcess(str(tmp_path / "strict"), "--etcd-endpoints", etcd_server.endpoint,
                         "--cluster-id", CLUSTER, "--etcd-lease-ttl", "2s",
                         "--disable-auto-create").start()
    try:
        await live_nodes(meta, 3)
        assert await pub(a, "auto", b"hello") == b"OK"  # classic PUB: made in etcd, led here
        view = await meta.read()
        topic = view.topics["auto"]
        assert topic.meta.partitions == 4 and topic.meta.replicas == 1
        assert a.tcp_address in {s.leader for s in topic.partitions.values()}

        with pytest.raises(NSQError, match="E_TOPIC_NOT_EXIST"):
            await pub(strict, "nothere", b"x")
        assert "nothere" not in (await meta.read()).topics

        conn = await Connection("127.0.0.1", a.tcp_port).connect()
        await conn.command(c.cmd_sub("auto", "workers"))
        conn.rdy(10)
        msg = await asyncio.wait_for(conn.messages.get(), 5)
        assert msg.body == b"hello"
        assert "workers" in (await meta.read()).topics["auto"].channels
        leaders = {s.leader for s in (await meta.read()).topics["auto"].partitions.values()}
        for node in (a, b, strict):
            if node.tcp_address in leaders:
                await eventually(lambda: "workers" in channels_of(node, "auto"),
                                 what=f"channel on {node.tcp_address}")

        status, _ = http(a.http_address, "POST", "/channel/delete?topic=auto&channel=workers")
        assert status == 200
        assert "workers" not in (await meta.read()).topics["auto"].channels
        for node in (a, b, strict):
            await eventually(lambda: "workers" not in channels_of(node, "auto"),
                             what=f"channel deleted on {node.tcp_address}")
        await conn.close()

        assert http(b.http_address, "POST", "/topic/delete?topic=auto")[0] == 200
        for node in (a, b, strict):
            await eventually(lambda: http(node.http_address, "GET",
                                          "/stats?format=json&topic=auto")[1]["topics"] == [],
                             what=f"topic deleted on {node.tcp_address}")
    finally:
        for node in (a, b, strict):
            node.kill()


async def test_a_replicated_topic_made_by_a_publish_takes_that_publish(tmp_path, etcd_server,
                                                                      meta):
    """A classic PUB (TCP) or /pub of an unknown topic, R=3: made in etcd, then answered OK at
    once: the node waits for its led partitions' epochs before it publishes (it answered
    E_FAILED_ON_NOT_WRITABLE, HTTP 503, when the publish came before the epoch's CAS)."""
    nodes = start_nodes(tmp_path, etcd_server, 3, "--default-replicas", "3",
                        "--default-partitions", "2")
    try:
        await live_nodes(meta, 3)
        for i in range(6):
            assert await pub(nodes[i % 3], f"made{i}", b"hello") == b"OK"
            req = urllib.request.Request(
                f"http://{nodes[(i + 1) % 3].http_address}/pub?topic=web{i}", data=b"hello")
            with urllib.request.urlopen(req, timeout=10) as r:  # a 503 raises HTTPError
                assert (r.status, r.read()) == (200, b"OK")
        assert (await meta.read()).topics["made0"].meta.replicas == 3
    finally:
        for node in nodes:
            node.stop()


async def test_a_node_named_leader_takes_the_topics_operations_at_once(tmp_path, etcd_server,
                                                                       meta):
    """Right after a topic is made in etcd (as the master nsqlookupd makes it), its leader
    takes /channel/create and a SUB at once, though its view of etcd may not show the topic
    yet: it reads etcd and waits for its view (it answered 404 TOPIC_NOT_FOUND for up to a
    second)."""
    nodes = start_nodes(tmp_path, etcd_server, 1)
    try:
        [node] = await live_nodes(meta, 1)
        for i in range(8):
            await create(meta, f"fresh{i}", [node], 1)
            status, body = http(nodes[0].http_address, "POST",
                                f"/channel/create?topic=fresh{i}&channel=c")
            assert status == 200, (status, body)
        status, _ = http(nodes[0].http_address, "POST", "/channel/create?topic=never&channel=c")
        assert status == 404  # one etcd has not: still not found
    finally:
        nodes[0].stop()


async def test_etcd_away_while_running(tmp_path, etcd_server, meta):
    (node,) = start_nodes(tmp_path, etcd_server, 1)
    try:
        ids = await live_nodes(meta, 1)
        await create(meta, "steady", ids, 2)
        conn = await Connection("127.0.0.1", node.tcp_port).connect()
        await eventually(lambda: _pub_ok(conn, "steady", 1), what="steady served")

        etcd_server.kill()
        await eventually(lambda: not cluster_stats(node)["etcd_connected"], what="disconnect")
        deadline = time.monotonic() + 4.0
        sent = 0
        while time.monotonic() < deadline:  # etcd away: led partitions keep taking PUBs
            assert await conn.command(c.cmd_pub("steady", b"m%d" % sent, sent % 2)) == b"OK"
            sent += 1
            await asyncio.sleep(0.01)
        with pytest.raises(NSQError, match="E_TOPIC_NOT_EXIST.*cluster metadata unavailable"):
            await conn.pub("brandnew", b"x")  # auto-create needs etcd; not fatal
        assert await conn.command(c.cmd_pub("steady", b"after", 0)) == b"OK"
        sub = await Connection("127.0.0.1", node.tcp_port).connect()
        with pytest.raises(NSQError, match="E_SUB_FAILED.*cluster metadata unavailable"):
            await sub.command(c.cmd_sub("steady", "newchannel"))
        assert http(node.http_address, "GET", "/ping")[0] == 200

        etcd_server.start()
        await eventually(lambda: (s := cluster_stats(node))["etcd_connected"] and s["lease_ok"],
                         timeout=10, what="resync")
        await create(meta, "later", ids, 1)
        await eventually(lambda: _pub_ok(conn, "later", 0), what="new topic served")
        print(f"\n{sent} PUBs answered OK while etcd was down")
        await conn.close()
    finally:
        node.kill()


async def _pub_ok(conn: Connection, topic: str, partition: int) -> bool:
    try:
        return await conn.command(c.cmd_pub(topic, b"probe", partition)) == b"OK"
    except NSQError:
        return False


async def test_etcd_away_at_start_takes_publishes_once_etcd_answers(tmp_path, etcd_server,
                                                                     meta):
    """A node started while etcd is away leads nothing it cannot fence: in cluster mode every
    partition is a replicated log, a topic of one replica too, and a leadership starts
    with an epoch written in etcd. So a PUB is answered E_FAILED_ON_NOT_WRITABLE at once
    (not fatal, never left waiting); once etcd answers, the node takes its epochs and the
    publishes. (A topic of one replica used to serve its stored assignment without etcd,
    while it could never move; now it can, and a node started again after its partition
    moved away would take publishes into a log nobody reads.)"""
    (node,) = start_nodes(tmp_path, etcd_server, 1)
    try:
        ids = await live_nodes(meta, 1)
        await create(meta, "kept", ids, 3)
        conn = await Connection("127.0.0.1", node.tcp_port).connect()
        await eventually(lambda: _pub_ok(conn, "kept", 2), what="kept served")
        await conn.close()
        assert node.stop() == 0
        etcd_server.kill()

        node.start()  # etcd away: it starts, says so, leads nothing yet
        conn = await Connection("127.0.0.1", node.tcp_port).connect()
        for n in range(3):  # the first waits for the node's start grace (NSQD.serving)
            started = time.monotonic()
            with pytest.raises(NSQError, match="E_FAILED_ON_NOT_WRITABLE"):
                await conn.command(c.cmd_pub("kept", b"x", n))
            assert time.monotonic() - started < (START_GRACE_S + 1 if n == 0 else 1)
        await eventually(lambda: "cluster_etcd_unreachable" in node.log(), what="log line")
        assert not cluster_stats(node)["lease_ok"]

        etcd_server.start()
        await eventually(lambda: cluster_stats(node)["lease_ok"], timeout=10, what="registered")
        for n in range(3):
            await eventually(lambda n=n: _pub_ok(conn, "kept", n), timeout=10,
                             what=f"partition {n} led again")
        await conn.close()
    finally:
        node.kill()


async def test_malformed_keys_are_reported_not_fatal(tmp_path, etcd_server, meta):
    (node,) = start_nodes(tmp_path, etcd_server, 1)
    try:
        ids = await live_nodes(meta, 1)
        bad_meta = keys.topic_meta(CLUSTER, "broken")
        await meta.etcd.put(bad_meta, b"{not json")
        await meta.etcd.put(keys.partition_state(CLUSTER, "broken2", 0), b'{"leader": 7}')
        await meta.etcd.put(keys.node(CLUSTER, "10.9.9.9:4150"), b'{"id": "elsewhere"}')
        problems = await eventually(lambda: len(p := cluster_stats(node)["problems"]) >= 3 and p,
                                    what="problems reported")
        assert any(bad_meta in p for p in problems)
        _, metrics = http(node.http_address, "GET", "/metrics")
        assert b"nsqd_cluster_problems 3" in metrics
        assert "bad_metadata" in node.log()
        await create(meta, "fine", ids, 1)
        conn = await Connection("127.0.0.1", node.tcp_port).connect()
        await eventually(lambda: _pub_ok(conn, "fine", 0), what="a good topic beside bad keys")
        await conn.close()
        assert node.proc.poll() is None
    finally:
        node.kill()


def test_flags_refused(tmp_path):
    import subprocess
    import sys

    from servers import ROOT
    out = subprocess.run([sys.executable, "-m", "nsqd.main", "--etcd-endpoints",
                          "http://127.0.0.1:1", "--lookupd-tcp-address", "127.0.0.1:4160"],
                         capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "cannot be used together" in out.stderr
    out = subprocess.run([sys.executable, "-m", "nsqd.main", "--etcd-endpoints",
                          "http://127.0.0.1:1", "--rack", "r" * 256],
                         capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert out.returncode == 2 and "--rack: at most 255" in out.stderr
