"""nsqd's HTTP API against a real nsqd subprocess, and against the v1.3.0 reference.

The reference (tests/data/nsqd-v1.3.0.json, key "http") is replayed case by case in
its order: status, Content-Type and body must match, except what describes the
capture run itself (/info's hostname, ports and start_time; /stats times, memory
figures, client addresses and connect times, and the build line of the text
format). Our additive /stats fields (`partitions`, `partition_num`, `ordered`,
`client_count`, `data_free_bytes`, `lookupd`, `journal`, `file_budget`) are checked apart and
removed before comparing.

The /stats cases were captured after TCP traffic the reference does not record;
`stats_scenario` rebuilds it: ref_t gets 5 messages (13 bytes) and a channel c1,
ref_deliver 2 messages (11 bytes: one over HTTP, one from a TCP producer that
stays connected) and a consumer cons1 (hostname h1, user agent capture/1.0, RDY 5)
on channel c. One difference is the capture's own: there a consumer had left
with a message in flight (classic nsqd keeps a gone client's messages in flight
until they time out; we requeue them at once), so its channel showed in_flight 2
with requeue_count 1 and cons1 held 1 message; here cons1 holds both and the
channel's requeue_count is 0 (REF_DELIVER_OVERRIDES). And one is ours by design:
`backend_depth` is the part of `depth` that is on disk, which here is all of it
unless requeued (classic keeps up to --mem-queue-size messages in memory, so its
capture shows 0).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import socket
import struct
import time
from pathlib import Path

import aiohttp
import pytest
import yarl
from hypothesis import given, settings
from hypothesis import strategies as st

from nsqwire.commands import (FrameParser, cmd_fin, cmd_identify, cmd_nop, cmd_pub, cmd_rdy, cmd_req, cmd_sub,
                                parse_message)
from nsqd import httpargs
from nsqwire import httpapi
from nsqwire import protocol as p
from stalled import slow_link, stalled_client

REFERENCE = json.loads((Path(__file__).parent / "data" / "nsqd-v1.3.0.json").read_text())["http"]
ACCEPT_V1 = {"Accept": "application/vnd.nsq; version=1.0"}
JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
# The capture run's own numbers in ref_deliver (see the module docstring).
REF_DELIVER_OVERRIDES = {"channel": {"requeue_count": 0},
                         "client": {"in_flight_count": 2, "message_count": 2}}


# ---- helpers -------------------------------------------------------------------


class Reply:
    def __init__(self, status: int, content_type: str | None, body: bytes, headers):
        self.status = status
        self.content_type = content_type
        self.body = body
        self.headers = headers

    @property
    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode()


async def call(nsqd, method: str, path: str, body: bytes = b"", headers=None) -> Reply:
    async with aiohttp.ClientSession(skip_auto_headers=("Content-Type",)) as session:
        url = yarl.URL(f"http://{nsqd.http_address}{path}", encoded=True)  # sent as written
        async with session.request(method, url,
                                   data=body if body or method in ("POST", "PUT") else None,
                                   headers=headers or {}) as r:
            data = await r.read()
            return Reply(r.status, r.headers.get("Content-Type"), data, r.headers)


async def ok(nsqd, method: str, path: str, body: bytes = b"") -> Reply:
    r = await call(nsqd, method, path, body)
    assert r.status == 200, (path, r.status, r.body)
    return r


async def stats(nsqd, query: str = "") -> dict:
    return (await ok(nsqd, "GET", "/stats?format=json" + query)).json


def find_topic(doc: dict, name: str) -> dict | None:
    return next((t for t in doc["topics"] if t["topic_name"] == name), None)


def find_channel(doc: dict, topic: str, channel: str) -> dict | None:
    t = find_topic(doc, topic)
    return None if t is None else next(
        (c for c in t["channels"] if c["channel_name"] == channel), None)


class Conn:
    """A raw protocol V2 connection driven with nsqclient/commands.py's client helpers."""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        self.frames = FrameParser()
        self.queue: list[tuple[int, bytes]] = []

    @classmethod
    async def open(cls, nsqd, identify: dict | None = None) -> "Conn":
        reader, writer = await asyncio.open_connection("127.0.0.1", nsqd.tcp_port)
        conn = cls(reader, writer)
        writer.write(p.MAGIC_V2)
        if identify is not None:
            writer.write(cmd_identify(identify))
            assert await conn.frame() == (p.FRAME_RESPONSE, b"OK")
        return conn

    @classmethod
    async def consumer(cls, nsqd, topic: str, channel: str, rdy: int,
                       identify: dict | None = None) -> "Conn":
        conn = await cls.open(nsqd, identify)
        conn.writer.write(cmd_sub(topic, channel))
        assert await conn.frame() == (p.FRAME_RESPONSE, b"OK")
        if rdy:
            conn.send(cmd_rdy(rdy))
        return conn

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frame(self, timeout: float = 5.0) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        while not self.queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            data = await asyncio.wait_for(self.reader.read(65536), left)
            if not data:
                raise ConnectionError("closed")
            self.frames.feed(data)
            self.queue.extend(self.frames.frames())
        return self.queue.pop(0)

    async def message(self, timeout: float = 5.0) -> tuple[bytes, bytes, int]:
        """(msg_id, body, attempts) of the next message frame (heartbeats answered)."""
        while True:
            kind, data = await self.frame(timeout)
            if kind == p.FRAME_RESPONSE and data == b"_heartbeat_":
                self.send(cmd_nop())
                continue
            assert kind == p.FRAME_MESSAGE, (kind, data)
            _ts, attempts, msg_id, body = parse_message(data)
            return msg_id, body, attempts

    async def messages(self, n: int, timeout: float = 5.0) -> list[bytes]:
        return [(await self.message(timeout))[1] for _ in range(n)]

    async def no_message(self, wait: float) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await self.message(wait)

    async def closed(self, timeout: float = 5.0) -> bool:
        try:
            while True:
                await self.frame(timeout)
        except ConnectionError:
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


