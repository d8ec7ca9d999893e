"""Cursor: where one channel stands in one partition's history (pure, no I/O).

- `confirmed` / `confirmed_count`: every message before this offset is finished;
- `next_read` / `next_count`: where the next fresh message is read from;
- the window: every message taken between them, in offset order, each
  finished or not. Finished messages beyond the first unfinished one are the
  channel's "confirmed segments"; when the first unfinished message finishes,
  `confirmed` jumps to the next unfinished one (or to `next_read`).
- `finished`: those confirmed segments as merged ranges, kept up to date on every
  FIN, so a checkpoint saves them without a walk over the window. After a restart
  the saved ranges are `ahead` of `next_read`: reading takes each one as finished
  at once (`take_finished`), so its messages are not delivered again.

Invariants: the window's first slot is never finished; every slot not finished is
in the window (`reset` marks the slots it forgets finished, so a late FIN of one is
ignored); `finished` lists exactly the finished slots beyond the first unfinished one.

FINs mostly arrive in order, so popping finished slots from the front is
amortised O(1) per message whatever the order; a FIN beyond a gap costs one
binary search over the ranges.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right
from collections import deque


class Slot:
    """One taken message's place in the window (the channel's Message is one too)."""

    __slots__ = ("offset", "end", "count", "done")

    def __init__(self, offset: int, end: int, count: int):
        self.offset = offset
        self.end = end
        self.count = count  # the message's 0-based place in the partition's history
        self.done = False


def pack_u64(values) -> bytes:
    """Integers as little-endian 64-bit words (the checkpoint's compact form)."""
    a = array("q", values)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_u64(data: bytes) -> list[int]:
    a = array("q")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


class Ranges:
    """Merged finished ranges in offset order: `bounds` = [start0, end0, start1, end1, ...]
    (offsets) and `counts` the same places as message counts (first message, one past the
    last), so a range holds counts[2i+1] - counts[2i] messages. Ranges never touch: an
    unfinished message lies between two of them."""

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: list[int] | None = None, counts: list[int] | None = None):
        self.bounds = bounds if bounds is not None else []
        self.counts = counts if counts is not None else []

    def __len__(self) -> int:
        return len(self.bounds) // 2

    def pairs(self) -> list[tuple[int, int]]:
        b = self.bounds
        return list(zip(b[0::2], b[1::2]))

    def messages(self) -> int:
        c = self.counts
        return sum(c[1::2]) - sum(c[0::2])

    def beyond(self, offset: int, count: int) -> bool:
        """Whether every range lies past (`offset`, `count`), in order, none touching."""
        b, c = self.bounds, self.counts
        return (len(b) == len(c) and all(x < y for x, y in zip([offset, *b], b))
                and all(x < y for x, y in zip([count, *c], c)))

    def add(self, start: int, end: int, start_count: int, end_count: int) -> None:
        """Add a finished range that overlaps none, merging with its neighbours."""
        bounds, counts = self.bounds, self.counts
        i = bisect_right(bounds, start)  # even: `start` is not inside a range
        left = i and bounds[i - 1] == start
        right = i < len(bounds) and bounds[i] == end
        if left and right:
            del bounds[i - 1:i + 1]
            del counts[i - 1:i + 1]
        elif left:
            bounds[i - 1] = end
            counts[i - 1] = end_count
        elif right:
            bounds[i] = start
            counts[i] = start_count
        else:
            bounds[i:i] = (start, end)
            counts[i:i] = (start_count, end_count)

    def encode(self, limit: int) -> bytes:
        """The first `limit` ranges as little-endian u64s: every bound offset, then every
        bound count."""
        n = 2 * min(limit, len(self))
        if n == len(self.bounds):
            return pack_u64(self.bounds) + pack_u64(self.counts)
        return pack_u64(self.bounds[:n]) + pack_u64(self.counts[:n])

    @classmethod
    def decode(cls, data: bytes) -> "Ranges":
        """Raises ValueError when `data` is not whole ranges."""
        values = unpack_u64(data)
        if len(values) % 4:
            raise ValueError("finished ranges: not whole (start, end) pairs")
        half = len(values) // 2
        return cls(values[:half], values[half:])


