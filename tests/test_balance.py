"""Load balancing on real processes (tests/cluster.py: etcd, one nsqlookupd, 3 nsqds, lease
TTL 2 s), one cluster for the module:

- load reports reach the master's /cluster/stats (rates of the partitions published to);
- refusals of bad moves (unknown topic or partition, a target down or outside the ISR, a
  balancer step outside --balance-window): 4xx JSON, nothing moved;
- a topic of one replica moved to another node under traffic, nothing lost;
- leader transfers under keyed publishing and consuming: each partition unavailable < 2 s
  per move, >= 99% of publishes succeed, every acknowledged message consumed;
- a transfer interrupted by kill -9 of the target or of the old leader ends with exactly
  one leader, which serves;
- a node drained under traffic (publishing and consuming) holds nothing afterwards
  (removable), a fourth node added taking its share; a node killed, then drained, too;
- with the window open (the lookupd restarted), the balancer evens a fully skewed topic
  and refills the drained node, under publishing and consuming, nothing acknowledged lost;
- (a cluster of its own, nsqlookupd's defaults) leaders piled on the first node up after a
  full restart are even again within 60 s, under publishing, nothing lost.

The module's cluster runs with `--leader-balance off` (tests/cluster.py), so the leaders
its tests move stay where they put them.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from cluster import LEASE_TTL_S, Cluster, http_json
from isr import keys
from isr.etcd import Etcd
from isr.metadata import Metadata
from nsqclient.consumer import Consumer
from nsqwire.partitioning import partition_of
from nsqclient.producer import Producer
from servers import NsqdProcess, free_port

SLACK_S = 4  # this 2-core machine runs etcd, a lookupd, three nsqds and the test at once


def closed_window() -> str:
    """A one-minute window twelve hours from now (local time): the balancer stays idle."""
    t = time.localtime()
    start = (t.tm_hour * 60 + t.tm_min + 720) % 1440
    start = min(start, 1438)
    return f"{start // 60:02d}:{start % 60:02d}-{(start + 1) // 60:02d}:{(start + 1) % 60:02d}"


@pytest.fixture(scope="module")
def cl(module_dir):
    c = Cluster(str(module_dir), 3, 1)
    c.lookupds[0].extra += ["--balance-window", closed_window(), "--balance-interval", "200ms"]
    c.start()
    yield c
    c.stop()


def lookupd(cl: Cluster) -> str:
    return f"http://{cl.lookupds[0].http_address}"


def post(cl: Cluster, path: str) -> tuple[int, dict]:
    return http_json("POST", lookupd(cl) + path)


def stats(cl: Cluster) -> dict:
    return http_json("GET", lookupd(cl) + "/cluster/stats?topn=5")[1]


def node_led(cl: Cluster, node, topic: str) -> set[int]:
    status, body = http_json("GET", f"http://{node.http_address}/stats?format=json")
    return set(body.get("cluster", {}).get("led", {}).get(topic, [])) if status == 200 else set()


def make_topic(cl: Cluster, topic: str, partitions: int, replicas: int) -> None:
    status, body = cl.create_topic(topic, partitions, replicas=replicas)
    assert status == 200, body


async def settled(cl: Cluster, topic: str, timeout: float = 15):
    """States once every partition has a live leader holding its leader key, ISR full."""
    deadline = time.monotonic() + timeout
    while True:
        etcd = Etcd(cl.etcd.endpoint)
        try:
            view = await Metadata(etcd, "test").read()
        finally:
            await etcd.close()
        tv = view.topics.get(topic)
        if tv is not None and all(s.leader in view.nodes and tv.leader_locks.get(n) == s.leader
                                  and len(s.isr) >= tv.meta.replicas
                                  and (s.epoch > 1 or tv.meta.replicas == 1)  # its own epoch
                                  for n, s in tv.partitions.items()):
            return dict(tv.partitions)
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {topic} settled; {tv}")
        await asyncio.sleep(0.05)


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.1)


class Load:
    """8 keyed publishers through the partition-aware client (each publish retried within
    10 s): acknowledged bodies, failures, and per partition the times of its acks."""

    def __init__(self, cl: Cluster, topic: str, partitions: int, keys_n: int = 32):
        self.topic = topic
        self.acked: set[bytes] = set()
        self.failed = 0
        self.acks: dict[int, list[float]] = {n: [] for n in range(partitions)}
        self._stop = asyncio.Event()
        self._producer = Producer([cl.lookupds[0].http_address], max_retry_time=10.0)
        self._keys = [(f"k{i}", partition_of(f"k{i}".encode(), partitions)) for i in range(keys_n)]
        self._workers = [asyncio.create_task(self._run(w)) for w in range(8)]

    async def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            key, n = self._keys[(worker * 7 + i) % len(self._keys)]
            body = f"{worker}-{i}".encode()
            try:
                await self._producer.publish(self.topic, body, key=key)
                self.acked.add(body)
                self.acks[n].append(time.monotonic())
            except Exception:
                self.failed += 1
            i += 1
            await asyncio.sleep(0.002)

    def gap(self, partition: int, start: float, end: float) -> float:
        """The longest time without an ack of `partition` within [start, end]."""
        times = [start] + [t for t in self.acks[partition] if start < t < end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))

    async def read(self, cl: Cluster) -> "Load":
        """Consume the topic all along (channel "check"): what came is `seen`."""
        self.seen: set[bytes] = set()

        async def handler(m) -> None:
            self.seen.add(m.body)
        self.consumer = await Consumer(self.topic, "check", [cl.lookupds[0].http_address],
                                       handler, max_in_flight=200, lookup_interval=0.5).start()
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._workers)
        await self._producer.close()

    def check_success(self) -> None:
        total = len(self.acked) + self.failed
        assert total > 100 and len(self.acked) >= 0.99 * total, (len(self.acked), self.failed)


async def consume_all(cl: Cluster, topic: str, expected: set[bytes], timeout: float) -> set[bytes]:
    seen: set[bytes] = set()
    done = asyncio.Event()

    async def handler(m) -> None:
        seen.add(m.body)
        if expected <= seen:
            done.set()

    consumer = await Consumer(topic, "check", [cl.lookupds[0].http_address], handler,
                              max_in_flight=200, lookup_interval=0.5).start()
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        await consumer.close()
    return seen


async def check_nothing_lost(cl: Cluster, load: Load) -> None:
    """Every acknowledged message consumed: by the consumer that ran all along, if any."""
    if getattr(load, "consumer", None) is not None:
        try:
            await until(lambda: load.acked <= load.seen, 30, "every acked message consumed")
        except AssertionError:
            pass
        finally:
            await load.consumer.close()
        seen = load.seen
    else:
        seen = await consume_all(cl, load.topic, load.acked, 30)
    lost = load.acked - seen
    assert not lost, (len(lost), sorted(lost)[:10])


# ---- load reports -----------------------------------------------------------------------


async def test_load_reports_reach_cluster_stats(cl):
    make_topic(cl, "ld", 2, 3)
    states = await settled(cl, "ld")
    load = Load(cl, "ld", 2)

    def busy():
        body = stats(cl)
        nodes = {n["id"]: n for n in body.get("node_stat_list", [])}
        leader = nodes.get(states[0].leader, {})
        return (leader.get("msgs_per_s") or 0) > 0 and body["topn_topics"] and body
    body = await until(busy, 10, "the leader of ld:0 reports its publishes")
    await load.stop()
    assert len(body["node_stat_list"]) == 3
    assert {n["id"] for n in body["node_stat_list"]} == {n.tcp_address for n in cl.nsqds}
    for n in body["node_stat_list"]:
        assert n["cpu"] is not None and n["report_age_ms"] is not None
        assert n["node_load_factor"] >= n["leader_load_factor"] >= 0
        assert n["http_port"] == cl.nsqd_at(n["id"]).http_port
    assert sum(n["partitions_led"] for n in body["node_stat_list"]) == 2
    assert body["topn_topics"][0]["topic"] == "ld"
    assert body["topn_topics"][0]["load_factor"] > 2  # 2 partitions, more than idle
    assert body["balance"]["open"] is False
    status, bad = http_json("GET", lookupd(cl) + "/cluster/stats?topn=x")
    assert status == 400 and bad["message"] == "INVALID_ARG_TOPN"


# ---- refusals ---------------------------------------------------------------------------


async def test_bad_moves_are_refused_and_move_nothing(cl):
    make_topic(cl, "bad", 1, 2)
    make_topic(cl, "solo", 1, 1)
    before = await settled(cl, "bad")
    s = before[0]
    outside = next(n.tcp_address for n in cl.nsqds if n.tcp_address not in s.isr)
    follower = next(x for x in s.isr if x != s.leader)
    solo = (await settled(cl, "solo"))[0]
    not_solo = next(n.tcp_address for n in cl.nsqds if n.tcp_address != solo.leader)
    cases = [
        ("/partition/move_leader?partition=0&to=" + follower, 400, "MISSING_ARG_TOPIC"),
        ("/partition/move_leader?topic=bad&to=" + follower, 400, "MISSING_ARG_PARTITION"),
        ("/partition/move_leader?topic=bad&partition=0", 400, "MISSING_ARG_TO"),
        ("/partition/move_leader?topic=bad&partition=x&to=" + follower, 400,
         "INVALID_ARG_PARTITION"),
        ("/partition/move_leader?topic=nope&partition=0&to=" + follower, 404, "TOPIC_NOT_FOUND"),
        ("/partition/move_leader?topic=bad&partition=3&to=" + follower, 400, "BAD_PARTITION"),
        ("/partition/move_leader?topic=bad&partition=0&to=127.0.0.1:1", 409, "NODE_NOT_LIVE"),
        ("/partition/move_leader?topic=bad&partition=0&to=" + outside, 409, "NOT_IN_ISR"),
        ("/partition/move_leader?topic=bad&partition=0&to=" + s.leader, 409, "ALREADY_LEADER"),
        ("/partition/move_leader?topic=solo&partition=0&to=" + not_solo, 409, "NOT_IN_ISR"),
        (f"/partition/move_replica?topic=bad&partition=0&from={s.leader}&to={follower}", 409,
         "ALREADY_REPLICA"),
        (f"/partition/move_replica?topic=bad&partition=0&from={outside}&to={outside}", 409,
         "NOT_A_REPLICA"),
        (f"/partition/move_replica?topic=bad&partition=0&from={s.leader}&to=127.0.0.1:1", 409,
         "NODE_NOT_LIVE"),
        ("/node/drain?node=127.0.0.1:1", 409, "NODE_NOT_LIVE"),
        ("/node/drain", 400, "MISSING_ARG_NODE"),
        ("/cluster/balance", 409, "OUTSIDE_BALANCE_WINDOW"),
    ]
    for path, status, code in cases:
        got = post(cl, path)
        assert got[0] == status and got[1].get("message") == code, (path, got)
    assert (await cl.states("bad")) == before  # nothing moved
    assert http_json("GET", lookupd(cl) + "/partition/move_leader")[0] == 405
    # gone before the kills below: its only replica killed, the cluster reads "leaderless"
    assert post(cl, "/topic/delete?topic=solo")[0] == 200


async def test_a_topic_of_one_replica_moves_under_traffic(cl):
    """Issue 29 item 1: a topic of one replica moves to another node like any other (every
    partition is a replicated log, its ISR the leader alone): the new replica catches up,
    joins, leads, and the old one leaves, under keyed publishing and consuming; nothing
    acknowledged is lost."""
    make_topic(cl, "one", 1, 1)
    s = (await settled(cl, "one"))[0]
    to = next(n.tcp_address for n in cl.nsqds if n.tcp_address != s.leader)
    load = await Load(cl, "one", 1).read(cl)
    await until(lambda: len(load.acked) > 200, 20, "publishing")
    status, body = post(cl, f"/partition/move_replica?topic=one&partition=0&from={s.leader}"
                            f"&to={to}")
    assert status == 200 and body["leader_move"], body
    after = (await cl.states("one"))[0]
    assert after.leader == to and after.isr == (to,) and not after.catchup, after
    await until(lambda: node_led(cl, cl.nsqd_at(to), "one") == {0}, 10, f"{to} leads it")
    moved_at = len(load.acked)
    await until(lambda: len(load.acked) > moved_at + 200, 20, "publishing after the move")
    await load.stop()
    assert not node_led(cl, cl.nsqd_at(s.leader), "one")
    load.check_success()
    await check_nothing_lost(cl, load)
    print(f"one replica moved {s.leader} -> {to} in {body['took_ms']} ms; "
          f"acked {len(load.acked)}, failed {load.failed}")
    # gone before the kills below: its only replica killed, the cluster reads "leaderless"
    assert post(cl, "/topic/delete?topic=one")[0] == 200


async def test_a_replica_move_to_a_node_that_died_ends_with_its_lease(tmp_path):
    """The target of a replica move is killed just before the move: the move answers 409
    NODE_NOT_LIVE once the target's lease ended (not after CATCHUP_S, 30 s), and leaves
    the partition as it was, the dead node in neither the ISR nor the catch-up list."""
    c = Cluster(str(tmp_path), 3, 1).start()
    try:
        make_topic(c, "gone", 1, 2)
        s = (await settled(c, "gone"))[0]
        target = next(n for n in c.nsqds if n.tcp_address not in s.isr)
        frm = next(x for x in s.isr if x != s.leader)
        target.kill()  # its lease lives on for up to LEASE_TTL_S: the move starts
        started = time.monotonic()
        status, body = await asyncio.to_thread(
            post, c, f"/partition/move_replica?topic=gone&partition=0&from={frm}"
                     f"&to={target.tcp_address}")
        took = time.monotonic() - started
        assert (status, body.get("message")) == (409, "NODE_NOT_LIVE"), body
        assert "while catching up" in body.get("detail", ""), body  # refused mid-move
        assert took < LEASE_TTL_S + SLACK_S, took
        after = (await c.states("gone"))[0]
        assert target.tcp_address not in (*after.isr, *after.catchup), after
        assert set(after.isr) == set(s.isr), after
    finally:
        c.stop()


# ---- leader transfer --------------------------------------------------------------------


async def test_leader_moves_under_traffic_lose_nothing(cl):
    make_topic(cl, "mv", 4, 3)
    await settled(cl, "mv")
    load = await Load(cl, "mv", 4).read(cl)
    await asyncio.sleep(1)
    gaps = []
    for round_ in range(2):
        for n in range(4):
            s = (await cl.states("mv"))[n]
            to = [x for x in s.isr if x != s.leader][round_ % 2]
            started = time.monotonic()
            status, body = post(cl, f"/partition/move_leader?topic=mv&partition={n}&to={to}")
            assert status == 200 and body["settled"] and body["leader"] == to, body
            assert body["epoch"] == s.epoch + 1
            await asyncio.sleep(0.8)
            gaps.append(load.gap(n, started - 0.2, time.monotonic()))
            assert node_led(cl, cl.nsqd_at(to), "mv") >= {n}
            assert n not in node_led(cl, cl.nsqd_at(s.leader), "mv")
    await load.stop()
    gaps.sort()
    print(f"leader moves: unavailability median {gaps[len(gaps) // 2]:.3f} s, "
          f"max {gaps[-1]:.3f} s; acked {len(load.acked)}, failed {load.failed}")
    assert gaps[-1] < 2.0, gaps
    load.check_success()
    await check_nothing_lost(cl, load)


def in_thread(fn):
    """Run fn() in a thread now; the thread (join it)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("victim", ["target", "old_leader"])
