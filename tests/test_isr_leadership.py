"""isr/leadership.py LeaderKeys against a real etcd: keys created under the registration's
lease, another node's key never taken, released on step-down, nothing held once the lease
is lost, everything written again under the new lease after a re-registration."""

import asyncio
import time

import pytest

from isr import keys
from isr.etcd import Etcd
from isr.leadership import LeaderKeys, held_under, to_write
from isr.registry import Registration

CLUSTER = "c"
TTL = 2


@pytest.fixture
async def etcd(etcd_server):
    client = Etcd(etcd_server.endpoint, timeout=1)
    yield client
    await client.close()


async def until(predicate, timeout: float, step: float = 0.02) -> float:
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


async def leader_key(etcd, topic: str, n: int):
    kv, _ = await etcd.get(keys.partition_leader(CLUSTER, topic, n))
    return kv


async def start_node(etcd, node_id: str) -> tuple[Registration, LeaderKeys]:
    reg = Registration(etcd, keys.node(CLUSTER, node_id), b"{}", TTL).start()
    assert await reg.wait_registered(5)
    return reg, LeaderKeys(etcd, CLUSTER, node_id, reg).start()


def test_pure_parts():
    held = {("a", 0): 7, ("a", 1): 8}
    assert to_write({("a", 0), ("a", 1), ("b", 0)}, held, 7) == [("a", 1), ("b", 0)]
    assert to_write({("a", 0)}, held, 7) == []
    assert held_under(held, 7) == {("a", 0)}
    assert held_under(held, 0) == frozenset()  # lease lost: nothing held


async def test_hold_release_and_another_nodes_key(etcd):
    reg_a, a = await start_node(etcd, "127.0.0.1:4150")
    reg_b, b = await start_node(etcd, "127.0.0.1:4250")
    try:
        assert reg_a.lease_id and reg_a.lease_id != reg_b.lease_id
        assert await a.hold({("t", 0), ("t", 1)}) == {("t", 0), ("t", 1)}
        kv = await leader_key(etcd, "t", 0)
        assert kv.value == b"127.0.0.1:4150" and kv.lease == reg_a.lease_id
        assert await a.hold({("t", 0)}) == {("t", 0)}  # again: still held, no change
        assert (await leader_key(etcd, "t", 0)).mod_revision == kv.mod_revision
        # b cannot take a's key; it holds its own
        assert await b.hold({("t", 0), ("t", 2)}) == {("t", 2)}
        assert (await leader_key(etcd, "t", 0)).value == b"127.0.0.1:4150"
        assert b.held == {("t", 2)} and a.held == {("t", 0), ("t", 1)}
        # b's release never deletes a's key
        await b.release({("t", 0)})
        assert (await leader_key(etcd, "t", 0)).value == b"127.0.0.1:4150"
        # a steps down from t:0: the key goes, and b can take it
        await a.release({("t", 0)})
        assert await leader_key(etcd, "t", 0) is None and a.held == {("t", 1)}
        assert await b.hold({("t", 0)}) == {("t", 0)}
        with pytest.raises(Exception, match="partition"):
            await a.hold({("t", -1)})
    finally:
        for part in (a, b, reg_a, reg_b):
            await part.close()
    # the keys went with the leases
    assert await leader_key(etcd, "t", 1) is None and await leader_key(etcd, "t", 2) is None


async def test_a_wanted_key_is_taken_when_the_other_node_lets_it_go(etcd):
    """b wants a key a holds: b gets it within RETRY_S of a's release (a deposed leader)."""
    reg_a, a = await start_node(etcd, "127.0.0.1:4150")
    reg_b, b = await start_node(etcd, "127.0.0.1:4250")
    try:
        assert await a.hold({("t", 0)}) == {("t", 0)}
        assert await b.hold({("t", 0)}) == set()
        await a.release({("t", 0)})
        took = await until(lambda: ("t", 0) in b.held, 3)
        assert took <= 1.5
        assert (await leader_key(etcd, "t", 0)).value == b"127.0.0.1:4250"
    finally:
        for part in (a, b, reg_a, reg_b):
            await part.close()


async def test_lost_lease_holds_nothing_then_everything_again(etcd, etcd_server):
    """The registration's lease is revoked behind its back (as etcd does when it expires
    it): held is empty at once; the registration comes back under a new lease, and every
    wanted key is written again under it."""
    reg, lk = await start_node(etcd, "127.0.0.1:4150")
    try:
        wanted = {("t", n) for n in range(5)}
        assert await lk.hold(wanted) == wanted
        old, kept = reg.lease_id, reg._lease
        etcd_server.post("lease/revoke", {"ID": old})
        await asyncio.wait_for(kept.lost.wait(), TTL + 1)  # the refresh finds it gone
        assert lk.held == frozenset() and reg.lease_id == 0  # at once
        took = await until(lambda: lk.held == wanted, 3)
        assert reg.lease_id not in (0, old)
        for t, n in wanted:
            kv = await leader_key(etcd, t, n)
            assert kv.value == b"127.0.0.1:4150" and kv.lease == reg.lease_id
        print(f"keys back under the new lease {took * 1000:.0f} ms after the loss was seen")
    finally:
        await lk.close()
        await reg.close()