class Cursor:
    def __init__(self, confirmed: int, confirmed_count: int, ahead: Ranges | None = None):
        """`ahead`: finished ranges a checkpoint saved beyond `confirmed` (a restart)."""
        self._window: deque[Slot] = deque()
        self.changes = 0  # bumped whenever `finished` changes (a checkpoint re-encodes it)
        self.reset(confirmed, confirmed_count)
        if ahead is not None and len(ahead):
            if not ahead.beyond(confirmed, confirmed_count):
                raise ValueError("saved finished ranges must be ordered, apart, beyond confirmed")
            self.ahead = ahead
            self.ahead_count = ahead.messages()

    def reset(self, offset: int, count: int) -> None:
        """Forget the window and read from `offset` (restart, replay, empty)."""
        for slot in self._window:
            slot.done = True  # a late FIN of a forgotten message is ignored
        self.confirmed = self.next_read = offset
        self.confirmed_count = self.next_count = count
        self._window = deque()
        self.finished = Ranges()
        self.changes += 1
        self.ahead: Ranges | None = None  # saved finished ranges not read yet (restart)
        self.ahead_count = 0  # messages in them

    def take(self, slot) -> None:
        """Register a fresh message (`offset`, `end`, `count`, `done` attributes, like Slot):
        its offset must be `next_read`."""
        if slot.offset != self.next_read:
            raise ValueError(f"take at {slot.offset} but next_read is {self.next_read}")
        self._window.append(slot)
        self.next_read = slot.end
        self.next_count = slot.count + 1

    def take_finished(self) -> bool:
        """When the first saved range `ahead` starts at `next_read`, take all of it as one
        finished slot (its messages are not delivered again) and return True."""
        ahead = self.ahead
        bounds, counts = ahead.bounds, ahead.counts
        if bounds[0] != self.next_read:
            return False
        start, end, start_count, end_count = bounds[0], bounds[1], counts[0], counts[1]
        del bounds[:2], counts[:2]
        self.ahead_count -= end_count - start_count
        if not bounds:
            self.ahead = None
        self.next_read, self.next_count = end, end_count
        if not self._window:  # nothing unfinished before it: confirmed moves over it
            self.confirmed, self.confirmed_count = end, end_count
            return True
        slot = Slot(start, end, start_count)
        slot.done = True
        self._window.append(slot)
        self.finished.add(start, end, start_count, end_count)
        self.changes += 1
        return True

    def finish(self, slot: Slot) -> None:
        """Mark a taken message finished and move `confirmed` over every finished prefix."""
        if slot.done:
            return  # finished already, or forgotten by `reset`
        slot.done = True
        window = self._window
        if not window:
            return
        if window[0] is not slot:  # beyond the first unfinished message
            self.finished.add(slot.offset, slot.end, slot.count, slot.count + 1)
            self.changes += 1
            return
        while window and window[0].done:
            window.popleft()
        if window:
            self.confirmed = window[0].offset
            self.confirmed_count = window[0].count
        else:
            self.confirmed = self.next_read
            self.confirmed_count = self.next_count
        bounds = self.finished.bounds
        if bounds and bounds[1] <= self.confirmed:  # the range after the gap is confirmed now
            del bounds[:2], self.finished.counts[:2]
            self.changes += 1

    @property
    def window_size(self) -> int:
        """Slots taken and not yet confirmed past (finished ones beyond a gap included; a
        saved range taken after a restart is one slot)."""
        return len(self._window)

    def unfinished(self) -> int:
        return sum(1 for s in self._window if not s.done)

    def confirmed_segments(self) -> list[tuple[int, int]]:
        """Finished ranges beyond `confirmed`, merged: [(start, end), ...]."""
        return self.finished.pairs()
