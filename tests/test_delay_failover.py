"""What a channel's disk delay queue holds survives a failover, and holds nothing else back
(nsqd/replica.py, nsqd/handover.py), on real processes (tests/cluster.py: etcd, an
nsqlookupd, three nsqds, R=3, lease TTL 2 s, --delay-threshold 1s).

A replicated channel with a DPUB due later among 2,000 messages all FINished, and a
message REQ'd with a long delay at its third delivery; the leader is killed (-9) once
the state was pushed. On the new leader none of the 2,000 comes back, the DPUB comes at
its due time (not before), and the REQ'd message after its delay, as its 4th delivery.
The topic is traced: the new leader records a DELAY_IN for each held message it took over,
and a DELAY_OUT when it came due.
Before the held list existed, the replicated cursor stopped at the oldest held message:
every FINished message after it came back, and the REQ'd one came at once, as its first.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.request

import pytest

from cluster import LEASE_TTL_S, Cluster, http_json, wait_until
from nsqclient.conn import Connection
from nsqwire import commands as c

SLACK_S = 4  # this 2-core machine runs etcd, a lookupd, three nsqds and the test at once
DPUB_DEFER_MS = 14_000
REQ_DELAY_MS = 11_000


@pytest.fixture(scope="module")
def cluster(module_dir):
    cl = Cluster(str(module_dir), 3, 1, "--delay-threshold", "1s",
                 "--checkpoint-interval", "200ms").start()
    yield cl
    cl.stop()


def channel_partition(http_address: str, topic: str, channel: str) -> dict:
    with urllib.request.urlopen(f"http://{http_address}/stats?format=json&topic={topic}"
                                f"&channel={channel}", timeout=5) as r:
        stats = json.loads(r.read())
    for t in stats["topics"]:
        for ch in t["channels"]:
            if ch["channel_name"] == channel:
                return ch["partitions"][0]
    return {}


def trace_on(cl: Cluster, node, topic: str) -> None:
    """Tracing of `topic` switched on, and followed by every node (any may lead next)."""
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{node.http_address}/message/trace/enable?topic={topic}", data=b"",
            method="POST"), timeout=10) as r:
        assert r.status == 200
    for n in cl.nsqds:
        wait_until(lambda n=n: topic in http_json(
            "GET", f"http://{n.http_address}/stats?format=json")[1]["trace"]["topics"],
            15, "the switch followed")


def traced(node, msg_id: str, at_least: int) -> list[tuple[str, int]] | None:
    """(kind, attempts) of a message's trace events on `node`, once there are `at_least`."""
    status, body = http_json("GET", f"http://{node.http_address}/trace/search?msg_id={msg_id}")
    events = [(e["kind"], e["attempts"]) for m in body.get("messages", ()) for e in m["events"]]
    return events if status == 200 and len(events) >= at_least else None


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.05)
    return value


async def test_a_failover_brings_back_the_held_messages_and_nothing_finished(cluster):
    cl = cluster
    status, body = cl.create_topic("held", 1, replicas=3)
    assert status == 200, body
    s = await cl.until_states("held", lambda s: len(s[0].isr) == 3, 10, "3 in sync")
    leader = cl.nsqd_at(s[0].leader)
    await asyncio.to_thread(trace_on, cl, leader, "held")
    bodies = [b"m%04d" % i for i in range(2000)]
    finished: set[bytes] = set()
    retry_attempts: list[int] = []
    req_sent_at: list[float] = []

    def on_messages(msgs) -> None:
        for m in msgs:
            if m.body == b"retry":
                retry_attempts.append(m.attempts)
                if m.attempts < 3:
                    m.req(0)
                else:
                    req_sent_at.append(time.time())
                    m.req(REQ_DELAY_MS)
            else:
                assert m.body != b"deferred", "the DPUB came before it was due"
                finished.add(m.body)
                m.fin()

    host, port = leader.tcp_address.rsplit(":", 1)
    conn = await Connection(host, int(port), on_messages=on_messages).connect()
    try:
        await conn.sub("held", "c")
        assert await conn.command(c.cmd_pub("held", b"retry", 0)) == b"OK"
        assert await conn.command(c.cmd_mpub("held", bodies[:1000], 0)) == b"OK"
        dpub_sent_at = time.time()
        assert await conn.command(c.cmd_dpub("held", DPUB_DEFER_MS, b"deferred", 0)) == b"OK"
        assert await conn.command(c.cmd_mpub("held", bodies[1000:], 0)) == b"OK"
        conn.rdy(200)
        await until(lambda: len(finished) == 2000 and req_sent_at, 15, "2,000 FINs, 3 deliveries")
        stats = await until(lambda: (lambda p: p.get("delayed_count") == 2 and p["depth"] == 0
                                     and p["in_flight_count"] == 0 and p)(
            channel_partition(leader.http_address, "held", "c")), 10, "both held on disk")
        assert stats["confirmed"] == stats["next_read"], "the cursor passed both held messages"
        # checkpoints every 200 ms, channel states sent every 200 ms: pushed well within this
        await asyncio.sleep(1.5)
    finally:
        await conn.close()
    assert retry_attempts == [1, 2, 3]
    leader.kill()
    s = await cl.until_states("held", lambda t: t[0].leader not in (None, leader.tcp_address),
                              LEASE_TTL_S + 1 + SLACK_S, "a new leader")

    came: list[tuple[bytes, int, float]] = []
    host, port = s[0].leader.rsplit(":", 1)
    came_ids: dict[bytes, str] = {}
    conn = await Connection(host, int(port), on_messages=lambda msgs: [
        (came.append((m.body, m.attempts, time.time())), came_ids.setdefault(m.body, m.id.decode()),
         m.fin()) for m in msgs]).connect()
    try:
        await conn.sub("held", "c", rdy=200)
        wait = max(dpub_sent_at + DPUB_DEFER_MS / 1000, req_sent_at[0] + REQ_DELAY_MS / 1000)
        await until(lambda: {b"deferred", b"retry"} <= {b for b, _, _ in came},
                    wait - time.time() + 6, "the DPUB and the REQ'd message")
        await asyncio.sleep(0.3)
    finally:
        await conn.close()
    again = [b for b, _, _ in came if b in finished]
    print(f"after the failover: {len(again)} of 2000 finished messages came again; came: "
          f"{[(b, a, round(t - dpub_sent_at, 2)) for b, a, t in came if b not in finished]}")
    assert not again, f"{len(again)} FINished messages came back"
    (dpub,) = [(a, t) for b, a, t in came if b == b"deferred"]
    (retry,) = [(a, t) for b, a, t in came if b == b"retry"]
    assert dpub[1] >= dpub_sent_at + DPUB_DEFER_MS / 1000 - 0.05, "the DPUB came early"
    assert dpub[1] <= dpub_sent_at + DPUB_DEFER_MS / 1000 + 5 and dpub[0] == 1
    assert retry[1] >= req_sent_at[0] + REQ_DELAY_MS / 1000 - 0.05, "the REQ'd message came early"
    assert retry[0] == 4, "its attempts are carried on"

    new = cl.nsqd_at(s[0].leader)
    for body, attempts in ((b"deferred", 0), (b"retry", 3)):
        events = await asyncio.to_thread(
            wait_until, functools.partial(traced, new, came_ids[body], 3), 10,
            f"{body}'s events on the new leader")
        assert events[:2] == [("DELAY_IN", attempts), ("DELAY_OUT", attempts)], (body, events)
