"""Failover by the nsqlookupd master, as real processes against a real etcd (lease TTL 2 s).

Two nsqlookupd processes share one etcd. The nodes are child processes
(tests/isr_holder.py `lead`) that hold a node's registration and the leader keys of the
partitions they lead under a real lease, as an nsqd does: SIGKILL of one is a node's death,
and its lease expires at most TTL after its last refresh."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from cluster import http_json, wait_until
from etcdserver import EtcdProcess
from isr import keys
from isr.etcd import Etcd
from isr.metadata import Metadata, build_view
from isr.state import NodeInfo, PartitionState, TopicMeta
from nsqlookupd.failover import Failover
from servers import ROOT, NsqlookupdProcess

HOLDER = os.path.join(ROOT, "tests", "isr_holder.py")
TTL = 2
CLUSTER = "nsq"


class Node:
    """A simulated nsqd: its registration and the leader keys of `leads` (topic, n)."""

    def __init__(self, etcd: EtcdProcess, port: int, leads=()):
        self.etcd = etcd
        self.id = f"127.0.0.1:{port}"
        self.info = NodeInfo(id=self.id, tcp=self.id, http=f"127.0.0.1:{port + 1}",
                             rpc=f"127.0.0.1:{port + 2}", hostname=f"node{port}",
                             version="1.3.0")
        self.leads = leads
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, HOLDER, "lead", self.etcd.endpoint, CLUSTER,
             self.info.encode().decode(), str(TTL), ",".join(f"{t}:{n}" for t, n in self.leads)],
            stdout=subprocess.PIPE, cwd=ROOT)
        assert self.proc.stdout.readline() == b"ready\n"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def etcd_call(etcd: EtcdProcess, fn):
    async def run():
        client = Etcd(etcd.endpoint, timeout=2)
        try:
            return await fn(Metadata(client, CLUSTER))
        finally:
            await client.close()
    return asyncio.run(run())


def create_topic(etcd: EtcdProcess, topic: str, placement: list[list[str]]) -> None:
    meta = TopicMeta(partitions=len(placement), replicas=len(placement[0]), min_isr=1)
    etcd_call(etcd, lambda md: md.create_topic(topic, meta, placement))


def state(etcd: EtcdProcess, topic: str, n: int = 0) -> PartitionState:
    return etcd_call(etcd, lambda md: md.read_partition(topic, n))


def info(lookupd) -> dict:
    return http_json("GET", f"http://{lookupd.http_address}/info")[1]["cluster"]


def master_of(lookupds):
    for lk in lookupds:
        if lk.proc.poll() is None and info(lk)["is_master"]:
            return lk, [o for o in lookupds if o is not lk]
    raise AssertionError("no master")


@pytest.fixture(scope="module")
def cluster(module_dir):
    base = str(module_dir)
    etcd = EtcdProcess(os.path.join(base, "etcd")).start()
    lookupds = [NsqlookupdProcess(base, "--etcd-endpoints", etcd.endpoint, "--cluster-id",
                                  CLUSTER, "--etcd-lease-ttl", f"{TTL}s", "--log-format",
                                  "json").start() for _ in range(2)]
    nodes: list[Node] = []
    try:
        wait_until(lambda: sum(info(lk)["is_master"] for lk in lookupds) == 1, 10, "a master")
        yield etcd, lookupds, nodes
    finally:
        for p in (*lookupds, *nodes):
            p.kill()
        etcd.kill()


def test_a_killed_leader_is_replaced_within_ttl_plus_1s(cluster):
    etcd, lookupds, nodes = cluster
    a = Node(etcd, 45000, leads=[("f", 0)])
    b = Node(etcd, 45010, leads=[("f", 1)])
    nodes += [a, b]
    create_topic(etcd, "f", [[a.id, b.id], [b.id, a.id]])
    master, _ = master_of(lookupds)
    before = info(master)["elections"]
    time.sleep(TTL + 1.2)  # both hold their keys: nothing moves
    assert state(etcd, "f", 0) == PartitionState(a.id, (a.id, b.id), (), 1)
    a.kill()
    killed = time.monotonic()
    wait_until(lambda: state(etcd, "f", 0).leader == b.id, TTL + 3, "f:0 led by b")
    took = time.monotonic() - killed
    assert took <= TTL + 1, took
    assert state(etcd, "f", 0) == PartitionState(b.id, (a.id, b.id), (), 2)  # ISR as it was
    assert state(etcd, "f", 1) == PartitionState(b.id, (b.id, a.id), (), 1)  # untouched
    for lk in lookupds:
        wait_until(lambda: http_json("GET", f"http://{lk.http_address}/lookup?topic=f")[1]
                   ["partitions"]["0"]["remote_address"] == b.id, 2, "/lookup shows b")
        assert not [x for x in info(lk)["leaderless"] if x.startswith("f:")]
    assert info(master)["elections"] == before + 1
    print(f"leader SIGKILLed -> new leader (epoch 2) in etcd after {took:.2f} s (TTL {TTL} s)")
    b.kill()


def test_a_live_leader_without_its_key_loses_the_partition_after_the_ttl(cluster):
    """c is registered but never holds k:0's key (it is not serving it): after the TTL the
    other ISR member d leads it; d's own partition, whose key it holds, stays with d."""
    etcd, _, nodes = cluster
    c = Node(etcd, 45100)
    d = Node(etcd, 45110, leads=[("k2", 0)])
    nodes += [c, d]
    create_topic(etcd, "k", [[c.id, d.id]])
    create_topic(etcd, "k2", [[d.id, c.id]])
    created = time.monotonic()
    wait_until(lambda: state(etcd, "k").leader == d.id, TTL + 3, "k:0 led by d")
    took = time.monotonic() - created
    assert TTL < took <= TTL + 3, took  # after the TTL, within a second or so (3: a loaded machine)
    assert state(etcd, "k").epoch == 2
    assert state(etcd, "k2") == PartitionState(d.id, (d.id, c.id), (), 1)
    print(f"leader without its key -> new leader after {took:.2f} s (TTL {TTL} s)")
    c.kill()
    d.kill()