async def eventually(check, timeout: float = 3.0):
    """Retry an async check until it stops raising AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


# ---- the reference, case by case ---------------------------------------------------


def case_request(case: dict) -> tuple[str, str, bytes, dict]:
    method, path = case["request"].split(" ", 1)
    return method, path, case["body_sent"].encode("latin-1"), ACCEPT_V1 if case["accept_v1"] else {}


def strip_ours(doc):
    """The /stats document without our additive fields."""
    doc = copy.deepcopy(doc)
    doc.pop("client_count", None)
    doc.pop("data_free_bytes", None)
    doc.pop("lookupd", None)
    doc.pop("trace", None)  # ours: message trace (test_trace.py)
    doc.pop("journal", None)  # ours: the node journal (checked in test_reference_cases)
    doc.pop("file_budget", None)  # ours: logs with files open (checked there too)
    for t in doc["topics"]:
        for key in ("partitions", "partition_num", "ordered"):
            t.pop(key, None)
        for c in t["channels"]:
            c.pop("partitions", None)
    return doc


def normalize_run(doc: dict, ref: dict) -> dict:
    """Copy the capture-run fields of `ref` into `doc` (after checking they are there)."""
    doc = copy.deepcopy(doc)
    assert isinstance(doc["start_time"], int) and abs(doc["start_time"] - time.time()) < 600
    doc["start_time"] = ref["start_time"]
    if "memory" in ref:
        assert set(doc["memory"]) == set(ref["memory"])
        assert all(isinstance(v, int) for v in doc["memory"].values())
        doc["memory"] = ref["memory"]
    ref_clients = [c for t in ref["topics"] for ch in t["channels"] for c in ch["clients"]]
    ref_clients += ref["producers"]
    clients = [c for t in doc["topics"] for ch in t["channels"] for c in ch["clients"]]
    clients += doc["producers"]
    assert len(clients) == len(ref_clients)
    for mine, theirs in zip(clients, ref_clients):
        assert re.fullmatch(r"127\.0\.0\.1:\d+", mine["remote_address"])
        assert abs(mine["connect_ts"] - time.time()) < 600
        mine["remote_address"] = theirs["remote_address"]
        mine["connect_ts"] = theirs["connect_ts"]
    return doc


def expected_stats(ref: dict) -> dict:
    ref = copy.deepcopy(ref)
    for t in ref["topics"]:  # every message is on disk: backend_depth is the unread part
        t["backend_depth"] = t["depth"]
        for c in t["channels"]:
            c["backend_depth"] = c["depth"]
    t = find_topic(ref, "ref_deliver")
    if t is not None:
        for c in t["channels"]:
            c.update(REF_DELIVER_OVERRIDES["channel"])
            for client in c["clients"]:
                client.update(REF_DELIVER_OVERRIDES["client"])
    return ref


def normalize_text(text: str) -> str:
    text = re.sub(r"^nsqd v1\.3\.0 \(built w/[^)]*\)$", "nsqd v1.3.0 (built)", text, flags=re.M)
    text = re.sub(r"^start_time \S+$", "start_time T", text, flags=re.M)
    text = re.sub(r"^uptime \S+$", "uptime U", text, flags=re.M)
    text = re.sub(r"^(   \w+ +\t)\d+$", r"\g<1>N", text, flags=re.M)
    text = re.sub(r"connected: \S+$", "connected: D", text, flags=re.M)
    text = re.sub(r"(\[V2 [^ :]+(?::[^ :]+)*):\d+ ", r"\1:PORT ", text)
    return text


def expected_text(ref_text: str) -> str:
    """The reference text with backend depths and REF_DELIVER_OVERRIDES as expected_stats."""
    text = re.sub(r"depth: (\d+) +be-depth: \d+ +",
                  lambda m: f"depth: {m[1]:<5} be-depth: {m[1]:<5} ", ref_text)
    text = text.replace("inflt: 2    def: 0    re-q: 1     timeout: 0     msgs: 2 ",
                            "inflt: 2    def: 0    re-q: 0     timeout: 0     msgs: 2 ")
    return text.replace("state: 3 inflt: 1    rdy: 5    fin: 0        re-q: 0        msgs: 1 ",
                        "state: 3 inflt: 2    rdy: 5    fin: 0        re-q: 0        msgs: 2 ")


async def stats_scenario(nsqd) -> list[Conn]:
    """Rebuild the TCP side of the capture (see the module docstring)."""
    await ok(nsqd, "POST", "/mpub?topic=ref_t", b"aa\nbb\nccc\nddd\neee\n")
    await ok(nsqd, "POST", "/channel/create?topic=ref_t&channel=c1")
    await ok(nsqd, "POST", "/pub?topic=ref_deliver", b"hello")
    producer = await Conn.open(nsqd)
    producer.send(cmd_pub("ref_deliver", b"world!"))
    assert await producer.frame() == (p.FRAME_RESPONSE, b"OK")
    consumer = await Conn.consumer(nsqd, "ref_deliver", "c", 5, identify={
        "client_id": "cons1", "hostname": "h1", "user_agent": "capture/1.0"})
    assert sorted(await consumer.messages(2)) == [b"hello", b"world!"]
    # keep the producer's connection younger than the consumer's, as in the capture
    return [consumer, producer]


async def test_reference_cases(nsqd):
    conns: list[Conn] = []
    try:
        for i, case in enumerate(REFERENCE):
            method, path, body, headers = case_request(case)
            if path.startswith("/stats") and not conns:
                conns = await stats_scenario(nsqd)
            r = await call(nsqd, method, path, body, headers)
            where = f"case {i}: {case['request']}"
            assert r.status == case["status"], where
            assert r.content_type == case["content_type"], where
            if case["json"] is None:
                if path.startswith("/stats"):
                    expected = normalize_text(expected_text(case["text"]))
                    assert normalize_text(r.text) == expected, where
                else:
                    assert r.text == case["text"], where
                continue
            got = r.json
            if path == "/info":
                assert got["hostname"] == socket.gethostname(), where
                assert (got["http_port"], got["tcp_port"]) == (nsqd.http_port, nsqd.tcp_port)
                got = {**got, **{k: case["json"][k] for k in ("hostname", "http_port",
                                                              "tcp_port", "start_time")}}
            elif path.startswith("/stats"):
                assert got["client_count"] == 2
                assert got["journal"]["failed"] is False  # ours: the node journal, on by default
                budget = got["file_budget"]  # ours: logs with files open (diskqueue/budget.py)
                assert 0 < budget["held"] <= budget["limit"] and budget["waiting"] == 0
                for t in got["topics"]:
                    assert [p_["partition"] for p_ in t["partitions"]] == [0]
                got = normalize_run(strip_ours(got), case["json"])
                assert got == expected_stats(case["json"]), where
                continue
            assert got == case["json"], where
            if r.status != 200:  # errors: exactly Go's bytes
                assert r.body == json.dumps(case["json"], separators=(",", ":")).encode()
    finally:
        for c in conns:
            await c.close()


async def test_v1_header_and_options(nsqd):
    r = await call(nsqd, "GET", "/info")
    assert r.headers["X-NSQ-Content-Type"] == "nsq; version=1.0"
    r = await call(nsqd, "POST", "/topic/create?topic=x")
    assert r.headers["X-NSQ-Content-Type"] == "nsq; version=1.0"
    assert "Content-Type" not in r.headers and r.body == b""
    r = await call(nsqd, "DELETE", "/pub")
    assert (r.status, r.json) == (405, {"message": "METHOD_NOT_ALLOWED"})
    assert "POST" in r.headers["Allow"]
    r = await call(nsqd, "OPTIONS", "/pub")
    assert r.status == 200 and "POST" in r.headers["Allow"]
    r = await call(nsqd, "GET", "/ping")
    assert (r.status, r.content_type, r.body) == (200, TEXT_TYPE, b"OK")
    # a client's odd IDENTIFY strings (a lone surrogate escape) never break /stats
    conn = await Conn.consumer(nsqd, "x", "c", 1, identify={"user_agent": "\ud800<&>"})
    try:
        (client,) = find_channel(await stats(nsqd), "x", "c")["clients"]
        assert client["user_agent"] == "\ufffd<&>"
        assert "\ufffd<&>" in (await ok(nsqd, "GET", "/stats")).text
    finally:
        await conn.close()


# ---- publishing and consuming ----------------------------------------------------------


async def test_pub_then_consume_same_bytes(nsqd):
    body = bytes(range(256)) * 4 + b"\n\r\x00end"
    await ok(nsqd, "POST", "/pub?topic=bytes", body)
    conn = await Conn.consumer(nsqd, "bytes", "c", 10)
    try:
        msg_id, got, attempts = await conn.message()
        assert got == body and attempts == 1
        assert p.msg_id_partition(int(msg_id, 16)) == 0
    finally:
        await conn.close()


async def test_mpub_text_and_binary_in_order(nsqd):
    conn = await Conn.consumer(nsqd, "multi", "c", 100)
    try:
        r = await ok(nsqd, "POST", "/mpub?topic=multi", b"one\ntwo\n\nthree")
        assert (r.content_type, r.body) == (TEXT_TYPE, b"OK")
        bodies = [b"\x00\x01", b"x" * 1000, b"\n"]
        binary = struct.pack(">i", len(bodies)) + b"".join(
            struct.pack(">i", len(b)) + b for b in bodies)
        await ok(nsqd, "POST", "/mpub?topic=multi&binary=true", binary)
        assert await conn.messages(6) == [b"one", b"two", b"three", *bodies]
        # an empty text body publishes nothing and says OK, as classic nsqd
        await ok(nsqd, "POST", "/mpub?topic=multi", b"")
        await conn.no_message(0.3)
    finally:
        await conn.close()
    t = find_topic(await stats(nsqd), "multi")
    assert t["message_count"] == 6
    assert t["message_bytes"] == len(b"onetwothree") + sum(map(len, bodies))


async def test_pub_is_durable_before_ok(nsqd):
    await ok(nsqd, "POST", "/pub?topic=durable", b"kept")
    await ok(nsqd, "POST", "/mpub?topic=durable", b"a\nb")
    nsqd.kill()  # SIGKILL right after the OKs
    nsqd.start()
    conn = await Conn.consumer(nsqd, "durable", "c", 10)
    try:
        assert await conn.messages(3) == [b"kept", b"a", b"b"]
    finally:
        await conn.close()


async def test_defer_delays_delivery(nsqd):
    conn = await Conn.consumer(nsqd, "later", "c", 10)
    try:
        t0 = time.monotonic()
        await ok(nsqd, "POST", "/pub?topic=later&defer=700", b"deferred")
        await ok(nsqd, "POST", "/pub?topic=later", b"now")
        assert (await conn.message())[1] == b"now"
        doc = await stats(nsqd)
        assert find_channel(doc, "later", "c")["deferred_count"] == 1
        msg_id, body, _ = await conn.message(5)
        assert body == b"deferred"
        assert time.monotonic() - t0 >= 0.6
    finally:
        await conn.close()


async def test_topic_pause_and_unpause(nsqd):
    conn = await Conn.consumer(nsqd, "pt", "c", 10)
    try:
        await ok(nsqd, "POST", "/topic/pause?topic=pt")
        assert find_topic(await stats(nsqd), "pt")["paused"] is True
        await ok(nsqd, "POST", "/pub?topic=pt", b"held")
        await conn.no_message(0.4)
        await ok(nsqd, "POST", "/topic/unpause?topic=pt")
        assert (await conn.message())[1] == b"held"
        assert find_topic(await stats(nsqd), "pt")["paused"] is False
    finally:
        await conn.close()


async def test_channel_pause_and_unpause_persist(nsqd):
    conn = await Conn.consumer(nsqd, "pc", "c", 10)
    try:
        await ok(nsqd, "POST", "/channel/pause?topic=pc&channel=c")
        await ok(nsqd, "POST", "/pub?topic=pc", b"held")
        await conn.no_message(0.4)
        await ok(nsqd, "POST", "/channel/unpause?topic=pc&channel=c")
        assert (await conn.message())[1] == b"held"
    finally:
        await conn.close()
    # the paused state survives a restart (stored at once, as classic PersistMetadata)
    await ok(nsqd, "POST", "/channel/pause?topic=pc&channel=c")
    await ok(nsqd, "POST", "/topic/pause?topic=pc")
    nsqd.kill()
    nsqd.start()
    doc = await stats(nsqd)
    assert find_topic(doc, "pc")["paused"] is True
    assert find_channel(doc, "pc", "c")["paused"] is True


async def test_empty_drops_backlog(nsqd):
    # a channel's backlog
    await ok(nsqd, "POST", "/topic/create?topic=e1")
    await ok(nsqd, "POST", "/channel/create?topic=e1&channel=c")
    await ok(nsqd, "POST", "/mpub?topic=e1", b"1\n2\n3")
    assert find_channel(await stats(nsqd), "e1", "c")["depth"] == 3
    await ok(nsqd, "POST", "/channel/empty?topic=e1&channel=c")
    assert find_channel(await stats(nsqd), "e1", "c")["depth"] == 0
    conn = await Conn.consumer(nsqd, "e1", "c", 10)
    try:
        await conn.no_message(0.3)
        await ok(nsqd, "POST", "/pub?topic=e1", b"after")
        assert (await conn.message())[1] == b"after"
    finally:
        await conn.close()
    # a topic's backlog (no channel yet): a channel made afterwards starts empty
    await ok(nsqd, "POST", "/mpub?topic=e2", b"1\n2\n3")
    assert find_topic(await stats(nsqd), "e2")["depth"] == 3
    await ok(nsqd, "POST", "/topic/empty?topic=e2")
    assert find_topic(await stats(nsqd), "e2")["depth"] == 0
    await ok(nsqd, "POST", "/channel/create?topic=e2&channel=c")
    assert find_channel(await stats(nsqd), "e2", "c")["depth"] == 0
    await ok(nsqd, "POST", "/pub?topic=e2", b"4")
    assert find_channel(await stats(nsqd), "e2", "c")["depth"] == 1


async def test_delete_channel_and_topic(nsqd):
    await ok(nsqd, "POST", "/pub?topic=gone", b"x")
    conn = await Conn.consumer(nsqd, "gone", "c", 0)
    await ok(nsqd, "POST", "/channel/create?topic=gone&channel=d")
    try:
        await ok(nsqd, "POST", "/channel/delete?topic=gone&channel=c")
        assert await conn.closed()  # its clients are disconnected
        doc = await stats(nsqd)
        assert [c["channel_name"] for c in find_topic(doc, "gone")["channels"]] == ["d"]
        r = await call(nsqd, "POST", "/channel/delete?topic=gone&channel=c")
        assert (r.status, r.json) == (404, {"message": "CHANNEL_NOT_FOUND"})
        await ok(nsqd, "POST", "/topic/delete?topic=gone")
        assert find_topic(await stats(nsqd), "gone") is None
        r = await call(nsqd, "POST", "/topic/delete?topic=gone")
        assert (r.status, r.json) == (404, {"message": "TOPIC_NOT_FOUND"})
        # a topic made again under the name starts from nothing
        await ok(nsqd, "POST", "/topic/create?topic=gone")
        assert find_topic(await stats(nsqd), "gone")["depth"] == 0
    finally:
        await conn.close()


async def test_sync_every_and_sync_timeout_flags(tmp_path):
    """--sync-every N: batches are written without a sync until N messages wait;
    --sync-timeout T: what waits is synced T after it was written anyway."""
    from servers import NsqdProcess

    nsqd = NsqdProcess(str(tmp_path / "lazy"), "--sync-every", "1000",
                       "--sync-timeout", "300ms").start()
    try:
        for i in range(10):
            await ok(nsqd, "POST", "/pub?topic=t", b"m%d" % i)
        gc = find_topic(await stats(nsqd), "t")["partitions"][0]["group_commit"]
        assert (gc["batches"], gc["syncs"]) == (10, 0)
        await asyncio.sleep(0.6)
        gc = find_topic(await stats(nsqd), "t")["partitions"][0]["group_commit"]
        assert gc["syncs"] == 1, "the timed sync did not come"
    finally:
        nsqd.kill()


async def test_a_topic_may_have_its_own_sync_policy(nsqd):
    """/topic/create?sync_every=&sync_timeout= gives one topic a lazier policy (or back to
    durable); others keep the node's; it survives a restart."""
    await ok(nsqd, "POST", "/topic/create?topic=lazy&sync_every=1000&sync_timeout=5s")
    await ok(nsqd, "POST", "/topic/create?topic=strict")
    for i in range(20):
        await ok(nsqd, "POST", "/pub?topic=lazy", b"l%d" % i)
        await ok(nsqd, "POST", "/pub?topic=strict", b"s%d" % i)

    def part(doc, name):
        return find_topic(doc, name)["partitions"][0]

    doc = await stats(nsqd)
    lazy, strict = part(doc, "lazy"), part(doc, "strict")
    assert (lazy["sync_every"], lazy["sync_timeout_ms"]) == (1000, 5000)
    assert (strict["sync_every"], strict["sync_timeout_ms"]) == (1, 0)
    assert lazy["group_commit"]["syncs"] == 0 and lazy["group_commit"]["batches"] == 20
    assert strict["group_commit"]["syncs"] == strict["group_commit"]["batches"] == 20
    for bad, code in (("sync_every=0", "INVALID_SYNC_EVERY"), ("sync_every=x", "INVALID_SYNC_EVERY"),
                      ("sync_timeout=soon", "INVALID_SYNC_TIMEOUT")):
        r = await call(nsqd, "POST", f"/topic/create?topic=lazy&{bad}")
        assert (r.status, r.json) == (400, {"message": code})
    nsqd.stop()
    nsqd.start()
    assert part(await stats(nsqd), "lazy")["sync_every"] == 1000
    await ok(nsqd, "POST", "/topic/create?topic=lazy&syncdisk=1")  # durable again, at once
    assert part(await stats(nsqd), "lazy")["sync_every"] == 1
    await ok(nsqd, "POST", "/pub?topic=lazy", b"now durable")
    assert part(await stats(nsqd), "lazy")["group_commit"]["syncs"] == 1


