"""isr registration, election, metadata and mirror against a real etcd server (TTL 2 s)."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from etcdserver import EtcdProcess
from servers import ROOT
from isr import keys
from isr.election import Election
from isr.etcd import Etcd, EtcdRefused
from isr.metadata import Conflict, Metadata, TopicExists, TopicNotFound
from isr.mirror import ClusterMirror
from isr.placement import elect, place
from isr.registry import Registration
from isr.state import ChannelMeta, NodeInfo, PartitionState, TopicMeta

HOLDER = os.path.join(ROOT, "tests", "isr_holder.py")
TTL = 2


@pytest.fixture
async def etcd(etcd_server):
    client = Etcd(etcd_server.endpoint, timeout=1)
    yield client
    await client.close()


def holder(*args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, HOLDER, *args], stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline() == b"ready\n"
    return proc


async def until(predicate, timeout: float, step: float = 0.05) -> float:
    """Wait until predicate() (sync or async) is true: the seconds it took."""
    start = time.monotonic()
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true after {timeout} s")
        await asyncio.sleep(step)


async def present(etcd, key):
    return (await etcd.get(key))[0] is not None


async def test_registration_expires_when_its_process_is_killed(etcd, etcd_server):
    key = keys.node("c", "127.0.0.1:4150")
    proc = holder("register", etcd_server.endpoint, key, "v", str(TTL))
    try:
        assert (await etcd.get(key))[0].value == b"v"
        await asyncio.sleep(TTL + 1)  # the keepalive holds it past its TTL
        assert await present(etcd, key)
        proc.kill()
        proc.wait()
        gone_after = await until(lambda: _absent(etcd, key), TTL + 2)
        assert gone_after <= TTL + 1.5
    finally:
        proc.kill()
        proc.wait()


async def _absent(etcd, key):
    return not await present(etcd, key)


async def test_registration_close_revokes_and_update(etcd):
    reg = Registration(etcd, "/reg/a", b"1", ttl=TTL).start()
    assert await reg.wait_registered(5)
    await reg.update(b"2")
    assert (await etcd.get("/reg/a"))[0].value == b"2"
    await reg.close()
    assert not await present(etcd, "/reg/a")


async def test_registration_waits_for_etcd_and_comes_back(tmp_path):
    """etcd down at start: a clear error and retries; etcd killed for longer than the TTL
    (so the lease may be gone): registered again, under a new lease."""
    server = EtcdProcess(str(tmp_path / "etcd"))
    etcd = Etcd(server.endpoint, timeout=1)
    reg = Registration(etcd, "/reg/b", b"1", ttl=TTL).start()
    try:
        assert not await reg.wait_registered(1)
        assert "127.0.0.1" in reg.last_error
        await asyncio.to_thread(server.start)
        assert await reg.wait_registered(5)
        lease = (await etcd.get("/reg/b"))[0].lease
        server.kill()
        await until(lambda: not reg.registered.is_set(), TTL + 2)
        await asyncio.sleep(1)
        await asyncio.to_thread(server.start)
        await until(lambda: reg.registered.is_set(), 10)
        kv, _ = await etcd.get("/reg/b")
        assert kv.value == b"1" and kv.lease != lease
    finally:
        await reg.close()
        await etcd.close()
        server.kill()


async def test_election_takeover_within_ttl(etcd, etcd_server):
    key = keys.lookupd_master("c")
    proc = holder("elect", etcd_server.endpoint, key, "first:4160", str(TTL))
    changes = []
    second = Election(etcd, key, "second:4160", TTL,
                      on_change=lambda m, who: changes.append((m, who))).start()
    third = Election(etcd, key, "third:4160", TTL).start()
    try:
        await until(lambda: second.master_id == "first:4160" == third.master_id, 5)
        assert not second.is_master and not third.is_master
        proc.kill()
        proc.wait()
        took = await until(lambda: second.is_master or third.is_master, TTL + 2)
        assert took <= TTL + 1
        assert second.is_master != third.is_master
        winner, loser = (second, third) if second.is_master else (third, second)
        await until(lambda: loser.master_id == winner.my_id, 2)
        assert (await etcd.get(key))[0].value == winner.my_id.encode()
        # a clean close hands over at once
        await winner.close()
        took = await until(lambda: loser.is_master, 2)
        assert took < 1
        assert (False, "first:4160") in changes
    finally:
        proc.kill()
        proc.wait()
        await second.close()
        await third.close()


async def test_master_steps_down_when_etcd_is_gone(tmp_path):
    server = EtcdProcess(str(tmp_path / "etcd")).start()
    etcd = Etcd(server.endpoint, timeout=1)
    election = Election(etcd, "/m", "me:1", TTL).start()
    try:
        await until(lambda: election.is_master, 5)
        server.kill()
        took = await until(lambda: not election.is_master, TTL + 1)
        assert took <= TTL + 0.2  # never later than etcd could expire the lease
        await asyncio.to_thread(server.start)
        await until(lambda: election.is_master, 10)
    finally:
        await election.close()
        await etcd.close()
        server.kill()


NODES = [f"127.0.0.1:{p}" for p in (4150, 4152, 4154)]


async def test_topic_lifecycle_and_cas(etcd):
    md = Metadata(etcd, "c")
    meta = TopicMeta(partitions=4, replicas=2)
    placement = place(NODES, 4, 2)
    rev = await md.create_topic("orders", meta, placement)
    with pytest.raises(TopicExists):
        await md.create_topic("orders", meta, placement)
    view = await md.read()
    assert view.revision >= rev and not view.problems
    topic = view.topics["orders"]
    assert topic.meta == meta
    assert [[s.leader, *[n for n in s.isr if n != s.leader]]
            for _, s in sorted(topic.partitions.items())] == placement
    assert {s.revision for s in topic.partitions.values()} == {rev}  # one transaction

    assert await md.create_channel("orders", "ch", ChannelMeta(created_ms=1))
    assert not await md.create_channel("orders", "ch", ChannelMeta(created_ms=2))
    with pytest.raises(TopicNotFound):
        await md.create_channel("nothing", "ch", ChannelMeta())
    assert (await md.read()).topics["orders"].channels == {"ch": ChannelMeta(created_ms=1)}

    # compare-and-swap: two deciders read the same state, one wins, one gets Conflict
    state = await md.read_partition("orders", 0)
    a = elect(state, set(NODES) - {state.leader})
    b = state.evolve(isr=(state.leader,), epoch=state.epoch + 1)
    written = await md.update_partition("orders", 0, a)
    assert written.revision > state.revision and written.epoch == state.epoch + 1
    with pytest.raises(Conflict):
        await md.update_partition("orders", 0, b)
    assert await md.read_partition("orders", 0) == written
    with pytest.raises(ValueError):
        await md.update_partition("orders", 0, PartitionState(NODES[0], (NODES[0],)))

    assert await md.delete_channel("orders", "ch")
    assert await md.delete_topic("orders")
    assert not await md.delete_topic("orders")
    assert (await md.read()).topics == {}
    with pytest.raises(Conflict):  # a late update never brings a deleted topic back
        await md.update_partition("orders", 0, written)
    assert (await etcd.get_prefix(keys.topic_prefix("c", "orders")))[0] == []


async def test_biggest_topic_is_one_transaction(etcd):
    md = Metadata(etcd, "c")
    await md.create_topic("big", TopicMeta(1024, 3), place(NODES, 1024, 3))
    view = await md.read()
    assert len(view.topics["big"].partitions) == 1024 and not view.problems


async def test_default_etcd_txn_limit_is_a_clear_error(tmp_path):
    """An etcd left at --max-txn-ops 128 refuses a 200-partition create, with its reason."""
    server = EtcdProcess(str(tmp_path / "etcd"), extra=("--max-txn-ops", "128"))
    etcd = Etcd(server.endpoint, timeout=2)
    try:
        await asyncio.to_thread(server.start)
        with pytest.raises(EtcdRefused, match="too many operations"):
            await Metadata(etcd, "c").create_topic("t", TopicMeta(200), place(NODES, 200, 1))
        assert (await Metadata(etcd, "c").read()).topics == {}
    finally:
        await etcd.close()
        server.kill()


async def test_malformed_values_are_reported_not_fatal(etcd):
    md = Metadata(etcd, "c")
    await md.create_topic("t", TopicMeta(2), place(NODES, 2, 1))
    await etcd.put(keys.partition_state("c", "t", 1), b'{"leader": "127.0.0.1:4150"')
    await etcd.put(keys.node("c", NODES[0]), b"\x00\x01")
    await etcd.put(keys.topic_meta("c", "u"), b'{"partitions": 0}')
    view = await md.read()
    assert list(view.topics) == ["t"] and list(view.topics["t"].partitions) == [0]
    text = "\n".join(view.problems)
    assert "/nsq/c/topics/t/p/1/state: not JSON" in text
    assert "/nsq/c/nodes/127.0.0.1:4150: not JSON" in text
    assert "/nsq/c/topics/u/meta: missing" in text
    with pytest.raises(ValueError, match="not JSON"):
        await md.read_partition("t", 1)


async def test_mirror_follows_across_an_etcd_restart(tmp_path):
    server = EtcdProcess(str(tmp_path / "etcd")).start()
    etcd = Etcd(server.endpoint, timeout=1)
    md = Metadata(etcd, "c")
    mirror = ClusterMirror(etcd, "c").start()
    reg = None
    try:
        await asyncio.wait_for(mirror.ready.wait(), 5)
        node = NodeInfo(NODES[0], NODES[0], "127.0.0.1:4151", "127.0.0.1:4250", "h", "v")
        reg = Registration(etcd, keys.node("c", NODES[0]), node.encode(), TTL).start()
        await md.create_topic("t", TopicMeta(3), place(NODES, 3, 1))
        await until(lambda: mirror.view.nodes.get(NODES[0]) == node
                    and "t" in mirror.view.topics, 5)
        assert len(mirror.view.topics["t"].partitions) == 3  # never half a transaction
        server.kill()
        await asyncio.sleep(0.3)
        assert not mirror.connected and "t" in mirror.view.topics  # the last view stays
        await asyncio.to_thread(server.start)
        await md.delete_topic("t")
        await until(lambda: "t" not in mirror.view.topics, 10)
        assert mirror.connected
    finally:
        if reg is not None:
            await reg.close()
        await mirror.close()
        await etcd.close()
        server.kill()
