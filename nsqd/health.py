"""Health: what is failing on this node, said once and kept short.

`node_health(nsqd)` is the node's health text in classic nsqd's shape: `OK`, or
`NOK - <reason>` (what /ping answers with a 500, and /stats' `health`). The reasons are
the partitions that do not serve (failed to open, or their log failed while running), a
full disk under the data path (less than DISK_FULL_BYTES free: publishes fail with
E_PUB_FAILED until there is space again; classic says NOK after a failed write, we say
it while the disk is full), a data path that does not answer (a read of its free space
still running after DISK_READ_S: a stalled network disk; the event loop never waits for
it, `DiskWatch`), and a checkpoint that keeps failing (cursors then lag: more duplicates
after a crash, nothing lost).

`FailureLog` reports a failure that repeats (a checkpoint every second on a full disk, a
delay store's writes) without flooding the log: the first failure of a run with its
traceback, then at most one line every `every_s` seconds with the count, and one line
when it works again.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import time

MAX_REASONS = 3  # in the health text; the rest are counted
DISK_FULL_BYTES = 1 << 20  # less free than this under the data path: the disk is full
DISK_READ_S = 1.0  # a read of the free space still running after this: the disk hangs


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of `path`."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class DiskWatch:
    """The free space under the data path, read in a thread (a statvfs on a disk that hangs
    blocks for as long as it does: never on the event loop). One read at a time: callers
    that come while one runs share it. `free` is the last value read (None: unknown);
    `hung_since` the monotonic time a read that outlived DISK_READ_S began (None once one
    finishes)."""

    def __init__(self, path: str):
        self.path = path
        self.free: int | None = None
        self.hung_since: float | None = None
        self._read: asyncio.Future | None = None
        self._began = 0.0

    async def read(self) -> int | None:
        """Read it now, waiting DISK_READ_S at most: the value, else the last one."""
        if self._read is None or self._read.done():
            self._began = time.monotonic()
            self._read = asyncio.ensure_future(asyncio.to_thread(free_bytes, self.path))
        try:
            async with asyncio.timeout(DISK_READ_S):
                self.free = await asyncio.shield(self._read)
            self.hung_since = None
        except TimeoutError:
            if self.hung_since is None:
                self.hung_since = self._began
        return self.free


def is_disk_full(exc: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC or EDQUOT, or SQLite's own "database
    or disk is full" (the metadata store), also when wrapped in another exception."""
    for _ in range(8):  # a chain is short; never loop on a cycle
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def node_health(nsqd) -> str:
    reasons = []
    for name in sorted(nsqd.topics):
        topic = nsqd.topics[name]
        for number, error in sorted(topic.errors().items()):
            reasons.append(f"topic {name} partition {number}: {error}")
    disk = nsqd.disk
    if disk.hung_since is not None:
        reasons.append(f"the data path {disk.path} has not answered for "
                       f"{time.monotonic() - disk.hung_since:.0f}s")
    elif disk.free is not None and disk.free < DISK_FULL_BYTES:
        reasons.append(f"disk full: {disk.free} bytes free under {disk.path}")
    if nsqd.checkpoint_failures.error is not None:
        reasons.append(f"checkpoint failing: {nsqd.checkpoint_failures.error}")
    if not reasons:
        return "OK"
    more = len(reasons) - MAX_REASONS
    text = "; ".join(reasons[:MAX_REASONS])
    return f"NOK - {text}" + (f" (and {more} more)" if more > 0 else "")


class FailureLog:
    """One kind of repeating failure (`event`), logged as the module docstring says."""

    def __init__(self, log, event: str, every_s: float = 60.0, clock=time.monotonic):
        self.log = log
        self.event = event
        self.every_s = every_s
        self.clock = clock
        self.error: str | None = None  # the last failure's text while failing, else None
        self.count = 0  # failures in the current run
        self._unreported = 0
        self._last_line = 0.0

    def failed(self, exc: BaseException, **fields) -> None:
        self.error = str(exc) or type(exc).__name__
        self.count += 1
        now = self.clock()
        if self.count == 1:
            self.log.error(self.event, error=self.error, exc_info=exc, **fields)
            self._last_line = now
            self._unreported = 0
            return
        self._unreported += 1
        if now - self._last_line >= self.every_s:
            self.log.error(f"{self.event}_again", error=self.error, failures=self._unreported,
                           failures_total=self.count, **fields)
            self._last_line = now
            self._unreported = 0

    def ok(self, **fields) -> None:
        if self.count:
            self.log.info(f"{self.event.removesuffix('_failed')}_recovered",
                          failures_total=self.count, **fields)
        self.error = None
        self.count = 0
        self._unreported = 0
