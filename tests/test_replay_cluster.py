"""Replay in a cluster (tests/cluster.py: etcd, an nsqlookupd, three nsqds, R=3): the master
nsqlookupd's POST /channel/setoffset moves the channel on every partition's leader; a
partition whose leader is gone is named in a 502; the moved cursor is on every ISR follower
before the answer, so a new leader after a kill -9 of the old one right after starts there.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

from cluster import LEASE_TTL_S, Cluster, pub
from nsqclient.conn import NSQError
from test_replication import SLACK_S, consume_all

PARTITIONS, EACH = 3, 10


def lookupd_post(cl: Cluster, path: str, body: bytes = b"") -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{cl.lookupds[0].http_address}{path}", data=body,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


async def publish(address: str, partition: int, body: bytes) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            assert await pub(address, "rp", partition, body) == b"OK"
            return
        except NSQError as e:  # a leader still taking its partition over
            if time.monotonic() > deadline or "E_FAILED_ON_NOT_" not in str(e):
                raise
            await asyncio.sleep(0.1)


async def test_lookupd_moves_every_partition_and_a_new_leader_keeps_the_move(tmp_path):
    """Messages before and after a second boundary on 3 partitions; the lookupd's setoffset
    to that second moves each leader's channel to its partition's 10th message. Checkpoints
    are an hour apart, so only the move's own store reaches the followers; the leader of
    partition 0 is killed as soon as the move is answered (before, the followers got the
    move with the next 200 ms send of channel states, and the new leader delivered
    everything), and then the channel delivers exactly the later messages of every
    partition. Right after that kill (before the failover), a setoffset names the dead
    leader's partitions in a 502 and moves the others."""
    cl = Cluster(str(tmp_path), 3, 1, "--checkpoint-interval", "1h",
                 "--retention-check-interval", "1h").start()
    try:
        status, body = cl.create_topic("rp", PARTITIONS, replicas=3)
        assert status == 200, body
        states = await cl.until_states("rp", lambda s: all(len(p.isr) == 3 for p in s.values()),
                                       20, "every partition with 3 in sync")
        for channel in ("c", "d"):
            assert lookupd_post(cl, f"/channel/create?topic=rp&channel={channel}")[0] == 200
        await asyncio.sleep(1)  # the leaders make the channels from their views
        early = {b"early-%d-%d" % (n, i) for n in range(PARTITIONS) for i in range(EACH)}
        late = {b"late-%d-%d" % (n, i) for n in range(PARTITIONS) for i in range(EACH)}
        for n in range(PARTITIONS):
            for i in range(EACH):
                await publish(states[n].leader, n, b"early-%d-%d" % (n, i))
        boundary = int(time.time()) + 1
        await asyncio.sleep(boundary + 0.2 - time.time())
        for n in range(PARTITIONS):
            for i in range(EACH):
                await publish(states[n].leader, n, b"late-%d-%d" % (n, i))

        for path, body, want in (
                ("/channel/setoffset?topic=rp&channel=c&partition=7", b"end", "BAD_PARTITION"),
                ("/channel/setoffset?topic=rp&channel=c", b"count:3", "MISSING_ARG_PARTITION"),
                ("/channel/setoffset?topic=rp&channel=c", b"bogus", "INVALID_OFFSET"),
                ("/channel/setoffset?topic=rp&channel=zz", b"end", "CHANNEL_NOT_FOUND")):
            assert lookupd_post(cl, path, body)[1]["message"] == want, path

        status, answer = lookupd_post(cl, "/channel/setoffset?topic=rp&channel=c",
                                      b"timestamp:%d" % boundary)
        assert status == 200, answer
        assert sorted((e["partition"], e["count"], e["clipped"]) for e in answer["partitions"]) == [
            (n, EACH, None) for n in range(PARTITIONS)]
        victim = states[0].leader  # killed at once: the answer came once followers stored it
        cl.nsqd_at(victim).kill()
        status, answer = lookupd_post(cl, "/channel/setoffset?topic=rp&channel=d", b"end")
        dead = {n for n, s in states.items() if s.leader == victim}
        assert status == 502 and answer["message"] == "SETOFFSET_FAILED", answer
        assert {f["partition"] for f in answer["failed"]} == dead
        assert {e["partition"] for e in answer["partitions"]} == set(range(PARTITIONS)) - dead

        await cl.until_states("rp", lambda s: s[0].leader not in (None, victim),
                              LEASE_TTL_S + 1 + SLACK_S, "partition 0 has a new leader")
        seen = await consume_all(cl, "rp", late, 30, "c")
        assert set(seen) == late, sorted(set(seen) ^ late)[:5]
        assert not early & seen.keys()
    finally:
        cl.stop()
