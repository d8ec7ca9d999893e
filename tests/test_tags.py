"""Tag dispatch and extension-header filters (issue 8): the pure matching of nsqd/tags.py,
then real nsqd processes with consumers that IDENTIFY `desired_tag` and `ext_filter`
(raw connections, our client, and pynsq, a classic client)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nsqclient.conn import Connection
from nsqd import tags
from nsqd.identify import IdentifyLimits, negotiate
from nsqwire import commands as c
from nsqwire import protocol as p
from nsqwire.errors import ProtocolError

TOPIC, CHANNEL = "tagged", "ch"


# ---- pure matching ---------------------------------------------------------------


def test_tag_of_a_header():
    assert tags.tag_of(tags.header_of(b'{"##client_dispatch_tag":"a","k":1}')) == "a"
    for ext in (b"", b"not json", b"[1]", b'{"##client_dispatch_tag":5}', b'{"k":"a"}'):
        assert tags.tag_of(tags.header_of(ext)) == ""
    assert tags.check_tag("") == "" and tags.check_tag("a-B_9") == "a-B_9"
    for bad in ("a b", "x" * 101, "é", "a/b"):
        with pytest.raises(ValueError):
            tags.check_tag(bad)


def f(kind, key, data=None, **kw):
    spec = {"type": kind, "filter_ext_key": key, **kw}
    if data is not None:
        spec["filter_data"] = data
    return tags.compile_filter(spec)


def test_each_filter_type_matches_as_youzans():
    exact = f(1, "k", "v")
    assert [exact.accepts(h) for h in ({"k": "v"}, {"k": "vv"}, {"k": 1}, {}, None)] == [
        True, False, False, False, False]
    regexp = f(2, "k", "^ord-[0-9]+$")
    assert [regexp.accepts({"k": v}) for v in ("ord-12", "ord-", "xord-1")] == [True, False, False]
    assert f(2, "k", "ab").accepts({"k": "xxabyy"})  # a search, as Go's MatchString
    assert f(2, "k", "^$").accepts({"other": 1})  # a missing key is "" (Youzan's gjson)
    assert not f(2, "k", "^$").accepts(None)  # no header: nothing matches
    glob = f(3, "k", "img-*.{jpg,png}")
    assert [glob.accepts({"k": v}) for v in ("img-1.jpg", "img-.png", "img-1.gif", "ximg-1.jpg")
            ] == [True, True, False, False]
    assert f(3, "k", "[!a]?").accepts({"k": "bc"}) and not f(3, "k", "[!a]?").accepts({"k": "ac"})
    rules = [{"filter_ext_key": "a", "filter_data": "1"}, {"filter_ext_key": "b", "filter_data": "2"}]
    every, some = f(4, "all", filter_data_list=rules), f(4, "any", filter_data_list=rules)
    for header, want in (({"a": "1", "b": "2"}, (True, True)), ({"a": "1"}, (False, True)),
                         ({"b": "3"}, (False, False))):
        assert (every.accepts(header), some.accepts(header)) == want
    inverse = f(1, "k", "v", inverse=True)
    assert not inverse.accepts({"k": "v"}) and inverse.accepts({"k": "w"}) and inverse.accepts(None)
    assert tags.compile_filter(None) is None and tags.compile_filter({"type": 0}) is None


@pytest.mark.parametrize("spec", [
    [1], {"type": "1", "filter_ext_key": "k", "filter_data": "v"},
    {"type": 9, "filter_ext_key": "k", "filter_data": "v"},
    {"type": 1, "filter_data": "v"}, {"type": 1, "filter_ext_key": "k"},
    {"type": 1, "filter_ext_key": "k", "filter_data": 7},
    {"type": 1, "filter_ext_key": "k", "filter_data": "v", "inverse": 1},
    {"type": 2, "filter_ext_key": "k", "filter_data": "(unclosed"},
    {"type": 2, "filter_ext_key": "k", "filter_data": "(a)\\1"},  # backreference: not RE2
    {"type": 2, "filter_ext_key": "k", "filter_data": "a" * 2000},
    {"type": 3, "filter_ext_key": "k", "filter_data": "{a,b"},
    {"type": 3, "filter_ext_key": "k", "filter_data": "[ab"},
    {"type": 4, "filter_ext_key": "some", "filter_data_list": [
        {"filter_ext_key": "a", "filter_data": "1"}]},
    {"type": 4, "filter_ext_key": "any", "filter_data_list": []},
    {"type": 4, "filter_ext_key": "any", "filter_data_list": [{"filter_ext_key": "a"}]},
])
def test_a_bad_filter_is_a_value_error_and_identify_refuses_it(spec):
    with pytest.raises(ValueError):
        tags.compile_filter(spec)
    with pytest.raises(ProtocolError) as e:
        negotiate(json.dumps({"ext_filter": spec}).encode(), IdentifyLimits())
    assert e.value.code == "E_BAD_BODY" and e.value.fatal


json_leaf = st.none() | st.booleans() | st.integers(-3, 6) | st.text(max_size=6) | st.sampled_from(
    ["any", "all", "k", "(", "[a", "{a,", "*", "\\"])
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "filter_ext_key", "filter_data", "filter_data_list", "inverse", "x"]),
    inner, max_size=5), max_leaves=12)


@given(spec=json_any, tag=json_any)
@settings(max_examples=400, deadline=None)
def test_any_ext_filter_or_tag_gives_a_filter_or_a_fatal_bad_body(spec, tag):
    try:
        settings_, _ = negotiate(json.dumps({"ext_filter": spec, "desired_tag": tag}).encode(),
                                 IdentifyLimits())
    except ProtocolError as e:
        assert e.fatal and e.code == "E_BAD_BODY"
        return
    f = settings_.ext_filter
    assert f is None or f.accepts({"k": "v"}) in (True, False)


def test_a_regexp_cannot_hang_the_matcher():
    """RE2 runs in linear time: the classic catastrophic pattern on a long value."""
    evil = f(2, "k", "^(a+)+$")
    start = time.perf_counter()
    assert not evil.accepts({"k": "a" * 60_000 + "b"})
    assert time.perf_counter() - start < 0.5


def test_identify_takes_the_tag_and_the_filter_and_names_the_tag_in_its_reply():
    body = json.dumps({"feature_negotiation": True, "desired_tag": "t1",
                       "ext_filter": {"type": 1, "filter_ext_key": "k", "filter_data": "v"}})
    settings, reply = negotiate(body.encode(), IdentifyLimits())
    assert settings.desired_tag == "t1" and settings.ext_filter.accepts({"k": "v"})
    assert json.loads(reply)["desired_tag"] == "t1"
    settings, reply = negotiate(b'{"feature_negotiation":true,"desired_tag":""}', IdentifyLimits())
    assert settings.desired_tag == "" and "desired_tag" not in json.loads(reply)


class FakeClient:
    """What Router reads of a client: settings, RDY, in flight, writable."""

    channel = "one channel"  # not None: it consumes one partition

    def __init__(self, tag, spec, ready):
        self.settings, _ = negotiate(json.dumps({"desired_tag": tag, "ext_filter": spec}).encode(),
                                     IdentifyLimits())
        self.ready_count, self.in_flight, self.writable = ready, {}, True


class FakeMessage:
    def __init__(self, header):
        self.ext = json.dumps(header, separators=(",", ":")).encode() if header else b""
        self.route, self.attempts, self.header = None, 0, header


FILTER_CHOICES = [None, {"type": 1, "filter_ext_key": "c", "filter_data": "red"},
                  {"type": 2, "filter_ext_key": "c", "filter_data": "^(red|blue)$"},
                  {"type": 3, "filter_ext_key": "c", "filter_data": "g*"},
                  {"type": 1, "filter_ext_key": "c", "filter_data": "red", "inverse": True}]


@given(clients=st.lists(st.tuples(st.sampled_from(["", "a", "b"]), st.sampled_from(FILTER_CHOICES),
                                  st.integers(0, 4)), max_size=5),
       headers=st.lists(st.one_of(st.none(), st.fixed_dictionaries({}, optional={
           "##client_dispatch_tag": st.sampled_from(["a", "b", "z", ""]),
           "c": st.sampled_from(["red", "blue", "green"])})), max_size=30))
@settings(max_examples=300, deadline=None)
def test_the_router_hands_each_message_to_a_consumer_that_may_take_it(clients, headers):
    """Model check: each message is delivered once to a consumer of its group (its tag's, or
    the untagged ones when nobody desires its tag) whose filter takes it, within RDY; refused
    only when its group is not empty and no filter there takes it; else still held, and then
    every consumer that would take it is full, or its group is empty."""
    cs = [FakeClient(*x) for x in clients]
    msgs = [FakeMessage(h) for h in headers]
    router = tags.Router()
    router.regroup(cs)
    router.add(msgs)
    out, refused = router.dispatch(None)

    def group(m):
        tag = (m.header or {}).get("##client_dispatch_tag", "")
        desired = {cl.settings.desired_tag for cl in cs}
        tag = tag if tag and tag in desired else ""
        return [cl for cl in cs if cl.settings.desired_tag == tag]

    def takes(cl, m):
        return cl.settings.ext_filter is None or cl.settings.ext_filter.accepts(m.header or None)

    held = list(router.messages())
    assert sorted(map(id, [m for ms in out.values() for m in ms] + refused + held)) == sorted(
        map(id, msgs))
    assert router.count == len(held)
    for cl, ms in out.items():
        assert len(ms) <= cl.ready_count and all(cl in group(m) and takes(cl, m) for m in ms)
    for m in refused:
        assert group(m) and not any(takes(cl, m) for cl in group(m))
    full = {cl for cl in cs if len(out.get(cl, ())) >= cl.ready_count}
    for m in held:
        assert all(cl in full for cl in group(m) if takes(cl, m))
        assert not group(m) or any(takes(cl, m) for cl in group(m))


# ---- real nsqd processes ---------------------------------------------------------


def stats(proc) -> dict:
    url = f"http://127.0.0.1:{proc.http_port}/stats?format=json&topic={TOPIC}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def channel_stats(proc, channel=CHANNEL) -> dict:
    topic = next(t for t in stats(proc)["topics"] if t["topic_name"] == TOPIC)
    return next(ch for ch in topic["channels"] if ch["channel_name"] == channel)


class Consumer:
    """A raw connection: IDENTIFY, SUB, RDY; records every message body and FINs it."""

    def __init__(self, name: str, identify: dict, fin: bool = True):
        self.name, self.identify, self.fin = name, identify, fin
        self.bodies: list[bytes] = []
        self.headers: list = []
        self.frames = c.FrameParser()
        self.errors: list[bytes] = []
        self.closed = False

    async def start(self, port: int, rdy: int = 50, channel: str = CHANNEL) -> "Consumer":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(p.MAGIC_V2 + c.cmd_identify(self.identify) + c.cmd_sub(TOPIC, channel)
                          + c.cmd_rdy(rdy))
        self.ext = bool(self.identify.get("extend_support"))
        got = []
        while len(got) < 2:
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, f"{self.name} closed: {got}"
            self.frames.feed(data)
            got += list(self.frames.frames())
        assert got == [(p.FRAME_RESPONSE, b"OK")] * 2, got
        self.task = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self):
        while True:
            data = await self.reader.read(65536)
            if not data:
                self.closed = True
                return
            self.frames.feed(data)
            fins = []
            for kind, payload in self.frames.frames():
                if kind == p.FRAME_ERROR:
                    self.errors.append(payload)
                if kind != p.FRAME_MESSAGE:
                    if payload == b"_heartbeat_":
                        self.writer.write(c.cmd_nop())
                    continue
                if self.ext:
                    _, _, msg_id, version, header, body = c.parse_ext_message(payload)
                    self.headers.append(json.loads(header) if header else None)
                else:
                    _, _, msg_id, body = c.parse_message(payload)
                self.bodies.append(body)
                if self.fin:
                    fins.append(c.cmd_fin(msg_id))
            if fins:
                self.writer.write(b"".join(fins))

    async def close(self):
        self.writer.close()
        self.task.cancel()


async def publish(port: int, messages: list[tuple[dict | None, bytes]]) -> None:
    """PUB_EXT for a header, PUB for None, pipelined; every answer OK."""
    conn = await Connection("127.0.0.1", port).connect()
    try:
        waits = [conn.command(c.cmd_pub_ext(TOPIC, h, b) if h is not None else c.cmd_pub(TOPIC, b))
                 for h, b in messages]
        assert set(await asyncio.gather(*waits)) == {b"OK"}
    finally:
        await conn.close()


async def until(cond, timeout: float = 15, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


def tagged(tag: str, n: int, start: int = 0) -> list:
    return [({"##client_dispatch_tag": tag, "n": i}, f"{tag}-{i}".encode())
            for i in range(start, start + n)]


async def test_tagged_and_untagged_consumers_each_get_exactly_their_share(nsqd):
    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])  # the topic and channel exist before SUB
    a1 = await Consumer("a1", {"desired_tag": "a"}).start(port)
    a2 = await Consumer("a2", {"desired_tag": "a", "extend_support": True}).start(port)
    b = await Consumer("b", {"desired_tag": "b"}).start(port, rdy=3)
    u1 = await Consumer("u1", {}).start(port)
    u2 = await Consumer("u2", {"desired_tag": ""}).start(port)  # go-nsq sends "" for none
    plain = [(None, f"plain-{i}".encode()) for i in range(150)]
    other_keys = [({"k": i}, f"other-{i}".encode()) for i in range(50)]
    orphans = tagged("zzz", 100)  # nobody desires zzz: the untagged consumers take them
    messages = tagged("a", 300) + tagged("b", 200) + orphans + plain + other_keys
    messages = [messages[i] for i in sorted(range(len(messages)), key=lambda i: (i * 7919) % 800)]
    await publish(port, messages)
    total = 1 + len(messages)
    everyone = [a1, a2, b, u1, u2]
    await until(lambda: sum(len(x.bodies) for x in everyone) >= total, what="every message")
    await asyncio.sleep(0.3)  # a duplicate would arrive now
    by_tag = {x.name: sorted(x.bodies) for x in everyone}
    assert sorted(by_tag["a1"] + by_tag["a2"]) == sorted(b for _, b in tagged("a", 300))
    assert by_tag["b"] == sorted(b for _, b in tagged("b", 200))
    assert sorted(by_tag["u1"] + by_tag["u2"]) == sorted(
        [b"warm-up"] + [b for _, b in orphans + plain + other_keys])
    assert a1.bodies and a2.bodies and u1.bodies and u2.bodies  # shared within a group
    assert all(h["##client_dispatch_tag"] == "a" for h in a2.headers)  # it sees its header
    await until(lambda: channel_stats(nsqd)["depth"] == 0, what="depth 0")
    part = channel_stats(nsqd)["partitions"][0]
    assert part["confirmed_count"] == total and part["filtered_count"] == 0
    assert sorted(cl.get("desired_tag", "") for cl in channel_stats(nsqd)["clients"]) == [
        "", "", "a", "a", "b"]
    for x in everyone:
        await x.close()


async def test_a_tag_without_its_consumer_goes_to_the_untagged_and_waits_when_there_are_none(nsqd):
    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])
    a = await Consumer("a", {"desired_tag": "a"}, fin=False).start(port, rdy=2)
    b = await Consumer("b", {"desired_tag": "b"}).start(port)
    await publish(port, tagged("a", 10) + tagged("c", 5))
    await until(lambda: len(a.bodies) == 2, what="a holds two")
    await asyncio.sleep(0.5)
    assert len(a.bodies) == 2 and b.bodies == []  # c waits: nobody may take it
    assert channel_stats(nsqd)["depth"] == 1 + 8 + 5  # warm-up and the waiting ones count
    await a.close()  # a's tag has no consumer now: its messages, in flight too, go untagged
    u = await Consumer("u", {}).start(port)
    want = sorted([b"warm-up"] + [m for _, m in tagged("a", 10) + tagged("c", 5)])
    await until(lambda: len(u.bodies) >= len(want), what="u takes them")
    await asyncio.sleep(0.3)
    assert sorted(u.bodies) == want and b.bodies == []
    await u.close()
    await b.close()


FILTERS = [
    ({"type": 1, "filter_ext_key": "color", "filter_data": "red"}, {b"red-1", b"red-2"}),
    ({"type": 2, "filter_ext_key": "color", "filter_data": "^(red|blue)-?"},
     {b"red-1", b"red-2", b"blue"}),
    ({"type": 3, "filter_ext_key": "color", "filter_data": "*e*"},
     {b"red-1", b"red-2", b"blue", b"green"}),
    ({"type": 4, "filter_ext_key": "all", "filter_data_list": [
        {"filter_ext_key": "color", "filter_data": "red"},
        {"filter_ext_key": "size", "filter_data": "L"}]}, {b"red-2"}),
    ({"type": 4, "filter_ext_key": "any", "filter_data_list": [
        {"filter_ext_key": "color", "filter_data": "blue"},
        {"filter_ext_key": "size", "filter_data": "L"}]}, {b"blue", b"red-2", b"pink-L"}),
    ({"type": 1, "filter_ext_key": "color", "filter_data": "red", "inverse": True},
     {b"blue", b"green", b"pink-L", b"no-header", b"no-color"}),
]
HEADERS = [({"color": "red"}, b"red-1"), ({"color": "red", "size": "L"}, b"red-2"),
           ({"color": "blue"}, b"blue"), ({"color": "green"}, b"green"),
           ({"color": "pink", "size": "L"}, b"pink-L"), (None, b"no-header"),
           ({"colour": "red"}, b"no-color")]


@pytest.mark.parametrize("spec,want", FILTERS, ids=["exact", "regexp", "glob", "all", "any",
                                                     "inverse"])
async def test_a_filter_delivers_what_matches_and_finishes_the_rest_for_good(nsqd, spec, want):
    port = nsqd.tcp_port
    await publish(port, [(None, b"created")])
    first = await Consumer("first", {}).start(port)  # takes "created", then leaves
    await until(lambda: first.bodies == [b"created"], what="created")
    await first.close()
    filtered = await Consumer("filtered", {"ext_filter": spec, "extend_support": True}).start(port)
    await publish(port, HEADERS * 3)
    await until(lambda: channel_stats(nsqd)["partitions"][0]["confirmed_count"] == 1 + 21,
                what="every message finished")
    assert sorted(filtered.bodies) == sorted(list(want) * 3)
    part = channel_stats(nsqd)["partitions"][0]
    assert part["filtered_count"] == 21 - 3 * len(want) and part["depth"] == 0
    assert [cl["ext_filter"] for cl in channel_stats(nsqd)["clients"]] == [spec]
    await filtered.close()
    nsqd.stop()  # a clean restart: nothing filtered is delivered again
    nsqd.start()
    again = await Consumer("again", {}).start(port)
    await publish(port, [(None, b"after")])
    await until(lambda: again.bodies, what="after")
    await asyncio.sleep(0.3)
    assert again.bodies == [b"after"]
    await again.close()


async def test_filters_and_tags_together_and_a_filtered_message_waits_for_a_consumer_that_takes_it(
        nsqd):
    """Two untagged consumers with different filters: each message goes to one that takes
    it (never finished unseen while one of them would take it); one that neither takes is
    finished. Tagged consumers are filtered within their tag."""
    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])
    red = await Consumer("red", {"ext_filter": {"type": 1, "filter_ext_key": "c",
                                                "filter_data": "red"}}).start(port)
    blue = await Consumer("blue", {"ext_filter": {"type": 1, "filter_ext_key": "c",
                                                  "filter_data": "blue"}}).start(port)
    a_big = await Consumer("a-big", {"desired_tag": "a", "ext_filter": {
        "type": 3, "filter_ext_key": "size", "filter_data": "big*"}}).start(port)
    msgs = ([({"c": "red"}, f"r{i}".encode()) for i in range(40)]
            + [({"c": "blue"}, f"b{i}".encode()) for i in range(40)]
            + [({"c": "green"}, f"g{i}".encode()) for i in range(10)]
            + [({"##client_dispatch_tag": "a", "size": "bigger"}, f"ab{i}".encode()) for i in range(20)]
            + [({"##client_dispatch_tag": "a", "size": "small", "c": "red"}, f"as{i}".encode())
               for i in range(5)])
    await publish(port, msgs)
    await until(lambda: channel_stats(nsqd)["partitions"][0]["confirmed_count"] == 1 + len(msgs),
                what="all finished")
    assert sorted(red.bodies) == sorted(f"r{i}".encode() for i in range(40))
    assert sorted(blue.bodies) == sorted(f"b{i}".encode() for i in range(40))
    assert sorted(a_big.bodies) == sorted(f"ab{i}".encode() for i in range(20))
    # warm-up has no header (neither filter takes it), nor green, nor a small "a"
    assert channel_stats(nsqd)["partitions"][0]["filtered_count"] == 1 + 10 + 5
    for x in (red, blue, a_big):
        await x.close()


@pytest.mark.parametrize("identify", [
    {"desired_tag": "not a tag"}, {"desired_tag": 7},
    {"ext_filter": {"type": 2, "filter_ext_key": "k", "filter_data": "(a"}},
    {"ext_filter": {"type": 5, "filter_ext_key": "k", "filter_data": "v"}},
    {"ext_filter": "type 1"},
    {"ext_filter": {"type": 4, "filter_ext_key": "any", "filter_data_list": "k=v"}},
])
async def test_a_bad_tag_or_filter_is_e_bad_body_and_the_server_goes_on(nsqd, identify):
    reader, writer = await asyncio.open_connection("127.0.0.1", nsqd.tcp_port)
    writer.write(p.MAGIC_V2 + c.cmd_identify(identify))
    frames = c.FrameParser()
    got = []
    while True:
        data = await asyncio.wait_for(reader.read(65536), 5)
        if not data:
            break  # fatal: the connection is closed
        frames.feed(data)
        got += list(frames.frames())
    assert len(got) == 1 and got[0][0] == p.FRAME_ERROR and got[0][1].startswith(b"E_BAD_BODY IDENTIFY")
    writer.close()
    await publish(nsqd.tcp_port, [(None, b"still serving")])
    ok = await Consumer("ok", {}).start(nsqd.tcp_port)
    await until(lambda: ok.bodies == [b"still serving"])
    await ok.close()


async def test_a_classic_client_never_sees_an_ext_byte_and_gets_the_untagged(nsqd):
    """pynsq (a classic client, IDENTIFYs no extension) beside a tagged consumer."""
    import nsq

    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])
    a = await Consumer("a", {"desired_tag": "a"}).start(port)
    got: list[bytes] = []

    def handler(m):
        got.append(bytes(m.body))
        return True

    reader = nsq.Reader(TOPIC, CHANNEL, message_handler=handler, max_in_flight=20,
                        nsqd_tcp_addresses=[f"127.0.0.1:{port}"])
    try:
        await until(lambda: bool(reader.conns) and any(
            conn.rdy for conn in reader.conns.values()), what="pynsq subscribed")
        untagged = [(None, b"plain"), ({"k": "v"}, b"with-header"), ({"##trace_id": "77"}, b"traced"),
                    ({"##client_dispatch_tag": "nobody"}, b"orphan")]
        await publish(port, tagged("a", 20) + untagged * 5)
        want = sorted([b"warm-up"] + [b for _, b in untagged] * 5)
        await until(lambda: len(got) >= len(want) and len(a.bodies) >= 20, what="all delivered")
        await asyncio.sleep(0.3)
        assert sorted(got) == want  # the bodies byte for byte: no ext version or length
        assert sorted(a.bodies) == sorted(b for _, b in tagged("a", 20))
    finally:
        reader.connect_to_nsqd = lambda *x, **k: None
        for conn in list(reader.conns.values()):
            conn.close()
        if reader.redist_periodic is not None:
            reader.redist_periodic.stop()
        await a.close()


def test_extended_frames_use_youzans_ext_versions_byte_for_byte():
    """go-nsq's DecodeMessageWithExt reads no length after version 0, and Youzan's nsqd
    numbers a JSON header 4 (2 is a bare tag): the bytes after the id, exactly."""
    from nsqwire.frames import encode_messages

    class M:
        timestamp, attempts, wire_id, trace_id = 1, 0, b"0" * 16, 0

        def __init__(self, ext, body):
            self.ext, self.body = ext, body

    frames = c.FrameParser()
    frames.feed(encode_messages([M(b"", b"body"), M(b'{"k":"v"}', b"b2")], extended=True))
    (_, plain), (_, with_header) = frames.frames()
    assert plain[26:] == b"\x00body"
    assert with_header[26:] == b"\x04\x00\x09" + b'{"k":"v"}' + b"b2"


async def test_held_messages_survive_kill_9_and_filtered_ones_never_come_back(nsqd):
    """Messages held for a tag nobody consumes are unfinished: after SIGKILL they are all
    delivered. Auto-finished ones are finished: once a checkpoint saved them, never again."""
    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])
    b = await Consumer("b", {"desired_tag": "b"}).start(port)
    red = await Consumer("red", {"desired_tag": "r", "ext_filter": {
        "type": 1, "filter_ext_key": "c", "filter_data": "red"}}).start(port)
    await publish(port, tagged("held", 30)
                  + [({"##client_dispatch_tag": "r", "c": c}, f"{c}{i}".encode())
                     for i in range(10) for c in ("red", "blue")])
    await until(lambda: len(red.bodies) == 10, what="red")
    await until(lambda: channel_stats(nsqd)["partitions"][0]["filtered_count"] == 10, what="blue")
    assert channel_stats(nsqd)["depth"] == 31  # warm-up and the held ones
    await asyncio.sleep(1.5)  # a checkpoint (every second) saves the finished ones
    nsqd.kill()
    nsqd.start()
    u = await Consumer("u", {}).start(port)
    want = sorted([b"warm-up"] + [m for _, m in tagged("held", 30)])
    await until(lambda: len(u.bodies) >= len(want), what="held ones after the crash")
    await asyncio.sleep(0.5)
    assert sorted(u.bodies) == want  # nothing lost, no red or blue again
    for x in (b, red, u):
        await x.close()


async def test_our_consumer_sends_desired_tag_and_ext_filter(nsqd):
    from nsqclient.consumer import Consumer as ClientConsumer
    from nsqclient.lookup import StaticLookup

    port = nsqd.tcp_port
    await publish(port, [(None, b"warm-up")])
    lookup = StaticLookup()
    lookup.set(TOPIC, None, producers=[f"127.0.0.1:{port}"])
    got: list[bytes] = []
    consumer = await ClientConsumer(
        TOPIC, CHANNEL, lookup=lookup, handler=lambda m: got.append(m.body), max_in_flight=10,
        desired_tag="a", ext_filter={"type": 1, "filter_ext_key": "k", "filter_data": "yes"}
    ).start()
    try:
        untagged = await Consumer("u", {}).start(port)
        await until(lambda: untagged.bodies == [b"warm-up"], what="warm-up untagged")
        await publish(port, [({"##client_dispatch_tag": "a", "k": "yes"}, b"a-yes"),
                             ({"##client_dispatch_tag": "a", "k": "no"}, b"a-no"),
                             ({"k": "yes"}, b"untagged-yes")])
        await until(lambda: got == [b"a-yes"] and untagged.bodies[1:] == [b"untagged-yes"])
        await until(lambda: channel_stats(nsqd)["partitions"][0]["filtered_count"] == 1)
        await untagged.close()
    finally:
        await consumer.close()


async def test_tags_over_two_partitions_consumed_through_one_connection(nsqd):
    """SUB without a partition consumes both partitions of the topic over one connection
    (RDY shared between them): tags route on each, nothing lost or twice."""
    url = f"http://127.0.0.1:{nsqd.http_port}"
    for path in (f"/topic/create?topic={TOPIC}&partition_num=2",
                 f"/channel/create?topic={TOPIC}&channel={CHANNEL}"):
        urllib.request.urlopen(urllib.request.Request(url + path, method="POST"), timeout=5).close()
    port = nsqd.tcp_port
    a = await Consumer("a", {"desired_tag": "a"}).start(port, rdy=7)
    u = await Consumer("u", {}).start(port, rdy=5)
    plain = [(None, f"p{i}".encode()) for i in range(120)]
    await publish(port, tagged("a", 120) + plain)
    await until(lambda: len(a.bodies) + len(u.bodies) >= 240, what="all")
    await asyncio.sleep(0.3)
    assert sorted(a.bodies) == sorted(b for _, b in tagged("a", 120))
    assert sorted(u.bodies) == sorted(b for _, b in plain)
    parts = channel_stats(nsqd)["partitions"]
    assert len(parts) == 2 and sum(x["confirmed_count"] for x in parts) == 240
    assert all(x["confirmed_count"] for x in parts)  # both partitions had some
    await a.close()
    await u.close()
