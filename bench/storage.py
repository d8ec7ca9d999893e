"""Storage engine benchmark (diskqueue), on uvloop.

    .venv/bin/python bench/storage.py [--quick] [--dir DIR]
    .venv/bin/python bench/storage.py --part group|batch|read [--cprofile] [--quick]   # one part

Measures, in one run (see bench/README.md for what each figure means):
  1. fsync bound: one 236-byte os.write + os.fdatasync per call, ~2 s
  2. group commit: 1,000 coroutines each appending one 200-byte message and awaiting it
  3. batch appends: 1,000 (and 200) 200-byte messages per append, 4 appenders
  4. sequential read of (3) through one Reader, read(4096) loop (warm, then cold cache)
  5. peak RSS while writing 2 GiB (300 MiB with --quick), in a child process
  6. aiofiles file object (3 thread hops per durable write) vs one wrapped function (1 hop)
Prints readable lines, then ONE line of JSON with every figure (units in the names).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# With bench/ first on sys.path, `import nsqd` would import bench/nsqd.py: drop bench/ and
# import the bench modules as `bench.*` from the repository root, appended (never
# shadowing the standard library).
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)

import aiofiles  # noqa: E402
import aiofiles.os  # noqa: E402
import uvloop  # noqa: E402

from bench.common import (MB, CpuWatch, GcWatch, Report, RssSampler, machine_info,  # noqa: E402
                          percentile, rss_mb)
from diskqueue.queue import DiskQueue, QueueOptions  # noqa: E402
from diskqueue.record import record_size  # noqa: E402
from diskqueue.runtime import tune_gc  # noqa: E402

BODY_LEN = 200
REC_LEN = record_size(BODY_LEN)  # 236 bytes on disk per 200-byte message
assert REC_LEN == 236, REC_LEN

FULL = dict(fsync_s=2.0, group_msgs=300_000, concurrency=1000, batch_msgs=2_000_000,
            batch200_msgs=600_000, appenders=4, rss_bytes=2 << 30, aiofiles_s=1.0)
QUICK = dict(fsync_s=2.0, group_msgs=100_000, concurrency=1000, batch_msgs=500_000,
             batch200_msgs=200_000, appenders=4, rss_bytes=300 << 20, aiofiles_s=1.0)

TARGET_GROUP_MSGS = 100_000
TARGET_GROUP_RATIO = 20
TARGET_GROUP_P99_MS = 10
TARGET_BATCH_MSGS = 500_000
TARGET_READ_MSGS = 1_000_000
TARGET_RSS_MB = 150
RSS_FLAT_DRIFT_MB = 10


def bodies_of(n: int) -> list[bytes]:
    return [os.urandom(BODY_LEN) for _ in range(n)]


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


# ---- 1. the physical bound ------------------------------------------------------

def fsync_bound(path: str, seconds: float) -> tuple[float, float]:
    """(syncs per second, mean µs per write+fdatasync) of a 236-byte append + fdatasync loop."""
    rec = os.urandom(REC_LEN)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        n = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        now = t0
        while now < deadline:
            os.write(fd, rec)
            os.fdatasync(fd)
            n += 1
            now = time.perf_counter()
        elapsed = now - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return n / elapsed, elapsed / n * 1e6


# ---- 2. group commit ------------------------------------------------------------

async def group_commit(path: str, total: int, concurrency: int) -> dict:
    """`concurrency` producers appending one message at a time; a warm-up round of a tenth
    as many appends first (thread pool, first segment pages), then the measured round."""
    q = await DiskQueue.open(path, QueueOptions())
    body = os.urandom(BODY_LEN)
    per = total // concurrency
    warm = max(1, per // 10)
    lat: list[float] = []

    async def one_producer(n: int, record):
        append = q.append
        clock = time.perf_counter
        for _ in range(n):
            t = clock()
            await append([body])
            record(clock() - t)

    await asyncio.gather(*(one_producer(warm, lambda _: None) for _ in range(concurrency)))
    stats0 = dict(q.stats)
    with CpuWatch() as cpu, GcWatch() as gcw:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_producer(per, lat.append) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    stats = {k: v - stats0[k] for k, v in q.stats.items()}
    assert q.written_count == (warm + per) * concurrency, q.written_count
    await q.close()
    lat.sort()
    return dict(msgs=per * concurrency, elapsed=elapsed, p50=percentile(lat, 50) * 1e3,
                p99=percentile(lat, 99) * 1e3, max=lat[-1] * 1e3, stats=stats, cpu=cpu, gc=gcw)


# ---- 3. batch appends, 4. read ----------------------------------------------------

async def batch_appends(q: DiskQueue, total: int, per_append: int, appenders: int) -> dict:
    bodies = bodies_of(per_append)
    n_appends = max(1, total // (per_append * appenders))
    count0, end0 = q.written_count, q.written_end

    async def one_appender():
        for _ in range(n_appends):
            await q.append(bodies)

    with CpuWatch() as cpu:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_appender() for _ in range(appenders)))
        elapsed = time.perf_counter() - t0
    return dict(msgs=q.written_count - count0, bytes=q.written_end - end0, elapsed=elapsed,
                cpu=cpu)


async def read_all(q: DiskQueue, max_count: int = 4096) -> dict:
    r = q.reader()
    start = r.offset
    n = 0
    with CpuWatch() as cpu, GcWatch() as gcw:
        t0 = time.perf_counter()
        while True:
            records = await r.read(max_count)
            if not records:
                break
            n += len(records)
        elapsed = time.perf_counter() - t0
    nbytes = r.offset - start
    r.close()
    return dict(msgs=n, bytes=nbytes, elapsed=elapsed, cpu=cpu, gc=gcw)


def drop_page_cache(qdir: str) -> bool:
    """Ask the kernel to drop the cached pages of this queue's data files only
    (posix_fadvise DONTNEED; the data is synced, so the pages are clean)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in glob.glob(os.path.join(qdir, "data", "*.dat")):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