async def test_a_transfer_interrupted_by_kill_9_ends_with_one_leader(cl, victim):
    topic = f"kill-{victim.replace('_', '-')}"
    make_topic(cl, topic, 1, 3)
    s = (await settled(cl, topic))[0]
    to = next(x for x in s.isr if x != s.leader)
    killed = cl.nsqd_at(to if victim == "target" else s.leader)
    load = Load(cl, topic, 1)
    await asyncio.sleep(0.5)
    mover = in_thread(lambda: post(cl, f"/partition/move_leader?topic={topic}&partition=0&to={to}"))
    await asyncio.sleep(0.005)
    killed.kill()
    mover.join(10)
    live = [n for n in cl.nsqds if n is not killed]

    def one_leader():
        st = cl.lookupd_get("/info")[1].get("cluster", {})
        leaders = [n for n in live if 0 in node_led(cl, n, topic)]
        return not st.get("leaderless") and len(leaders) == 1 and leaders[0]
    leader = await until(one_leader, LEASE_TTL_S + 2 + SLACK_S, "one live leader serving")
    after = (await cl.states(topic))[0]
    assert after.leader == leader.tcp_address and after.epoch > s.epoch
    n_acked = len(load.acked)
    await until(lambda: len(load.acked) > n_acked + 20, 10, "publishing again")
    # the dead node's load report goes with its lease (the move may settle before it expires)
    etcd = Etcd(cl.etcd.endpoint)
    try:
        async def report_gone():
            return (await etcd.get(keys.load("test", killed.tcp_address)))[0] is None
        deadline = time.monotonic() + LEASE_TTL_S + SLACK_S
        while not await report_gone():
            assert time.monotonic() < deadline, "the killed node's load report outlived its lease"
            await asyncio.sleep(0.1)
    finally:
        await etcd.close()
        killed.start()  # whatever happened: the module's cluster goes on with three nodes
    await cl.until_states(topic, lambda st: len(st[0].isr) == 3, 30, "the killed node back")
    assert [n for n in cl.nsqds if 0 in node_led(cl, n, topic)] == [leader]
    await load.stop()
    load.check_success()
    await check_nothing_lost(cl, load)


