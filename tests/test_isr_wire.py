"""isr/wire.py: the replication frames, sans-I/O (unit tests and a fuzz test)."""

import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isr import wire
from isr.wire import BadFrame, Decoder, Frame, Kind


def push(rid=1, n=1, data=b"xyz"):
    header = {"topic": "t", "partition": 0, "epoch": 3, "leader": "a:1", "offset": 0,
              "count": 0, "n": n, "data_len": len(data), "commit": [0, 0]}
    return wire.encode(Kind.PUSH, rid, header, b"e" * 64 * n + data)


def test_round_trip_in_any_pieces():
    frames = [push(1), wire.encode(Kind.PING, 2, {}), wire.error(3, wire.E_GAP, "gap", end=[5, 1])]
    stream = b"".join(frames)
    for piece in (1, 2, 7, 100, len(stream)):
        d = Decoder()
        got = []
        for i in range(0, len(stream), piece):
            got += d.feed(stream[i:i + piece])
        assert [f.rid for f in got] == [1, 2, 3]
        assert got[0].kind is Kind.PUSH and got[0].payload == b"e" * 64 + b"xyz"
        assert got[2].header == {"code": "E_GAP", "message": "gap", "end": [5, 1]}
        assert d.buffered == 0
    wire.check(Decoder().feed(frames[0])[0])


def test_size_limits():
    d = Decoder(max_frame=1000)
    with pytest.raises(BadFrame):
        d.feed(struct.pack(">I", 1001))
    with pytest.raises(BadFrame):
        Decoder().feed(struct.pack(">I", wire.MAX_FRAME + 1))
    with pytest.raises(BadFrame):  # smaller than kind + id + header length
        Decoder().feed(struct.pack(">I", 3) + b"abc")
    with pytest.raises(BadFrame):  # header longer than the frame
        Decoder().feed(wire.PREFIX.pack(10, Kind.PING, 1, 9))
    with pytest.raises(ValueError):
        wire.encode(Kind.PUSH, 1, {}, bytes(wire.MAX_FRAME))


@pytest.mark.parametrize("raw", [
    wire.PREFIX.pack(wire.FIXED + 2, 99, 1, 2) + b"{}",          # unknown kind
    wire.PREFIX.pack(wire.FIXED + 3, Kind.PING, 1, 3) + b"{no",  # not JSON
    wire.PREFIX.pack(wire.FIXED + 2, Kind.PING, 1, 2) + b"[]",   # not an object
    wire.PREFIX.pack(wire.FIXED + 2, Kind.PING, 1, 2) + b"\xff\xfe",
])
def test_bad_frames(raw):
    with pytest.raises(BadFrame):
        Decoder().feed(raw)


def test_check_fields():
    ok = Decoder().feed(push())[0]
    wire.check(ok)
    for bad in ({**ok.header, "epoch": -1}, {**ok.header, "epoch": "3"},
                {**ok.header, "commit": [1]}, {**ok.header, "n": 2},
                {k: v for k, v in ok.header.items() if k != "topic"}):
        with pytest.raises(BadFrame):
            wire.check(Frame(Kind.PUSH, 1, bad, ok.payload))
    with pytest.raises(BadFrame):
        wire.check(Frame(Kind.OK, 1, {}))
    with pytest.raises(BadFrame):
        wire.check(Frame(Kind.PING, 1, {}, b"x"))


def test_buffer_stays_bounded_over_many_frames():
    d = Decoder()
    one = push(data=b"x" * 1000)
    for _ in range(2000):
        assert len(d.feed(one[:500])) == 0
        assert len(d.feed(one[500:])) == 1
        assert len(d._buf) < 200_000


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_fuzz_random_bytes(data, piece):
    d = Decoder(max_frame=4096)
    try:
        for i in range(0, len(data), piece):
            for f in d.feed(data[i:i + piece]):
                assert isinstance(f, Frame)
                try:
                    wire.check(f)
                except BadFrame:
                    pass
            assert d.buffered <= 4096 + 4 + piece
    except BadFrame:
        pass


def test_fuzz_mutated_frames():
    rnd = random.Random(7)
    good = b"".join([push(i, n=i % 3, data=bytes(rnd.randrange(256) for _ in range(i)))
                     for i in range(20)])
    for _ in range(3000):
        raw = bytearray(good)
        for _ in range(rnd.randrange(1, 5)):
            op = rnd.randrange(3)
            i = rnd.randrange(len(raw))
            if op == 0:
                raw[i] = rnd.randrange(256)
            elif op == 1:
                del raw[i:i + rnd.randrange(1, 20)]
            else:
                raw = raw[:i]  # truncation
            if not raw:
                break
        d = Decoder(max_frame=1 << 20)
        try:
            for f in d.feed(bytes(raw)):
                try:
                    wire.check(f)
                except BadFrame:
                    pass
        except BadFrame:
            continue
        assert d.buffered <= len(raw)


def test_frames_before_a_bad_one_are_given_with_the_error():
    d = Decoder()
    with pytest.raises(BadFrame) as e:
        d.feed(wire.encode(Kind.PING, 1, {}) + wire.encode(Kind.PING, 2, {}) + b"\xff" * 8)
    assert [f.rid for f in e.value.frames] == [1, 2]


