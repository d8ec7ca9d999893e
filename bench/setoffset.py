"""How long a POST /channel/setoffset by timestamp takes on a big partition.

A real nsqd (a subprocess, over HTTP, like a user): topic `big` with channel `replay` is
made through the HTTP API, nsqd is stopped, and the partition's files are written directly
through diskqueue's own writer (DiskQueue.append in this process: 1 KiB bodies, 10 per
write request, so one commitlog entry per 10 messages, ~1 M entries for 10 GiB; synced
lazily, and at close; timestamps spread over a month by HistoryClock); then nsqd is
started again on that data and asked to move the channel to many random timestamps (unix
seconds between the first and the last record's), one request at a time on one keep-alive
connection. Each answer is the commitlog's binary
search (no scan), the channel's seek, and the cursor's SQLite commit (in a worker thread).
Also `count:` moves (the same search by count, plus a walk of one request's records), and
`end` moves (no search: what the seek and the commit cost alone).

Figures: `write_mb_per_s` (filling the partition), `locate_timestamp_median_us` / `_p99_us`
(DiskQueue.locate by time alone, in the filling process, on the queue just written);
`timestamp_median_ms`, `_p99_ms`, `_max_ms` (the whole HTTP answer), and the same for
`count_` and `end_`; `entries` (commitlog entries), `partition_gb`.
Target: `timestamp_p99_ms` < 50. The commitlog (64 bytes an entry) was just written, so
the searches read it from the page cache, as they do on a node that serves the partition.

    .venv/bin/python bench/setoffset.py            # 10 GiB (needs ~11 GiB free in /tmp)
    .venv/bin/python bench/setoffset.py --quick    # 1 GiB
    .venv/bin/python bench/setoffset.py --dir /mnt/big --gib 4 --requests 1000

The data is deleted at the end, also after a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.common import HistoryClock, Report, machine_info, percentile  # noqa: E402
from diskqueue.queue import DiskQueue, QueueOptions, SyncPolicy  # noqa: E402
from diskqueue.runtime import tune_gc  # noqa: E402
from jepsen.ports import free_port  # noqa: E402

GIB = 1 << 30
BODY = 1024
PER_REQUEST = 10
IN_FLIGHT = 256  # write requests queued at once (the writer batches them)
SPAN_S = 30 * 86400  # the records' timestamps span this (HistoryClock)
LOCATES = 2000  # searches by time timed in-process (the search alone)


class Nsqd:
    """nsqd in a subprocess on free loopback ports."""

    def __init__(self, data: str):
        self.data = data
        self.http = f"127.0.0.1:{free_port()}"
        self.tcp = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(os.path.join(self.data, "nsqd.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nsqd.main", "--data-path", self.data, "--tcp-address",
             self.tcp, "--http-address", self.http, "--retention-check-interval", "1h",
             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 120  # opening a big partition reads its tail
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.http}/ping", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"nsqd exited with {self.proc.returncode}")
                time.sleep(0.1)
        raise RuntimeError("nsqd did not start")

    def post(self, path: str, body: bytes = b"") -> bytes:
        req = urllib.request.Request(f"http://{self.http}{path}", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def fill(path: str, size: int) -> tuple[float, int, int, int, list[float]]:
    """Write `size` bytes of records to the partition at `path`: (seconds, entries, first
    timestamp ns, last timestamp ns, microseconds of each of LOCATES searches by time,
    sorted: DiskQueue.locate alone, in this process, on the queue just written)."""
    tune_gc()
    q = await DiskQueue.open(path, QueueOptions(sync=SyncPolicy(every_messages=1 << 30)))
    bodies = [os.urandom(BODY // 2).hex().encode() for _ in range(PER_REQUEST)]
    request_bytes = PER_REQUEST * (BODY + 36)
    requests = size // request_bytes
    t0 = time.perf_counter()
    done = 0
    with HistoryClock(requests // IN_FLIGHT, SPAN_S):  # about one step a batch
        while done < requests:
            n = min(IN_FLIGHT, requests - done)
            await asyncio.gather(*(q.append(bodies) for _ in range(n)))
            done += n
    seconds = time.perf_counter() - t0
    entries = len(q.commitlog)
    first, last = q.commitlog.get(q.commitlog.first_log_id), q.commitlog.last()
    rng = random.Random(9)
    searches = []
    for _ in range(LOCATES):
        t = time.perf_counter()
        await q.locate("timestamp", rng.randint(first.timestamp, last.timestamp))
        searches.append((time.perf_counter() - t) * 1e6)
    await q.close()
    return seconds, entries, first.timestamp, last.timestamp, sorted(searches)


def timed_moves(address: str, targets: list[bytes]) -> list[float]:
    """Milliseconds per setoffset, one at a time on one keep-alive connection."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    out = []
    try:
        for target in targets:
            t0 = time.perf_counter()
            conn.request("POST", "/channel/setoffset?topic=big&channel=replay&partition=0",
                         body=target)
            r = conn.getresponse()
            body = r.read()
            out.append((time.perf_counter() - t0) * 1000)
            if r.status != 200:
                raise RuntimeError(f"setoffset {target!r}: {r.status} {body!r}")
    finally:
        conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 GiB instead of 10")
    ap.add_argument("--gib", type=float, help="partition size in GiB (default 10, --quick 1)")
    ap.add_argument("--requests", type=int, default=500, help="setoffsets of each kind")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the data goes")
    args = ap.parse_args()
    gib = args.gib or (1 if args.quick else 10)
    size = int(gib * GIB)
    report = Report("setoffset")
    report.figures.update(machine_info())
    free = shutil.disk_usage(args.dir).free
    if free < size * 1.1 + GIB:
        sys.exit(f"{args.dir} has {free / GIB:.1f} GiB free; {gib:g} GiB needs "
                 f"{(size * 1.1 + GIB) / GIB:.1f}")
    data = tempfile.mkdtemp(prefix="bench-setoffset-", dir=args.dir)
    nsqd = Nsqd(data)
    try:
        report.section(f"a {gib:g} GiB partition, {BODY}-byte bodies, {PER_REQUEST} per request")
        nsqd.start()
        nsqd.post("/topic/create?topic=big")
        nsqd.post("/channel/create?topic=big&channel=replay")
        nsqd.stop()
        seconds, entries, first_ns, last_ns, searches = asyncio.run(
            fill(os.path.join(data, "big.topic", "0"), size))
        report.add("partition_gb", size / GIB, "partition GiB", ",.2f")
        report.add("entries", entries, "commitlog entries", ",d")
        report.add("write_mb_per_s", size / seconds / (1 << 20), "filled at MiB/s")
        report.add("history_days", (last_ns - first_ns) / 86400e9, "days between first and last",
                   ",.1f")
        report.add("locate_timestamp_median_us", statistics.median(searches),
                   "the search alone (in-process): median us", ",.0f")
        report.add("locate_timestamp_p99_us", percentile(searches, 99), "... p99 us", ",.0f")
        t0 = time.perf_counter()
        nsqd.start()
        report.add("nsqd_start_s", time.perf_counter() - t0, "nsqd start on it, s", ",.2f")

        rng = random.Random(8)
        lo, hi = first_ns // 10**9, last_ns // 10**9 + 1
        timestamps = [b"timestamp:%d" % rng.randint(lo, hi) for _ in range(args.requests)]
        counts = [b"count:%d" % rng.randrange(entries * PER_REQUEST) for _ in range(args.requests)]
        timed_moves(nsqd.http, timestamps[:20])  # warm the connection and the code paths
        ends = [b"end"] * args.requests  # no search: the seek and the commit alone
        for name, targets in (("timestamp", timestamps), ("count", counts), ("end", ends)):
            ms = sorted(timed_moves(nsqd.http, targets))
            report.section(f"{len(ms)} setoffsets by {name}")
            report.add(f"{name}_median_ms", statistics.median(ms), "median ms", ",.2f")
            report.add(f"{name}_p99_ms", percentile(ms, 99), "p99 ms", ",.2f",
                       target=("< 50", percentile(ms, 99) < 50) if name == "timestamp" else None)
            report.add(f"{name}_max_ms", ms[-1], "max ms", ",.2f")
    finally:
        nsqd.stop()
        shutil.rmtree(data, ignore_errors=True)
    report.emit_json()


if __name__ == "__main__":
    main()
