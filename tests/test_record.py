"""Property tests of the record codec (diskqueue/record.py)."""

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diskqueue.record import (FIXED_LENGTH, HEAD_SIZE, MAX_RECORD, CorruptRecordError, Record,
                              decode_all, decode_at, encode_into, encode_records, record_size)

U64 = st.integers(0, 2**64 - 1)

message = st.fixed_dictionaries({
    "msg_id": U64,
    "trace_id": U64,
    "timestamp": U64,
    "attempts": st.integers(0, 0xFFFF),
    "ext": st.binary(max_size=300),
    "body": st.binary(max_size=5000),
})

LENGTH_BYTES = range(4, 8)  # where `length` sits in an encoded record


def encode_one(m) -> bytes:
    out = bytearray()
    size = encode_into(out, m["msg_id"], m["trace_id"], m["timestamp"], m["attempts"], m["ext"],
                       m["body"])
    assert size == len(out) == record_size(len(m["body"]), len(m["ext"]))
    return bytes(out)


def expected(m, offset: int) -> Record:
    return Record(offset, record_size(len(m["body"]), len(m["ext"])), m["msg_id"],
                  m["trace_id"], m["timestamp"], m["attempts"], m["ext"], m["body"])


def test_layout_is_the_documented_one():
    rec = encode_one({"msg_id": 7, "trace_id": 9, "timestamp": 11, "attempts": 3,
                      "ext": b"{}", "body": b"hello"})
    crc, length, msg_id, trace_id, ts, attempts, ext_len = struct.unpack_from(">IIQQQHH", rec)
    assert (length, msg_id, trace_id, ts, attempts, ext_len) == (len(rec) - 8, 7, 9, 11, 3, 2)
    assert rec[HEAD_SIZE:] == b"{}hello"
    assert crc == zlib.crc32(rec[4:])


@settings(max_examples=150, deadline=None)
@given(st.lists(message, min_size=1, max_size=8), st.integers(0, 2**60))
def test_round_trip(messages, base):
    buf = b"".join(encode_one(m) for m in messages)
    want, pos = [], 0
    for m in messages:
        want.append(expected(m, base + pos))
        pos += want[-1].size
    records, new_pos, error = decode_all(buf, 0, len(buf), base, 1 << 30)
    assert error is None and new_pos == len(buf)
    assert records == want
    for w in want:
        assert decode_at(buf, w.offset - base, base) == w


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=8), U64, U64, U64, st.integers(0, 0xFFFF),
       st.binary(max_size=300), st.integers(0, 2**60), st.integers(0, 2**50))
def test_encode_records_matches_encode_into(bodies, first_id, trace_id, ts, attempts, ext, offset,
                                            base):
    first_id %= 2**64 - len(bodies)
    pieces, offsets = [], []
    end = encode_records(pieces.append, offsets, offset, first_id, trace_id, ts, attempts, ext,
                         bodies)
    buf = b"".join(pieces)
    singles = b"".join(encode_one({"msg_id": first_id + i, "trace_id": trace_id, "timestamp": ts,
                                   "attempts": attempts, "ext": ext, "body": b})
                       for i, b in enumerate(bodies))
    assert buf == singles
    assert end == offset + len(buf)
    records, _, error = decode_all(buf, 0, len(buf), offset, 1 << 30)
    assert error is None
    assert [r.offset for r in records] == offsets
    assert [r.msg_id for r in records] == [first_id + i for i in range(len(bodies))]
    assert [r.body for r in records] == bodies


@settings(max_examples=200, deadline=None)
@given(st.lists(message, min_size=1, max_size=6), st.data(), st.integers(0, 2**60))
def test_any_prefix_decodes_only_whole_records(messages, data, base):
    encoded = [encode_one(m) for m in messages]
    buf = b"".join(encoded)
    cut = data.draw(st.integers(0, len(buf)), label="cut")
    ends, pos = [], 0
    for e in encoded:
        pos += len(e)
        ends.append(pos)
    whole = sum(1 for end in ends if end <= cut)
    want = [expected(m, base + (ends[i] - len(encoded[i]))) for i, m in enumerate(messages)][:whole]
    want_pos = ends[whole - 1] if whole else 0
    # a buffer that stops at the cut, and a longer buffer read only up to the cut
    for src in (buf[:cut], buf):
        records, new_pos, error = decode_all(src, 0, cut, base, 1 << 30)
        assert error is None
        assert records == want
        assert new_pos == want_pos
    if whole < len(messages):
        assert decode_at(buf[:cut], want_pos, base) is None
    # max_count stops early and resumes at the right place
    limit = data.draw(st.integers(1, len(messages)), label="max_count")
    records, new_pos, error = decode_all(buf, 0, len(buf), base, limit)
    assert error is None and records == [expected(m, base + ends[i] - len(encoded[i]))
                                         for i, m in enumerate(messages)][:limit]
    assert new_pos == ends[limit - 1]


