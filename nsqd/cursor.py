"""Cursor: where one channel stands in one partition's history (pure, no I/O).

- `confirmed` / `confirmed_count`: every message before this offset is finished;
- `next_read` / `next_count`: where the next fresh message is read from;
- the window: every message taken between them, in offset order, each
  finished or not. Finished messages beyond the first unfinished one are the
  channel's "confirmed segments"; when the first unfinished message finishes,
  `confirmed` jumps to the next unfinished one (or to `next_read`).

FINs mostly arrive in order, so popping finished slots from the front is
amortised O(1) per message whatever the order.
"""

from __future__ import annotations

from collections import deque


class Slot:
    """One taken message's place in the window (the channel's Message is one too)."""

    __slots__ = ("offset", "end", "count", "done")

    def __init__(self, offset: int, end: int, count: int):
        self.offset = offset
        self.end = end
        self.count = count  # the message's 0-based place in the partition's history
        self.done = False


class Cursor:
    def __init__(self, confirmed: int, confirmed_count: int):
        self.reset(confirmed, confirmed_count)

    def reset(self, offset: int, count: int) -> None:
        """Forget the window and read from `offset` (restart, replay, empty)."""
        self.confirmed = self.next_read = offset
        self.confirmed_count = self.next_count = count
        self._window: deque[Slot] = deque()

    def take(self, slot) -> None:
        """Register a fresh message (`offset`, `end`, `count`, `done` attributes, like Slot):
        its offset must be `next_read`."""
        if slot.offset != self.next_read:
            raise ValueError(f"take at {slot.offset} but next_read is {self.next_read}")
        self._window.append(slot)
        self.next_read = slot.end
        self.next_count = slot.count + 1

    def finish(self, slot: Slot) -> None:
        """Mark a taken message finished and move `confirmed` over every finished prefix."""
        slot.done = True
        window = self._window
        if not window or window[0] is not slot:
            return
        while window and window[0].done:
            window.popleft()
        if window:
            self.confirmed = window[0].offset
            self.confirmed_count = window[0].count
        else:
            self.confirmed = self.next_read
            self.confirmed_count = self.next_count

    @property
    def window_size(self) -> int:
        """Messages taken and not yet confirmed past (finished ones beyond a gap included)."""
        return len(self._window)

    def unfinished(self) -> int:
        return sum(1 for s in self._window if not s.done)

    def confirmed_segments(self) -> list[tuple[int, int]]:
        """Finished ranges beyond `confirmed`, merged: [(start, end), ...]."""
        ranges: list[tuple[int, int]] = []
        for s in self._window:
            if not s.done:
                continue
            if ranges and ranges[-1][1] == s.offset:
                ranges[-1] = (ranges[-1][0], s.end)
            else:
                ranges.append((s.offset, s.end))
        return ranges
