"""What the followers of a replicated partition get of a channel (pure, no I/O).

A channel's checkpoint counts a message its delay store holds as finished (the store has
it). Followers have no delay store, so what they get, `replica_state`, lists the first
MAX_HELD such messages, in origin order, as `held`: (origin offset, msg_id, due_ms,
attempts) each. A new leader puts them back into its own store, read from its own log
(nsqd/handover.py), before it delivers from the channel or saves a checkpoint of it.

A replica state has two cursors, so that an nsqd that does not know `held` stays safe:
- the classic keys (`confirmed`, `confirmed_count`, `next_read`, `finished`) stop at the
  first held message, as before `held` existed: a node that ignores `held` reads the held
  messages from the log again (duplicates after them, never a loss);
- `held_cursor` (packed: confirmed, confirmed_count, next_read, then the finished ranges)
  stops only at the (MAX_HELD + 1)-th held message: what a node that puts `held` back
  opens the channel from (`checkpoint_of`).

Invariants of a replica state:
- each cursor counts as finished only messages that are finished, or held (listed, for
  `held_cursor`); nothing at or after the first held message not listed counts, so a huge
  store costs duplicates after a failover, never an unbounded state;
- `held` present means the state came from the partition's leader: the list is all it
  held below the cap (a stale store a new leader kept from an older term is emptied);
- its wire form fits one CHANNELS header (isr/wire.py MAX_HEADER) with a 64-character
  topic and channel name: at most MAX_HELD held messages, MAX_REPLICA_RANGES finished
  ranges per cursor (the nearest to `confirmed`; messages of the others are delivered
  again) and MAX_REPLICA_ATTEMPTS attempts (the highest).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from nsqwire.ids import SEQUENCE_MASK

from .cursor import MAX_SAVED_RANGES, Ranges, pack_u64, unpack_u64

# 1,000 held messages: 32 KB packed, 43 KB in the JSON header as base64, and a push reads
# them from LMDB in about 3 ms of CPU (bench/delayrepl.py); the rest of the 64 KiB header
# is for the ranges of both cursors and the attempts below.
MAX_HELD = 1000
MAX_REPLICA_RANGES = 128  # per cursor: 4 KB packed
MAX_REPLICA_ATTEMPTS = 256  # 4 KB packed


class Held(NamedTuple):
    """A log message a delay store holds: where it is in the log, and when and how often."""

    origin: int  # virtual offset of its record in the partition's log
    msg_id: int
    due_ms: int
    attempts: int


def encode_held(held) -> bytes:
    """Held messages as little-endian u64s: every origin, every msg_id, every due_ms, then
    every attempts (msg_ids above 2^63 as their two's complement)."""
    ids = [m.msg_id - (1 << 64) if m.msg_id >= 1 << 63 else m.msg_id for m in held]
    return (pack_u64([m.origin for m in held]) + pack_u64(ids)
            + pack_u64([m.due_ms for m in held]) + pack_u64([m.attempts for m in held]))


def decode_held(data: bytes) -> list[Held]:
    """The inverse of encode_held. Raises ValueError when it is not whole entries, not in
    strictly increasing origin order, or has a field out of range."""
    values = unpack_u64(data)
    if len(values) % 4:
        raise ValueError("held messages: not whole (origin, msg_id, due_ms, attempts)")
    n = len(values) // 4
    origins, ids, dues, attempts = (values[i * n:(i + 1) * n] for i in range(4))
    if any(o < 0 for o in origins[:1]) or any(a >= b for a, b in zip(origins, origins[1:])):
        raise ValueError("held messages: origins not increasing from 0 on")
    if any(d < 0 for d in dues) or any(not 0 <= a <= 0xFFFF for a in attempts):
        raise ValueError("held messages: due_ms or attempts out of range")
    return [Held(o, i & ((1 << 64) - 1), d, a)
            for o, i, d, a in zip(origins, ids, dues, attempts)]


def capped(state: dict, offset: int, count: int) -> dict:
    """`state` (a checkpoint) with nothing at or after (`offset`, `count`), a message's place,
    counted as finished: `confirmed` and `next_read` go no further, and the finished ranges
    are kept only below it (the one it falls in is cut there). Pure."""
    out = dict(state)
    if offset < state["confirmed"]:
        out["confirmed"], out["confirmed_count"] = offset, count
    if offset < state.get("next_read", 0):
        out["next_read"] = offset
        out["finished"] = Ranges.decode(state.get("finished", b"")).below(
            offset, count).encode(MAX_SAVED_RANGES)
    return out


def replica_state(state: dict, held: list[Held] | None,
                  min_origin: tuple[int, int] | None) -> dict:
    """What followers may store of a channel's checkpoint `state` (see the module docstring).

    `held`: the first MAX_HELD + 1 (or more) log messages its delay store holds, in origin
    order, read no earlier than `state` was taken (a newer list is only more careful: a
    message that left the store since was finished or dropped); [] without a store. None
    when the store could not be read: then, as before `held` existed, nothing at or after
    `min_origin` (the smallest (offset, msg_id) the store held when `state` was taken, or
    later) counts as finished, and there is no list. A state that still carries `held` (a
    new leader's channel whose takeover has not put them back yet) passes that list on."""
    out = dict(state, delay_store=False)
    if "held" in state:
        held = decode_held(out.pop("held"))
    if held is None:
        if min_origin is not None:
            out = capped(out, min_origin[0], min_origin[1] & SEQUENCE_MASK)
        return _bounded(out)
    listed = held[:MAX_HELD]
    out["held"] = encode_held(listed)
    if not listed:  # one cursor: nothing held
        return _bounded(out)
    cursor = out
    if len(held) > MAX_HELD:
        cursor = capped(out, held[MAX_HELD].origin, held[MAX_HELD].msg_id & SEQUENCE_MASK)
    out = _bounded(capped(cursor, listed[0].origin, listed[0].msg_id & SEQUENCE_MASK))
    ranges = Ranges.decode(cursor.get("finished", b"")).encode(MAX_REPLICA_RANGES)
    out["held_cursor"] = pack_u64([cursor["confirmed"], cursor["confirmed_count"],
                                   cursor.get("next_read", 0)]) + ranges
    return out


def checkpoint_of(state: dict) -> dict:
    """The checkpoint a node that puts `held` back opens a channel from: a replica state's
    `held_cursor` as its cursor (and `held`, for the takeover); a state without
    `held_cursor` as it is. Raises ValueError when `held` or `held_cursor` is damaged."""
    decode_held(state.get("held", b""))
    if "held_cursor" not in state:
        return state
    raw = state["held_cursor"]
    if len(raw) < 24:
        raise ValueError("held_cursor: shorter than its three numbers")
    confirmed, count, next_read = unpack_u64(raw[:24])
    ranges = Ranges.decode(raw[24:])
    if not ranges.beyond(confirmed, count) or (len(ranges) and ranges.bounds[-1] > next_read):
        raise ValueError("held_cursor: finished ranges not in order beyond confirmed")
    out = {k: v for k, v in state.items() if k != "held_cursor"}
    out.update(confirmed=confirmed, confirmed_count=count, next_read=next_read,
               finished=raw[24:])
    return out


def _bounded(state: dict) -> dict:
    """`state` with at most MAX_REPLICA_RANGES finished ranges (the first) and the attempts of
    at most MAX_REPLICA_ATTEMPTS messages (the highest, in offset order)."""
    finished = state.get("finished", b"")
    if len(finished) > 32 * MAX_REPLICA_RANGES:
        state["finished"] = Ranges.decode(finished).encode(MAX_REPLICA_RANGES)
    attempts = state.get("attempts", b"")
    if len(attempts) > 16 * MAX_REPLICA_ATTEMPTS:
        values = unpack_u64(attempts)
        half = len(values) // 2
        top = sorted(heapq.nlargest(MAX_REPLICA_ATTEMPTS, zip(values[:half], values[half:]),
                                    key=lambda item: item[1]))
        state["attempts"] = pack_u64([o for o, _ in top]) + pack_u64([a for _, a in top])
    return state