async def test_dot_names_stay_inside_the_data_path(nsqd, tmp_path):
    """`.` and `..` are legal NSQ names: they must name topics and channels like any
    other, never folders around the data path."""
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "keep").write_text("untouched")
    await ok(nsqd, "POST", "/mpub?topic=keep", b"k1\nk2")
    await ok(nsqd, "POST", "/channel/create?topic=keep&channel=c")
    for name in (".", ".."):
        await ok(nsqd, "POST", f"/pub?topic={name}", b"dot")
        await ok(nsqd, "POST", f"/channel/create?topic=keep&channel={name}")
        await ok(nsqd, "POST", f"/channel/delete?topic=keep&channel={name}")
        await ok(nsqd, "POST", f"/topic/delete?topic={name}")
    assert (beside / "keep").read_text() == "untouched"
    assert sorted(os.listdir(tmp_path)) == ["beside", "nsqd"]
    assert find_channel(await stats(nsqd), "keep", "c")["depth"] == 2
    conn = await Conn.consumer(nsqd, "keep", "c", 10)
    try:
        assert sorted([(await conn.message())[1] for _ in range(2)]) == [b"k1", b"k2"]
    finally:
        await conn.close()


# ---- /stats numbers ---------------------------------------------------------------------------


async def test_stats_numbers_after_known_sequence(nsqd):
    await ok(nsqd, "POST", "/mpub?topic=num", b"m1\nm2\nm3\nm4\nm5")
    conn = await Conn.consumer(nsqd, "num", "c", 2, identify={"client_id": "k1", "hostname": "hk"})
    try:
        first, _, _ = await conn.message()
        second, _, _ = await conn.message()
        conn.send(cmd_fin(first))
        conn.send(cmd_req(second, 0))

        async def settled():
            doc = await stats(nsqd, "&topic=num")
            t = doc["topics"][0]
            c = t["channels"][0]
            assert (t["message_count"], t["message_bytes"], t["depth"]) == (5, 10, 0)
            assert c["message_count"] == 5
            assert c["requeue_count"] == 1
            assert c["in_flight_count"] == 2  # the requeued one went out again, and m3
            assert c["depth"] == 2  # m4, m5
            assert c["client_count"] == 1
            (client,) = c["clients"]
            assert (client["client_id"], client["hostname"], client["state"]) == ("k1", "hk", 3)
            assert (client["ready_count"], client["in_flight_count"]) == (2, 2)
            assert (client["finish_count"], client["requeue_count"]) == (1, 1)
            assert client["message_count"] == 4
            (part,) = c["partitions"]
            assert part["window"] == 2 and part["confirmed_count"] == 1  # m2, m3
            assert part["backend_depth"] == 2
            return doc

        doc = await eventually(settled)
        gc = doc["topics"][0]["partitions"][0]["group_commit"]
        assert gc["batch_messages_total"] == 5 and gc["batches"] >= 1
        assert sum(gc["batch_messages_histogram"]["counts"]) == gc["batches"]
        # filters
        assert (await stats(nsqd, "&topic=nope"))["topics"] == []
        assert (await stats(nsqd, "&topic=num&channel=nope"))["topics"] == []
        doc = await stats(nsqd, "&include_clients=false&include_mem=false")
        assert "memory" not in doc and doc["producers"] == []
        assert find_channel(doc, "num", "c")["clients"] == []
        assert find_channel(doc, "num", "c")["client_count"] == 1
    finally:
        await conn.close()
    text = (await ok(nsqd, "GET", "/stats?topic=num")).text
    assert re.search(r"^   \[num            \] depth: 0     be-depth: 0     msgs: 5  ", text, re.M)