# ---- wire version 2: binary PUSH and ACK headers ----

def push_header(**over):
    return {"topic": "topic.a", "partition": 7, "epoch": 3, "leader": "10.0.0.1:4150",
            "offset": 1 << 40, "count": 12345, "n": 2, "data_len": 5, "commit": [9, 4],
            "crc": 0xFFFFFFFF, **over}


def test_push_and_ack_headers_are_binary_and_decode_to_the_same_fields():
    for header in (push_header(), {k: v for k, v in push_header().items() if k != "crc"}):
        raw = wire.encode(Kind.PUSH, 5, header, b"e" * 128 + b"12345")
        (frame,) = Decoder().feed(raw)
        assert frame.header == header and frame.rid == 5
        wire.check(frame)
        hlen = wire.PREFIX.unpack_from(raw)[3]
        assert hlen == wire.PUSH_HEAD.size + len("topic.a") + len("10.0.0.1:4150")
    raw = wire.encode(Kind.ACK, 6, {"end": [1 << 62, 3]})
    assert wire.PREFIX.unpack_from(raw)[3] == wire.ACK_HEAD.size
    assert Decoder().feed(raw)[0].header == {"end": [1 << 62, 3]}
    assert Decoder().feed(wire.encode(Kind.PING, 1, {}))[0].header == {}  # others: JSON


def _push_raw(head: bytes) -> bytes:
    return wire.PREFIX.pack(wire.FIXED + len(head), Kind.PUSH, 1, len(head)) + head


@pytest.mark.parametrize("head", [
    b"",  # no header
    wire.encode_header(Kind.PUSH, push_header())[:wire.PUSH_HEAD.size - 1],  # cut short
    wire.encode_header(Kind.PUSH, push_header())[:-1],  # a name cut short
    wire.encode_header(Kind.PUSH, push_header()) + b"x",  # longer than its names
    wire.PUSH_HEAD.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 1) + b"ta",  # has_crc not 0/1
    wire.PUSH_HEAD.pack(1 << 63, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1) + b"ta",  # epoch >= 2**63
    wire.PUSH_HEAD.pack(1, 0, 0, 0, 1 << 63, 0, 0, 0, 0, 0, 1, 1) + b"ta",  # commit count
    wire.PUSH_HEAD.pack(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1) + b"\xffa",  # not UTF-8
])
def test_bad_push_headers_are_bad_frames(head):
    with pytest.raises(BadFrame):
        Decoder().feed(_push_raw(head))


def test_bad_ack_headers_and_unencodable_headers():
    for head in (b"", bytes(15), bytes(17)):
        with pytest.raises(BadFrame):
            Decoder().feed(wire.PREFIX.pack(wire.FIXED + len(head), Kind.ACK, 1, len(head)) + head)
    for bad in ({"topic": "t"}, push_header(topic="t" * 256), push_header(epoch=-1),
                push_header(commit=[1]), push_header(partition="0")):
        with pytest.raises(ValueError):
            wire.encode(Kind.PUSH, 1, bad)
    with pytest.raises(ValueError):
        wire.encode(Kind.ACK, 1, {"end": [1]})


def test_empty_names_pass_the_decoder_and_fail_the_check():
    frame = Decoder().feed(wire.encode(Kind.PUSH, 1, push_header(topic="", n=0, data_len=0)))[0]
    with pytest.raises(BadFrame):
        wire.check(frame)


_u63 = st.integers(0, (1 << 63) - 1)
_u32 = st.integers(0, (1 << 32) - 1)
_name = st.text(min_size=1, max_size=60)


@settings(max_examples=120, deadline=None)
@given(st.fixed_dictionaries({
    "topic": _name, "leader": _name, "partition": _u32, "epoch": _u63, "offset": _u63,
    "count": _u63, "n": st.integers(0, 3), "data_len": st.integers(0, 100),
    "commit": st.tuples(_u63, _u63).map(list)}, optional={"crc": _u32}), st.integers(1, 50))
def test_fuzz_push_headers_round_trip_in_any_pieces(header, piece):
    payload = b"e" * wire.ENTRY_SIZE * header["n"] + b"d" * header["data_len"]
    stream = wire.encode(Kind.PUSH, 9, header, payload) + wire.encode(Kind.ACK, 9, {"end": [1, 2]})
    if len(header["topic"].encode()) > 255 or len(header["leader"].encode()) > 255:
        return
    d, got = Decoder(), []
    for i in range(0, len(stream), piece):
        got += d.feed(stream[i:i + piece])
    assert got[0].header == header and bytes(got[0].payload) == payload
    assert got[1].header == {"end": [1, 2]}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([Kind.PUSH, Kind.ACK]))
def test_fuzz_random_binary_headers(head, kind):
    raw = wire.PREFIX.pack(wire.FIXED + len(head), kind, 1, len(head)) + head
    try:
        (frame,) = Decoder().feed(raw)
    except BadFrame:
        return
    if kind is Kind.PUSH:
        try:
            wire.check(frame)
        except BadFrame:
            pass
