"""The cluster end to end, all real processes (tests/cluster.py): etcd, two nsqlookupds,
three nsqds in cluster mode.

- topics of 1, 4 and 16 partitions: every partition has exactly one leader, leaders are
  spread evenly (placement counts existing load: over all topics, per node within 1), the nodes agree with /lookup about what they lead,
  and a partition takes PUB on its leader only (E_FAILED_ON_NOT_LEADER elsewhere);
- kill -9 of an nsqd: its partitions (R=1: no other ISR member) are leaderless on every
  nsqlookupd within the lease TTL, and the other leaders keep taking PUBs; restarted, the
  node is their only ISR member and the master elects it again (epoch + 1 at each step);
- a node restarted after its topic was deleted in etcd takes no publish for it before its
  first view of etcd is applied.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from cluster import LEASE_TTL_S, Cluster, http_json, pub, wait_until
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c


@pytest.fixture
def cluster(tmp_path):
    cl = Cluster(str(tmp_path)).start()
    yield cl
    cl.stop()


async def pub_or_error(address: str, partition: int, body: bytes = b"back",
                       topic: str = "orders") -> bytes | None:
    try:
        return await pub(address, topic, partition, body)
    except (NSQError, OSError):
        return None


def led_by_node(cl: Cluster, topic: str) -> dict[str, list[int]]:
    """What each nsqd says it leads of `topic` (/stats cluster.led)."""
    out = {}
    for n in cl.nsqds:
        status, stats = http_json("GET", f"http://{n.http_address}/stats?format=json")
        assert status == 200
        out[n.tcp_address] = stats["cluster"]["led"].get(topic, [])
    return out


async def test_partitions_have_one_leader_each_spread_evenly(cluster):
    total = Counter()
    for topic, n in (("t1", 1), ("t4", 4), ("t16", 16)):
        status, body = cluster.create_topic(topic, n)
        assert status == 200, body
        leaders = wait_until(lambda: len(cluster.leaders(topic)) == n and cluster.leaders(topic),
                             5, f"{topic}: every partition with a leader")
        for i in range(len(cluster.lookupds)):  # every lookupd gives the same answer
            status, answer = cluster.lookupd_get(f"/lookup?topic={topic}", i)
            assert status == 200 and answer["meta"]["partition_num"] == n
            assert {int(k): f"127.0.0.1:{v['tcp_port']}" for k, v in
                    answer["partitions"].items()} == leaders
        # placement counts what the nodes already lead: over every topic so far, the
        # nodes lead within 1 of each other
        total.update(leaders.values())
        counts = [total.get(node.tcp_address, 0) for node in cluster.nsqds]
        assert max(counts) - min(counts) <= 1, (topic, counts)
        # the nodes lead exactly what the lookupds say (once their view has the topic)
        expected = {node.tcp_address: sorted(p for p, a in leaders.items()
                                             if a == node.tcp_address) for node in cluster.nsqds}
        wait_until(lambda: led_by_node(cluster, topic) == expected, 5,
                   f"{topic}: the nodes lead what /lookup says")
        for partition, leader in leaders.items():
            assert await pub(leader, topic, partition, b"x") == b"OK"
            other = next(node.tcp_address for node in cluster.nsqds
                         if node.tcp_address != leader)
            with pytest.raises(NSQError, match="E_FAILED_ON_NOT_LEADER"):
                await pub(other, topic, partition, b"x")


async def test_a_killed_nsqd_leaves_its_partitions_leaderless_and_the_others_serve(cluster):
    status, body = cluster.create_topic("orders", 6)
    assert status == 200, body
    leaders = wait_until(lambda: len(cluster.leaders("orders")) == 6 and
                         cluster.leaders("orders"), 5, "every partition with a leader")
    victim = cluster.nsqds[0]
    lost = sorted(p for p, a in leaders.items() if a == victim.tcp_address)
    kept = {p: a for p, a in leaders.items() if a != victim.tcp_address}
    assert lost and kept
    victim.kill()
    killed_at = time.monotonic()
    for i in range(len(cluster.lookupds)):
        wait_until(lambda: sorted(set(range(6)) - {
            int(k) for k in cluster.lookupd_get("/lookup?topic=orders", i)[1]
            .get("partitions", {})}) == lost, LEASE_TTL_S + 2,
            f"lookupd {i}: the killed node's partitions leaderless")
    took = time.monotonic() - killed_at
    print(f"partitions of a killed nsqd leaderless after {took:.2f} s (TTL {LEASE_TTL_S} s)")
    status, info = cluster.lookupd_get("/info")
    assert sorted(info["cluster"]["leaderless"]) == sorted(f"orders:{p}" for p in lost)
    for partition, leader in kept.items():
        assert await pub(leader, "orders", partition, b"still here") == b"OK"
    victim.start()  # the ISR member is back: elected again
    restarted_at = time.monotonic()
    wait_until(lambda: cluster.leaders("orders") == leaders, 10, "the victim leads again")
    took = time.monotonic() - restarted_at
    print(f"restarted nsqd leads its partitions again after {took:.2f} s")
    for partition in lost:
        deadline = time.monotonic() + 5
        while (reply := await pub_or_error(victim.tcp_address, partition)) != b"OK" \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert reply == b"OK"
    assert cluster.lookupd_get("/info")[1]["cluster"]["leaderless"] == []


async def test_a_restarted_node_takes_no_publish_for_a_topic_deleted_while_it_was_down(cluster):
    """A node leads a topic (R=1), is killed, and the topic is deleted in etcd. A producer
    publishes to the node from the moment its port accepts again. Before its first view of
    etcd was applied, it served the assignment it had stored: 3 PUBs in about 10 ms were
    acknowledged into a topic etcd no longer has, and closed with it (no consumer could
    ever get them). Publishes now wait for that first view (NSQD.serving) and are refused."""
    cl = cluster
    status, body = cl.create_topic("gone", 1)
    assert status == 200, body
    node = cl.nsqd_at(wait_until(lambda: cl.leaders("gone").get(0), 10, "a leader"))
    host, port = node.tcp_address.rsplit(":", 1)
    for _ in range(100):  # the leader takes the partition over
        if await pub_or_error(node.tcp_address, 0, b"before", "gone") == b"OK":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the leader never took a PUB")
    node.kill()
    status, body = http_json("POST", f"http://{cl.lookupds[0].http_address}/topic/delete"
                                     "?topic=gone")
    assert status == 200, body

    acked: list[bytes] = []

    async def publish_from_the_first_moment(until: float) -> None:
        i = 0
        while time.monotonic() < until:
            try:
                conn = await Connection(host, int(port)).connect()
            except OSError:
                await asyncio.sleep(0.002)
                continue
            try:
                while time.monotonic() < until:
                    body = b"after-%d" % i
                    i += 1
                    try:
                        if await conn.command(c.cmd_pub("gone", body)) == b"OK":
                            acked.append(body)
                    except NSQError:
                        await asyncio.sleep(0.01)
            except ConnectionError:
                pass
            finally:
                await conn.close()

    publisher = asyncio.create_task(publish_from_the_first_moment(time.monotonic() + 6))
    await asyncio.to_thread(node.start)
    await publisher
    assert cl.lookup("gone") == {}  # still deleted: nothing made it again
    assert acked == [], f"acknowledged into a deleted topic: {acked[:5]}"
