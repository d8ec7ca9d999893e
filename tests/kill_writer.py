"""The writer that tests/test_kill.py kills: appends to a DiskQueue until it is killed.

    python kill_writer.py FOLDER RUN [SEGMENT_BYTES]

Opens the queue (durable default policy), prints "ready", then 200 coroutines append
without pause. After each append is acknowledged it writes one line to stdout with one
write call: "first_id offset count log_id run ctr" — the request's bodies are
`body(run, ctr)` .. `body(run, ctr + count - 1)`, its trace id and ext header
`trace_id(run, ctr)` and `ext(run, ctr)`, so the test can recompute every byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
import zlib

SEGMENT_BYTES = 256 * 1024
COROUTINES = 200


def body(run: int, ctr: int) -> bytes:
    key = f"{run}:{ctr}".encode()
    return hashlib.shake_128(key).digest(1 + zlib.crc32(key) % 2000)


def trace_id(run: int, ctr: int) -> int:
    return (run << 32) | (ctr & 0xFFFFFFFF)


def ext(run: int, ctr: int) -> bytes:
    return f'{{"run":{run},"ctr":{ctr}}}'.encode() if ctr % 3 == 0 else b""


def options(segment_bytes: int = SEGMENT_BYTES):
    from diskqueue.queue import QueueOptions

    return QueueOptions(segment_bytes=segment_bytes)


async def main(path: str, run: int, segment_bytes: int) -> None:
    from diskqueue.queue import DiskQueue

    q = await DiskQueue.open(path, options(segment_bytes))
    os.write(1, b"ready\n")
    rng = random.Random(run)
    counter = 0

    async def writer() -> None:
        nonlocal counter
        while True:
            n = 1 if rng.random() < 0.7 else rng.randint(2, 8)
            ctr = counter
            counter += n
            a = await q.append([body(run, ctr + i) for i in range(n)], trace_id=trace_id(run, ctr),
                               ext=ext(run, ctr))
            os.write(1, f"{a.first_id} {a.offset} {a.count} {a.log_id} {run} {ctr}\n".encode())

    await asyncio.gather(*(writer() for _ in range(COROUTINES)))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import structlog
    import uvloop

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: acks

    uvloop.run(main(sys.argv[1], int(sys.argv[2]),
                    int(sys.argv[3]) if len(sys.argv) > 3 else SEGMENT_BYTES))
