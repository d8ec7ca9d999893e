"""The node's logs with their files open: its FileBudget (diskqueue/budget.py) and the loop
that closes the files of logs it no longer needs open.

A log's files (active segment, commitlog, a replica's committed end) are open only while it
holds a place of the budget: at most half of the process's descriptors, three a log
(`open_logs_limit`); a log without a place waits for one. `release_loop` closes the files
(DiskQueue.release_files) of a log unused for FILES_IDLE_S and, while more than OPEN_LOGS (or
half the budget, if less) logs hold a place, of the least recently used beyond that number;
it looks every RELEASE_INTERVAL, and at once when a log waits for a place. It looks only at
the logs holding a place (led or followed), never at every partition of the node.
"""

from __future__ import annotations

import asyncio
import resource
import time

import structlog

from diskqueue.budget import FileBudget
from diskqueue.errors import QueueClosedError

log = structlog.get_logger("nsqd")

FILES_IDLE_S = 60.0
OPEN_LOGS = 1024
RELEASE_INTERVAL = 1.0
RELEASE_STEP = 16  # releases given to the write thread at once (each may sync a segment)


def open_logs_limit() -> int:
    """How many logs may hold their files open at once: half of the process's descriptors
    (its soft RLIMIT_NOFILE), three a log (its active segment, its commitlog, a replica's
    committed end); the other half is for connections, stores and the read threads."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(2, soft // 6)


class OpenLogs:
    """The budget (`files`, given to every queue of the node) and its release loop."""

    def __init__(self):
        self._wanted = asyncio.Event()  # a log waits for a place
        self.files = FileBudget(open_logs_limit(), on_full=self._wanted.set)

    async def release_loop(self) -> None:
        """Close the files of the logs that FILES_IDLE_S and OPEN_LOGS say (above), and as
        many more as logs wait for a place, least recently used first, RELEASE_STEP at a
        time: the write thread runs jobs in order, and a release syncs its segment when it
        has unsynced data, so a burst of them delays every publish queued behind it (after
        10,000 first writes a pass closes thousands: given at once, a PUB waited half a
        second); passes follow each other while logs wait and the last one released some.
        A failed log keeps its place until it is closed."""
        files = self.files
        keep = min(OPEN_LOGS, files.limit // 2)
        chosen: list = []
        while True:
            if not (files.waiting and chosen):
                try:
                    async with asyncio.timeout(RELEASE_INTERVAL):
                        await self._wanted.wait()
                except TimeoutError:
                    pass
            self._wanted.clear()
            held = sorted(((max(q.files_used_at or 0.0, taken), q)
                          for q, taken in files.holders.items() if q.failed is None),
                          key=lambda item: item[0])
            excess = len(held) - keep + files.waiting
            now = time.monotonic()
            chosen = []
            for i, (used, queue) in enumerate(held):
                if i >= excess and now - used < FILES_IDLE_S:
                    break  # the rest were used more recently
                chosen.append(queue)
            for i in range(0, len(chosen), RELEASE_STEP):
                await asyncio.gather(*map(_release, chosen[i:i + RELEASE_STEP]))


async def _release(queue) -> None:
    try:
        await queue.release_files()
    except QueueClosedError:
        pass
    except Exception:
        log.exception("release_files_failed", path=queue.path)
