"""Samples kept in memory for the charts: after each poll, every topic's and partition's
(messages, depth), and every channel's depth, for the last `--history` seconds. Rates are
differences of `messages` between samples. Sparklines are inline SVG computed here, on the
server: no JavaScript, no library.

Invariant: `series[key][-i]` was taken at `times[-i]` (series are aligned at the newest
end); a key missing from a sample is dropped, so a deleted topic's series ends, and one
made again starts afresh.
"""

from __future__ import annotations

import html
from collections import deque

from .model import Snapshot


class History:
    def __init__(self, seconds: float, interval: float):
        self.maxlen = max(2, int(seconds / max(interval, 0.001)) + 1)
        self.times: deque[float] = deque(maxlen=self.maxlen)
        self.series: dict[tuple, deque[tuple[int, int]]] = {}

    def add(self, snap: Snapshot) -> None:
        self.times.append(snap.taken_at)
        now: dict[tuple, tuple[int, int]] = {}
        for t in snap.topics.values():
            now[("t", t.name)] = (t.messages, t.depth)
            for p in t.partitions:
                now[("p", t.name, p.number, p.leader)] = (p.messages, p.depth)
            for c in t.channels.values():
                now[("c", t.name, c.name)] = (c.messages, c.depth)
        old = self.series
        self.series = {}
        for key, value in now.items():
            s = old.get(key)
            if s is None:
                s = deque(maxlen=self.maxlen)
            s.append(value)
            self.series[key] = s

    def rates(self, key: tuple) -> list[float]:
        """Messages per second between consecutive samples (oldest first)."""
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
        """The latest rate (messages/s), 0 without two samples."""
        r = self.rates(key)
        return r[-1] if r else 0.0

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
