"""Half messages through kill -9 (issue 30, item 2), real processes, a real check-back
server (aiohttp, the producer's side) in the test:

- a cluster (tests/cluster.py: etcd, an nsqlookupd, three nsqds; a topic of 3 replicas)
  whose leader is killed with a half in each state at once: committed, rolled back,
  undecided (its producer would commit one, roll back another) and one in the middle of
  its check-back. The new leader delivers the committed ones and the ones its check-backs
  commit, each once; never a rolled back one; and asks about every undecided one, none
  decided;
- nsqclient's Producer committing and rolling back halves across a leader kill (its
  decision is retried until the new leader takes it);
- a single nsqd killed with halves in each state and started again: the same, from its
  own log.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from cluster import Cluster
from servers import NsqdProcess
from test_deadletters_cluster import _connect, _consume, _http, _new_leader

from nsqclient.conn import Connection, NSQError
from nsqclient.producer import Producer
from nsqwire import commands as c

CHECK = ("--half-check-timeout", "1500ms")


class CheckServer:
    """A producer's check-back endpoint: answers an id as `decisions` says (None: no
    decision), holds the answer of the ids in `held` until the test lets them go; records
    every ask with its time."""

    def __init__(self):
        self.decisions: dict[str, str | None] = {}
        self.held: set[str] = set()
        self.asked: list[tuple[str, float]] = []
        self.release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> "CheckServer":
        async def check(request):
            payload = await request.json()
            self.asked.append((payload["id"], time.monotonic()))
            if payload["id"] in self.held:
                await self.release.wait()
            return web.json_response({"decision": self.decisions.get(payload["id"])})
        app = web.Application()
        app.router.add_post("/check", check)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/check"
        return self

    def asked_since(self, t: float) -> set[str]:
        return {i for i, at in self.asked if at >= t}

    async def stop(self) -> None:
        self.release.set()
        await self._runner.cleanup()


@pytest.fixture
def half_cluster(tmp_path):
    cl = Cluster(str(tmp_path), 3, 1, *CHECK).start()
    yield cl
    cl.stop()


async def _half(conn: Connection, body: bytes, url: str, partition: int | None = 0) -> str:
    answer = await conn.command(c.cmd_half("pay", body, url, partition))
    assert answer.startswith(b"OK "), answer
    return answer[3:].decode()


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not in {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def _subscribed(address: str, timeout: float = 20.0) -> Connection:
    """A connection subscribed to `ledger` on `address`, SUB sent again while the node,
    named leader in etcd, has not taken the partition yet (E_FAILED_ON_NOT_LEADER)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = await _connect(address)
        try:
            await conn.command(c.cmd_sub("pay", "ledger", 0))
            return conn
        except NSQError as e:
            await conn.close()
            if not str(e).startswith("E_FAILED_ON_NOT_LEADER") or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def _delivered(address: str, expected: set[bytes], timeout: float = 30.0) -> list[bytes]:
    """Bodies the channel `ledger` delivers (each FINed) until every one of `expected`
    came, then 2 s more: every body delivered, in order."""
    conn = await _subscribed(address)
    conn.rdy(100)
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                m = await asyncio.wait_for(conn.messages.get(), 0.5)
            except TimeoutError:
                continue
            got.append(m.body)
            m.fin()
            if expected <= set(got):
                deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        await conn.close()
    return got


async def _single(tmp_path, *flags: str) -> NsqdProcess:
    """A single nsqd with the topic `pay` and its channel `ledger`."""
    node = NsqdProcess(str(tmp_path / "nsqd"), *flags).start()
    await _http(node, "POST", "/topic/create?topic=pay")
    await _http(node, "POST", "/channel/create?topic=pay&channel=ledger")
    return node


async def _setup(cl):
    status, body = cl.create_topic("pay", 1, replicas=3)
    assert status == 200, body
    states = await cl.until_states("pay", lambda s: len(s[0].isr) == 3, 10, "3 in sync")
    leader = cl.nsqd_at(states[0].leader)
    await _http(leader, "POST", "/channel/create?topic=pay&channel=ledger")
    return states, leader


