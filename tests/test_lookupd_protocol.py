"""The nsqlookupd V1 codec alone (nsqwire/lookupd.py) and the registration DB
(nsqlookupd/registry.py), with no socket: commands, Go nsqlookupd's error texts,
malformed input, bounded buffers, tombstones and inactivity with an explicit clock."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings, strategies as st

from nsqlookupd.registry import PeerInfo, RegistrationDB
from nsqwire import lookupd as v1
from nsqwire.errors import ProtocolError

INFO = {"broadcast_address": "10.0.0.1", "tcp_port": 4150, "http_port": 4151,
        "version": "1.3.0", "hostname": "box"}


def identify(info=INFO) -> bytes:
    return v1.cmd_identify(info)


def parse(data: bytes, parser: v1.LookupParser | None = None) -> list:
    parser = parser or v1.LookupParser()
    parser.feed(data)
    out = []
    while (c := parser.next_command()) is not None:
        out.append(c)
    return out


def error_of(data: bytes) -> str:
    with pytest.raises(ProtocolError) as e:
        parse(data)
    assert e.value.fatal
    return e.value.text


def test_a_whole_session_parses_in_order():
    commands = parse(v1.MAGIC_V1 + v1.PING + identify() + v1.cmd_register("t")
                     + v1.cmd_register("t", "c#ephemeral") + v1.cmd_unregister("t", "c#ephemeral")
                     + v1.cmd_unregister("t") + v1.PING)
    assert commands == [v1.Ping(), v1.Identify(INFO), v1.Register("t"),
                        v1.Register("t", "c#ephemeral"), v1.Unregister("t", "c#ephemeral"),
                        v1.Unregister("t"), v1.Ping()]


def test_byte_at_a_time_gives_the_same_commands():
    data = v1.MAGIC_V1 + identify() + v1.cmd_register("t", "c") + v1.PING
    parser = v1.LookupParser()
    out = []
    for i in range(len(data)):
        out += parse(data[i:i + 1], parser)
    assert out == [v1.Identify(INFO), v1.Register("t", "c"), v1.Ping()]


def test_lines_are_trimmed_as_go_does():
    assert parse(v1.MAGIC_V1 + identify() + b"  REGISTER t c \r\n") == [
        v1.Identify(INFO), v1.Register("t", "c")]


@pytest.mark.parametrize("data, text", [
    (b"  V2PING\n", "E_BAD_PROTOCOL"),
    (b"GET / HTTP/1.1\r\n", "E_BAD_PROTOCOL"),
    (v1.MAGIC_V1 + b"REGISTER t\n", "E_INVALID client must IDENTIFY"),
    (v1.MAGIC_V1 + b"UNREGISTER t\n", "E_INVALID client must IDENTIFY"),
    (v1.MAGIC_V1 + b"NOP\n", "E_INVALID invalid command NOP"),
    (v1.MAGIC_V1 + b"\n", "E_INVALID invalid command "),
    (v1.MAGIC_V1 + identify() + identify(), "E_INVALID cannot IDENTIFY again"),
    (v1.MAGIC_V1 + identify() + b"REGISTER\n", "E_INVALID REGISTER insufficient number of params"),
    (v1.MAGIC_V1 + identify() + b"UNREGISTER\n",
     "E_INVALID UNREGISTER insufficient number of params"),
    (v1.MAGIC_V1 + identify() + b"REGISTER bad!topic\n",
     "E_BAD_TOPIC REGISTER topic name 'bad!topic' is not valid"),
    (v1.MAGIC_V1 + identify() + b"REGISTER t " + b"c" * 65 + b"\n",
     "E_BAD_CHANNEL REGISTER channel name '" + "c" * 65 + "' is not valid"),
    (v1.MAGIC_V1 + identify() + b"UNREGISTER t bad:ch\n",
     "E_BAD_CHANNEL UNREGISTER channel name 'bad:ch' is not valid"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", 0), "E_BAD_BODY IDENTIFY invalid body size 0"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", -5), "E_BAD_BODY IDENTIFY invalid body size -5"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", 2**31 - 1),
     f"E_BAD_BODY IDENTIFY invalid body size {2**31 - 1}"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", 3) + b"{x}",
     "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", 2) + b"[]",
     "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (v1.MAGIC_V1 + b"IDENTIFY\n" + struct.pack(">i", 4) + b"null",
     "E_BAD_BODY IDENTIFY missing fields"),
    (v1.MAGIC_V1 + identify({**INFO, "tcp_port": 0}), "E_BAD_BODY IDENTIFY missing fields"),
    (v1.MAGIC_V1 + identify({**INFO, "version": ""}), "E_BAD_BODY IDENTIFY missing fields"),
    (v1.MAGIC_V1 + identify({k: v for k, v in INFO.items() if k != "broadcast_address"}),
     "E_BAD_BODY IDENTIFY missing fields"),
    (v1.MAGIC_V1 + identify({**INFO, "tcp_port": "4150"}),
     "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (v1.MAGIC_V1 + identify({**INFO, "http_port": 4151.5}),
     "E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (v1.MAGIC_V1 + identify({**INFO, "hostname": 7}),
     "E_BAD_BODY IDENTIFY failed to decode JSON body"),
])
def test_errors_are_go_nsqlookupds_and_fatal(data, text):
    assert error_of(data) == text


def test_an_error_is_sticky():
    parser = v1.LookupParser()
    parser.feed(v1.MAGIC_V1 + b"REGISTER t\n")
    with pytest.raises(ProtocolError):
        parser.next_command()
    parser.feed(v1.PING)
    with pytest.raises(ProtocolError, match="client must IDENTIFY"):
        parser.next_command()


def test_a_line_without_end_is_bounded():
    parser = v1.LookupParser()
    parser.feed(v1.MAGIC_V1 + b"R" * 1024)
    assert parser.next_command() is None  # may still end
    parser.feed(b"R")
    with pytest.raises(ProtocolError, match="E_INVALID command line longer than 1024 bytes"):
        parser.next_command()


def test_unknown_identify_fields_are_ignored_and_extra_params_too():
    cmds = parse(v1.MAGIC_V1 + identify({**INFO, "extra": [1]}) + b"REGISTER t c extra\n")
    assert cmds == [v1.Identify(INFO), v1.Register("t", "c")]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_any_bytes_give_commands_or_a_protocol_error(data, prefix):
    parser = v1.LookupParser()
    parser.feed((v1.MAGIC_V1 + identify() if prefix else b"") + data)
    try:
        while parser.next_command() is not None:
            pass
    except ProtocolError as e:
        assert e.fatal and e.text.startswith("E_")


def test_client_half_reads_size_prefixed_answers():
    reader = v1.ResponseReader()
    stream = (v1.encode_response(b"OK") + v1.encode_response(json.dumps({"version": "1.3.0"}).encode())
              + v1.error_response(ProtocolError("E_INVALID", "client must IDENTIFY")))
    out = []
    for i in range(len(stream)):
        reader.feed(stream[i:i + 1])
        while (r := reader.next_response()) is not None:
            out.append(r)
    assert out[0] == b"OK" and json.loads(out[1]) == {"version": "1.3.0"}
    assert reader.buffered == 0
    reader.feed(v1.encode_response(b"OK") + b"\x00")  # an answer and a byte of the next
    assert reader.next_response() == b"OK" and reader.next_response() is None
    assert reader.buffered == 1
    assert v1.check_response(out[0]) == b"OK"
    with pytest.raises(v1.LookupdError, match="E_INVALID client must IDENTIFY"):
        v1.check_response(out[2])
    bad = v1.ResponseReader(max_size=10)
    bad.feed(struct.pack(">i", 11))
    with pytest.raises(ValueError):
        bad.next_response()


def test_client_encoders():
    assert v1.cmd_register("t") == b"REGISTER t\n"
    assert v1.cmd_register("t", "c") == b"REGISTER t c\n"
    assert v1.cmd_unregister("t", "c") == b"UNREGISTER t c\n"
    body = identify()
    assert body.startswith(b"IDENTIFY\n") and json.loads(body[13:]) == INFO
    assert struct.unpack(">i", body[9:13])[0] == len(body) - 13


# ---- the registration DB ------------------------------------------------------------


def peer(n: int, now: float = 0.0) -> PeerInfo:
    return PeerInfo(id=f"127.0.0.1:{5000 + n}", remote_address=f"127.0.0.1:{5000 + n}",
                    hostname=f"h{n}", broadcast_address=f"node{n}", tcp_port=4150 + n,
                    http_port=4250 + n, version="1.3.0", last_update=now)


def test_register_unregister_and_disconnect():
    db = RegistrationDB()
    a, b = peer(1), peer(2)
    for p in (a, b):
        db.identify(p)
    db.register(a, "t", "c")
    db.register(b, "t", None)
    assert db.topics() == ["t"] and db.channels("t") == ["c"]
    assert [p["broadcast_address"] for p in db.producers("t", 1)] == ["node1", "node2"]
    db.unregister(a, "t", None)  # a topic's unregister takes its channels too
    assert [p["broadcast_address"] for p in db.producers("t", 1)] == ["node2"]
    assert db.channels("t") == ["c"]  # the registration stays, without producers
    db.disconnected(b)
    assert db.producers("t", 1) == [] and db.has_topic("t")
    assert db.nodes(1) == [{**a.public(), "tombstones": [], "topics": []}]


def test_ephemeral_registrations_go_with_their_last_unregister():
    db = RegistrationDB()
    a = peer(1)
    db.identify(a)
    db.register(a, "t", "c#ephemeral")
    db.register(a, "e#ephemeral", None)
    db.unregister(a, "t", "c#ephemeral")
    db.unregister(a, "e#ephemeral", None)
    assert db.channels("t") == [] and db.topics() == ["t"]


def test_tombstone_hides_a_producer_from_lookup_for_its_lifetime_only():
    db = RegistrationDB(inactive_timeout=300, tombstone_lifetime=45)
    a, b = peer(1), peer(2)
    for p in (a, b):
        db.identify(p)
        db.register(p, "t", None)
        db.register(p, "u", None)
    db.tombstone("t", "node1:4251", now=10)
    assert [p["broadcast_address"] for p in db.producers("t", 20)] == ["node2"]
    assert len(db.producers("u", 20)) == 2  # only that topic
    nodes = {n["broadcast_address"]: n for n in db.nodes(20)}
    assert nodes["node1"]["topics"] == ["t", "u"] and nodes["node1"]["tombstones"] == [True, False]
    assert nodes["node2"]["tombstones"] == [False, False]
    db.register(a, "t", None)  # registering again keeps the tombstone
    assert len(db.producers("t", 54)) == 1
    assert len(db.producers("t", 56)) == 2  # 46 s later: lifetime over
    assert {n["broadcast_address"]: n["tombstones"] for n in db.nodes(56)}["node1"] == [False, False]


def test_inactive_producers_are_hidden_everywhere():
    db = RegistrationDB(inactive_timeout=300)
    a = peer(1, now=0)
    db.identify(a)
    db.register(a, "t", None)
    assert db.producers("t", 300) and db.nodes(300)
    assert db.producers("t", 301) == [] and db.nodes(301) == []
    db.ping(a, 301)
    assert db.producers("t", 400) and db.nodes(400)


def test_http_side_changes():
    db = RegistrationDB()
    db.create_channel("t", "c")
    assert db.topics() == ["t"] and db.channels("t") == ["c"]
    assert db.delete_channel("t", "c") and not db.delete_channel("t", "c")
    db.create_topic("u")
    db.create_channel("u", "x")
    db.delete_topic("u")
    assert db.topics() == ["t"] and db.channels("u") == []