# ---- drain and the balancer -------------------------------------------------------------


def add_nsqd(cl: Cluster) -> NsqdProcess:
    """A fourth nsqd joins the cluster (empty)."""
    node = NsqdProcess(os.path.join(cl.root, f"nsqd{len(cl.nsqds)}"),
                       "--etcd-endpoints", cl.etcd.endpoint, "--cluster-id", "test",
                       "--etcd-lease-ttl", f"{LEASE_TTL_S}s",
                       "--rpc-address", f"127.0.0.1:{free_port()}").start()
    cl.nsqds.append(node)
    return node


async def test_drain_under_traffic_moves_everything_off(cl):
    make_topic(cl, "dr", 6, 2)
    await settled(cl, "dr")
    # fully skewed for the next test: every leader of "sk" on one node, moved by hand
    make_topic(cl, "sk", 6, 3)
    states = await settled(cl, "sk")
    heavy = cl.nsqds[0].tcp_address
    for n, s in states.items():
        if s.leader != heavy:
            status, body = post(cl, f"/partition/move_leader?topic=sk&partition={n}&to={heavy}")
            assert status == 200, body
    assert {s.leader for s in (await cl.states("sk")).values()} == {heavy}
    add_nsqd(cl)
    await until(lambda: len(cl.live_nodes()) == 4, 10, "the fourth node registered")

    drained = cl.nsqds[1].tcp_address
    load = await Load(cl, "dr", 6).read(cl)
    await asyncio.sleep(0.5)
    status, body = post(cl, f"/node/drain?node={drained}")
    assert status == 200 and body["state"] == "draining", body

    def removable():
        n = next(x for x in stats(cl)["node_stat_list"] if x["id"] == drained)
        return n["removable"] and n
    await until(removable, 60, f"{drained} drained")
    moved = stats(cl)["balance"]["drains"][drained]["moved"]
    for topic in ("dr", "sk", "mv", "ld", "bad", "kill-target", "kill-old-leader"):
        for n, s in (await cl.states(topic)).items():
            assert drained not in s.isr and drained not in s.catchup, (topic, n, s)
            assert len(s.isr) >= (cl.lookup(topic).get("meta") or {}).get("replica"), s
    assert not node_led(cl, cl.nsqd_at(drained), "dr")
    await load.stop()
    print(f"drained {drained}: {moved} replica moves; acked {len(load.acked)}, "
          f"failed {load.failed}")
    load.check_success()
    await check_nothing_lost(cl, load)


