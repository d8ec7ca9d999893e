"""The balancer from fully skewed: how long to even 24 partitions on 3 nodes, and what each
leader move costs the publishers.

    .venv/bin/python bench/balance.py [--quick] [--partitions 24] [--replicas 3]

A real cluster (tests/cluster.py: etcd, one nsqlookupd, 3 nsqd, lease TTL 2 s); a topic of
24 partitions, R=3, min_isr 2, every batch synced. Its leaders are first moved by hand
(POST /partition/move_leader) onto one node while the lookupd's --balance-window is
closed; then the lookupd is restarted with `--balance-window 00:00-24:00
--balance-interval 200ms` and the balancer evens them, while keyed publishers (the
partition-aware nsqclient.Producer, one key per partition, one publish at a time each,
retried within 10 s) publish to every partition all along.

Figures: time from the master being up to `/cluster/stats` saying `stable`; the moves it
made; per leader move (seen by polling etcd every 50 ms), the unavailability of that
partition = the longest time without an acknowledged publish to it from 0.5 s before the
move was seen to 1.5 s after (an upper bound: it includes the ordinary wait between two
acks of a partition, printed as the baseline); publish success rate (acknowledged /
attempted); the same unavailability for the hand-made moves. Prints readable lines, then ONE line of JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request  # noqa: F401  (cluster.http_json's)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench.common import Report, machine_info, percentile  # noqa: E402
from cluster import Cluster, http_json  # noqa: E402
from nsqwire.partitioning import partition_of  # noqa: E402
from nsqclient.producer import Producer  # noqa: E402

TOPIC = "bench_balance"
TARGET_MOVE_MAX_S = 2.0
TARGET_SUCCESS = 0.99


class Publishers:
    """One keyed publisher per partition (a key of that partition, one publish at a time,
    each after the previous one's OK): per partition the times of its acks, so the
    longest wait between two is that partition's unavailability (plus one publish's
    latency)."""

    def __init__(self, lookupd: str, partitions: int):
        self.acked = 0
        self.failed = 0
        self.acks: dict[int, list[float]] = {n: [] for n in range(partitions)}
        keys: dict[int, str] = {}
        i = 0
        while len(keys) < partitions:
            keys.setdefault(partition_of(f"key{i}".encode(), partitions), f"key{i}")
            i += 1
        self.producer = Producer([lookupd], max_retry_time=10.0)
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run(n, key)) for n, key in keys.items()]

    async def _run(self, n: int, key: str) -> None:
        while not self._stop.is_set():
            try:
                await self.producer.publish(TOPIC, b"x" * 200, key=key)
                self.acked += 1
                self.acks[n].append(time.monotonic())
            except Exception:
                self.failed += 1

    def gap(self, n: int, start: float, end: float) -> float:
        times = [start] + [t for t in self.acks[n] if start < t < end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self.producer.close()


async def watch_moves(cl: Cluster, stop: asyncio.Event, seen: list) -> None:
    """Append (time, partition) whenever etcd shows a partition's leader changed."""
    leaders = {n: s.leader for n, s in (await cl.states(TOPIC)).items()}
    while not stop.is_set():
        now = time.monotonic()
        for n, s in (await cl.states(TOPIC)).items():
            if s.leader != leaders.get(n):
                seen.append((now, n))
                leaders[n] = s.leader
        await asyncio.sleep(0.05)


def closed_window() -> str:
    t = time.localtime()
    start = min((t.tm_hour * 60 + t.tm_min + 720) % 1440, 1438)
    return f"{start // 60:02d}:{start % 60:02d}-{(start + 1) // 60:02d}:{(start + 1) % 60:02d}"


