"""The partition-aware client against the real cluster (tests/cluster.py: etcd, two
nsqlookupds, three nsqds in cluster mode), found through the lookupds' /lookup only."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from cluster import Cluster, wait_until
from nodes import until
from nsqclient.consumer import Consumer
from nsqwire.partitioning import partition_of
from nsqclient.producer import Producer
from nsqwire.ids import decode_msg_id, msg_id_partition
from servers import free_port

N = 6


@pytest.fixture
def cluster(tmp_path):
    cl = Cluster(str(tmp_path)).start()
    yield cl
    cl.stop()


async def test_keys_routed_and_consumed_through_the_cluster(cluster):
    status, body = await asyncio.to_thread(cluster.create_topic, "orders", N)
    assert status == 200, body
    leaders = await asyncio.to_thread(
        wait_until, lambda: len(cluster.leaders("orders")) == N and cluster.leaders("orders"),
        5, "every partition led")
    assert len(set(leaders.values())) == 3  # spread over the three nsqds
    lookupds = [f"127.0.0.1:{free_port()}"] + [p.http_address for p in cluster.lookupds]

    got = []
    consumer = await Consumer("orders", "audit", lookupds, handler=got.append,
                              max_in_flight=12, backoff=0.05).start()
    await until(lambda: len(consumer.subscriptions) == N, 10)
    producer = Producer(lookupds)
    keys = [f"customer-{i}" for i in range(60)]
    await asyncio.gather(*(producer.publish("orders", f"{k}|{j}".encode(), key=k)
                           for k in keys for j in range(5)))
    await producer.publish_many("orders", [b"customer-1|m0", b"customer-1|m1"], key="customer-1")
    total = len(keys) * 5 + 2
    await until(lambda: len(got) >= total, 15)

    by_partition = Counter()
    for m in got:
        key = m.body.split(b"|")[0]
        n = msg_id_partition(decode_msg_id(m.id))
        assert n == partition_of(key, N), m.body
        assert f"{m.conn.host}:{m.conn.port}" == leaders[n]  # served by its leader
        by_partition[n] += 1
    assert len(got) == len({m.body for m in got}) == total  # each once, nothing else
    assert set(by_partition) == set(range(N))
    assert len(producer._conns) == 3  # one connection per leader node
    await producer.close()
    await consumer.close()
