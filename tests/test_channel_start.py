"""Where a new channel starts on each partition in cluster mode (nsqd/README.md, "A new
channel's start"), with real processes (tests/cluster.py): etcd and nsqlookupd on the
machine's clock, one nsqd whose wall clock is 2 s behind the others (libfaketime through
LD_PRELOAD; its monotonic clock is left alone) and whose view of etcd lags by 0.6 s (its
etcd watch goes through a relay that holds what etcd sends for that long: a loaded node,
a slow link), so it makes the new channel after the first messages for it arrived.

- a channel made by a SUB (or nsqd's /channel/create, or the master nsqlookupd's) on a
  node whose clock is ahead: every message published to the skewed leader's partition
  right after the SUB's OK (or the 200) is delivered on the new channel (before: the skewed leader started the channel at
  the creating node's wall clock matched against its own record timestamps and skipped
  what was published in those 2 s, for good);
- the same, with the skewed leader killed with SIGKILL right after those publishes: the
  new leader delivers every one of them, and nothing published before the channel was
  made (its start was on the ISR before the SUB's OK).
"""

from __future__ import annotations

import asyncio
import glob
import threading
import time

import pytest

from cluster import LEASE_TTL_S, Cluster, http_json, wait_until
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c
from servers import free_port

SKEW = "-2s"
LAG_S = 0.6  # what etcd sends the skewed node reaches it this much later
SLACK_S = 6  # a 2-core machine shared with other runs
LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                               + glob.glob("/usr/lib/faketime/libfaketime.so.1"))), None)

pytestmark = pytest.mark.skipif(LIBFAKETIME is None,
                                reason="libfaketime missing (Debian's faketime package)")


