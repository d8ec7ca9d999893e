"""Unchanged classic consumers on a real cluster: etcd, two nsqlookupds and three nsqds in
cluster mode (tests/cluster.py). A 6-partition topic is led by all three nodes; the
cluster `/lookup` (classic keys plus `partitions` and `meta`) sends pynsq, gnsq and nsqjs
to every leader, and a classic `SUB topic channel` there receives from every partition
the node leads: each client gets every message exactly once."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from cluster import Cluster, http_json
from compat_util import JS_DIR, PYTHON, run_process, unique
from nsqclient.conn import Connection
from nsqwire import commands as c
from test_compat_lookupd import GNSQ_CONSUMER, NSQJS_CONSUMER

PARTITIONS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = Cluster(str(tmp_path_factory.mktemp("compat_cluster"))).start()
    yield cl
    cl.stop()


async def publish_everywhere(cl: Cluster, topic: str, per_partition: int) -> set[str]:
    """Create the topic on the master, publish `per_partition` messages to each partition
    on its leader (PUB topic n), and return the bodies."""
    status, body = cl.create_topic(topic, PARTITIONS)
    assert status == 200, body
    leaders = cl.leaders(topic)
    assert sorted(leaders) == list(range(PARTITIONS))
    assert set(leaders.values()) == {n.tcp_address for n in cl.nsqds}
    bodies = set()
    for n, address in leaders.items():
        host, port = address.rsplit(":", 1)
        conn = await Connection(host, int(port)).connect()
        try:
            for i in range(per_partition):
                msg = f"p{n}-m{i}"
                await conn.command(c.cmd_pub(topic, msg.encode(), partition=n))
                bodies.add(msg)
        finally:
            await conn.close()
    return bodies


def check(result, bodies, cl: Cluster):
    assert sorted(result["received"]) == sorted(bodies)
    assert set(result["connected"]) == {n.tcp_address for n in cl.nsqds}


async def test_pynsq_reader_consumes_every_partition_of_a_cluster(cluster):
    import nsq

    topic = unique("cl_pynsq")
    bodies = await publish_everywhere(cluster, topic, 3)
    received = []

    def handler(m):
        received.append(m.body.decode())
        return True

    r = nsq.Reader(topic=topic, channel="ch", message_handler=handler,
                   lookupd_http_addresses=[f"http://{p.http_address}" for p in cluster.lookupds],
                   lookupd_poll_interval=1, max_in_flight=10)
    try:
        for _ in range(300):
            if len(received) >= len(bodies):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # nothing more may come (exactly once)
        assert sorted(received) == sorted(bodies)
        assert {f"{c.host}:{c.port}" for c in r.conns.values()} == {
            n.tcp_address for n in cluster.nsqds}
    finally:
        r.query_periodic.stop()
        r.redist_periodic.stop()
        for conn in list(r.conns.values()):
            conn.close()


async def test_gnsq_consumer_consumes_every_partition_of_a_cluster(cluster):
    topic = unique("cl_gnsq")
    bodies = await publish_everywhere(cluster, topic, 3)
    result = await run_process([PYTHON, "-c", GNSQ_CONSUMER],
                               {"topic": topic, "channel": "ch", "count": len(bodies),
                                "lookupd": cluster.lookupds[1].http_address, "wait": 20},
                               timeout=40)
    check(result, bodies, cluster)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
async def test_nsqjs_reader_consumes_every_partition_of_a_cluster(cluster):
    topic = unique("cl_nsqjs")
    bodies = await publish_everywhere(cluster, topic, 3)
    result = await run_process([shutil.which("node"), "-e", NSQJS_CONSUMER],
                               {"topic": topic, "channel": "ch", "count": len(bodies),
                                "lookupd": cluster.lookupds[0].http_address, "wait": 20},
                               timeout=40, cwd=JS_DIR)
    check(result, bodies, cluster)


def test_a_lookup_of_an_unknown_topic_is_classic_404(cluster):
    assert http_json("GET", f"http://{cluster.lookupds[0].http_address}/lookup?topic=nope") \
        == (404, {"message": "TOPIC_NOT_FOUND"})