async def test_a_leader_killed_with_halves_in_every_state(half_cluster):
    cl = half_cluster
    checks = await CheckServer().start()
    try:
        before, leader = await _setup(cl)
        conn = await _connect(before[0].leader)
        checking = await _half(conn, b"checking", checks.url)
        checks.held.add(checking)  # its check-back hangs until after the kill
        checks.decisions[checking] = "commit"
        await _until(lambda: checking in checks.asked_since(0), 10, "the first check-back")
        commit_later = await _half(conn, b"commit-later", checks.url)
        rollback_later = await _half(conn, b"rollback-later", checks.url)
        committed = await _half(conn, b"committed", checks.url)
        rolled_back = await _half(conn, b"rolled-back", checks.url)
        await conn.command(c.cmd_decide("pay", committed, True))
        await conn.command(c.cmd_decide("pay", rolled_back, False))
        checks.decisions.update({commit_later: "commit", rollback_later: "rollback"})
        await conn.close()
        leader.kill()  # within 1.5 s of the undecided ones: before their first check-back
        killed_at = time.monotonic()
        checks.held.clear()
        checks.release.set()

        new = await _new_leader(cl, before)
        got = await _delivered(new.tcp_address, {b"checking", b"commit-later", b"committed"})
        assert sorted(got) == [b"checking", b"commit-later", b"committed"], got
        assert checks.asked_since(killed_at) == {checking, commit_later, rollback_later}
        listed = await _http(new, "GET", "/half?topic=pay")
        [p] = listed["partitions"]
        # decided by the new leader's check-backs (the rest were decided by the old one)
        assert (p["waiting"], p["committed"], p["rolled_back"], p["expired"]) == ([], 2, 1, 0)
    finally:
        await checks.stop()


async def test_nsqclient_commits_and_rolls_back_across_a_leader_kill(half_cluster):
    cl = half_cluster
    checks = await CheckServer().start()  # answers no decision: only the producer decides
    producer = Producer([cl.lookupds[0].http_address], max_retry_time=30.0)
    try:
        before, leader = await _setup(cl)
        paid = await producer.half("pay", b"paid", checks.url)
        refunded = await producer.half("pay", b"refunded", checks.url)
        assert (paid.partition, paid.node.address) == (0, before[0].leader)
        leader.kill()
        await asyncio.gather(producer.commit(paid), producer.rollback(refunded))
        new = await _new_leader(cl, before)
        assert await _delivered(new.tcp_address, {b"paid"}) == [b"paid"]
        await producer.commit(paid)  # sent again: answered as the first was
        [p] = (await _http(new, "GET", "/half?topic=pay"))["partitions"]
        assert (p["waiting"], p["committed"], p["rolled_back"]) == ([], 1, 1)
    finally:
        await producer.close()
        await checks.stop()


async def test_a_node_killed_with_halves_in_every_state_reads_them_back(tmp_path):
    node = await _single(tmp_path, *CHECK)
    checks = await CheckServer().start()
    try:
        conn = await _connect(node.tcp_address)
        checking = await _half(conn, b"checking", checks.url, None)
        checks.held.add(checking)
        checks.decisions[checking] = "rollback"
        await _until(lambda: checking in checks.asked_since(0), 10, "the first check-back")
        undecided = await _half(conn, b"undecided", checks.url, None)
        committed = await _half(conn, b"committed", checks.url, None)
        rolled_back = await _half(conn, b"rolled-back", checks.url, None)
        await conn.command(c.cmd_decide("pay", committed, True))
        await conn.command(c.cmd_decide("pay", rolled_back, False))
        checks.decisions[undecided] = "commit"
        await conn.close()
        node.kill()
        killed_at = time.monotonic()
        checks.held.clear()
        checks.release.set()
        node.start()
        got = await _delivered(node.tcp_address, {b"undecided", b"committed"})
        assert sorted(got) == [b"committed", b"undecided"], got
        assert checks.asked_since(killed_at) == {checking, undecided}
        [p] = (await _http(node, "GET", "/half?topic=pay"))["partitions"]
        assert p["waiting"] == [] and (p["committed"], p["rolled_back"]) == (1, 1), p  # after the restart
    finally:
        node.kill()
        await checks.stop()


async def test_an_undecided_half_keeps_its_segment_from_retention(tmp_path):
    """A channel past an undecided half, small segments and a retention check every 100 ms:
    the half's segment stays, and its commit delivers it."""
    node = await _single(tmp_path, "--segment-bytes", "4096", "--retention-check-interval",
                         "100ms", "--half-check-timeout", "1h")
    checks = await CheckServer().start()
    try:
        conn = await _connect(node.tcp_address)
        held = await _half(conn, b"held", checks.url, None)
        for i in range(0, 400, 50):  # ~20 segments after it
            await conn.command(c.cmd_mpub("pay", [b"x" * 200] * 50))
        got = await _consume(node.tcp_address, "pay", "ledger", lambda m: m.fin(), 2.0)
        assert len(got) == 400
        await asyncio.sleep(0.5)  # retention runs
        stats = await _http(node, "GET", "/stats?format=json&topic=pay")
        [part] = stats["topics"][0]["partitions"]
        assert part["start_offset"] == 0 and part["half_waiting"] == 1, part
        await conn.command(c.cmd_decide("pay", held, True))
        await conn.close()
        assert await _delivered(node.tcp_address, {b"held"}) == [b"held"]
        await asyncio.sleep(0.5)
        [part] = (await _http(node, "GET", "/stats?format=json&topic=pay"))["topics"][0][
            "partitions"]
        assert part["start_offset"] > 0, part  # decided: retention goes on past it
    finally:
        node.kill()
        await checks.stop()