async def test_a_dead_node_is_drained_once_failover_gave_its_partitions_leaders(cl):
    # the node drained before comes back into the pool (R=3 needs 3 nodes besides the dead)
    back = cl.nsqds[1].tcp_address
    status, body = post(cl, f"/node/drain?node={back}&cancel=true")
    assert status == 200 and body["state"] == "cancelled", body
    dead = cl.nsqds[2]
    dead.kill()
    status, body = post(cl, f"/node/drain?node={dead.tcp_address}")
    assert status == 200 and body["state"] == "draining", body

    last = {}

    def removable():
        last.update(stats(cl)["balance"]["drains"].get(dead.tcp_address, {}))
        return last.get("state") == "removable" and dict(last)
    try:
        d = await until(removable, 40, f"dead {dead.tcp_address} drained")
    except AssertionError:
        raise AssertionError(f"not drained: {last}; states "
                             f"{ {t: await cl.states(t) for t in ('dr', 'sk', 'mv')} }")
    for topic in ("dr", "sk", "mv", "ld", "bad", "kill-target", "kill-old-leader"):
        for n, s in (await cl.states(topic)).items():
            assert dead.tcp_address not in (*s.isr, *s.catchup), (topic, n, s)
            assert len(s.isr) >= (cl.lookup(topic).get("meta") or {}).get("replica"), s
    print(f"dead node drained: {d['moved']} moves")
    dead.start()  # back, empty: the balancer fills it next
    await until(lambda: len(cl.live_nodes()) == 4, 10, "the node registered again")