def test_no_live_isr_member_stays_leaderless_until_one_is_back(cluster):
    etcd, lookupds, nodes = cluster
    e = Node(etcd, 45200, leads=[("solo", 0)])
    other = Node(etcd, 45210)  # live, but not in the ISR: never elected
    nodes += [e, other]
    create_topic(etcd, "solo", [[e.id]])
    e.kill()
    wait_until(lambda: state(etcd, "solo").leader is None, TTL + 3, "solo:0 leaderless")
    assert state(etcd, "solo") == PartitionState(None, (e.id,), (), 2)  # old leader fenced
    for lk in lookupds:
        wait_until(lambda: "solo:0" in info(lk)["leaderless"], 2, "listed leaderless")
    time.sleep(1.5)  # still nobody: nothing is written again
    assert state(etcd, "solo").epoch == 2
    e.start()  # the ISR member is back
    wait_until(lambda: state(etcd, "solo").leader == e.id, 3, "solo:0 led by e again")
    assert state(etcd, "solo").epoch == 3
    for lk in lookupds:
        wait_until(lambda: "solo:0" not in info(lk)["leaderless"], 2, "not leaderless")
    e.kill()
    other.kill()


def test_master_takeover_still_fails_over(cluster):
    """The master lookupd and a leader are SIGKILLed together: the other lookupd becomes
    master and moves the partition."""
    etcd, lookupds, nodes = cluster
    g = Node(etcd, 45300, leads=[("m", 0)])
    h = Node(etcd, 45310, leads=[("m", 1)])
    nodes += [g, h]
    create_topic(etcd, "m", [[g.id, h.id], [h.id, g.id]])
    time.sleep(0.5)
    master, (survivor,) = master_of(lookupds)
    master.kill()
    g.kill()
    killed = time.monotonic()
    wait_until(lambda: state(etcd, "m", 0).leader == h.id, 2 * TTL + 3, "m:0 led by h")
    took = time.monotonic() - killed
    assert info(survivor)["is_master"]
    assert state(etcd, "m", 0).epoch == 2
    assert took <= TTL + 1.5, took  # both leases run out at once
    print(f"master and leader SIGKILLed -> new leader after {took:.2f} s (TTL {TTL} s)")
    master.start()
    h.kill()


async def test_a_conflict_reads_again_and_decides_again(etcd_server):
    """The driver on a stale view: the batch's CAS loses, each partition is written on its
    own, and the changed one is read again and decided on again; a lookupd that is not
    master writes nothing; 150 moves of one topic go in two transactions."""
    client = Etcd(etcd_server.endpoint, timeout=2)
    md = Metadata(client, CLUSTER)
    try:
        x, y, z = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
        await md.create_topic("c", TopicMeta(partitions=3, replicas=2, min_isr=1), [[x, y]] * 3)
        await md.create_topic("big", TopicMeta(partitions=150, replicas=2, min_isr=1),
                              [[x, z]] * 150)
        for n in (y, z):
            await client.put(keys.node(CLUSTER, n), NodeInfo(
                id=n, tcp=n, http=n, rpc=n, hostname="h", version="1").encode())
        kvs, rev = await client.get_prefix(keys.cluster_prefix(CLUSTER))
        stale = build_view(CLUSTER, kvs, rev)  # x (not live) leads, ISR [x, y]
        # meanwhile the leader of c:0 moved y out and z in (epoch 2)
        s = await md.read_partition("c", 0)
        await md.update_partition("c", 0, s.evolve(isr=(x, z), epoch=2))

        master = [False]
        failover = Failover(md, TTL, lambda: stale, lambda: master[0])
        await failover.run_once(stale, 0.0)  # not master: nothing written
        assert (await md.read_partition("c", 1)).epoch == 1 and failover.elections == 0
        master[0] = True
        await failover.run_once(stale, 0.0)
        states = [await md.read_partition("c", n) for n in range(3)]
        assert (states[0].leader, states[0].isr, states[0].epoch) == (z, (x, z), 3)
        assert [(s.leader, s.epoch) for s in states[1:]] == [(y, 2), (y, 2)]
        big = {(await md.read_partition("big", n)).revision for n in range(150)}
        assert len(big) == 2  # two transactions (100 + 50)
        assert failover.elections == 153
        await failover.run_once(stale, 0.0)  # the view does not show them yet: not again
        assert (await md.read_partition("c", 0)).epoch == 3 and failover.elections == 153
    finally:
        await client.close()
