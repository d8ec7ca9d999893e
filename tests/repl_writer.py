"""The replicated writers that tests/test_diskqueue_replication.py kills.

    python repl_writer.py commit FOLDER SEGMENT_BYTES
        Opens a replicated queue and appends from 50 coroutines without pause, while a
        committer calls `commit_to` every millisecond with the written end it saw LAG
        turns before (so the commit lags the writes). It prints "commit OFFSET COUNT"
        BEFORE each call, so every committed end is at most the last line printed.

    python repl_writer.py truncate FOLDER SEGMENT_BYTES CLOG_ENTRIES OFFSET COUNT CRASH_AT
        Opens the queue, then truncates it to (OFFSET, COUNT), killing itself (SIGKILL) just
        before its CRASH_AT-th file-changing system call (unlink, ftruncate, fsync, fdatasync,
        replace, write, pwrite, pwritev) from then on. Prints "done" if it got through. Its batches
        are small (max_batch_bytes 1 KiB): recovery then refuses a commitlog that runs more
        than 2 KiB past the data, so a wrong order of the cut shows.

    python repl_writer.py epochs FOLDER
        Opens a replicated queue, writes 3 durable batches at epoch 3 and 3 at epoch 7 (as a
        leader after set_epoch), prints "done" and exits without closing (no final sync of
        the commitlog): a power cut then keeps only what was synced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque

LAG = 20  # committer turns
MUTATING = ("unlink", "ftruncate", "fsync", "fdatasync", "replace", "write", "pwrite", "pwritev")


async def commit(path: str, segment_bytes: int) -> None:
    from diskqueue.queue import DiskQueue, QueueOptions

    q = await DiskQueue.open(path, QueueOptions(segment_bytes=segment_bytes, replicated=True))
    os.write(1, b"ready\n")

    async def writer(i: int) -> None:
        n = 0
        while True:
            n += 1
            await q.append([os.urandom(1 + (i * 37 + n) % 900) for _ in range(1 + n % 3)])

    async def committer() -> None:
        seen = deque([(q.written_end, q.written_count)] * LAG)
        while True:
            await asyncio.sleep(0.001)
            end = seen.popleft()
            os.write(1, f"commit {end[0]} {end[1]}\n".encode())
            q.commit_to(*end)
            seen.append((q.written_end, q.written_count))

    await asyncio.gather(committer(), *(writer(i) for i in range(50)))


def crash_before(n: int) -> None:
    """SIGKILL this process just before its n-th file-changing system call from now on."""
    calls = [0]

    def wrap(name):
        real = getattr(os, name)

        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    for name in MUTATING:
        setattr(os, name, wrap(name))


async def truncate(path: str, segment_bytes: int, clog_entries: int, offset: int, count: int,
                   crash_at: int) -> None:
    from diskqueue.queue import DiskQueue, QueueOptions

    q = await DiskQueue.open(path, QueueOptions(segment_bytes=segment_bytes, replicated=True,
                                                clog_entries_per_segment=clog_entries,
                                                max_batch_bytes=1024))
    crash_before(crash_at)
    await q.truncate_to(offset, count)
    sys.stdout.write("done\n")
    sys.stdout.flush()
    os._exit(0)  # no close: only the truncation is under test


async def epochs(path: str) -> None:
    from diskqueue.queue import DiskQueue, QueueOptions

    q = await DiskQueue.open(path, QueueOptions(replicated=True))
    for epoch in (3, 7):
        await q.set_epoch(epoch)
        for i in range(3):
            await q.append([b"%d-%d" % (epoch, i)])
    sys.stdout.write("done\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    mode, folder, *rest = sys.argv[1:]
    if mode == "commit":
        asyncio.run(commit(folder, int(rest[0])))
    elif mode == "epochs":
        asyncio.run(epochs(folder))
    else:
        asyncio.run(truncate(folder, *map(int, rest)))