async def test_the_balancer_evens_a_skewed_cluster_under_traffic(cl):
    # the window opens: the lookupd restarted with 00:00-24:00 (the drain is forgotten, so
    # the drained node is an empty node to fill)
    lk = cl.lookupds[0]
    lk.stop()
    lk.extra[lk.extra.index("--balance-window") + 1] = "00:00-24:00"
    lk.start()
    await until(lambda: cl.master() == 0, 10, "the lookupd is master again")
    load = await Load(cl, "sk", 6).read(cl)
    started = time.monotonic()
    body = await until(lambda: (b := stats(cl)).get("stable") and b, 90, "balanced")
    took = time.monotonic() - started
    await load.stop()
    led: dict[str, int] = {}
    held: dict[str, int] = {}
    for topic in ("dr", "sk", "mv", "ld", "bad", "kill-target", "kill-old-leader"):
        for s in (await cl.states(topic)).values():
            led[s.leader] = led.get(s.leader, 0) + 1
            for m in s.isr:
                held[m] = held.get(m, 0) + 1
    print(f"balanced in {took:.1f} s, {body['balance']['moves']} moves: led {led}, held {held}")
    assert len(led) == 4 and max(led.values()) - min(led.values()) <= 1
    assert len(held) == 4 and max(held.values()) - min(held.values()) <= 1
    assert body["balance"]["moves"] <= 60
    load.check_success()
    await check_nothing_lost(cl, load)