# ---- /metrics ----------------------------------------------------------------------------------


_SAMPLE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_metrics(text: str) -> tuple[dict, dict]:
    """Prometheus text -> ({(name, frozenset(labels)): value}, {family: type})."""
    samples, types = {}, {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"family {name} twice"
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.fullmatch(line)
        assert m, line
        name, raw_labels, value = m.groups()
        labels = {}
        if raw_labels:
            pos = 0
            for lm in _LABEL.finditer(raw_labels):
                assert lm.start() == pos, line
                labels[lm[1]] = lm[2].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                pos = lm.end()
            assert pos == len(raw_labels), line
        key = (name, frozenset(labels.items()))
        assert key not in samples, f"duplicate {line}"
        samples[key] = float(value)
    return samples, types


def metric(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset((k, str(v)) for k, v in labels.items()))]


async def test_metrics(nsqd):
    await ok(nsqd, "POST", "/mpub?topic=met", b"a\nbb\nccc")
    conn = await Conn.consumer(nsqd, "met", "c", 1)
    producer = await Conn.open(nsqd)
    try:
        await conn.message()
        producer.send(cmd_pub("met", b"dddd"))
        assert await producer.frame() == (p.FRAME_RESPONSE, b"OK")
        r = await ok(nsqd, "GET", "/metrics")
        assert r.content_type == "text/plain; version=0.0.4; charset=utf-8"
        samples, types = parse_metrics(r.text)
        ch = {"topic": "met", "partition": 0, "channel": "c"}
        part = {"topic": "met", "partition": 0}
        assert metric(samples, "nsqd_channel_depth", **ch) == 3
        assert metric(samples, "nsqd_channel_in_flight", **ch) == 1
        assert metric(samples, "nsqd_channel_deferred", **ch) == 0
        assert metric(samples, "nsqd_channel_requeued", **ch) == 0
        assert metric(samples, "nsqd_channel_clients", **ch) == 1
        assert metric(samples, "nsqd_channel_messages_total", **ch) == 4
        assert metric(samples, "nsqd_channel_timeouts_total", **ch) == 0
        assert metric(samples, "nsqd_topic_messages_total", topic="met") == 4
        assert metric(samples, "nsqd_topic_message_bytes_total", topic="met") == 10
        assert metric(samples, "nsqd_clients") == 2
        assert metric(samples, "nsqd_producers") == 1
        assert metric(samples, "nsqd_up") == 1
        assert types["nsqd_channel_messages_total"] == "counter"
        assert types["nsqd_channel_depth"] == "gauge"
        assert types["nsqd_group_commit_batch_messages"] == "histogram"
        # group commit: 2 write requests (one MPUB of 3, one PUB) -> 4 messages
        count = metric(samples, "nsqd_group_commit_batch_messages_count", **part)
        assert 1 <= count <= 2
        assert metric(samples, "nsqd_group_commit_batch_messages_sum", **part) == 4
        inf = metric(samples, "nsqd_group_commit_batch_messages_bucket", le="+Inf", **part)
        assert inf == count
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in samples.items()
                         if k[0] == "nsqd_group_commit_batch_messages_bucket"
                         and dict(k[1])["topic"] == "met")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        syncs = metric(samples, "nsqd_group_commit_sync_seconds_count", **part)
        assert syncs >= count  # durable default: every batch is synced
        assert metric(samples, "nsqd_group_commit_sync_seconds_sum", **part) > 0
    finally:
        await conn.close()
        await producer.close()


