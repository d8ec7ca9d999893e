"""What followers get of a channel (nsqd/replica.py, pure): the held list, the two cursors
(the classic one stops at the first held message, `held_cursor` at the (MAX_HELD + 1)-th),
the bounds that keep a state inside one CHANNELS header."""

from __future__ import annotations

import pytest

from isr import wire
from isr.leader import _fitting
from nsqd.cursor import Ranges, pack_u64, unpack_u64
from nsqd.replica import (MAX_HELD, MAX_REPLICA_ATTEMPTS, MAX_REPLICA_RANGES, Held, capped,
                          checkpoint_of, decode_held, encode_held, replica_state)
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


def cursor(state: dict) -> tuple:
    return (state["confirmed"], state["confirmed_count"], state["next_read"],
            Ranges.decode(state["finished"]).pairs())


def test_up_to_max_held_a_new_leader_gets_the_checkpoint_and_its_list():
    """The classic cursor stops at the first held message (what an nsqd that ignores `held`
    reads: it reads the held ones from the log again); `held_cursor`, which a node that
    puts `held` back opens from, is the checkpoint's own."""
    state = checkpoint(confirmed=1000, count=10, next_read=5000,
                       ranges=((2000, 3000, 20, 30), (4000, 4500, 40, 45)))
    for h in (held(3, first=2500), held(MAX_HELD, first=100, step=1)):
        replica = replica_state(state, h, min_origin=(1, SEQ | 1))
        assert decode_held(replica["held"]) == h and replica["delay_store"] is False
        assert checkpoint_of(replica) == dict(state, delay_store=False, held=encode_held(h))
        assert cursor(replica) == cursor(capped(state, h[0].origin, h[0].origin))
    assert cursor(replica) == (100, 100, 100, [])
    replica = replica_state(state, [], min_origin=None)
    assert replica == dict(state, delay_store=False, held=b"") == checkpoint_of(replica)
    assert state["delay_store"] is True and "held" not in state, "the checkpoint is unchanged"


def test_the_cap_is_the_first_held_message_beyond_the_list():
    """MAX_HELD + 1 held: the last is not listed, so nothing from its origin on counts as
    finished in `held_cursor` either: confirmed, next_read and the finished ranges stop
    there (the range it falls in is cut)."""
    state = checkpoint(confirmed=100_000, count=9000, next_read=100_000, ranges=())
    h = held(MAX_HELD + 1)  # origins 100 .. 10100
    beyond = h[MAX_HELD]
    replica = replica_state(state, h, min_origin=None)
    assert decode_held(replica["held"]) == h[:MAX_HELD]
    opened = checkpoint_of(replica)
    assert cursor(opened) == (beyond.origin, beyond.origin, beyond.origin, [])
    assert cursor(replica) == (100, 100, 100, [])
    state = checkpoint(confirmed=50, count=5, next_read=20_000,
                       ranges=((9_000, 10_500, 900, 1050), (12_000, 13_000, 1200, 1300)))
    opened = checkpoint_of(replica_state(state, held(MAX_HELD + 5), min_origin=None))
    assert cursor(opened) == (50, 5, beyond.origin, [(9_000, beyond.origin)])


def test_a_store_that_cannot_be_read_caps_at_its_smallest_origin_as_before():
    state = checkpoint(confirmed=1000, count=10, next_read=5000,
                       ranges=((2000, 3000, 20, 30), (4000, 4500, 40, 45)))
    replica = replica_state(state, None, min_origin=(2500, SEQ | 25))
    assert "held" not in replica and "held_cursor" not in replica
    assert cursor(replica) == (1000, 10, 2500, [(2000, 2500)])
    assert checkpoint_of(replica) is replica
    replica = replica_state(state, None, min_origin=(500, SEQ | 5))
    assert cursor(replica) == (500, 5, 500, [])
    assert replica_state(state, None, None) == dict(state, delay_store=False)
    assert capped(state, 9000, 90) == state


def test_a_state_still_carrying_held_passes_its_list_on():
    """A new leader's channel before its takeover put the held messages back: its store
    does not hold them yet, so the list it got is what it passes on, with its cursor."""
    h = held(2, first=2500)
    state = dict(checkpoint(), delay_store=False, held=encode_held(h))
    replica = replica_state(state, [], None)
    assert decode_held(replica["held"]) == h and checkpoint_of(replica) == state
    assert cursor(replica) == cursor(capped(state, 2500, 2500))


def test_a_damaged_list_or_cursor_is_refused():
    replica = replica_state(checkpoint(), held(3, first=2500), None)
    for bad in (dict(replica, held=b"\x01"), dict(replica, held_cursor=b"\x01" * 8),
                dict(replica, held_cursor=replica["held_cursor"][:24] + b"\x00" * 32)):
        with pytest.raises(ValueError):
            checkpoint_of(bad)


def test_ranges_and_attempts_are_bounded_for_the_wire():
    ranges = [(10_000 + 100 * i, 10_050 + 100 * i, 100 + 2 * i, 101 + 2 * i) for i in range(4096)]
    attempts = [(10_050 + 100 * i, i % 1000) for i in range(4096)]
    state = checkpoint(confirmed=1000, count=10, next_read=10_000 + 100 * 4096,
                       ranges=ranges, attempts=attempts)
    h = held(MAX_HELD, first=10_000 + 100 * 4000, step=1)
    replica = replica_state(state, h, None)
    expected = [(s, e) for s, e, _, _ in ranges[:MAX_REPLICA_RANGES]]
    assert Ranges.decode(replica["finished"]).pairs() == expected
    assert Ranges.decode(checkpoint_of(replica)["finished"]).pairs() == expected
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