def check_flip(prefix: bytes, rec: bytes, suffix: bytes, bit: int, base: int):
    """Flip one bit of `rec` (between two valid records): it must never decode as data."""
    bad = bytearray(rec)
    bad[bit // 8] ^= 1 << (bit % 8)
    buf = prefix + bytes(bad) + suffix
    pos = len(prefix)
    length = struct.unpack_from(">I", bad, 4)[0]
    claimed_end = pos + 8 + length
    may_be_partial = (bit // 8 in LENGTH_BYTES and length <= MAX_RECORD
                      and claimed_end > len(buf))
    try:
        got = decode_at(buf, pos, base)
    except CorruptRecordError as e:
        assert e.offset == base + pos
    else:
        assert got is None and may_be_partial, f"bit {bit} flipped decoded as {got}"
    records, new_pos, error = decode_all(buf, 0, len(buf), base, 1 << 30)
    assert new_pos == pos
    assert [r.offset for r in records] == ([base] if prefix else [])
    if may_be_partial:
        # the record claims bytes beyond the buffer: once they are there, the checksum fails
        assert error is None
        if claimed_end <= 1 << 20:
            padded = buf + bytes(claimed_end - len(buf))
            with pytest.raises(CorruptRecordError) as e:
                decode_at(padded, pos, base)
            assert e.value.offset == base + pos
    else:
        assert isinstance(error, CorruptRecordError) and error.offset == base + pos


@settings(max_examples=60, deadline=None)
@given(message, st.binary(max_size=200), st.integers(0, 2**60))
def test_every_single_bit_flip_is_detected(m, other_body, base):
    m = dict(m, body=m["body"][:800])
    rec = encode_one(m)
    neighbour = encode_one(dict(m, body=other_body))
    for bit in range(len(rec) * 8):
        check_flip(neighbour, rec, neighbour, bit, base)


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(message, st.binary(min_size=3000, max_size=5000))
def test_every_single_bit_flip_is_detected_large_records(m, body):
    rec = encode_one(dict(m, body=body))
    for bit in range(len(rec) * 8):
        check_flip(b"", rec, b"", bit, 4096)


def test_length_flips_claiming_huge_records_fail_the_checksum():
    rec = encode_one({"msg_id": 1, "trace_id": 2, "timestamp": 3, "attempts": 0, "ext": b"x",
                      "body": b"body" * 10})
    padding = bytes(MAX_RECORD + 16)
    for bit in range(32):
        bad = bytearray(rec)
        bad[4 + (31 - bit) // 8] ^= 1 << (bit % 8)
        length = struct.unpack_from(">I", bad, 4)[0]
        buf = bytes(bad) + padding[:max(0, min(length, MAX_RECORD) + 8 - len(bad))]
        with pytest.raises(CorruptRecordError) as e:
            decode_at(buf, 0, 100)
        assert e.value.offset == 100
        if length > MAX_RECORD:
            assert "bad length" in e.value.reason


def test_lengths_too_short_for_the_ext_header_are_rejected():
    rec = bytearray(encode_one({"msg_id": 1, "trace_id": 2, "timestamp": 3, "attempts": 0,
                                "ext": b"abc", "body": b""}))
    struct.pack_into(">I", rec, 4, FIXED_LENGTH + 2)  # one byte shorter than the ext header
    rec[0:4] = zlib.crc32(rec[4:]).to_bytes(4, "big")  # even with a matching checksum
    with pytest.raises(CorruptRecordError, match="bad length"):
        decode_at(bytes(rec), 0, 0)
    records, pos, error = decode_all(bytes(rec), 0, len(rec), 0, 10)
    assert records == [] and pos == 0 and "bad length" in error.reason
