"""Samples kept in memory for the charts: after each poll, every partition's (messages,
depth) and every channel partition's (confirmed_count, depth), under a key naming the node
that reported it, and every topic's and channel's depth, for the last `--history` seconds.
Sparklines are inline SVG computed here, on the server: no JavaScript, no library.

Rates come only from two samples of one log position read from one node: a partition's
`messages` from its leader, a channel partition's `confirmed_count` from the node serving
it. A topic's rate is the sum of its partitions' rates, a channel's the sum of its
partitions'. So a leader change starts the partition's series afresh instead of comparing
two nodes' numbers, a partition missing from one poll adds nothing, and a count that went
back (a replay) gives 0 for that step: no rate ever comes from a jump of a total.

Invariant: `series[key][-i]` was taken at `times[-i]` (series are aligned at the newest
end); a key missing from a sample is dropped, so a deleted topic's series ends, and one
made again (or a partition under a new leader) starts afresh.
"""

from __future__ import annotations

import html
from collections import deque

from .model import Snapshot


def partition_key(topic: str, number: int, leader: str) -> tuple:
    return ("p", topic, number, leader)


def topic_key(topic: str) -> tuple:
    return ("t", topic)


def channel_key(topic: str, channel: str) -> tuple:
    return ("c", topic, channel)


class History:
    def __init__(self, seconds: float, interval: float):
        self.maxlen = max(2, int(seconds / max(interval, 0.001)) + 1)
        self.times: deque[float] = deque(maxlen=self.maxlen)
        self.series: dict[tuple, deque[tuple[int, int]]] = {}  # key -> (count, depth)
        self.parts: dict[tuple, list[tuple]] = {}  # topic/channel key -> its parts' keys

    def add(self, snap: Snapshot) -> None:
        self.times.append(snap.taken_at)
        now: dict[tuple, tuple[int, int]] = {}
        parts: dict[tuple, list[tuple]] = {}
        for t in snap.topics.values():
            tk = topic_key(t.name)
            now[tk] = (0, t.depth)
            parts[tk] = []
            for p in t.partitions:
                key = partition_key(t.name, p.number, p.leader)
                now[key] = (p.messages, p.depth)
                parts[tk].append(key)
            for c in t.channels.values():
                ck = channel_key(t.name, c.name)
                now[ck] = (0, c.depth)
                parts[ck] = []
                for cp in c.parts:
                    key = ("cp", t.name, c.name, cp.partition, cp.node)
                    now[key] = (cp.confirmed_count, cp.depth)
                    parts[ck].append(key)
        old = self.series
        self.series = {}
        for key, value in now.items():
            s = old.get(key)
            if s is None:
                s = deque(maxlen=self.maxlen)
            s.append(value)
            self.series[key] = s
        self.parts = parts

    def rates(self, key: tuple) -> list[float]:
        """Per second between consecutive samples (oldest first): of the count of one
        partition key, or the sum of a topic's or channel's partitions' rates."""
        if key in self.parts:
            out: list[float] = []
            for part in self.parts[key]:
                r = self.rates(part)
                if len(r) > len(out):
                    out = [0.0] * (len(r) - len(out)) + out
                for i in range(1, len(r) + 1):
                    out[-i] += r[-i]
            return out
        s = self.series.get(key)
        if not s or len(s) < 2:
            return []
        times = list(self.times)[-len(s):]
        vals = [v[0] for v in s]
        out = []
        for i in range(1, len(vals)):
            dt = times[i] - times[i - 1]
            out.append(max(0, vals[i] - vals[i - 1]) / dt if dt > 0 else 0.0)
        return out

    def rate(self, key: tuple) -> float:
        """The latest of rates(key) (0 without two samples), from the last two samples only."""
        if key in self.parts:
            return sum(self.rate(part) for part in self.parts[key])
        s = self.series.get(key)
        if not s or len(s) < 2:
            return 0.0
        dt = self.times[-1] - self.times[-2]
        return max(0, s[-1][0] - s[-2][0]) / dt if dt > 0 else 0.0

    def depths(self, key: tuple) -> list[int]:
        s = self.series.get(key)
        return [v[1] for v in s] if s else []


def sparkline(values: list[float], label: str, width: int = 120, height: int = 24) -> str:
    """An inline SVG polyline of `values` (oldest left), scaled to its own max; its <title>
    says the last, min and max. Empty values give an empty box saying "no samples yet"."""
    label = html.escape(label)
    if len(values) < 2:
        return (f'<svg class="spark" width="{width}" height="{height}" role="img">'
                f'<title>{label}: no samples yet</title></svg>')
    top = max(values) or 1
    step = width / (len(values) - 1)
    points = " ".join(f"{i * step:.1f},{height - 1 - (v / top) * (height - 2):.1f}"
                      for i, v in enumerate(values))
    last = values[-1]
    title = f"{label}: last {last:g}, min {min(values):g}, max {max(values):g}"
    return (f'<svg class="spark" width="{width}" height="{height}" role="img" '
            f'viewBox="0 0 {width} {height}"><title>{title}</title>'
            f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" '
            f'points="{points}"/></svg>')
