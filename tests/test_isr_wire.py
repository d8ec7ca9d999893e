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
