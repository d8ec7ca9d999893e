"""What 1,000,000 delayed messages cost a running nsqd: disk, not RAM.

Starts our nsqd, subscribes one consumer (RDY 1) to a channel, measures the idle
RSS, then publishes N DPUBs due in a day (pipelined over a few connections) and
waits until the channel has moved all of them into its disk delay queue. Prints
the nsqd's RSS (VmRSS, sampled every 0.5 s) against the idle figure, publish and
move rates, and the size of the delay queue on disk; ends with one JSON line.

    .venv/bin/python bench/delay_memory.py [--quick]    # 1,000,000 (quick: 100,000)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.common import Report  # noqa: E402
from nsqwire import commands as c  # noqa: E402
from nsqclient.conn import Connection  # noqa: E402
from servers import NsqdProcess  # noqa: E402

DAY_MS = 86_400_000


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def channel_partition(http: str) -> dict:
    with urllib.request.urlopen(f"http://{http}/stats?format=json&topic=t") as r:
        stats = json.loads(r.read())
    return stats["topics"][0]["channels"][0]["partitions"][0]


def dir_mb(path: str) -> float:
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return total / (1 << 20)


async def publish(port: int, total: int, connections: int, chunk: int) -> None:
    async def one(count: int) -> None:
        conn = await Connection("127.0.0.1", port).connect()
        body = b"x" * 200
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            await asyncio.gather(*(conn.command(c.cmd_dpub("t", DAY_MS, body))
                                   for _ in range(n)))
        await conn.close()

    share = total // connections
    await asyncio.gather(*(one(share + (total % connections if i == 0 else 0))
                           for i in range(connections)))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--messages", type=int)
    args = ap.parse_args()
    total = args.messages or (100_000 if args.quick else 1_000_000)
    report = Report("delay_memory")
    report.add("messages", total, "delayed messages (200-byte bodies, due in a day)", ",d")
    work = tempfile.mkdtemp(prefix="delay-mem-")
    proc = NsqdProcess(os.path.join(work, "nsqd"), "--log-level", "warning").start()
    try:
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "c", rdy=1)
        await asyncio.sleep(2)
        idle = vm_rss_mb(proc.proc.pid)
        report.add("rss_idle_mb", idle, "nsqd RSS, idle with the channel open (MB)")

        peak = idle
        t0 = time.monotonic()
        pub_task = asyncio.create_task(publish(proc.tcp_port, total, 8, 500))
        published_s = None
        while True:
            await asyncio.sleep(0.5)
            peak = max(peak, vm_rss_mb(proc.proc.pid))
            if published_s is None and pub_task.done():
                await pub_task
                published_s = time.monotonic() - t0
            part = await asyncio.to_thread(channel_partition, proc.http_address)
            if published_s is not None and part["delayed_count"] >= total:
                break
            if time.monotonic() - t0 > 900:
                raise TimeoutError(f"only {part['delayed_count']} of {total} moved")
        moved_s = time.monotonic() - t0
        await asyncio.sleep(1)
        end = vm_rss_mb(proc.proc.pid)
        peak = max(peak, end)
        report.add("dpub_msgs_per_s", total / published_s, "DPUB msgs/s (8 pipelined connections)")
        report.add("moved_all_s", moved_s, "seconds until all were in the delay queue")
        report.add("rss_peak_mb", peak, "nsqd RSS peak while publishing and moving (MB)")
        report.add("rss_end_mb", end, "nsqd RSS with all of them delayed (MB)")
        report.add("rss_over_idle_mb", end - idle, "RSS over idle with all delayed (MB)",
                   target=("<= 50", end - idle <= 50))
        report.add("rss_peak_over_idle_mb", peak - idle, "peak RSS over idle (MB)")
        delay_dir = os.path.join(proc.data_path, "t.topic", "0", "delay")
        report.add("delay_queue_disk_mb", dir_mb(delay_dir), "delay queue on disk (MB)")
        await consumer.close()
    finally:
        proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    report.emit_json()


if __name__ == "__main__":
    asyncio.run(main())