async def test_leaders_piled_on_the_first_node_up_spread_by_default(tmp_path):
    """Issue 29 item 1 as a user met it: every nsqd stopped and started again, the first
    one up leads every partition; with nsqlookupd's defaults (no --balance-window) the
    leaders are even again within 60 s of the last node's return, under keyed publishing
    (>= 99% acknowledged, every acknowledged message consumed)."""
    cl = Cluster(str(tmp_path), 3, 1, leader_balance=True).start()
    try:
        make_topic(cl, "spread", 8, 3)
        await settled(cl, "spread")
        first = cl.nsqds[0]

        def first_leads_all():
            leaders = cl.leaders("spread")
            return len(leaders) == 8 and set(leaders.values()) == {first.tcp_address}
        for node in cl.nsqds[1:]:  # the others first: the last one stopped is in every ISR
            node.stop()
        await until(first_leads_all, 30, "the node left leads all 8")
        first.stop()
        first.start()
        await until(first_leads_all, 30, "the first node up leads all 8")
        for node in cl.nsqds[1:]:
            node.start()
        await until(lambda: len(cl.live_nodes()) == 3, 10, "every node registered again")
        back = time.monotonic()
        load = await Load(cl, "spread", 8).read(cl)

        def even():
            led = {n.tcp_address: 0 for n in cl.nsqds}
            for leader in cl.leaders("spread").values():
                led[leader] = led.get(leader, 0) + 1
            return (len(cl.leaders("spread")) == 8 and max(led.values()) - min(led.values()) <= 1
                    and led)
        led = await until(even, 60, "leaders even")
        took = time.monotonic() - back
        await asyncio.sleep(3)  # publishing goes on after the last move
        await load.stop()
        balance = stats(cl)["balance"]
        print(f"leaders even {took:.1f} s after the last node was back: {led}, "
              f"{balance['moves']} moves; {len(load.acked)} acked, {load.failed} failed")
        assert balance["leaders"] is True and balance["window"] == ""
        assert balance["moves"] <= 6  # 8, 0, 0 -> 3, 3, 2: five moves
        load.check_success()
        await check_nothing_lost(cl, load)
    finally:
        cl.stop()
