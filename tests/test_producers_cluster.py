"""Idempotent producers through leader kills (issue 30, item 1), all real processes
(tests/cluster.py: etcd, an nsqlookupd, three nsqds; topics of 3 replicas):

- a new leader answers a request the killed one took (read back from its copy of the
  log) and writes nothing again; the sequence goes on from there, a gap is refused;
- the partition-aware client (idempotent by default) under keyed load through leader
  kills (3; 50 with --long): every acknowledged message stored, none stored twice.
"""

from __future__ import annotations

import asyncio

import pytest

from cluster import LEASE_TTL_S
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c
from test_replication import SLACK_S, KeyedLoad, cluster, make_topic  # noqa: F401


async def _connect(address: str) -> Connection:
    host, port = address.rsplit(":", 1)
    return await Connection(host, int(port)).connect()


async def _until_led(conn: Connection, command: bytes, timeout: float = 10.0) -> None:
    """`command`, sent again while the node does not lead yet (it applies etcd's view)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await conn.command(command)
            return
        except NSQError as e:
            if (not str(e).startswith(("E_FAILED_ON_NOT_LEADER", "E_FAILED_ON_NOT_WRITABLE"))
                    or asyncio.get_running_loop().time() > deadline):
                raise
        await asyncio.sleep(0.1)


def _pub(body: bytes, seq: int) -> bytes:
    return c.cmd_pub_ext("pay", {"##producer_id": "till-7", "##sequence": seq}, body, 0)


async def _stored(leader: str, topic: str, partition: int,
                  wait: float = 3.0) -> dict[bytes, set]:
    """body -> the message ids it is stored under, for every message of the partition."""
    conn = await _connect(leader)
    await conn.command(c.cmd_sub(topic, "audit", partition))
    conn.rdy(1000)
    ids: dict[bytes, set] = {}
    try:
        while True:
            m = await asyncio.wait_for(conn.messages.get(), wait)
            ids.setdefault(m.body, set()).add(m.id)
            m.fin()
    except TimeoutError:
        pass
    finally:
        await conn.close()
    return ids


async def test_a_new_leader_answers_what_the_killed_one_took(cluster):
    cl = cluster
    make_topic(cl, "pay", 1)
    before = await cl.until_states("pay", lambda s: len(s[0].isr) == 3, 10, "3 in sync")
    conn = await _connect(cl.leaders("pay")[0])
    for seq in range(5):
        await conn.command(_pub(b"m%d" % seq, seq))
    await conn.close()
    cl.nsqd_at(before[0].leader).kill()
    after = await cl.until_states("pay", lambda s: s[0].leader not in (None, before[0].leader),
                                  LEASE_TTL_S + 1 + SLACK_S, "a new leader")
    conn = await _connect(after[0].leader)
    await _until_led(conn, _pub(b"m4", 4))
    for seq in (4, 2, 4):  # retries of what the old leader took: answered, not written
        await conn.command(_pub(b"m%d" % seq, seq))
    with pytest.raises(NSQError, match="E_BAD_SEQUENCE.*gap: the next is 5"):
        await conn.command(_pub(b"m7", 7))
    await conn.command(_pub(b"m5", 5))
    await conn.close()
    stored = await _stored(after[0].leader, "pay", 0)
    assert sorted(stored) == [b"m%d" % i for i in range(6)]
    assert all(len(ids) == 1 for ids in stored.values()), stored


@pytest.mark.parametrize("kills", [3, pytest.param(50, marks=pytest.mark.long)])
async def test_the_client_stores_nothing_twice_through_leader_kills(cluster, kills):
    """3 leader kills under keyed load (50 with --long; bench/duplicates.py also counts
    what the plain client writes twice)."""
    cl = cluster
    make_topic(cl, "pay", 2)
    await cl.until_states("pay", lambda s: all(len(p.isr) == 3 for p in s.values()), 10,
                          "every partition with 3 in sync")
    load = KeyedLoad(cl, "pay", 16)
    for k in range(kills):
        await asyncio.sleep(1.5)
        before = await cl.states("pay")
        n = k % 2
        victim = cl.nsqd_at(before[n].leader)
        victim.kill()
        await cl.until_states("pay", lambda s: s[n].leader not in (None, before[n].leader),
                              LEASE_TTL_S + 1 + SLACK_S, f"kill {k}: a new leader")
        await asyncio.to_thread(victim.start)
        await cl.until_states("pay", lambda s: all(len(p.isr) == 3 for p in s.values()), 30,
                              f"kill {k}: back in sync")
    await load.stop()
    states = await cl.states("pay")
    stored: dict[bytes, set] = {}
    for n in range(2):
        stored.update(await _stored(states[n].leader, "pay", n))
    lost = load.acked - stored.keys()
    twice = {b: ids for b, ids in stored.items() if len(ids) > 1}
    print(f"acked {len(load.acked)}, failed {load.failed}, lost {len(lost)}, "
          f"stored twice {len(twice)}")
    assert not lost, sorted(lost)[:10]
    assert not twice, list(twice.items())[:10]
    assert len(load.acked) > 200
