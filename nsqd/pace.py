"""Pace: a long walk on the event loop, in slices with the loop's turns between them.

/stats and /metrics walk every partition of the node: at 10,000 partitions, hundreds of
milliseconds of pure work, which every publish and delivery would wait out if done at once.
The walk is a pure generator of pieces (stats.topic_entries, httpapi.go_json_pieces,
metrics.render); `collect` takes them and lets the loop run everything else once SLICE_S
of work has passed. A piece is never split: the longest the loop waits is one piece (one
topic's stats, at most MAX_PARTITIONS partitions) past a slice."""

from __future__ import annotations

import asyncio
import time
from typing import Iterable, TypeVar

SLICE_S = 0.005  # work between two turns of the loop

T = TypeVar("T")


async def collect(pieces: Iterable[T]) -> list[T]:
    """list(pieces), with a turn of the loop once SLICE_S has passed since the last."""
    out: list[T] = []
    since = time.perf_counter()
    for piece in pieces:
        out.append(piece)
        if time.perf_counter() - since >= SLICE_S:
            await asyncio.sleep(0)
            since = time.perf_counter()
    return out
