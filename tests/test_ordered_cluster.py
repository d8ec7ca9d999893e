"""Ordered consumption in an R=3 cluster (tests/cluster.py: etcd, an nsqlookupd, three
nsqds), all real processes: keyed producers write per-key sequence numbers through the
partition-aware client to an ordered topic, an ordered consumer (SUB_ORDERED, one handler
call a partition at a time) checks them (tests/ordercheck.py), while the leader of a
partition is killed with SIGKILL, the consumer is restarted, and the killed node comes
back. Afterwards every key's numbers arrived strictly in order once duplicates are dropped,
with no gap: 0 reorderings, 0 gaps."""

from __future__ import annotations

import asyncio
import time


from cluster import LEASE_TTL_S, Cluster
from nsqclient.conn import Connection, NSQError
from nsqclient.consumer import Consumer
from nsqclient.producer import Producer
from nsqwire import commands as c
from ordercheck import OrderCheck, body
from test_replication import cluster  # noqa: F401  (a fixture: 3 nsqds, SIGCONT before stop)

SLACK_S = 4
KEYS = 12


def make_ordered_topic(cl: Cluster, topic: str, partitions: int) -> None:
    status, answer = cl.create_topic(topic, partitions, replicas=3, orderedmulti="true")
    assert status == 200, answer


class KeyedSequences:
    """One task per key publishing key:0, key:1, ... through the partition-aware Producer;
    a number is retried until acknowledged (a retry may duplicate it, never skip it)."""

    def __init__(self, cl: Cluster, topic: str):
        self.sent = {f"key{k}": 0 for k in range(KEYS)}  # key -> numbers acknowledged
        self.failures = 0
        self._stop = asyncio.Event()
        self._producer = Producer([cl.lookupds[0].http_address], max_retry_time=10.0)
        self._tasks = [asyncio.create_task(self._run(topic, key)) for key in self.sent]

    async def _run(self, topic: str, key: str) -> None:
        while not self._stop.is_set():
            try:
                await self._producer.publish(topic, body(key, self.sent[key]), key=key)
                self.sent[key] += 1
            except Exception:
                self.failures += 1
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._producer.close()


async def test_no_reorder_no_gap_across_leader_kill_and_consumer_restart(cluster):  # noqa: F811
    cl = cluster
    make_ordered_topic(cl, "ord", 2)
    await cl.until_states("ord", lambda s: all(len(p.isr) == 3 for p in s.values()), 15,
                          "every partition with 3 in sync")
    assert cl.lookup("ord")["meta"]["ordered"] is True
    check = OrderCheck()
    handled = []

    async def handler(m) -> None:
        check.observe_body(m.body)
        handled.append(time.monotonic())

    def consumer() -> Consumer:
        return Consumer("ord", "audit", [cl.lookupds[0].http_address], handler,
                        max_in_flight=32, lookup_interval=0.5, ordered=True)

    con = await consumer().start()
    load = KeyedSequences(cl, "ord")
    await asyncio.sleep(3)
    before = await cl.states("ord")
    victim = cl.nsqd_at(before[0].leader)
    victim.kill()
    await cl.until_states("ord", lambda s: s[0].leader not in (None, before[0].leader),
                          LEASE_TTL_S + 1 + SLACK_S, "partition 0 has a new leader")
    await asyncio.sleep(2)
    await con.close()  # a consumer restart: what it had out comes back to the next one
    con = await consumer().start()
    await asyncio.sleep(1)
    victim.start()
    await cl.until_states("ord", lambda s: all(len(p.isr) == 3 for p in s.values()), 30,
                          "the restarted node back in every ISR")
    now = await cl.states("ord")
    second = cl.nsqd_at(now[1].leader)  # the other partition's leader too
    second.kill()
    await cl.until_states("ord", lambda s: s[1].leader not in (None, now[1].leader),
                          LEASE_TTL_S + 1 + SLACK_S, "partition 1 has a new leader")
    await asyncio.sleep(2)
    await load.stop()
    sent = dict(load.sent)
    deadline = time.monotonic() + 60
    while (any(check.top.get(k, -1) < n - 1 for k, n in sent.items())
           and time.monotonic() < deadline):
        await asyncio.sleep(0.2)
    await con.close()
    second.start()
    check.finish(sent)
    report = check.report()
    print(f"sent {sum(sent.values())} over {KEYS} keys ({load.failures} publish calls "
          f"retried), {report}")
    assert sum(sent.values()) > 100, sent
    assert report["reorders"] == 0 and report["gaps"] == 0, report


async def test_a_new_leader_starts_exactly_after_the_last_fin(cluster):  # noqa: F811
    """The FIN of an ordered channel is in the ISR before the next message goes out: kill -9
    the leader the moment message 50 arrives (49 finished just before) and the new leader's
    first delivery is message 50, not an earlier one (the 200 ms checkpoint timer alone
    would leave followers behind)."""
    cl = cluster
    make_ordered_topic(cl, "exact", 1)
    s = await cl.until_states("exact", lambda s: len(s[0].isr) == 3, 15, "3 in sync")
    leader = s[0].leader
    host, port = leader.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:  # the leader's view may lag the state just read (as a client, retried)
        pub = await Connection(host, int(port)).connect()
        try:
            await pub.command(c.cmd_mpub("exact", [body("k", i) for i in range(100)], 0))
            break
        except NSQError as e:
            assert "E_FAILED_ON_NOT_" in str(e) and time.monotonic() < deadline, e
            await asyncio.sleep(0.1)
        finally:
            await pub.close()
    con = await Connection(host, int(port)).connect()
    await con.command(c.cmd_sub_ordered("exact", "c", 0))
    con.rdy(10)
    for i in range(50):
        m = await asyncio.wait_for(con.messages.get(), 10)
        assert m.body == body("k", i)
        m.fin()
    m = await asyncio.wait_for(con.messages.get(), 10)
    assert m.body == body("k", 50)
    cl.nsqd_at(leader).kill()
    await con.close()
    new = await cl.until_states("exact", lambda s: s[0].leader not in (None, leader),
                                LEASE_TTL_S + 1 + SLACK_S, "a new leader")
    host, port = new[0].leader.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            con = await Connection(host, int(port)).connect()
            await con.command(c.cmd_sub_ordered("exact", "c", 0))
            break
        except NSQError:  # still taking the partition over
            await con.close()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    con.rdy(10)
    first = await asyncio.wait_for(con.messages.get(), 10)
    await con.close()
    assert first.body == body("k", 50)
