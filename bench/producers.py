"""What an idempotent producers' table costs a partition outside the publish path
(nsqd/producers.py; the per-publish cost is bench/nsqd.py's part (i)).

    .venv/bin/python bench/producers.py [--quick]

In-process, like storage.py: a real DiskQueue in a temporary folder, filled with 200-byte
single-message requests, each named by one of 100 producers (its first record marked as a
named request is). Figures:
- rebuild: reading the table's source back, `DiskQueue.marked_requests` over the log's
  last SCAN_BYTES (what a partition opened after a restart or a failover reads on its
  first named request), median of 3: seconds and requests a second; beside it the
  reference, the same bytes read by a channel's Reader (every record decoded and
  checksummed), and what 60 s (SCAN_SECONDS) of single named PUBs at `--rate` would take;
- memory: a table of `--producers` producers with their 5 answers each (tracemalloc):
  bytes a producer.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from diskqueue.groupcommit import Appended  # noqa: E402
from diskqueue.queue import DiskQueue  # noqa: E402
from nsqd.producers import (KEPT, MARKER, SCAN_BYTES, SCAN_SECONDS, ProducerTable,  # noqa: E402
                            marked)


async def fill(q: DiskQueue, size: int) -> int:
    body, n = b"x" * 200, 0
    while q.written_end < size:
        await asyncio.gather(*[q.append([body], 0, marked(b"", (f"producer-{i % 100}", n + i)))
                               for i in range(2000)])
        n += 2000
    return n


async def read_all(q: DiskQueue, start: int) -> int:
    reader, n = q.reader(start), 0
    try:
        while True:
            records = await reader.read(4096)
            if not records:
                return n
            n += len(records)
    finally:
        reader.close()


async def rebuild(report: Report, size: int, rate: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-producers-") as tmp:
        q = await DiskQueue.open(tmp)
        try:
            await fill(q, size + (1 << 20))
            since = q.written_end - size
            first = q.commitlog.find_by_offset(since).offset
            scans, reads, found = [], [], 0
            for _ in range(3):
                t = time.perf_counter()
                found = len(await q.marked_requests(since, MARKER))
                scans.append(time.perf_counter() - t)
                q.shared_chunks.clear()  # decoded again, not taken from the last read
                t = time.perf_counter()
                await read_all(q, first)
                reads.append(time.perf_counter() - t)
        finally:
            await q.close()
    scan, read = statistics.median(scans), statistics.median(reads)
    report.section(f"rebuild: the table's source read back from the log's last {size >> 20} MiB")
    report.add("rebuild_requests", found, "named requests read", fmt=",d")
    report.add("rebuild_s", scan, "seconds (DiskQueue.marked_requests, median of 3)", fmt=".3f")
    report.add("rebuild_requests_per_s", found / scan, "requests a second", fmt=",.0f")
    report.add("reference_read_s", read, "reference: the same bytes by a Reader (decoded, "
               "checksummed)", fmt=".3f")
    report.add("rebuild_60s_at_rate_s", rate * SCAN_SECONDS / (found / scan),
               f"{SCAN_SECONDS} s of single named PUBs at {rate:,}/s, read back (s)", fmt=".2f")


def memory(report: Report, producers: int) -> None:
    table = ProducerTable(max_producers=producers)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(producers):
        pid = f"{i:032x}"  # nsqclient's ids: 32 hex digits
        for s in range(KEPT):
            waiters: list = []
            table.begin(pid, s, 0.0, waiters)
            table.settle(pid, s, waiters, Appended(i * KEPT + s, 1, 236 * s, 236 * s + 236, s,
                                                   1_700_000_000_000_000_000, [236 * s]), False)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    report.section(f"memory: a table of {producers:,} producers, {KEPT} answers each")
    report.add("table_bytes_per_producer", used / producers, "bytes a producer", fmt=",.0f")
    report.add("table_mb", used / 1e6, "MB the table", fmt=",.1f")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 MiB instead of SCAN_BYTES")
    ap.add_argument("--rate", type=int, default=26_000,
                    help="single named PUBs a second for the 60 s figure (bench/nsqd.py (i))")
    ap.add_argument("--producers", type=int, default=2_000)
    args = ap.parse_args()
    report = Report("producers")
    report.figures.update(common.machine_info())
    asyncio.run(rebuild(report, 4 << 20 if args.quick else SCAN_BYTES, args.rate))
    memory(report, args.producers)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
