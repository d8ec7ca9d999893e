"""Order checker for ordered consumption: keyed producers number each key's messages 0, 1,
2, ... (`body(key, seq)`); an ordered consumer feeds what it receives to `OrderCheck`.

After dropping duplicates (a number of that key seen before: at-least-once allows them),
each key's numbers must arrive strictly increasing and without gaps:
- a **reorder** is a number that arrives after a higher one of its key and was not seen
  before (it was overtaken);
- a **gap** is a number arriving more than one past the highest seen of its key (those
  between were skipped, at least for a while), or, at `finish`, numbers a key was sent
  that never arrived.
"""

from __future__ import annotations


def body(key: str, seq: int) -> bytes:
    return f"{key}:{seq}".encode()


def parse(data: bytes) -> tuple[str, int]:
    key, _, seq = data.decode().rpartition(":")
    return key, int(seq)


class OrderCheck:
    def __init__(self):
        self.top: dict[str, int] = {}  # key -> highest number seen
        self.seen: dict[str, set[int]] = {}
        self.received = 0
        self.duplicates = 0
        self.reorders: list[tuple[str, int, int]] = []  # (key, number, higher one seen first)
        self.gaps: list[tuple[str, int, int]] = []  # (key, first missing, last missing)

    def observe(self, key: str, seq: int) -> None:
        self.received += 1
        seen = self.seen.setdefault(key, set())
        top = self.top.get(key, -1)
        if seq in seen:
            self.duplicates += 1
            return
        seen.add(seq)
        if seq < top:
            self.reorders.append((key, seq, top))
            return
        if seq > top + 1:
            self.gaps.append((key, top + 1, seq - 1))
        self.top[key] = seq

    def observe_body(self, data: bytes) -> None:
        self.observe(*parse(data))

    def finish(self, sent: dict[str, int]) -> None:
        """`sent`: key -> how many numbers (0..n-1) the producer had acknowledged."""
        for key, n in sent.items():
            top = self.top.get(key, -1)
            if top < n - 1:
                self.gaps.append((key, top + 1, n - 1))

    def report(self) -> dict:
        return {"received": self.received, "keys": len(self.seen),
                "duplicates": self.duplicates, "reorders": len(self.reorders),
                "gaps": len(self.gaps), "first_reorders": self.reorders[:5],
                "first_gaps": self.gaps[:5]}

    @property
    def clean(self) -> bool:
        return not self.reorders and not self.gaps