# ---- bad input -------------------------------------------------------------------------------


def mpub_binary(*sizes_and_bodies) -> bytes:
    return b"".join(struct.pack(">i", x) if isinstance(x, int) else x for x in sizes_and_bodies)


BAD_REQUESTS = [
    ("POST", "/pub?topic=bad&defer=abc", b"x", 400, "INVALID_DEFER"),
    ("POST", "/pub?topic=bad&defer=259200001", b"x", 400, "INVALID_DEFER"),  # > 72h
    ("POST", "/pub?topic=%zz", b"x", 400, "INVALID_REQUEST"),
    ("POST", "/pub?topic=a;b", b"x", 400, "INVALID_REQUEST"),
    ("POST", "/pub?topic=" + "x" * 65, b"x", 400, "INVALID_TOPIC"),
    ("POST", "/pub?topic=bad&partition=x", b"x", 400, "BAD_PARTITION"),
    ("POST", "/pub?topic=bad&partition=7", b"x", 400, "BAD_PARTITION"),
    ("POST", "/pub?topic=bad", b"x" * 101, 413, "MSG_TOO_BIG"),
    ("POST", "/mpub?topic=bad", b"ok\n" + b"x" * 101, 413, "MSG_TOO_BIG"),
    ("POST", "/mpub?topic=bad", b"x\n" * 600, 413, "BODY_TOO_BIG"),
    ("POST", "/mpub", b"x", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(0), 413, "BAD_BODY"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(-1), 413, "BAD_BODY"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(1_000_000), 413, "BAD_BODY"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(2, 1, b"a"), 413, "BAD_MESSAGE"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(1, 0), 413, "BAD_MESSAGE"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(1, 5, b"ab"), 413, "BAD_MESSAGE"),
    ("POST", "/mpub?topic=bad&binary=true", mpub_binary(1, 101, b"x" * 101), 413, "BAD_MESSAGE"),
    ("POST", "/topic/create", b"", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/topic/empty?topic=bad*", b"", 400, "INVALID_TOPIC"),
    ("POST", "/topic/pause?topic=nope", b"", 404, "TOPIC_NOT_FOUND"),
    ("POST", "/topic/unpause", b"", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/channel/create?topic=bad*&channel=c", b"", 400, "INVALID_ARG_TOPIC"),
    ("POST", "/channel/create?channel=c", b"", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/channel/create?topic=exists&channel=c*", b"", 400, "INVALID_ARG_CHANNEL"),
    ("POST", "/channel/create?topic=nope&channel=c", b"", 404, "TOPIC_NOT_FOUND"),
    ("POST", "/channel/empty?topic=exists&channel=nope", b"", 404, "CHANNEL_NOT_FOUND"),
    ("POST", "/channel/pause?topic=exists&channel=nope", b"", 404, "CHANNEL_NOT_FOUND"),
    ("POST", "/channel/delete?topic=exists&channel=c&partition=3", b"", 400, "BAD_PARTITION"),
    ("GET", "/stats?topic=%", b"", 400, "INVALID_REQUEST"),
    ("GET", "/config/nope", b"", 400, "INVALID_OPTION"),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b"", 413, "INVALID_VALUE"),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b"{not json", 400, "INVALID_VALUE"),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b'[1, 2]', 400, "INVALID_VALUE"),
    ("PUT", "/config/nsqlookupd_tcp_addresses", b'["127.0.0.1:4160", "nohost"]', 400,
     "INVALID_VALUE"),
    ("PUT", "/config/max_msg_size", b"5", 400, "INVALID_OPTION"),
    ("PUT", "/pub?topic=x", b"x", 405, "METHOD_NOT_ALLOWED"),
    ("GET", "/topic/create?topic=x", b"", 405, "METHOD_NOT_ALLOWED"),
    ("GET", "/config/a/b", b"", 404, "NOT_FOUND"),
]


