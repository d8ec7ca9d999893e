"""Delay queue benchmark (delayqueue.store.DelayStore, LMDB): messages in and back out.

    .venv/bin/python bench/delayqueue.py [--quick] [--dir DIR] [--msgs N] [--batch N]

For each scenario, a fresh store gets N messages (200-byte bodies) in puts of `batch`
messages, as a channel moves them in (one synced LMDB transaction per put); then, with
all of them due, they are taken back with take_due(now, batch) and finished with
finish(ids) of the same batch (one synced transaction each), as the channel's poller and
its FINs would. Scenarios (see bench/README.md):
  fixed   due = now + 30 min, now moving on between puts: REQ/DPUB with one delay class
  random  due = now + uniform(1 min, 2 h): every put lands anywhere in the due order
Full run: both scenarios at batches 100, 1,000 and 10,000, plus 1,000,000 entries for RSS.
--quick: both scenarios at the chosen batch (1,000) only, well under a minute.
Prints readable lines, then ONE line of JSON with every figure (units in the names).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named like the package it measures: with bench/ first on sys.path,
# `import delayqueue` would import this script. Drop bench/ and import the bench modules
# as `bench.*` from the repository root, appended (never shadowing the standard library).
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)

from bench.common import CpuWatch, Report, RssSampler, machine_info, rss_mb  # noqa: E402
from delayqueue.entry import DelayedMessage  # noqa: E402
from delayqueue.store import DelayStore  # noqa: E402

BODY_LEN = 200
TARGET_MSGS_PER_S = 50_000
MILLION = 1_000_000
MILLION_BATCH = 10_000
TARGET_MILLION_RSS_MB = 50


def fsync_bound(folder: str, seconds: float) -> float:
    """Syncs per second of one 236-byte write + fdatasync at a time (the disk's bound)."""
    path = os.path.join(folder, "fsync.probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    rec = os.urandom(236)
    n, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            os.write(fd, rec)
            os.fdatasync(fd)
            n += 1
    finally:
        os.close(fd)
        os.unlink(path)
    return n / (time.perf_counter() - t0)


def make_messages(n: int, batch: int, scenario: str, t0_ms: int, rng: random.Random):
    """n messages with 200-byte bodies, ids ascending (a partition's ids), due times as the
    scenario says. Built before timing: the store's work is what is measured."""
    body = os.urandom(BODY_LEN)
    out = []
    for i in range(n):
        if scenario == "fixed":
            due = t0_ms + 1_800_000 + (i // batch) * 5  # the clock moves 5 ms per put
        else:
            due = t0_ms + rng.randrange(60_000, 7_200_000)
        msg_id = (3 << 50) | (10_000_000 + i)
        out.append(DelayedMessage(due, msg_id, msg_id ^ 0x5A5A, time.time_ns(), 1 + i % 3,
                                  b"", body, 4096 + i * 236))
    return out


def run_scenario(folder: str, scenario: str, n: int, batch: int, seed: int) -> dict:
    """Put n messages in batches, then take and finish them all. Returns the figures."""
    path = os.path.join(folder, f"dq-{scenario}-{batch}")
    t0_ms = time.time_ns() // 1_000_000
    msgs = make_messages(n, batch, scenario, t0_ms, random.Random(seed))
    store = DelayStore.open(path)
    r = {}
    try:
        # sampled from here on: the store's memory (the messages are already built)
        with RssSampler() as rss:
            with CpuWatch() as cpu_put:
                t = time.perf_counter()
                for i in range(0, n, batch):
                    store.put(msgs[i:i + batch])
                r["put_s"] = time.perf_counter() - t
            assert store.stats()[:2] == (n, 0)
            r["disk"] = store.disk_bytes()
            del msgs
            r.update(take_all(store, t0_ms + 3 * 3_600_000, batch, n))  # all due by then
            r["take_other_cpus"] = r.pop("other_cpus")
        assert store.stats() == (0, 0, None)
        r.update(rss_start=rss.samples[0][1], rss_peak=rss.peak,
                 put_other_cpus=cpu_put.other_cpus, put_cpus=cpu_put.own_cpus)
        return r
    finally:
        store.delete()


def take_all(store: DelayStore, now: int, batch: int, n: int) -> dict:
    """take_due(now, batch) + finish(those ids) until nothing is left; times and checks."""
    take_s = finish_s = 0.0
    got_total = 0
    order_ok = True
    last = (-1, -1)
    with CpuWatch() as cpu:
        while True:
            t = time.perf_counter()
            got = store.take_due(now, batch)
            t1 = time.perf_counter()
            take_s += t1 - t
            if not got:
                break
            order_ok &= (got[0].due_ms, got[0].msg_id) > last
            last = (got[-1].due_ms, got[-1].msg_id)
            store.finish([m.msg_id for m in got])
            finish_s += time.perf_counter() - t1
            got_total += len(got)
    assert got_total == n, got_total
    return dict(take_s=take_s, finish_s=finish_s, order_ok=order_ok, other_cpus=cpu.other_cpus)


def run_million(folder: str) -> dict:
    """1,000,000 entries in puts of 10,000 (four delay classes, as the RSS test does):
    VmRSS before and the peak while putting, sampled every 100 ms from a thread."""
    path = os.path.join(folder, "dq-million")
    store = DelayStore.open(path)
    body = os.urandom(BODY_LEN)
    base = time.time_ns() // 1_000_000
    delays = [60_000, 1_800_000, 3_600_000, 86_400_000]
    start = rss_mb()
    try:
        with RssSampler() as rss:
            t = time.perf_counter()
            for b in range(MILLION // MILLION_BATCH):
                store.put([DelayedMessage(base + b * 1000 + delays[i % 4] + i // 400,
                                          b * MILLION_BATCH + i, i, i, 1, b"", body,
                                          (b * MILLION_BATCH + i) * 140)  # growing offsets
                           for i in range(MILLION_BATCH)])
            put_s = time.perf_counter() - t
        disk = store.disk_bytes()
        assert store.stats()[0] == MILLION
    finally:
        store.delete()
    return dict(start=start, peak=rss.peak, put_s=put_s, disk=disk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one batch size, no million run")
    ap.add_argument("--dir", default=None, help="make the temporary folder inside DIR")
    ap.add_argument("--msgs", type=int, default=100_000, help="messages per scenario")
    ap.add_argument("--batch", type=int, default=1000,
                    help="messages per put / take_due / finish in the headline figures")
    args = ap.parse_args()

    rep = Report("delayqueue")
    info = machine_info()
    rep.figures.update(python=info["python"], cpus=info["cpus"], quick=args.quick,
                       msgs=args.msgs, body_bytes=BODY_LEN, batch_msgs=args.batch,
                       loadavg_1m_start=info["loadavg_1m"])
    folder = tempfile.mkdtemp(prefix="bench-delayqueue-", dir=args.dir)
    try:
        rep.section(f"delayqueue: {args.msgs:,} messages of {BODY_LEN} bytes, in {folder}")
        rep.note(f"python {info['python']}, {info['cpus']} CPUs, loadavg {info['loadavg_1m']}")
        rep.add("fsync_bound_syncs_per_s", fsync_bound(folder, 1.0),
                "fsync bound (236 B write + fdatasync)", ",.0f")
        batches = [args.batch] if args.quick else sorted({100, 1000, 10_000, args.batch})
        with RssSampler() as rss:
            for scenario in ("fixed", "random"):
                for batch in batches:
                    rep.section(f"{scenario} due times, batches of {batch:,}")
                    r = run_scenario(folder, scenario, args.msgs, batch, seed=batch)
                    n = args.msgs
                    head = batch == args.batch
                    prefix = "" if head and scenario == "fixed" else (
                        "random_" if head else f"{scenario}_b{batch}_")
                    tgt = (lambda v: (f">= {TARGET_MSGS_PER_S:,}", v >= TARGET_MSGS_PER_S)) \
                        if head else (lambda v: None)
                    put_rate = n / r["put_s"]
                    take_rate = n / (r["take_s"] + r["finish_s"])
                    rep.add(f"{prefix}put_msgs_per_s", put_rate,
                            "in:  put (1 synced txn per batch)", ",.0f", tgt(put_rate))
                    rep.add(f"{prefix}take_msgs_per_s", take_rate,
                            "out: take_due + finish (2 synced txns)", ",.0f", tgt(take_rate))
                    rep.add(f"{prefix}take_due_only_msgs_per_s", n / r["take_s"],
                            "     take_due alone", ",.0f")
                    rep.add(f"{prefix}finish_only_msgs_per_s", n / r["finish_s"],
                            "     finish alone", ",.0f")
                    rep.add(f"{prefix}disk_bytes_per_msg", r["disk"] / n,
                            "data.mdb bytes per message (after puts)", ",.0f")
                    rep.add(f"{prefix}rss_growth_mb", r["rss_peak"] - r["rss_start"],
                            "RSS growth (peak minus start of put)", ".1f")
                    rep.add(f"{prefix}put_cpus", r["put_cpus"], "CPUs used while putting", ".2f")
                    rep.add(f"{prefix}other_cpus", max(r["put_other_cpus"], r["take_other_cpus"]),
                            "other processes' CPUs (noise)", ".2f")
                    rep.check(f"{prefix or 'fixed_'}due_order", r["order_ok"])
        rep.section("memory")
        rep.add("rss_start_mb", rss.samples[0][1], "RSS at start", ".1f")
        rep.add("rss_peak_mb", rss.peak, "RSS peak (all, built messages too)",
                ".1f")
        if not args.quick:
            rep.section(f"{MILLION:,} entries in puts of {MILLION_BATCH:,} (four delay classes)")
            m = run_million(folder)
            growth = m["peak"] - m["start"]
            rep.add("million_put_msgs_per_s", MILLION / m["put_s"], "put rate", ",.0f")
            rep.add("million_disk_mb", m["disk"] / (1 << 20), "data.mdb size", ",.0f")
            rep.add("million_rss_start_mb", m["start"], "RSS before", ".1f")
            rep.add("million_rss_peak_mb", m["peak"], "RSS peak while putting", ".1f")
            rep.add("million_rss_growth_mb", growth, "RSS growth", ".1f",
                    (f"< {TARGET_MILLION_RSS_MB}", growth < TARGET_MILLION_RSS_MB))
        rep.figures["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        rep.add("fsync_bound_end_syncs_per_s", fsync_bound(folder, 1.0),
                "fsync bound again (noise check)", ",.0f")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rep.emit_json()


if __name__ == "__main__":
    main()
