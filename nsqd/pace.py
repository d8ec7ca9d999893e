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
from typing import AsyncIterator, Iterable, Iterator, TypeVar

SLICE_S = 0.005  # work between two turns of the loop

T = TypeVar("T")


async def paced(pieces: Iterable[T]) -> AsyncIterator[T]:
    """Each piece, with a turn of the loop once SLICE_S has passed since the last."""
    since = time.perf_counter()
    for piece in pieces:
        yield piece
        if time.perf_counter() - since >= SLICE_S:
            await asyncio.sleep(0)
            since = time.perf_counter()


async def collect(pieces: Iterable[T]) -> list[T]:
    """list(pieces), with a turn of the loop once SLICE_S has passed since the last."""
    return [piece async for piece in paced(pieces)]


def chunks(pieces: Iterable[str], size: int) -> Iterator[bytes]:
    """The text of `pieces` in UTF-8 chunks of about `size` characters (a piece is never
    split; the last chunk may be shorter)."""
    group: list[str] = []
    chars = 0
    for piece in pieces:
        group.append(piece)
        chars += len(piece)
        if chars >= size:
            yield "".join(group).encode()
            group, chars = [], 0
    if group:
        yield "".join(group).encode()