@pytest.fixture
def small_nsqd(tmp_path):
    from servers import NsqdProcess

    proc = NsqdProcess(str(tmp_path / "small"), "--max-msg-size", "100",
                       "--max-body-size", "1000").start()
    yield proc
    proc.kill()


async def test_legacy_envelope_when_asked_for(tmp_path):
    """--http-legacy-envelope: requests without the V1 Accept header get older nsqd's
    {status_code, status_txt, data}; with the header, or without the flag, V1 answers."""
    from servers import NsqdProcess

    nsqd = NsqdProcess(str(tmp_path / "legacy"), "--http-legacy-envelope").start()
    try:
        await ok(nsqd, "POST", "/pub?topic=env", b"x")
        r = await call(nsqd, "GET", "/stats?format=json&topic=env")
        assert r.status == 200 and r.json["status_code"] == 200 and r.json["status_txt"] == "OK"
        assert r.json["data"]["topics"][0]["topic_name"] == "env"
        r = await call(nsqd, "GET", "/stats?format=json&topic=env", headers=ACCEPT_V1)
        assert "status_code" not in r.json and r.json["topics"][0]["topic_name"] == "env"
        r = await call(nsqd, "POST", "/topic/delete?topic=nope")
        assert (r.status, r.json) == (404, {"status_code": 404, "status_txt": "TOPIC_NOT_FOUND",
                                            "data": None})
        r = await call(nsqd, "GET", "/ping")
        assert (r.status, r.text) == (200, "OK")
    finally:
        nsqd.kill()


