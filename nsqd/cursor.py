"""Cursor: where one channel stands in one partition's history (pure, no I/O).

- `confirmed` / `confirmed_count`: every message before this offset is finished;
- `next_read` / `next_count`: where the next fresh message is read from;
- the window: every message taken between them, in offset order, each
  finished or not. Finished messages beyond the first unfinished one are the
  channel's "confirmed segments"; when the first unfinished message finishes,
  `confirmed` jumps to the next unfinished one (or to `next_read`).
- `ranges()`: those confirmed segments as merged ranges, for a checkpoint. A FIN beyond
  the first unfinished message is only noted (`_late`); the notes are folded into the
  ranges every FOLD_EVERY of them and when the ranges are asked for, so a checkpoint
  never walks the window and a FIN stays a few list operations.
- `ahead`: after a restart, the finished ranges the checkpoint saved beyond `next_read`.
  Reading takes each one as finished at once (`take_finished`): its messages are not
  delivered again.

Invariants: the window's first slot is never finished; every slot not finished is
in the window (`reset` marks the slots it forgets finished, so a late FIN of one is
ignored); `ranges()` lists exactly the finished slots beyond the first unfinished one.

FINs mostly arrive in order, so popping finished slots from the front is
amortised O(1) per message whatever the order.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right
from collections import deque
from operator import attrgetter

FOLD_EVERY = 1024  # FINs beyond the gap noted before they are folded into the ranges
_offset = attrgetter("offset")


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
    a = values if isinstance(values, array) else array("q", values)
    if sys.byteorder == "big":
        a = array("q", a)
        a.byteswap()
    return a.tobytes()


def unpack_u64(data: bytes) -> array:
    """Raises ValueError when `data` is not whole 64-bit words."""
    a = array("q")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a


class Ranges:
    """Merged finished ranges in offset order: `bounds` = [start0, end0, start1, end1, ...]
    (offsets) and `counts` the same places as message counts (first message, one past the
    last), so a range holds counts[2i+1] - counts[2i] messages. Ranges never touch: an
    unfinished message lies between two of them. Both are arrays of 64-bit integers, so a
    checkpoint copies them out as they are."""

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds=(), counts=()):
        self.bounds = array("q", bounds)
        self.counts = array("q", counts)

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
        return (len(b) == len(c) and len(b) % 2 == 0
                and all(x < y for x, y in zip([offset, *b], b))
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
            bounds.insert(i, end)
            bounds.insert(i, start)
            counts.insert(i, end_count)
            counts.insert(i, start_count)

    def below(self, offset: int, count: int) -> Ranges:
        """The ranges cut at (`offset`, `count`), a message boundary: what lies before it."""
        bounds, counts = self.bounds, self.counts
        n = bisect_right(bounds, offset)  # odd: `offset` is inside range n // 2
        out = Ranges(bounds[:n], counts[:n])
        if n % 2:
            if bounds[n - 1] == offset:  # the range starts there: nothing of it is before
                del out.bounds[-1], out.counts[-1]
            else:
                out.bounds.append(offset)
                out.counts.append(count)
        return out

    def encode(self, limit: int) -> bytes:
        """The first `limit` ranges as little-endian u64s: every bound offset, then every
        bound count."""
        n = 2 * limit
        if n >= len(self.bounds):
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
        self.changes = 0  # bumped whenever the ranges change (a checkpoint re-encodes them)
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
        self._finished = Ranges()  # folded finished ranges (some may be confirmed since)
        self._late: list[Slot] = []  # finished beyond the gap, not folded yet
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
        self._finished.add(start, end, start_count, end_count)
        self.changes += 1
        return True

    def finish(self, slot: Slot) -> None:
        """Mark a taken message finished and move `confirmed` over every finished prefix."""
        if slot.done:
            return  # finished already, or forgotten by `reset`
        slot.done = True
        window = self._window
        if window[0] is not slot:  # beyond the first unfinished message (it is in the window)
            late = self._late
            late.append(slot)
            if len(late) >= FOLD_EVERY:
                self._fold()
            return
        while window and window[0].done:
            window.popleft()
        if window:
            self.confirmed = window[0].offset
            self.confirmed_count = window[0].count
        else:
            self.confirmed = self.next_read
            self.confirmed_count = self.next_count

    def _fold(self) -> None:
        """Drop the ranges `confirmed` passed; add the noted FINs still beyond it, each run of
        adjacent ones as one range."""
        confirmed = self.confirmed
        finished = self._finished
        bounds = finished.bounds
        dropped = 0
        while dropped < len(bounds) and bounds[dropped + 1] <= confirmed:
            dropped += 2
        if dropped:
            del bounds[:dropped], finished.counts[:dropped]
            self.changes += 1
        late = [s for s in self._late if s.offset >= confirmed]
        self._late = []
        if not late:
            return
        late.sort(key=_offset)
        add = finished.add
        first = last = late[0]
        for s in late[1:]:
            if s.offset != last.end:
                add(first.offset, last.end, first.count, last.count + 1)
                first = s
            last = s
        add(first.offset, last.end, first.count, last.count + 1)
        self.changes += 1

    def ranges(self) -> Ranges:
        """The finished ranges beyond `confirmed`, merged (read, do not change)."""
        if self._late or (self._finished.bounds and self._finished.bounds[1] <= self.confirmed):
            self._fold()
        return self._finished

    @property
    def window_size(self) -> int:
        """Slots taken and not yet confirmed past (finished ones beyond a gap included; a
        saved range taken after a restart is one slot)."""
        return len(self._window)

    def unfinished(self) -> int:
        return sum(1 for s in self._window if not s.done)

    def confirmed_segments(self) -> list[tuple[int, int]]:
        """Finished ranges beyond `confirmed`, merged: [(start, end), ...]."""
        return self.ranges().pairs()


def joined_ranges(taken: Ranges, ahead: Ranges | None) -> Ranges:
    """The finished ranges read so far, then those still ahead (merged where they touch)."""
    if ahead is None or not len(ahead):
        return taken
    bounds, counts = taken.bounds + ahead.bounds, taken.counts + ahead.counts
    n = len(taken.bounds)
    if n and bounds[n - 1] == bounds[n]:
        del bounds[n - 1:n + 1], counts[n - 1:n + 1]
    return Ranges(bounds, counts)


MAX_SAVED_RANGES = 4096  # finished ranges a checkpoint keeps (the nearest to `confirmed`)


class SavedWindow:
    """What a checkpoint saved of the window beyond `confirmed` (a restart reads it back):
    `ahead`, the finished ranges (the cursor skips them); `next_read`, where the window
    ended; `attempts`, offset -> attempts of unfinished messages that were not delivered
    exactly once. Any other message read again below `next_read` was delivered once."""

    __slots__ = ("ahead", "next_read", "attempts")

    def __init__(self, ahead: Ranges | None, next_read: int, attempts: dict[int, int]):
        self.ahead, self.next_read, self.attempts = ahead, next_read, attempts

    @classmethod
    def from_state(cls, state: dict) -> "SavedWindow | None":
        """From a stored checkpoint; None when it has no window (older checkpoints, new
        channels). Raises ValueError when it is damaged."""
        next_read = state.get("next_read", 0)
        if next_read <= state["confirmed"]:
            return None
        ahead = Ranges.decode(state.get("finished", b""))
        if not ahead.beyond(state["confirmed"], state["confirmed_count"]) or (
                len(ahead) and ahead.bounds[-1] > next_read):
            raise ValueError("finished ranges not in order beyond confirmed")
        attempts = unpack_u64(state.get("attempts", b""))
        half = len(attempts) // 2
        return cls(ahead if len(ahead) else None, next_read,
                   dict(zip(attempts[:half], attempts[half:])))