async def run(args, report: Report) -> None:
    root = tempfile.mkdtemp(prefix="bench-balance-")
    cl = Cluster(root, 3, 1)
    lk = cl.lookupds[0]
    lk.extra += ["--balance-window", closed_window(), "--balance-interval", "200ms"]
    cl.start()
    try:
        status, body = cl.create_topic(TOPIC, args.partitions, replicas=args.replicas)
        assert status == 200, body
        await cl.until_states(TOPIC, lambda s: all(len(p.isr) == args.replicas
                                                   for p in s.values()), 30, "ISR full")
        await asyncio.sleep(1.0)  # leader keys taken
        pubs = Publishers(lk.http_address, args.partitions)
        await asyncio.sleep(args.warm_s)

        report.section("baseline: no move (the longest wait between two acks of a partition, "
                       "over 3 s)")
        start = time.monotonic()
        await asyncio.sleep(3.0)
        base = sorted(pubs.gap(n, start, start + 3.0) for n in range(args.partitions))
        report.add("baseline_gap_median_ms", percentile(base, 50) * 1000,
                   "per partition, median (ms)")
        report.add("baseline_gap_max_ms", base[-1] * 1000, "per partition, max (ms)")

        report.section(f"skewing {args.partitions} partitions onto one node, by hand")
        heavy = cl.nsqds[0].tcp_address
        manual_gaps = []
        for n, s in sorted((await cl.states(TOPIC)).items()):
            if s.leader == heavy:
                continue
            started = time.monotonic()
            for _ in range(50):
                status, body = http_json("POST", f"http://{lk.http_address}/partition/"
                                                 f"move_leader?topic={TOPIC}&partition={n}"
                                                 f"&to={heavy}")
                if status != 409 or body.get("message") != "LEADER_NOT_SETTLED":
                    break
                await asyncio.sleep(0.1)
            assert status == 200, body
            await asyncio.sleep(args.settle_s)
            manual_gaps.append(pubs.gap(n, started - 0.2, time.monotonic()))
        manual_gaps.sort()
        report.add("manual_moves", len(manual_gaps), "leader moves by hand", fmt="d")
        report.add("manual_move_unavailable_median_ms", percentile(manual_gaps, 50) * 1000,
                   "unavailability per hand move, median (ms)")
        report.add("manual_move_unavailable_max_ms", manual_gaps[-1] * 1000,
                   "unavailability per hand move, max (ms)")

        report.section("the balancer evens them (window opened: the lookupd restarted)")
        lk.stop()
        lk.extra[lk.extra.index("--balance-window") + 1] = "00:00-24:00"
        lk.start()
        started = time.monotonic()
        while cl.master() != 0:
            await asyncio.sleep(0.05)
        stop, seen = asyncio.Event(), []
        watcher = asyncio.create_task(watch_moves(cl, stop, seen))
        body = {}
        while time.monotonic() - started < 120:
            body = http_json("GET", f"http://{lk.http_address}/cluster/stats")[1]
            if body.get("stable"):
                break
            await asyncio.sleep(0.1)
        took = time.monotonic() - started
        await asyncio.sleep(2.0)
        stop.set()
        await watcher
        await pubs.stop()
        gaps = sorted(pubs.gap(n, t - 0.5, t + 1.5) for t, n in seen)
        led: dict[str, int] = {}
        for s in (await cl.states(TOPIC)).values():
            led[s.leader] = led.get(s.leader, 0) + 1
        report.note(f"leaders per node after: {sorted(led.values())}")
        report.add("time_to_balance_s", took, "time to balance (s)", fmt=".2f")
        report.add("balance_moves", body.get("balance", {}).get("moves", 0),
                   "balancer moves", fmt="d")
        spread = max(led.values()) - min(led.values())
        report.add("leader_spread_after", spread, "leaders per node, max - min", fmt="d",
                   target=("<= 1", spread <= 1))
        if gaps:
            report.add("move_unavailable_median_ms", percentile(gaps, 50) * 1000,
                       "unavailability per balancer move, median (ms)")
            report.add("move_unavailable_max_ms", gaps[-1] * 1000,
                       "unavailability per balancer move, max (ms)",
                       target=(f"< {TARGET_MOVE_MAX_S * 1000:g}",
                               gaps[-1] < TARGET_MOVE_MAX_S))
        total = pubs.acked + pubs.failed
        report.add("publishes", total, "publishes attempted", fmt=",d")
        report.add("publish_success_share", pubs.acked / total if total else 0.0,
                   "publish success (share)", fmt=".4f",
                   target=(f">= {TARGET_SUCCESS}", total and pubs.acked / total >= TARGET_SUCCESS))
        report.add("publish_retries", pubs.producer.retries, "client retries", fmt=",d")
    finally:
        cl.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter waits")
    p.add_argument("--partitions", type=int, default=24)
    p.add_argument("--replicas", type=int, default=3)
    args = p.parse_args()
    args.warm_s = 0.5 if args.quick else 2.0
    args.settle_s = 0.3 if args.quick else 0.6
    report = Report("balance")
    report.figures.update(machine_info())
    report.figures.update(partitions=args.partitions, replicas=args.replicas, nodes=3,
                          quick=args.quick)
    asyncio.run(run(args, report))
    report.emit_json()


if __name__ == "__main__":
    main()