async def test_bad_input_gets_4xx_json(small_nsqd):
    nsqd = small_nsqd
    await ok(nsqd, "POST", "/topic/create?topic=exists")
    for method, path, body, status, code in BAD_REQUESTS:
        r = await call(nsqd, method, path, body)
        assert (r.status, r.content_type) == (status, JSON_TYPE), (method, path, r.body)
        assert r.json == {"message": code}, (method, path)
    # nothing of it was published, and no topic was made by a refused request
    doc = await stats(nsqd)
    assert [t["topic_name"] for t in doc["topics"]] == ["exists"]
    assert find_topic(doc, "exists")["message_count"] == 0


async def test_oversized_bodies_are_not_buffered(small_nsqd):
    """Bodies without Content-Length (chunked) are cut at the limit + 1 byte."""
    nsqd = small_nsqd

    async def chunks(n, size):
        for _ in range(n):
            yield b"y" * size

    async with aiohttp.ClientSession() as session:
        url = f"http://{nsqd.http_address}"
        async with session.post(url + "/pub?topic=big", data=chunks(1000, 1000)) as r:
            assert (r.status, await r.json()) == (413, {"message": "MSG_TOO_BIG"})
        async with session.post(url + "/mpub?topic=big", data=chunks(1000, 1000)) as r:
            assert (r.status, await r.json()) == (413, {"message": "BODY_TOO_BIG"})
        async with session.post(url + "/pub?topic=big", data=chunks(2, 50)) as r:
            assert (r.status, await r.text()) == (200, "OK")
    await ok(nsqd, "GET", "/ping")


async def test_a_reader_that_takes_nothing_of_topic_read_is_dropped(node, monkeypatch, tmp_path):
    """/topic/read to a reader that takes nothing: once TAKE_S passes with no chunk taken,
    its connection is dropped without the answer's last chunk and the segment's descriptor
    is closed (before, both stayed for as long as the reader stayed connected). The node's
    sends go through a 4 KiB socket buffer, as on a slow link."""
    from nsqd import readhttp

    monkeypatch.setattr(readhttp, "TAKE_S", 0.5)
    slow_link(monkeypatch, readhttp, "stream")
    n = await node()
    body = b"r" * 100_000
    mpub = struct.pack(">I", 20) + (struct.pack(">I", len(body)) + body) * 20
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{n.http_port}/mpub?topic=r&binary=true",
                             data=mpub) as r:
            assert r.status == 200, await r.text()

    def segments_open() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}").endswith(".dat")
                   for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    loop = asyncio.get_running_loop()
    got = b""
    before = segments_open()  # the log's own (its writer's), until its release
    stalled = await stalled_client(n.http_port, b"GET /topic/read?topic=r&partition=0&offset=0 "
                                                b"HTTP/1.1\r\nHost: n\r\n\r\n")
    try:
        await asyncio.sleep(0.2)
        during = segments_open()  # and the stream's own
        await asyncio.sleep(1.0)  # nothing taken: dropped once TAKE_S passed
        async with asyncio.timeout(5):
            while True:
                try:
                    data = await loop.sock_recv(stalled, 65536)
                except ConnectionResetError:
                    break
                if not data:
                    break
                got += data
    finally:
        stalled.close()
    assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"0\r\n\r\n")
    # dropped: only what the kernel's buffers held comes, not the rest of the 1 MiB chunk
    # a close would wait to send first
    assert len(got) < 256 * 1024, len(got)
    after = segments_open()
    assert after <= before and during > after, (before, during, after)


