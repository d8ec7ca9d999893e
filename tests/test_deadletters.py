"""Dead letters (issue 30, item 3): a channel with `max_attempts` buries a message delivered
that many times without a FIN; its dead letters are records in the partition's log, listed,
shown, requeued and purged over HTTP, and read back when the channel opens again. Across
real processes, kills and failover: test_deadletters_cluster.py."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from nodes import connect
from nsqclient.conn import NSQError
from test_http import call
from test_tcp_ext import frames_until

from nsqd.deadletters import (
    DELIVER,
    SKIP,
    DeadIndex,
    bury_ext,
    purge_ext,
    revive_ext,
    role,
)
from nsqwire import commands as c
from nsqwire import protocol as p
from nsqwire.ext import dead_control

# ---- the records and the index (pure) ----


def test_a_dead_copy_keeps_the_header_and_says_why():
    ext = bury_ext(b'{"k":"v"}', "ch", 0x12, 3, "req", "boom", 1000)
    control = dead_control(ext)
    assert json.loads(ext)["k"] == "v"
    assert control == {"channel": "ch", "id": "0000000000000012", "attempts": 3, "cause": "req",
                       "error": "boom", "published": 1000}
    assert role(ext, "ch") == SKIP and role(ext, "other") == SKIP
    revived = revive_ext(ext, "ch", 40)
    assert role(revived, "ch") == DELIVER and role(revived, "other") == SKIP
    assert role(b'{"note":"\\"##dead\\""}', "ch") is None  # the marker as a value: a message
    assert role(b"", "ch") is None and dead_control(b"not json") is None


def test_the_index_is_a_fold_that_takes_a_record_twice_as_once():
    idx = DeadIndex("ch", since=100)
    bury = {"channel": "ch", "id": "x"}
    for offset in (50, 120, 200, 300, 120):  # 50: before `since`, an older channel's
        idx.apply(offset, bury)
    idx.apply(400, {"channel": "other", "id": "y"})
    assert list(idx.offsets) == [120, 200, 300]
    idx.apply(500, dead_control(revive_ext(b"", "ch", 200)))
    idx.apply(510, dead_control(purge_ext("ch", [300, 999])))
    assert list(idx.offsets) == [120]
    idx.apply(600, {"channel": "ch", "id": "z"})
    idx.apply(700, dead_control(purge_ext("ch", before=601)))
    assert list(idx.offsets) == [] and len(idx) == 0


# ---- a node over TCP and HTTP ----


class Consumer:
    """A raw consumer: IDENTIFY, SUB, RDY; takes messages and answers each."""

    def __init__(self, reader, writer):
        self.reader, self.writer, self.frames = reader, writer, c.FrameParser()

    @classmethod
    async def open(cls, n, topic: str, channel: str, identify: dict | None = None):
        reader, writer = await asyncio.open_connection("127.0.0.1", n.tcp_port)
        self = cls(reader, writer)
        writer.write(p.MAGIC_V2 + c.cmd_identify(identify or {}) + c.cmd_sub(topic, channel)
                     + c.cmd_rdy(10))
        assert await frames_until(reader, self.frames, 2) == [(p.FRAME_RESPONSE, b"OK")] * 2
        return self

    async def take(self, count: int = 1) -> list[tuple[int, bytes, bytes]]:
        """(attempts, id, body) of the next `count` messages."""
        got = await frames_until(self.reader, self.frames, count)
        assert all(kind == p.FRAME_MESSAGE for kind, _ in got), got
        return [c.parse_message(data)[1:] for _, data in got]

    async def nothing(self, seconds: float = 0.5) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(65536), seconds)
        except asyncio.TimeoutError:
            return
        self.frames.feed(data)
        assert [f for f in self.frames.frames() if f[1] != b"_heartbeat_"] == []

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def close(self) -> None:
        self.writer.close()


def _at(n):
    return types.SimpleNamespace(http_address=f"127.0.0.1:{n.http_port}")


async def _json(n, method: str, path: str):
    r = await call(_at(n), method, path)
    assert r.status == 200, (path, r.status, r.body)
    return r.json if r.body else None


async def _channel(n, topic: str, channel: str, max_attempts: int | None = None) -> None:
    await _json(n, "POST", f"/topic/create?topic={topic}")
    await _json(n, "POST", f"/channel/create?topic={topic}&channel={channel}")
    if max_attempts is not None:
        assert await _json(n, "POST", f"/channel/config?topic={topic}&channel={channel}"
                                      f"&max_attempts={max_attempts}") == {
            "max_attempts": max_attempts}


async def _until(predicate, timeout: float = 5.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate()


async def test_a_message_requeued_max_attempts_times_is_buried_with_its_error(node):
    n = await node()
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=2)
    await pub.command(c.cmd_pub_ext("t", {"k": "v"}, b"poison"))
    await pub.command(c.cmd_pub("t", b"fine"))
    con = await Consumer.open(n, "t", "ch")
    first = await con.take(2)
    assert sorted(b for _, _, b in first) == [b"fine", b"poison"]
    for attempts, msg_id, body in first:
        con.send(c.cmd_fin(msg_id) if body == b"fine" else c.cmd_req(msg_id, 0, "boom 1"))
    [(attempts, msg_id, body)] = await con.take()
    assert (attempts, body) == (2, b"poison")
    con.send(c.cmd_req(msg_id, 0, "boom 2: the last"))
    await con.nothing()  # never delivered a third time
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: ch.dead_count == 1)
    listed = await _json(n, "GET", "/channel/dead?topic=t&channel=ch")
    [dead] = listed["dead_letters"]
    assert listed["count"] == 1 and listed["loading"] == []
    assert (dead["message_id"], dead["attempts"], dead["cause"], dead["error"], dead["body"]) == (
        msg_id.decode(), 2, "req", "boom 2: the last", "poison")
    assert dead["buried_ns"] >= dead["published_ns"]
    shown = await _json(n, "GET", f"/channel/dead/message?topic=t&channel=ch&id={dead['id']}")
    assert shown["ext"] == {"k": "v"} and shown["body"] == "poison"
    stats = await _json(n, "GET", "/stats?format=json&topic=t")
    [part] = stats["topics"][0]["channels"][0]["partitions"]
    assert (part["dead_count"], part["buried_count"], part["max_attempts"]) == (1, 1, 2)
    assert part["depth"] == 0 and part["in_flight_count"] == 0
    metrics = (await call(_at(n), "GET", "/metrics")).text
    assert 'nsqd_channel_dead_letters{topic="t",partition="0",channel="ch"} 1' in metrics

    # requeued: delivered to this channel again as a fresh message, and no longer dead
    assert await _json(n, "POST", f"/channel/dead/requeue?topic=t&channel=ch&id={dead['id']}") \
        == {"count": 1}
    [(attempts, again_id, body)] = await con.take()
    assert (attempts, body) == (1, b"poison") and again_id != msg_id
    con.send(c.cmd_fin(again_id))
    assert (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["count"] == 0
    r = await call(_at(n), "GET", f"/channel/dead/message?topic=t&channel=ch&id={dead['id']}")
    assert (r.status, r.json["message"]) == (404, "DEAD_LETTER_NOT_FOUND")
    con.close()


async def test_other_channels_never_see_dead_or_revived_copies(node):
    n = await node(msg_timeout_ms=200)
    pub = await connect(n)
    await _channel(n, "t", "other")
    await _channel(n, "t", "idle")
    await _channel(n, "t", "ch", max_attempts=1)
    await pub.command(c.cmd_pub("t", b"m"))
    idle = n.topics["t"].partition(0).channels["idle"]
    idle.empty()  # caught up: what comes next is at the head of its unread log
    con = await Consumer.open(n, "t", "ch")
    [(attempts, msg_id, _)] = await con.take()
    await con.nothing(0.6)  # it times out once, then it is buried, not delivered again
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: ch.dead_count == 1)
    [dead] = (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["dead_letters"]
    assert (dead["cause"], dead["error"], dead["attempts"]) == ("timeout", None, 1)
    assert idle.depth == 0  # no client reads it: the dead copy is skipped all the same
    await _json(n, "POST", "/channel/dead/requeue?topic=t&channel=ch")
    [(_, revived, _)] = await con.take()
    con.send(c.cmd_fin(revived))
    # its own timeout: the node's 200 ms would redeliver on a loaded machine before the read
    other = await Consumer.open(n, "t", "other", {"msg_timeout": 60_000})
    [(_, got, body)] = await other.take()
    assert (got, body) == (msg_id, b"m")  # the message itself, and nothing else
    other.send(c.cmd_fin(got))
    await other.nothing()
    o = n.topics["t"].partition(0).channels["other"]
    await _until(lambda: o.cursor.confirmed == n.topics["t"].partition(0).queue.committed_end)
    con.close()
    other.close()


async def test_dead_letters_are_read_back_after_a_restart_and_purged(node):
    n = await node(msg_timeout_ms=100)
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=1)
    await pub.command(c.cmd_mpub("t", [b"a", b"b", b"c"]))
    con = await Consumer.open(n, "t", "ch")
    for _, msg_id, _ in await con.take(3):
        con.send(c.cmd_req(msg_id, 0, "no"))
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: ch.dead_count == 3)
    con.close()
    await pub.close()
    await n.stop()
    n = await node(msg_timeout_ms=100)
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: not ch.dead.loading)  # read back from the log after the start
    listed = await _json(n, "GET", "/channel/dead?topic=t&channel=ch&limit=2")
    assert listed["loading"] == []
    assert listed["count"] == 3 and [d["body"] for d in listed["dead_letters"]] == ["a", "b"]
    rest = await _json(n, "GET", "/channel/dead?topic=t&channel=ch&after="
                       + listed["dead_letters"][-1]["id"])
    assert [d["body"] for d in rest["dead_letters"]] == ["c"]
    ch = n.topics["t"].partition(0).channels["ch"]
    assert ch.max_attempts == 1
    first = listed["dead_letters"][0]["id"]
    assert await _json(n, "POST", f"/channel/dead/purge?topic=t&channel=ch&id={first}") == {
        "count": 1}
    assert await _json(n, "POST", "/channel/dead/purge?topic=t&channel=ch") == {"count": 2}
    assert (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["count"] == 0
    await n.stop()
    n = await node(msg_timeout_ms=100)
    assert (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["count"] == 0
    con = await Consumer.open(n, "t", "ch")
    await con.nothing()  # buried and purged: never delivered again
    con.close()


async def test_bad_arguments_get_a_4xx(node):
    n = await node()
    await _channel(n, "t", "ch")
    for path, status, code in (
            ("/channel/config?topic=t&channel=ch&max_attempts=x", 400, "INVALID_ARG_MAX_ATTEMPTS"),
            ("/channel/config?topic=t&channel=ch&max_attempts=70000", 400,
             "INVALID_ARG_MAX_ATTEMPTS"),
            ("/channel/config?topic=t&channel=nope&max_attempts=1", 404, "CHANNEL_NOT_FOUND"),
            ("/channel/dead/requeue?topic=t&channel=ch&id=zz", 400, "INVALID_ID"),
            ("/channel/dead/purge?topic=t&channel=ch&id=0000000000000009", 404,
             "DEAD_LETTER_NOT_FOUND")):
        r = await call(_at(n), "POST", path)
        assert (r.status, r.json["message"]) == (status, code), path
    r = await call(_at(n), "GET", "/channel/dead?topic=t&channel=ch&limit=0")
    assert (r.status, r.json["message"]) == (400, "INVALID_ARG_LIMIT")
    assert await _json(n, "GET", "/channel/dead?topic=t&channel=ch") == {
        "dead_letters": [], "count": 0, "loading": []}


def test_the_index_knows_the_recent_messages_it_holds_a_dead_copy_of():
    idx = DeadIndex("ch", since=0)
    idx.apply(10, {"channel": "ch", "id": "00000000000000aa"})
    idx.apply(20, {"channel": "ch", "id": "00000000000000bb"})
    assert idx.buried_at(0xaa) == 10
    idx.apply(30, dead_control(purge_ext("ch", [10])))
    assert idx.buried_at(0xaa) is None  # purged: buried again if it comes back
    assert idx.buried_at(0xbb) == 20 and idx.buried_at(0xcc) is None


async def test_no_client_may_send_the_dead_key(node):
    n = await node()
    pub = await connect(n)
    with pytest.raises(NSQError, match="E_INVALID_JSON_HEADER"):
        await pub.command(c.cmd_pub_ext("t", {"##dead": {"channel": "ch", "revive": 0}}, b"x"))


async def test_an_ordered_channel_buries_and_goes_on_in_order(node):
    n = await node()
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=1)
    await _json(n, "POST", "/channel/setorder?topic=t&channel=ch&order=true")
    await pub.command(c.cmd_mpub("t", [b"a", b"b", b"c"]))
    con = await Consumer.open(n, "t", "ch")
    [(_, first, body)] = await con.take()
    assert body == b"a"
    con.send(c.cmd_req(first, 0, "poison"))
    got = []
    for _ in range(2):
        [(attempts, msg_id, body)] = await con.take()
        got.append((attempts, body))
        con.send(c.cmd_fin(msg_id))
    assert got == [(1, b"b"), (1, b"c")]
    [dead] = (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["dead_letters"]
    assert (dead["body"], dead["error"]) == ("a", "poison")
    con.close()


async def test_two_requeues_of_all_at_once_revive_each_once(node):
    n = await node()
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=1)
    await pub.command(c.cmd_mpub("t", [b"m%d" % i for i in range(20)]))
    con = await Consumer.open(n, "t", "ch")
    for _ in range(2):  # RDY 10
        for _, msg_id, _ in await con.take(10):
            con.send(c.cmd_req(msg_id, 0))
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: ch.dead_count == 20)
    con.close()
    counts = await asyncio.gather(*[_json(n, "POST", "/channel/dead/requeue?topic=t&channel=ch")
                                    for _ in range(2)])
    assert sorted(x["count"] for x in counts) == [0, 20]
    con = await Consumer.open(n, "t", "ch")
    got = []
    for _ in range(2):
        got += await con.take(10)
        for _, msg_id, _ in got[-10:]:
            con.send(c.cmd_fin(msg_id))
    assert sorted(b for _, _, b in got) == sorted(b"m%d" % i for i in range(20))
    await con.nothing()
    con.close()


async def test_a_message_whose_header_leaves_no_room_is_buried_without_it(node):
    n = await node()
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=1)
    await pub.command(c.cmd_pub_ext("t", {"k": "x" * 65_480}, b"big header"))
    con = await Consumer.open(n, "t", "ch")
    [(_, msg_id, _)] = await con.take()
    con.send(c.cmd_req(msg_id, 0, "no"))
    ch = n.topics["t"].partition(0).channels["ch"]
    await _until(lambda: ch.dead_count == 1)
    [dead] = (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["dead_letters"]
    shown = await _json(n, "GET", f"/channel/dead/message?topic=t&channel=ch&id={dead['id']}")
    assert (shown["body"], shown["error"], shown["ext"]) == ("big header", "no", None)
    await con.nothing()
    con.close()


@pytest.mark.parametrize("tagged", [False, True])
async def test_a_lower_max_attempts_buries_what_comes_back_spent(node, tagged):
    """A message REQed twice with a delay, then max_attempts lowered to 2: when it is due
    it is buried ("spent"), not delivered a third time; on a tag-routed channel too."""
    n = await node()
    pub = await connect(n)
    await _channel(n, "t", "ch", max_attempts=5)
    header = {"##client_dispatch_tag": "vip"} if tagged else {}
    await pub.command(c.cmd_pub_ext("t", header, b"m"))
    con = await Consumer.open(n, "t", "ch", {"desired_tag": "vip"} if tagged else None)
    for attempt in (1, 2):
        [(attempts, msg_id, _)] = await con.take()
        assert attempts == attempt
        con.send(c.cmd_req(msg_id, 300 if attempt == 2 else 0, f"fail {attempt}"))
    await _json(n, "POST", "/channel/config?topic=t&channel=ch&max_attempts=2")
    await con.nothing(0.8)
    [dead] = (await _json(n, "GET", "/channel/dead?topic=t&channel=ch"))["dead_letters"]
    assert (dead["cause"], dead["attempts"], dead["error"]) == ("spent", 2, "fail 2")
    con.close()
