"""Dead letters through kills and failover (issue 30, item 3), all real processes:
a single nsqd killed while it buries, and a cluster (tests/cluster.py: etcd, an
nsqlookupd, three nsqds; a topic of 3 replicas):

- an nsqd killed (-9) while it buries messages, again and again, and started again:
  every message is a dead letter once, none lost, none twice;

- the dead letters a leader kept (body, attempts, the client's error) are the new leader's
  after a kill -9, and are requeued and purged there;
- a leader killed while it buries messages loses none, and buries none twice: a message
  delivered again by the new leader (its progress not yet replicated) and failing again
  is known by the dead copy it has.
"""

from __future__ import annotations

import asyncio

from cluster import LEASE_TTL_S, http_json
from servers import NsqdProcess
from test_replication import SLACK_S, cluster, make_topic  # noqa: F401

from nsqclient.conn import Connection
from nsqwire import commands as c


async def _connect(address: str) -> Connection:
    host, port = address.rsplit(":", 1)
    return await Connection(host, int(port)).connect()


async def _http(node, method: str, path: str, ok=(200,), timeout: float = 20.0) -> dict:
    """The answer of `path` on `node`, asked again while it answers otherwise (a new
    leader opening the channel, reading its dead letters back)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status, body = await asyncio.to_thread(http_json, method,
                                               f"http://{node.http_address}{path}")
        if status in ok:
            return body
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{path}: {status} {body}")
        await asyncio.sleep(0.2)


async def _dead(node, topic: str, channel: str) -> list[dict]:
    """Every dead letter of the channel on `node`, page by page."""
    out, after = [], ""
    while True:
        page = await _http(node, "GET", f"/channel/dead?topic={topic}&channel={channel}"
                                        f"&limit=1000{after}")
        if page["loading"]:
            await asyncio.sleep(0.2)
            continue
        out += page["dead_letters"]
        if len(page["dead_letters"]) < 1000:
            return out
        after = f"&after={out[-1]['id']}"


async def _consume(address: str, topic: str, channel: str, answer, seconds: float,
                   rdy: int = 50, pause: float = 0.0) -> list:
    """Messages taken until none came for `seconds` (or the connection closed), each
    answered by `answer(message)`, `pause` seconds after it came."""
    conn = await _connect(address)
    await conn.command(c.cmd_sub(topic, channel, 0))
    conn.rdy(rdy)
    got = []
    try:
        while True:
            m = await asyncio.wait_for(conn.messages.get(), seconds)
            got.append(m)
            if pause:
                await asyncio.sleep(pause)
            answer(m)
    except (TimeoutError, ConnectionError):
        pass
    finally:
        await conn.close()
    return got


async def _setup(cl, max_attempts: int):
    make_topic(cl, "pay", 1)
    states = await cl.until_states("pay", lambda s: len(s[0].isr) == 3, 10, "3 in sync")
    leader = cl.nsqd_at(states[0].leader)
    await _http(leader, "POST", "/channel/create?topic=pay&channel=ledger")
    await _http(leader, "POST", f"/channel/config?topic=pay&channel=ledger"
                                f"&max_attempts={max_attempts}")
    return states, leader


async def _new_leader(cl, before):
    after = await cl.until_states("pay", lambda s: s[0].leader not in (None, before[0].leader),
                                  LEASE_TTL_S + 1 + SLACK_S, "a new leader")
    return cl.nsqd_at(after[0].leader)


async def test_a_new_leader_keeps_the_dead_letters_and_requeues_them(cluster):
    cl = cluster
    before, leader = await _setup(cl, max_attempts=2)
    conn = await _connect(before[0].leader)
    await conn.command(c.cmd_mpub("pay", [b"debit-%d" % i for i in range(5)], 0))
    await conn.close()
    await _consume(before[0].leader, "pay", "ledger",
                   lambda m: m.req(0, f"ledger down ({m.attempts})"), 3.0)
    dead = await _dead(leader, "pay", "ledger")
    assert sorted(d["body"] for d in dead) == [f"debit-{i}" for i in range(5)]
    assert {(d["attempts"], d["cause"], d["error"]) for d in dead} == {
        (2, "req", "ledger down (2)")}
    purged = dead[0]["id"]
    await _http(leader, "POST", f"/channel/dead/purge?topic=pay&channel=ledger&id={purged}")
    await asyncio.sleep(1.0)  # the channel's checkpoint reaches the followers (200 ms)
    leader.kill()

    new = await _new_leader(cl, before)
    kept = await _dead(new, "pay", "ledger")
    assert [(d["id"], d["body"], d["error"]) for d in kept] == [
        (d["id"], d["body"], d["error"]) for d in dead[1:]]
    stats = await _http(new, "GET", "/stats?format=json&topic=pay")
    [part] = stats["topics"][0]["channels"][0]["partitions"]
    assert (part["max_attempts"], part["dead_count"]) == (2, 4)
    assert await _http(new, "POST", "/channel/dead/requeue?topic=pay&channel=ledger") == {
        "count": 4}
    got = await _consume(new.tcp_address, "pay", "ledger", lambda m: m.fin(), 3.0)
    assert sorted(m.body for m in got) == [b"debit-%d" % i for i in range(1, 5)]
    assert {m.attempts for m in got} == {1}  # fresh: a client's own max-tries starts again
    assert await _dead(new, "pay", "ledger") == []


async def test_a_leader_killed_while_it_buries_loses_none_and_buries_none_twice(cluster):
    cl = cluster
    before, leader = await _setup(cl, max_attempts=1)
    bodies = [b"order-%d" % i for i in range(300)]
    conn = await _connect(before[0].leader)
    for i in range(0, 300, 50):
        await conn.command(c.cmd_mpub("pay", bodies[i:i + 50], 0))
    await conn.close()

    async def kill_soon():
        for _ in range(400):
            page = await _http(leader, "GET", "/channel/dead?topic=pay&channel=ledger&limit=1")
            if page["count"] >= 150:
                break
            await asyncio.sleep(0.05)
        leader.kill()
        return page["count"]
    killer = asyncio.create_task(kill_soon())
    await _consume(before[0].leader, "pay", "ledger", lambda m: m.req(0, "failing"), 4.0,
                   rdy=5, pause=0.01)
    killed_at = await killer

    new = await _new_leader(cl, before)
    # the new leader's consumer fails too: every message ends a dead letter, once
    delivered = await _consume(new.tcp_address, "pay", "ledger", lambda m: m.req(0, "still"),
                               4.0)
    dead = await _dead(new, "pay", "ledger")
    print(f"buried before the kill: {killed_at}; the new leader delivered {len(delivered)} "
          f"(progress its checkpoint had not carried yet, and what was never delivered); "
          f"dead letters {len(dead)}")
    assert sorted(d["body"].encode() for d in dead) == sorted(bodies)
    assert len({d["message_id"] for d in dead}) == len(bodies)


async def test_a_node_killed_while_it_buries_again_and_again_buries_each_once(tmp_path):
    node = NsqdProcess(str(tmp_path / "nsqd")).start()
    try:
        await _http(node, "POST", "/topic/create?topic=pay")
        await _http(node, "POST", "/channel/create?topic=pay&channel=ledger")
        await _http(node, "POST", "/channel/config?topic=pay&channel=ledger&max_attempts=1")
        bodies = [b"order-%d" % i for i in range(300)]
        conn = await _connect(node.tcp_address)
        for i in range(0, 300, 50):
            await conn.command(c.cmd_mpub("pay", bodies[i:i + 50]))
        await conn.close()
        for kill in range(4):  # each round's consumer fails every message; a kill ends it
            async def kill_soon(at=60 * (kill + 1)):
                for _ in range(400):
                    page = await _http(node, "GET", "/channel/dead?topic=pay&channel=ledger"
                                                    "&limit=1")
                    if page["count"] >= at:
                        break
                    await asyncio.sleep(0.02)
                node.kill()
            killer = asyncio.create_task(kill_soon())
            await _consume(node.tcp_address, "pay", "ledger", lambda m: m.req(0, "no"), 4.0,
                           rdy=5, pause=0.005)
            await killer
            node.start()
        await _consume(node.tcp_address, "pay", "ledger", lambda m: m.req(0, "no"), 3.0)
        dead = await _dead(node, "pay", "ledger")
        assert sorted(d["body"].encode() for d in dead) == sorted(bodies)
        assert len({d["message_id"] for d in dead}) == len(bodies)
    finally:
        node.kill()