class LaggingRelay:
    """A TCP relay to etcd on its own thread and loop: what the client sends goes on at
    once, and so do etcd's answers, except on a connection that carries a watch, where
    what etcd sends is held `lag` seconds (order kept): the node's view lags, its lease
    and other calls do not."""

    def __init__(self, upstream_port: int, lag: float):
        self.upstream_port, self.lag = upstream_port, lag
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", self.port))
        self._ready.set()
        self.loop.run_forever()

    async def _relay(self, reader, writer) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        lag = [0.0]  # this connection's: set once it carries a watch

        async def pipe(src, dst, upward: bool) -> None:
            held: asyncio.Queue = asyncio.Queue()

            async def deliver() -> None:
                while (item := await held.get()) is not None:
                    due, data = item
                    await asyncio.sleep(max(0.0, due - self.loop.time()))
                    dst.write(data)
                    await dst.drain()
                dst.close()
            sender = asyncio.create_task(deliver())
            try:
                while data := await src.read(65536):
                    if upward and b"/v3/watch" in data:
                        lag[0] = self.lag
                    held.put_nowait((self.loop.time() + (0.0 if upward else lag[0]), data))
            except OSError:
                pass
            held.put_nowait(None)
            try:
                await sender
            except OSError:
                pass

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False),
                             return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def skewed_cluster(root: str, nsqds: int, skewed: int) -> tuple[Cluster, LaggingRelay]:
    """A cluster whose nsqd `skewed` has its clock 2 s behind and a lagging view of etcd."""
    cl = Cluster(root, nsqds, 1)
    relay = LaggingRelay(int(cl.etcd.endpoint.rsplit(":", 1)[1]), LAG_S)
    node = cl.nsqds[skewed]
    at = node.extra.index("--etcd-endpoints")
    node.extra[at + 1] = f"http://127.0.0.1:{relay.port}"
    node.env = {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": SKEW,
                "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
    try:
        cl.start()
    except BaseException:
        relay.close()
        raise
    return cl, relay


def channels_on(node, topic: str, partition: int) -> set[str]:
    status, doc = http_json("GET", f"http://{node.http_address}/stats?format=json&topic={topic}")
    if status != 200:
        return set()
    for t in doc.get("topics", []):
        for p in t.get("partitions", []):
            if p["partition"] == partition:
                return set(p.get("channels") or [])
    return set()


async def publish(address: str, topic: str, partition: int, bodies: list[bytes]) -> None:
    host, port = address.rsplit(":", 1)
    conn = await Connection(host, int(port)).connect()
    try:
        for body in bodies:
            assert await conn.command(c.cmd_pub(topic, body, partition)) == b"OK"
    finally:
        await conn.close()


async def consume(address: str, topic: str, channel: str, partition: int,
                  want: set[bytes], timeout: float, linger: float = 0.5) -> list[bytes]:
    """Every body the channel's partition delivers (FINed), until `want` all came and
    `linger` more seconds passed, or `timeout`."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:  # a new leader named in etcd takes the partition a moment later
        conn = await Connection(host, int(port)).connect()
        try:
            await conn.command(c.cmd_sub(topic, channel, partition))
            break
        except NSQError as e:
            await conn.close()
            if "E_FAILED_ON_NOT_LEADER" not in str(e) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    got: list[bytes] = []
    try:
        conn.rdy(500)
        while True:
            left = deadline - time.monotonic()
            if want <= set(got):
                left = min(left, linger)
            if left <= 0:
                return got
            try:
                m = await asyncio.wait_for(conn.messages.get(), left)
            except TimeoutError:
                return got
            got.append(m.body)
            m.fin()
    finally:
        await conn.close()


async def led_by(cl: Cluster, topic: str, node_index: int, isr: int) -> int:
    """A partition the node leads, once every partition has `isr` replicas in sync."""
    me = cl.nsqds[node_index].tcp_address
    states = await cl.until_states(topic, lambda s: all(len(p.isr) >= isr for p in s.values()),
                                   20, f"every partition of {topic} with {isr} in sync")
    mine = [n for n, s in sorted(states.items()) if s.leader == me]
    assert mine, f"node {me} leads no partition of {topic}: {states}"
    return mine[0]


async def make_old_channel(cl: Cluster, topic: str, partition: int, leader) -> None:
    """A channel made before the one under test, so the new one is not the partition's
    first (a first channel starts at the partition's floor anyway)."""
    creator = cl.nsqds[0]
    url = f"http://{creator.http_address}/channel/create?topic={topic}&channel=old"
    wait_until(lambda: http_json("POST", url)[0] == 200, 10,
               "channel old made (the creating node serves the topic)")
    wait_until(lambda: "old" in channels_on(leader, topic, partition), 10,
               "channel old on the skewed leader's partition")


@pytest.fixture
def two_nodes(tmp_path):
    cl, relay = skewed_cluster(str(tmp_path), 2, skewed=1)
    yield cl
    cl.stop()
    relay.close()


@pytest.fixture
def three_nodes(tmp_path):
    cl, relay = skewed_cluster(str(tmp_path), 3, skewed=1)
    yield cl
    cl.stop()
    relay.close()


@pytest.mark.parametrize("how", ["sub", "http", "lookupd"])
async def test_messages_right_after_the_create_reach_a_leader_whose_clock_is_behind(
        two_nodes, how):
    cl = two_nodes
    creator, skewed = cl.nsqds[0], cl.nsqds[1]
    status, body = cl.create_topic("skew", 2, replicas=1)
    assert status == 200, body
    n = await led_by(cl, "skew", 1, 1)
    await make_old_channel(cl, "skew", n, skewed)
    await publish(skewed.tcp_address, "skew", n, [b"before-%d" % i for i in range(5)])

    sub = None
    if how == "sub":  # a classic SUB on the creating node: every partition it leads
        sub = await Connection("127.0.0.1", creator.tcp_port).connect()
        assert await sub.command(c.cmd_sub("skew", "fresh")) == b"OK"
    elif how == "http":
        status, body = http_json("POST", f"http://{creator.http_address}/channel/create"
                                         f"?topic=skew&channel=fresh")
        assert status == 200, body
    else:  # the master nsqlookupd writes it to etcd, then asks each leader
        master = cl.lookupds[cl.master()]
        status, body = http_json("POST", f"http://{master.http_address}/channel/create"
                                         f"?topic=skew&channel=fresh")
        assert status == 200, body
    after = [b"after-%d" % i for i in range(50)]
    await publish(skewed.tcp_address, "skew", n, after)
    if sub is not None:
        await sub.close()

    got = await consume(skewed.tcp_address, "skew", "fresh", n, set(after), 10 + SLACK_S)
    missing = [b for b in after if b not in got]
    assert not missing, (f"{len(missing)} of {len(after)} messages published after the "
                         f"{how} returned never reached channel fresh: {missing[:5]}...")


async def test_the_start_survives_a_kill_of_the_skewed_leader_right_after_the_create(
        three_nodes):
    cl = three_nodes
    creator, skewed = cl.nsqds[0], cl.nsqds[1]
    status, body = cl.create_topic("skewha", 3, replicas=3)
    assert status == 200, body
    n = await led_by(cl, "skewha", 1, 3)
    await make_old_channel(cl, "skewha", n, skewed)
    before = [b"before-%d" % i for i in range(20)]
    await publish(skewed.tcp_address, "skewha", n, before)

    sub = await Connection("127.0.0.1", creator.tcp_port).connect()
    assert await sub.command(c.cmd_sub("skewha", "fresh")) == b"OK"
    after = [b"after-%d" % i for i in range(30)]
    await publish(skewed.tcp_address, "skewha", n, after)
    old = (await cl.states("skewha"))[n]
    skewed.kill()  # SIGKILL, right after: no checkpoint of the new channel after its start
    await sub.close()

    states = await cl.until_states(
        "skewha", lambda s: s[n].leader not in (None, old.leader), LEASE_TTL_S + 1 + SLACK_S,
        f"partition {n} has a new leader")
    leader = cl.nsqd_at(states[n].leader)
    got = await consume(leader.tcp_address, "skewha", "fresh", n, set(after), 10 + SLACK_S)
    missing = [b for b in after if b not in got]
    assert not missing, (f"{len(missing)} of {len(after)} messages published after the SUB "
                         f"returned never reached channel fresh after the failover: "
                         f"{missing[:5]}...")
    replayed = [b for b in got if b in before]
    assert not replayed, (f"the new leader started channel fresh before its start "
                          f"(the start was not on the ISR): {replayed[:5]}...")