async def _until_closed(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection, within `seconds`."""
    got = b""
    async with asyncio.timeout(seconds):
        while chunk := await reader.read(65536):
            got += chunk
    return got


async def test_a_body_that_stops_coming_is_408(node, monkeypatch):
    """A client that sends part of a body and stops: 408 BODY_TIMEOUT once BODY_S passes,
    nothing published (before, the request waited for as long as the client stayed
    connected)."""
    monkeypatch.setattr(httpapi, "BODY_S", 0.5)
    n = await node()
    reader, writer = await asyncio.open_connection("127.0.0.1", n.http_port)
    got = b""
    try:
        writer.write(b"POST /pub?topic=slow HTTP/1.1\r\nHost: n\r\nContent-Length: 100\r\n\r\n"
                     + b"x" * 10)
        async with asyncio.timeout(5):
            while not got.endswith(b"}"):
                got += await reader.read(65536)
    finally:
        writer.close()
    assert got.startswith(b"HTTP/1.1 408 ") and got.endswith(b'{"message":"BODY_TIMEOUT"}'), got
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{n.http_port}/stats?format=json&topic=slow") as r:
            assert sum(t["message_count"] for t in (await r.json())["topics"]) == 0


async def test_half_a_request_line_is_closed_after_idle_s(node, monkeypatch):
    """A client that sends half a request line and stops is closed once IDLE_S passes
    (aiohttp's default, an hour, let it hold a descriptor that long); a whole request on
    another connection is answered meanwhile."""
    monkeypatch.setattr(httpapi, "IDLE_S", 0.5)
    n = await node()
    reader, writer = await asyncio.open_connection("127.0.0.1", n.http_port)
    try:
        writer.write(b"GET /pi")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{n.http_port}/ping") as r:
                assert (r.status, await r.text()) == (200, "OK")
        assert await _until_closed(reader, 5) == b""
    finally:
        writer.close()


async def raw_http(nsqd, data: bytes, half_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", nsqd.http_port)
    try:
        writer.write(data)
        if half_close:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


async def test_broken_bodies_never_500(nsqd):
    cut = await raw_http(nsqd, b"POST /pub?topic=cut HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Length: 10\r\n\r\nabc", half_close=True)
    # a half-close ends what the client sends, not what it reads: it is told why
    assert cut.startswith(b"HTTP/1.1 400") and b'{"message":"BAD_BODY"}' in cut, cut
    cut_chunked = await raw_http(nsqd, b"POST /pub?topic=cut HTTP/1.1\r\nHost: x\r\n"
                                       b"Transfer-Encoding: chunked\r\n\r\n5\r\nab",
                                 half_close=True)
    assert cut_chunked.startswith(b"HTTP/1.1 400") and b"BAD_BODY" in cut_chunked, cut_chunked
    whole = await raw_http(nsqd, b"POST /pub?topic=whole HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 3\r\n\r\nabc", half_close=True)
    assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b"OK"), whole
    bad_chunk = await raw_http(nsqd, b"POST /mpub?topic=cut HTTP/1.1\r\nHost: x\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
    # broken framing is refused by aiohttp's parser itself (plain text, as Go's net/http)
    assert re.match(rb"HTTP/1\.[01] 400 ", bad_chunk), bad_chunk
    assert find_topic(await stats(nsqd), "cut") is None
    await ok(nsqd, "GET", "/ping")


async def test_malformed_requests_log_one_line_each(nsqd):
    """A client's malformed request costs one log line, never a traceback (which would let
    a client fill the log cheaply), and is answered 400."""
    bad = [b"GARBAGE\r\n\r\n",
           b"POST /pub?topic=t HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
           b"POST /pub?topic=t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"zz\r\n",
           b"GET /ping HTTP/1.1\r\nBad Header\r\n\r\n"]
    for request in bad:
        for half_close in (False, True):
            answer = await raw_http(nsqd, request, half_close)
            assert re.match(rb"HTTP/1\.[01] 400 ", answer), (request, half_close, answer)
    await ok(nsqd, "GET", "/ping")
    log = nsqd.log()
    assert "Traceback" not in log, log
    assert 0 < log.count("http_bad_request") <= 2 * len(bad), log
    assert len(log.splitlines()) <= 2 * len(bad) + 1, log  # + the start line


async def test_config_lookupd_addresses(nsqd):
    r = await ok(nsqd, "GET", "/config/nsqlookupd_tcp_addresses")
    assert r.json == []
    r = await ok(nsqd, "PUT", "/config/nsqlookupd_tcp_addresses", b'["127.0.0.1:4160"]')
    assert r.json == ["127.0.0.1:4160"]
    assert (await ok(nsqd, "GET", "/config/nsqlookupd_tcp_addresses")).json == ["127.0.0.1:4160"]
    assert (await ok(nsqd, "GET", "/config/msg_timeout")).json == 60_000_000_000
    assert (await ok(nsqd, "GET", "/config/max_msg_size")).json == 1024 * 1024


# ---- pure parts, by property -----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_mpub_binary_parser_never_crashes(body):
    try:
        out = httpargs.parse_mpub_binary(body, 16, 1000)
    except httpargs.HTTPError as e:
        assert e.status == 413 and e.code in ("BAD_BODY", "BAD_MESSAGE")
    else:
        assert out and all(1 <= len(m) <= 16 for m in out)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=16), min_size=1, max_size=8))
def test_mpub_binary_round_trip(bodies):
    raw = struct.pack(">i", len(bodies)) + b"".join(struct.pack(">i", len(b)) + b for b in bodies)
    assert httpargs.parse_mpub_binary(raw, 16, 1000) == bodies


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4))
def test_parse_query_round_trip(params):
    from urllib.parse import urlencode

    assert httpapi.parse_query(urlencode(params)) == {k: [v] for k, v in params.items()}


def test_go_json_escapes_like_go():
    assert httpapi.go_json({"m": "<a&b>"}) == b'{"m":"\\u003ca\\u0026b\\u003e"}'
    assert httpapi.go_json({"m": "\ud800é"}) == '{"m":"\ufffdé"}'.encode()


def test_go_json_pieces_are_go_json_an_item_at_a_time():
    doc = {"count": 2, "messages": [{"a": "\ud800é", "n": [1, 2]}, {}], "limit": 10,
           "note": "<&>", "other": [], "more": ["x"]}
    pieces = list(httpapi.go_json_pieces(doc, "messages", "other", "more"))
    assert b"".join(pieces) == httpapi.go_json(doc)
    assert b'{"a":"\xef\xbf\xbd\xc3\xa9","n":[1,2]}' in pieces  # an item a piece
    assert b"".join(httpapi.go_json_pieces({"one": [1]}, "one")) == httpapi.go_json({"one": [1]})
    assert b"".join(httpapi.go_json_pieces({})) == b"{}"


def test_go_duration():
    from nsqd.stats import go_duration

    assert go_duration(0) == "0s"
    assert go_duration(23_114_703_482) == "23.114703482s"
    assert go_duration(2_000_000_000) == "2s"
    assert go_duration(65 * 10**9) == "1m5s"
    assert go_duration(3600 * 10**9) == "1h0m0s"
    assert go_duration(1_500_000) == "1.5ms"


def test_memory_stats_never_break_a_thread_building_a_tuple():
    """`/stats` runs on the loop while write workers run Python in threads: taking the list
    of every gc object there gave a tuple being built in a worker a second reference, and
    the worker failed with SystemError (seen once in a full run, on a delay-store write)."""
    import sys
    import threading

    from nsqd.stats import memory_stats

    errors = []

    def build_tuples():
        try:
            for _ in range(50_000):
                tuple(i for i in range(30))
        except SystemError as e:
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        worker = threading.Thread(target=build_tuples)
        worker.start()
        while worker.is_alive() and not errors:
            assert memory_stats()["heap_objects"] > 0
        worker.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []


@pytest.mark.parametrize("text, ns", [
    ("1795680000", 1795680000 * 10**9),
    ("1795680000.25", 1795680000 * 10**9 + 250_000_000),
    (" 0 ", 0),
    ("2026-11-26T00:00:00Z", 1795651200 * 10**9),
    ("2026-11-26T00:00:00", 1795651200 * 10**9),  # no zone: UTC, on any machine
    ("2026-11-26T01:00:00+01:00", 1795651200 * 10**9),
    ("2026-11-26T00:00:00.000001Z", 1795651200 * 10**9 + 1000),
])
def test_times_in_queries(text, ns):
    from nsqwire.httpapi import parse_time_ns
    assert parse_time_ns(text) == ns


@pytest.mark.parametrize("text", ["", "yesterday", "1e400", "inf", "nan", "2026-13-01"])
def test_bad_times_in_queries(text):
    from nsqwire.httpapi import parse_time_ns
    with pytest.raises(ValueError):
        parse_time_ns(text)
