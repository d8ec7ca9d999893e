"""What followers get of a channel (nsqd/replica.py, pure): the held list, the cap at the
(MAX_HELD + 1)-th held origin, the bounds that keep a state inside one CHANNELS header."""

from __future__ import annotations

import pytest

from isr import wire
from isr.leader import _fitting
from nsqd.cursor import Ranges, pack_u64, unpack_u64
from nsqd.replica import (MAX_HELD, MAX_REPLICA_ATTEMPTS, MAX_REPLICA_RANGES, Held, capped,
                          decode_held, encode_held, held_floor, replica_state)
from nsqd.replication import state_from_wire, state_to_wire

SEQ = 1 << 50  # partition 1's ids: partition << 50 | sequence


def checkpoint(confirmed=1000, count=10, next_read=5000, ranges=((2000, 3000, 20, 30),),
               attempts=()) -> dict:
    """A channel checkpoint: `ranges` (start, end, start_count, end_count) beyond confirmed,
    `attempts` (offset, attempts) pairs."""
    r = Ranges()
    for start, end, start_count, end_count in ranges:
        r.add(start, end, start_count, end_count)
    return {"confirmed": confirmed, "confirmed_count": count, "next_read": next_read,
            "finished": r.encode(4096),
            "attempts": (pack_u64([o for o, _ in attempts]) + pack_u64([a for _, a in attempts])
                         if attempts else b""),
            "paused": False, "ordered": False, "delay_store": True}


def held(n: int, first: int = 100, step: int = 10) -> list[Held]:
    """n held messages at origins first, first + step, ... (count = their place)."""
    return [Held(first + i * step, SEQ | (first + i * step), 1_800_000_000_000 + i, i % 7)
            for i in range(n)]


def test_held_round_trips_and_refuses_what_it_is_not():
    h = [Held(0, 1, 2, 3), Held(5, (1 << 64) - 1, (1 << 63) - 1, 0xFFFF)]
    assert decode_held(encode_held(h)) == h
    assert decode_held(b"") == [] and len(encode_held(h)) == 2 * 32
    for bad in (encode_held(h)[:-1], encode_held(h)[:-8],
                encode_held([Held(5, 1, 2, 3), Held(5, 2, 2, 3)]),  # not increasing
                encode_held([Held(-1, 1, 2, 3)]), encode_held([Held(1, 1, -2, 3)]),
                encode_held([Held(1, 1, 2, 0x10000)])):
        with pytest.raises(ValueError):
            decode_held(bad)


def test_up_to_max_held_the_state_is_the_checkpoint_with_its_list():
    state = checkpoint()
    for h in ([], held(3), held(MAX_HELD)):
        replica = replica_state(state, h, min_origin=(100, SEQ | 100))
        assert replica == dict(state, delay_store=False, held=encode_held(h))
    assert state["delay_store"] is True and "held" not in state, "the checkpoint is unchanged"


def test_the_cap_is_the_first_held_message_beyond_the_list():
    """MAX_HELD + 1 held: the last is not listed, so nothing from its origin on counts as
    finished: confirmed, next_read and the finished ranges stop there."""
    state = checkpoint(confirmed=100_000, count=9000, next_read=100_000, ranges=())
    h = held(MAX_HELD + 1)  # origins 100 .. 10100
    beyond = h[MAX_HELD]
    replica = replica_state(state, h, min_origin=None)
    assert decode_held(replica["held"]) == h[:MAX_HELD]
    assert (replica["confirmed"], replica["confirmed_count"]) == (beyond.origin, beyond.origin)
    assert replica["next_read"] == beyond.origin
    # the cap inside a finished range cuts it there; ranges beyond it go
    state = checkpoint(confirmed=50, count=5, next_read=20_000,
                       ranges=((9_000, 10_500, 900, 1050), (12_000, 13_000, 1200, 1300)))
    replica = replica_state(state, held(MAX_HELD + 5), min_origin=None)
    assert (replica["confirmed"], replica["next_read"]) == (50, beyond.origin)
    assert Ranges.decode(replica["finished"]).pairs() == [(9_000, beyond.origin)]


def test_a_store_that_cannot_be_read_caps_at_its_smallest_origin_as_before():
    state = checkpoint(confirmed=1000, count=10, next_read=5000,
                       ranges=((2000, 3000, 20, 30), (4000, 4500, 40, 45)))
    replica = replica_state(state, None, min_origin=(2500, SEQ | 25))
    assert "held" not in replica and replica["delay_store"] is False
    assert (replica["confirmed"], replica["next_read"]) == (1000, 2500)
    assert Ranges.decode(replica["finished"]).pairs() == [(2000, 2500)]
    replica = replica_state(state, None, min_origin=(500, SEQ | 5))
    assert (replica["confirmed"], replica["confirmed_count"], replica["next_read"]) == (500, 5, 500)
    assert replica_state(state, None, None) == dict(state, delay_store=False)
    assert capped(state, 9000, 90) == state


def test_a_state_still_carrying_held_goes_as_it_came():
    """A new leader's channel before its takeover put the held messages back: its store
    does not hold them yet, so the list it got is what it passes on."""
    state = dict(checkpoint(), delay_store=False, held=encode_held(held(2)))
    assert replica_state(state, [], None) is state


def test_ranges_and_attempts_are_bounded_for_the_wire():
    ranges = [(10_000 + 100 * i, 10_050 + 100 * i, 100 + 2 * i, 101 + 2 * i) for i in range(4096)]
    attempts = [(10_050 + 100 * i, i % 1000) for i in range(4096)]
    state = checkpoint(confirmed=1000, count=10, next_read=10_000 + 100 * 4096,
                       ranges=ranges, attempts=attempts)
    replica = replica_state(state, held(MAX_HELD), None)
    kept = Ranges.decode(replica["finished"]).pairs()
    assert kept == [(s, e) for s, e, _, _ in ranges[:MAX_REPLICA_RANGES]]
    values = unpack_u64(replica["attempts"])
    offsets, counts = values[:len(values) // 2], values[len(values) // 2:]
    assert len(offsets) == MAX_REPLICA_ATTEMPTS and list(offsets) == sorted(offsets)
    assert min(counts) == 999 - (MAX_REPLICA_ATTEMPTS // 4 - 1), "the highest attempts"
    # the largest replica state, with 64-character names, fits one CHANNELS header
    wired = state_to_wire(replica)
    assert state_from_wire(wired) == replica
    head = wire.dumps({"topic": "t" * 64, "partition": 1023, "epoch": 1 << 40,
                       "channels": {"c" * 64: wired}})
    assert len(head) < wire.MAX_HEADER - 4096, len(head)
    assert [len(g) for g in _fitting({f"c{i}": wired for i in range(3)},
                                     wire.MAX_HEADER - 1024)] == [1, 1, 1]
    small = state_to_wire(checkpoint())
    assert [len(g) for g in _fitting({f"c{i}": small for i in range(300)},
                                     wire.MAX_HEADER - 1024)] == [300]


def test_held_floor_keeps_the_first_held_record_on_the_followers():
    state = dict(checkpoint(confirmed=1000), held=encode_held(held(3, first=400)))
    assert held_floor(state) == 400
    assert held_floor(dict(state, held=encode_held(held(3, first=4000)))) == 1000
    assert held_floor(checkpoint(confirmed=1000)) == 1000
    with pytest.raises(ValueError):
        held_floor(dict(state, held=b"\x01"))