# ---- 5. RSS while writing (child process) -----------------------------------------

async def rss_child(path: str, target_bytes: int, per_append: int, appenders: int) -> dict:
    bodies = bodies_of(per_append)
    rss_start = rss_mb()
    with RssSampler(0.1) as sampler:
        q = await DiskQueue.open(path, QueueOptions())
        t0 = time.perf_counter()

        async def one_appender():
            while q.written_end < target_bytes:
                await q.append(bodies)

        await asyncio.gather(*(one_appender() for _ in range(appenders)))
        elapsed = time.perf_counter() - t0
        rss_end = rss_mb()
        written, msgs = q.written_end, q.written_count
        await q.close()
    on_disk = dir_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return dict(rss_start_mb=rss_start, rss_peak_mb=sampler.peak, rss_end_mb=rss_end,
                rss_drift_mb=sampler.drift(), rss_samples=len(sampler.samples),
                bytes_written=written, bytes_on_disk=on_disk, msgs=msgs, elapsed_s=elapsed)


def run_rss_child(path: str, target_bytes: int, appenders: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", str(target_bytes),
           "--dir", path, "--appenders", str(appenders)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"RSS child failed with code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- 6. aiofiles file object vs one wrapped function --------------------------------

def _write_and_sync(fd: int, rec: bytes) -> None:
    os.write(fd, rec)
    os.fdatasync(fd)


async def aiofiles_compare(dirpath: str, seconds: float) -> dict:
    rec = os.urandom(REC_LEN)
    fdatasync_off_loop = aiofiles.os.wrap(os.fdatasync)
    clock = time.perf_counter

    # aiofiles file object: write (hop 1), flush (hop 2), fdatasync (hop 3).
    path = os.path.join(dirpath, "aiofiles.bin")
    n_file = 0
    async with aiofiles.open(path, "ab") as f:
        fd = f.fileno()
        t0 = clock()
        while clock() - t0 < seconds:
            await f.write(rec)
            await f.flush()
            await fdatasync_off_loop(fd)
            n_file += 1
        file_elapsed = clock() - t0
    os.unlink(path)

    # One aiofiles.os.wrap-ed function doing write + fdatasync: one hop.
    path = os.path.join(dirpath, "onehop.bin")
    one_hop = aiofiles.os.wrap(_write_and_sync)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n_one = 0
    try:
        t0 = clock()
        while clock() - t0 < seconds:
            await one_hop(fd, rec)
            n_one += 1
        one_elapsed = clock() - t0
    finally:
        os.close(fd)
        os.unlink(path)

    # The cost of a hop alone: a wrapped no-op.
    noop = aiofiles.os.wrap(lambda: None)
    n_noop = 0
    t0 = clock()
    while clock() - t0 < seconds / 2:
        await noop()
        n_noop += 1
    noop_elapsed = clock() - t0
    return dict(file_ops=n_file / file_elapsed, one_hop_ops=n_one / one_elapsed,
                hop_us=noop_elapsed / n_noop * 1e6)


# ---- the run ----------------------------------------------------------------------

def mbps(nbytes: float, seconds: float) -> float:
    return nbytes / MB / seconds


async def run_all(cfg: dict, base: str, quick: bool) -> None:
    rep = Report("storage")
    info = machine_info()
    rep.figures.update(quick=quick, python=info["python"], cpus=info["cpus"],
                       loadavg_1m_start=info["loadavg_1m"], loop=type(asyncio.get_running_loop()).__module__,
                       gc_thresholds=list(gc.get_threshold()))
    print(f"storage benchmark ({'quick' if quick else 'full'}), data in {base}, "
          f"python {info['python']}, {info['cpus']} CPUs, load average {info['loadavg_1m']}, "
          f"loop {rep.figures['loop']}, gc thresholds {gc.get_threshold()} "
          f"({'Python default' if gc.get_threshold()[0] == 700 else 'nsqd policy'})")
    print(f"record: {BODY_LEN}-byte body = {REC_LEN} bytes on disk; MB = MiB; "
          f"'other CPUs' = CPUs busy with other processes during a part (noise)")
    t_start = time.perf_counter()

    # 1.
    rep.section("1. fsync bound: one 236-byte os.write + os.fdatasync per call")
    with CpuWatch() as cpu:
        syncs, us = fsync_bound(os.path.join(base, "fsync.bin"), cfg["fsync_s"])
    rep.add("fsync_bound_syncs_per_s", syncs, "write+fdatasync per second")
    rep.add("fsync_bound_us_per_sync", us, "mean µs per write+fdatasync")
    rep.note(f"other CPUs busy: {cpu.other_cpus:.2f}")

    # 2.
    rep.section(f"2. group commit: {cfg['concurrency']:,} coroutines, one 200-byte durable "
                f"append each, awaited ({cfg['group_msgs']:,} messages)")
    g = await group_commit(os.path.join(base, "group"), cfg["group_msgs"], cfg["concurrency"])
    shutil.rmtree(os.path.join(base, "group"), ignore_errors=True)
    rate = g["msgs"] / g["elapsed"]
    st = g["stats"]
    ratio = rate / syncs
    rep.add("group_commit_msgs_per_s", rate, "messages per second",
            target=(f">= {TARGET_GROUP_MSGS:,}", rate >= TARGET_GROUP_MSGS))
    rep.add("group_commit_ratio_to_fsync", ratio, "ratio to fsync bound", fmt=".1f",
            target=(f">= {TARGET_GROUP_RATIO}x", ratio >= TARGET_GROUP_RATIO))
    rep.add("group_commit_p50_ms", g["p50"], "append latency p50 (ms)", fmt=".2f")
    rep.add("group_commit_p99_ms", g["p99"], "append latency p99 (ms)", fmt=".2f",
            target=(f"< {TARGET_GROUP_P99_MS}", g["p99"] < TARGET_GROUP_P99_MS))
    rep.add("group_commit_max_ms", g["max"], "append latency max (ms)", fmt=".2f")
    rep.add("group_commit_mean_batch_msgs", st["batch_messages_total"] / max(1, st["batches"]),
            "mean batch size (messages)")
    rep.add("group_commit_batches_per_s", st["batches"] / g["elapsed"], "batches per second")
    rep.add("group_commit_sync_ms_mean", st["sync_seconds_total"] / max(1, st["syncs"]) * 1e3,
            "mean write+2 syncs per batch (ms)", fmt=".2f")
    rep.add("group_commit_elapsed_s", g["elapsed"], "elapsed (s)", fmt=".2f")
    rep.add("group_commit_cpus_used", g["cpu"].own_cpus, "CPUs used by this process", fmt=".2f")
    rep.add("group_commit_gc_share", g["gc"].seconds / g["elapsed"],
            "share of wall time in the cyclic GC", fmt=".3f")
    rep.add("group_commit_gc_gen2_collections", g["gc"].collections[2], "full (gen 2) GC runs",
            fmt=",d")
    rep.add("group_commit_gc_longest_ms", g["gc"].longest * 1e3, "longest GC pause (ms)", fmt=".2f")
    rep.note(f"other CPUs busy: {g['cpu'].other_cpus:.2f}")
    rep.figures["group_commit_other_cpus"] = round(g["cpu"].other_cpus, 2)

    # 3.
    qdir = os.path.join(base, "batch")
    q = await DiskQueue.open(qdir, QueueOptions())
    rep.section(f"3. batch appends: 1,000 x 200-byte messages per append, {cfg['appenders']} "
                f"appenders, durable ({cfg['batch_msgs']:,} messages)")
    b = await batch_appends(q, cfg["batch_msgs"], 1000, cfg["appenders"])
    rate = b["msgs"] / b["elapsed"]
    rep.add("batch_append_msgs_per_s", rate, "messages per second",
            target=(f">= {TARGET_BATCH_MSGS:,}", rate >= TARGET_BATCH_MSGS))
    rep.add("batch_append_mb_per_s", mbps(b["bytes"], b["elapsed"]), "MB per second (on disk)")
    rep.add("batch_append_cpus_used", b["cpu"].own_cpus, "CPUs used by this process", fmt=".2f")
    rep.note(f"other CPUs busy: {b['cpu'].other_cpus:.2f}")
    rep.figures["batch_append_other_cpus"] = round(b["cpu"].other_cpus, 2)
    rep.note(f"then 200 messages per append ({cfg['batch200_msgs']:,} messages, same queue):")
    b2 = await batch_appends(q, cfg["batch200_msgs"], 200, cfg["appenders"])
    rep.add("batch200_append_msgs_per_s", b2["msgs"] / b2["elapsed"], "messages per second")
    rep.add("batch200_append_mb_per_s", mbps(b2["bytes"], b2["elapsed"]), "MB per second (on disk)")
    st = q.stats
    rep.add("batch_append_mean_batch_msgs", st["batch_messages_total"] / max(1, st["batches"]),
            "mean batch size, both runs (messages)")

    # 4.
    total_msgs, total_bytes = q.written_count, q.written_end
    rep.section(f"4. sequential read through one Reader, read(4096) loop "
                f"({total_msgs:,} messages, {total_bytes / MB:,.0f} MB)")
    rd = await read_all(q)
    assert rd["msgs"] == total_msgs and rd["bytes"] == total_bytes, (rd, total_msgs, total_bytes)
    rate = rd["msgs"] / rd["elapsed"]
    rep.add("read_msgs_per_s", rate, "messages per second (page cache warm)",
            target=(f">= {TARGET_READ_MSGS:,}", rate >= TARGET_READ_MSGS))
    rep.add("read_mb_per_s", mbps(rd["bytes"], rd["elapsed"]), "MB per second (warm)")
    rep.add("read_cpus_used", rd["cpu"].own_cpus, "CPUs used by this process", fmt=".2f")
    rep.add("read_gc_share", rd["gc"].seconds / rd["elapsed"], "share of wall time in the cyclic GC",
            fmt=".3f")
    rep.note(f"other CPUs busy: {rd['cpu'].other_cpus:.2f}")
    rep.figures["read_other_cpus"] = round(rd["cpu"].other_cpus, 2)
    if drop_page_cache(qdir):
        cold = await read_all(q)
        assert cold["msgs"] == total_msgs
        rep.add("read_cold_msgs_per_s", cold["msgs"] / cold["elapsed"],
                "messages per second (our pages dropped)")
        rep.add("read_cold_mb_per_s", mbps(cold["bytes"], cold["elapsed"]), "MB per second (cold)")
        rep.note("cold = posix_fadvise(DONTNEED) on the data files; a VM's host cache may still help")
    await q.close()
    shutil.rmtree(qdir, ignore_errors=True)

    # 5.
    rep.section(f"5. RSS while writing {cfg['rss_bytes'] / MB:,.0f} MB with 1,000-message "
                f"batch appends (durable, {cfg['appenders']} appenders, child process, "
                f"sampled every 100 ms)")
    with CpuWatch() as cpu:
        m = run_rss_child(os.path.join(base, "rss"), cfg["rss_bytes"], cfg["appenders"])
    rep.add("rss_start_mb", m["rss_start_mb"], "RSS before the write (MB)")
    rep.add("rss_peak_mb", m["rss_peak_mb"], "RSS peak (MB)",
            target=(f"< {TARGET_RSS_MB}", m["rss_peak_mb"] < TARGET_RSS_MB))
    rep.add("rss_end_mb", m["rss_end_mb"], "RSS at the end of the write (MB)")
    rep.add("rss_drift_mb", m["rss_drift_mb"], "RSS drift, last vs second quarter (MB)")
    flat = abs(m["rss_drift_mb"]) < RSS_FLAT_DRIFT_MB
    rep.check(f"RSS flat (|drift| < {RSS_FLAT_DRIFT_MB} MB)", flat)
    rep.add("rss_samples", m["rss_samples"], "RSS samples", fmt=",d")
    rep.add("rss_bytes_written", m["bytes_written"], "bytes written (records)", fmt=",d")
    rep.add("rss_bytes_on_disk", m["bytes_on_disk"], "bytes on disk (data + commitlog)", fmt=",d")
    rep.add("rss_write_msgs_per_s", m["msgs"] / m["elapsed_s"], "sustained messages per second")
    rep.add("rss_write_mb_per_s", mbps(m["bytes_written"], m["elapsed_s"]), "sustained MB per second")
    rep.note(f"other CPUs busy: {cpu.other_cpus:.2f}; data deleted")
    rep.figures["rss_other_cpus"] = round(cpu.other_cpus, 2)

    # 6.
    rep.section("6. aiofiles file object (write, flush, fdatasync: 3 hops) vs one wrapped "
                "function (write+fdatasync: 1 hop), 236 bytes, ~1 s each")
    with CpuWatch() as cpu:
        a = await aiofiles_compare(base, cfg["aiofiles_s"])
    rep.add("aiofiles_file_ops_per_s", a["file_ops"], "aiofiles file object, ops per second")
    rep.add("one_hop_ops_per_s", a["one_hop_ops"], "one wrapped function, ops per second")
    rep.add("one_hop_speedup", a["one_hop_ops"] / a["file_ops"], "one hop / file object", fmt=".2f")
    rep.add("thread_hop_us", a["hop_us"], "one thread hop alone, wrapped no-op (µs)")
    rep.note(f"other CPUs busy: {cpu.other_cpus:.2f}")

    # Noise check: the fsync bound again, briefly.
    rep.section("noise check")
    syncs_end, _ = fsync_bound(os.path.join(base, "fsync.bin"), 1.0)
    rep.add("fsync_bound_end_syncs_per_s", syncs_end, "fsync bound again at the end")
    rep.figures["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    rep.add("total_elapsed_s", time.perf_counter() - t_start, "whole run (s)", fmt=".1f")
    rep.note(f"load average {rep.figures['loadavg_1m_start']} at start, "
             f"{rep.figures['loadavg_1m_end']} at end ({info['cpus']} CPUs)")
    print()
    rep.emit_json()


# ---- one part alone (for profiling) ------------------------------------------------

async def run_part(part: str, cfg: dict, base: str) -> None:
    """Run one part alone, e.g. under py-spy or with --cprofile."""
    if part == "group":
        g = await group_commit(os.path.join(base, "group"), cfg["group_msgs"], cfg["concurrency"])
        print(f"group commit: {g['msgs'] / g['elapsed']:,.0f} msgs/s, p50 {g['p50']:.2f} ms, "
              f"p99 {g['p99']:.2f} ms")
        return
    q = await DiskQueue.open(os.path.join(base, "batch"), QueueOptions())
    b = await batch_appends(q, cfg["batch_msgs"], 1000, cfg["appenders"])
    print(f"batch appends: {b['msgs'] / b['elapsed']:,.0f} msgs/s")
    if part == "read":
        rd = await read_all(q)
        print(f"read: {rd['msgs'] / rd['elapsed']:,.0f} msgs/s")
    await q.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    ap.add_argument("--dir", help="folder for the data (a temporary folder is made inside it; "
                                  "default: the system temp folder)")
    ap.add_argument("--part", choices=["group", "batch", "read"],
                    help="run only this part (2, 3, or 3 then 4), e.g. under py-spy")
    ap.add_argument("--cprofile", action="store_true",
                    help="with --part: profile the event-loop thread with cProfile")
    ap.add_argument("--default-gc", action="store_true",
                    help="keep Python's default garbage-collector thresholds (by default the "
                         "engine runs under nsqd's policy, diskqueue.runtime.tune_gc)")
    ap.add_argument("--rss-child", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    ap.add_argument("--appenders", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if not args.default_gc:
        tune_gc()
    if args.rss_child is not None:  # internal: part 5 in a fresh process
        out = uvloop.run(rss_child(args.dir, args.rss_child, 1000, args.appenders))
        print(json.dumps(out))
        return

    cfg = QUICK if args.quick else FULL
    base = tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir)
    try:
        if args.part and args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            uvloop.run(run_part(args.part, cfg, base))
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(25)
        elif args.part:
            uvloop.run(run_part(args.part, cfg, base))
        else:
            uvloop.run(run_all(cfg, base, args.quick))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
