"""What a checkpoint of many channels with gappy windows costs the event loop.

In-process, like storage.py: the figure is the event loop's own time inside nsqd's
checkpoint path (NSQD.checkpoint -> Channel.checkpoint -> MetaStore.put/flush), which a
client cannot see: so this bench, unlike those that talk to nsqd over the wire, imports nsqd. A real NSQD object, real topics (DiskQueue), real Channels and a real
MetaStore (SQLite through sqlitedict) in a temporary folder; no sockets, no delivery loops.

Each of C channels (1,000; `--quick` 100) has a window of 10,000 taken messages of which
every 10th is unfinished (in flight, delivered once): 1,000 gaps, 1,000 finished ranges.
10 unfinished messages per channel were put back before (attempts 5), so they are saved
with their attempts. Cases, each checkpointed 5 times (median):
  all_changed        every channel took and finished one more message (its ranges changed)
  few_changed        10 channels did; the others did nothing (not written at all)
  ranges_unchanged   every channel took one more message and finished none (its state is
                     written, its ranges are not encoded again)
Per case: `*_loop_cpu_ms` (CPU time of the event-loop thread over one checkpoint: encoding
and noting the puts; the pickling, SQLite writes and commit run in a worker thread),
`*_wall_ms` (the whole checkpoint, commit included), `*_bytes` (bytes of the values written),
and for all_changed `all_changed_loop_stall_ms` (longest time the loop could not run
another task during the checkpoint: its own work plus the worker's GIL holds; compare
`idle_loop_stall_ms`, the same without a checkpoint, on a busy machine).
Target: all_changed_loop_cpu_ms < 50 for 1,000 channels (with --quick, < 5 for 100).

Then the cursor's hot path, ns per call: `take`, `finish` in order, `finish` in a shuffled
order within 100 (many consumers), `finish` with the first message stuck (every FIN beyond
the gap).

    .venv/bin/python bench/checkpoint.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.common import Report, machine_info  # noqa: E402
from nsqd.channel import Channel  # noqa: E402
from nsqd.cursor import Cursor, Slot  # noqa: E402
from diskqueue.runtime import tune_gc  # noqa: E402
from nsqd.metastore import MetaStore, channel_key  # noqa: E402
from nsqd.main import build  # noqa: E402
from nsqd.nsqd import NSQD  # noqa: E402
from nsqd.options import Options  # noqa: E402

WINDOW = 10_000
GAP_EVERY = 10  # every 10th message of the window is unfinished: 1,000 gaps
PUT_BACK = 10  # unfinished messages per channel put back before (saved with their attempts)
SIZE = 120  # bytes per record (offsets only; nothing is read)
ROUNDS = 5


class Held(Slot):
    """An unfinished message as the checkpoint sees it (attempts, delayed)."""

    __slots__ = ("attempts", "delayed")


def fill_window(channel: Channel) -> None:
    cursor = channel.cursor
    offset = cursor.next_read
    gaps = []
    for i in range(WINDOW):
        if i % GAP_EVERY:
            slot = Slot(offset, offset + SIZE, i)
        else:
            slot = Held(offset, offset + SIZE, i)
            slot.attempts, slot.delayed = 1, False
            gaps.append(slot)
        cursor.take(slot)
        offset += SIZE
    for slot in cursor._window:
        if not isinstance(slot, Held):
            cursor.finish(slot)
    for slot in gaps[1:PUT_BACK + 1]:
        slot.attempts = 5
        channel.put_back[slot.offset] = slot


def take_one(channel: Channel, finish: bool) -> None:
    cursor = channel.cursor
    slot = Slot(cursor.next_read, cursor.next_read + SIZE, cursor.next_count)
    cursor.take(slot)
    if finish:
        cursor.finish(slot)
    channel.dirty = True


def stored_bytes(db_path: str, keys: list[str]) -> int:
    with sqlite3.connect(db_path) as db:
        total = 0
        for i in range(0, len(keys), 500):
            part = keys[i:i + 500]
            row = db.execute(f"SELECT sum(length(value)) FROM meta WHERE key IN "
                             f"({','.join('?' * len(part))})", part).fetchone()
            total += row[0] or 0
        return total


async def timed_checkpoint(nsqd: NSQD) -> tuple[float, float]:
    """(event-loop thread CPU ms, wall ms) of one checkpoint."""
    cpu, wall = time.thread_time(), time.perf_counter()
    await nsqd.checkpoint()
    return (time.thread_time() - cpu) * 1000, (time.perf_counter() - wall) * 1000


async def longest_stall(nsqd: NSQD | None) -> float:
    """Longest gap (ms) between turns of a task that only yields, during a checkpoint (or,
    without `nsqd`, during 0.3 s of nothing: the machine's own noise)."""
    done, worst = False, 0.0

    async def probe():
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    task = asyncio.get_running_loop().create_task(probe())
    await asyncio.sleep(0)
    await (nsqd.checkpoint() if nsqd is not None else asyncio.sleep(0.3))
    done = True
    await task
    return worst * 1000


async def checkpoints(report: Report, channels: int, data: str) -> None:
    nsqd = build(Options(data_path=data))
    db_path = os.path.join(data, "nsqd.meta.sqlite")
    nsqd.meta = MetaStore(db_path)
    all_channels: list[Channel] = []
    t0 = time.perf_counter()
    topics = max(1, channels // 100)
    for t in range(topics):
        topic = await nsqd._open_topic(f"t{t}", {"partitions": [0]}, create=True)
        nsqd.topics[topic.name] = topic
        part = topic.partitions[0]
        for n in range(channels // topics):
            ch = Channel(topic, f"c{n}", part.queue, 0, 0)
            part.channels[ch.name] = ch
            fill_window(ch)
            all_channels.append(ch)
    report.note(f"{len(all_channels):,} channels x window {WINDOW:,} x "
                f"{WINDOW // GAP_EVERY:,} gaps built in {time.perf_counter() - t0:.1f} s")
    first_cpu, first_wall = await timed_checkpoint(nsqd)  # every channel is new: all written
    report.add("first_loop_cpu_ms", first_cpu, "first checkpoint (all new): loop CPU ms")
    keys_all = [channel_key(c.topic_name, c.partition, c.name) for c in all_channels]
    few = all_channels[::max(1, len(all_channels) // 10)][:10]
    cases = {"all_changed": (all_channels, True), "few_changed": (few, True),
             "ranges_unchanged": (all_channels, False)}
    budget = 50 * channels / 1000
    for name, (changed, finish) in cases.items():
        cpus, walls = [], []
        for _ in range(ROUNDS):
            for ch in changed:
                take_one(ch, finish)
            cpu, wall = await timed_checkpoint(nsqd)
            cpus.append(cpu)
            walls.append(wall)
        keys = [channel_key(c.topic_name, c.partition, c.name) for c in changed]
        target = (f"< {budget:g} ms", statistics.median(cpus) < budget) if name == "all_changed" \
            else None
        report.add(f"{name}_loop_cpu_ms", statistics.median(cpus),
                   f"{name} ({len(changed):,} ch): loop CPU ms", fmt=",.2f", target=target)
        report.add(f"{name}_wall_ms", statistics.median(walls), f"{name}: whole checkpoint ms",
                   fmt=",.1f")
        report.add(f"{name}_bytes", stored_bytes(db_path, keys), f"{name}: bytes written",
                   fmt=",d")
    for ch in all_channels:
        take_one(ch, True)
    report.add("all_changed_loop_stall_ms", await longest_stall(nsqd),
               "all_changed: longest loop stall ms", fmt=",.2f")
    report.add("idle_loop_stall_ms", await longest_stall(None),
               "no checkpoint: longest loop stall ms (noise)", fmt=",.2f")
    report.add("channel_state_bytes", stored_bytes(db_path, keys_all[:1]),
               "one channel's stored state bytes", fmt=",d")
    nsqd.meta.close()
    for topic in nsqd.topics.values():
        for p in topic.partitions.values():
            await p.queue.close()


def per_call_ns(fn, n: int) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / n * 1e9


def cursor_hot_path(report: Report, n: int) -> None:
    def slots():
        return [Slot(i * SIZE, (i + 1) * SIZE, i) for i in range(n)]

    def take_all(cursor, ss):
        take = cursor.take
        for s in ss:
            take(s)

    def finish_in(cursor, ss):
        finish = cursor.finish
        for s in ss:
            finish(s)

    ss = slots()
    cursor = Cursor(0, 0)
    report.add("take_ns", per_call_ns(lambda: take_all(cursor, ss), n), "take: ns per call",
               fmt=",.0f")
    report.add("finish_in_order_ns", per_call_ns(lambda: finish_in(cursor, ss), n),
               "finish in order: ns per call", fmt=",.0f")
    rng = random.Random(1)
    ss = slots()
    cursor = Cursor(0, 0)
    take_all(cursor, ss)
    shuffled = []
    for i in range(0, n, 100):
        block = ss[i:i + 100]
        rng.shuffle(block)
        shuffled += block
    report.add("finish_shuffled_100_ns", per_call_ns(lambda: finish_in(cursor, shuffled), n),
               "finish shuffled within 100: ns per call", fmt=",.0f")
    ss = slots()
    cursor = Cursor(0, 0)
    take_all(cursor, ss)
    report.add("finish_beyond_gap_ns", per_call_ns(lambda: finish_in(cursor, ss[1:]), n - 1),
               "finish, first message stuck: ns per call", fmt=",.0f")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 channels, fewer calls")
    ap.add_argument("--channels", type=int, help="channels (default 1,000; quick 100)")
    args = ap.parse_args()
    channels = args.channels or (100 if args.quick else 1000)
    tune_gc()
    report = Report("checkpoint")
    report.figures.update(machine_info())
    report.figures.update(channels=channels, window=WINDOW, gaps=WINDOW // GAP_EVERY)
    data = tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        report.section(f"checkpoint: {channels:,} channels, window {WINDOW:,}, "
                       f"{WINDOW // GAP_EVERY:,} gaps each")
        asyncio.run(checkpoints(report, channels, data))
    finally:
        shutil.rmtree(data, ignore_errors=True)
    report.section("cursor hot path")
    cursor_hot_path(report, 200_000 if args.quick else 1_000_000)
    report.emit_json()


if __name__ == "__main__":
    main()
