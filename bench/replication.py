"""Replication: what R=3 costs against R=1, and what a leader kill costs.

    .venv/bin/python bench/replication.py [--quick] [--kills N] [--py-spy DIR]

One real cluster (tests/cluster.py: etcd, an nsqlookupd, 3 nsqd in cluster mode, lease TTL
2 s), durable (every batch synced before OK, on every ISR member for R=3):
1. throughput: topics of 6 partitions with R=1 and with R=3 (min_isr 2), in one run;
   (a) 100 producer connections, one 200-byte PUB at a time each, routed by key as the
   partition-aware client routes; (b) 6 connections of MPUB 200. Load generators are
   bench/loadgen.py processes. Figures: msgs/s, p99, CPU of each nsqd over the span, and
   R=3 / R=1 (issue 31's targets: >= 0.7 for single PUB, >= 0.5 for MPUB). All three nodes and the
   load generator share 2 cores here: with R=3 every node writes every message, so on
   separate machines the ratio is bounded by the network round trip, not by CPU.
2. failover: `--kills` times (20; --quick: 3), keyed publishing through nsqclient.Producer
   (8 concurrent publishers, retry budget 10 s) while the leader of partition 0 is killed
   with SIGKILL, then restarted once the partition is led again and waited for until it is
   back in the ISR. Figures: kill to the first publish acknowledged by the new leader
   (median, max), publish success rate through the kills, and redeliveries per failover
   (duplicates seen by a consumer of the whole history, divided by the kills); lost must
   be 0.

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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench import common  # noqa: E402
from bench.cluster import P_DUR, leader_targets, report_part, run, spec  # noqa: E402
from bench.common import Report  # noqa: E402
from cluster import Cluster, wait_until  # noqa: E402
from nsqclient.consumer import Consumer  # noqa: E402
from nsqwire.partitioning import partition_of  # noqa: E402
from nsqclient.producer import Producer  # noqa: E402
from nsqwire.commands import cmd_mpub, cmd_pub  # noqa: E402

BODY = b"x" * 200
PARTITIONS = 6
MPUB_BATCH = 200
TARGET_MPUB = 0.5
TARGET_PUB = 0.7
FULL = dict(pub_conns=100, mpub_conns=6, warm_s=1.0, dur_s=10.0, kills=20)
QUICK = dict(pub_conns=100, mpub_conns=6, warm_s=0.5, dur_s=3.0, kills=3)


def profiles(P: dict, part: str, nodes: int) -> list[str] | None:
    """With --py-spy DIR: a profile path for each node in this part."""
    if not P.get("py_spy"):
        return None
    os.makedirs(P["py_spy"], exist_ok=True)
    return [os.path.join(P["py_spy"], f"{part}_node{i}.txt") for i in range(nodes)]


def throughput(report: Report, cl: Cluster, P: dict) -> dict:
    out = {}
    pids = [n.proc.pid for n in cl.nsqds]
    lookupds = [p.http_address for p in cl.lookupds]
    for r in (1, 3):
        topic = f"bench_r{r}"
        report.section(f"{PARTITIONS} partitions, R={r} (durable)")
        status, body = cl.create_topic(topic, PARTITIONS, replicas=r)
        assert status == 200, body
        asyncio.run(cl.until_states(topic, lambda s: len(s) == PARTITIONS and all(
            len(p.isr) == r and p.leader for p in s.values()), 20, "every partition in sync"))
        time.sleep(1.0)  # the leaders' replication connected
        targets = asyncio.run(leader_targets(lookupds, P["pub_conns"], topic))
        pub = run([spec([(h, port, cmd_pub(topic, BODY, partition=part))
                         for h, port, part in targets])], pids, P, 1,
                  profiles(P, f"r{r}_pub1", len(pids)))
        report_part(report, f"r{r}_pub1", f"{P['pub_conns']} connections, PUB", pub)
        leaders = wait_until(lambda: len(cl.leaders(topic)) == PARTITIONS and
                             cl.leaders(topic), 10, "every partition led")
        mpub = []
        for i in range(P["mpub_conns"]):
            n = sorted(leaders)[i % len(leaders)]
            host, port = leaders[n].rsplit(":", 1)
            mpub.append((host, int(port), cmd_mpub(topic, [BODY] * MPUB_BATCH, partition=n)))
        mp = run([spec(mpub)], pids, P, MPUB_BATCH, profiles(P, f"r{r}_mpub", len(pids)))
        report_part(report, f"r{r}_mpub", f"{P['mpub_conns']} connections, MPUB 200", mp)
        out[r] = {"pub": pub, "mpub": mp}
    report.section("R=3 / R=1")
    for part, target in (("pub", TARGET_PUB), ("mpub", TARGET_MPUB)):
        ratio = out[3][part]["msgs_per_s"] / out[1][part]["msgs_per_s"]
        report.add(f"{part}_r3_over_r1", ratio, f"{part}: msgs/s, R=3 / R=1", fmt=",.2f",
                   target=(f">= {target:g}", ratio >= target))
        per_cpu = [out[r][part]["msgs"] / sum(out[r][part]["cpu_s"]) for r in (1, 3)]
        report.add(f"{part}_per_cpu_r3_over_r1", per_cpu[1] / per_cpu[0],
                   f"{part}: msgs per nsqd CPU-second, R=3 / R=1", fmt=",.2f")
    return out


async def failover(report: Report, cl: Cluster, kills: int) -> None:
    topic = "bench_failover"
    report.section(f"failover: {kills} kills of partition 0's leader under keyed publishing")
    status, body = cl.create_topic(topic, 2, replicas=3)
    assert status == 200, body
    await cl.until_states(topic, lambda s: all(len(p.isr) == 3 for p in s.values()), 20,
                      "3 in sync")
    key0 = next(f"k{i}" for i in range(1000) if partition_of(f"k{i}", 2) == 0)
    producer = Producer([cl.lookupds[0].http_address], max_retry_time=10.0)
    acked: list[bytes] = []
    on_partition0: list[tuple[float, float]] = []  # (invoked, acknowledged) of its key
    failed = 0
    stop = asyncio.Event()

    async def publisher(w: int) -> None:
        nonlocal failed
        i = 0
        while not stop.is_set():
            body = f"{w}-{i}".encode()
            invoked = time.monotonic()
            try:
                await producer.publish(topic, body, key=key0 if w % 2 == 0 else f"o{w}-{i % 8}")
                acked.append(body)
                if w % 2 == 0:
                    on_partition0.append((invoked, time.monotonic()))
            except Exception:
                failed += 1
            i += 1

    workers = [asyncio.create_task(publisher(w)) for w in range(8)]
    times = []
    try:
        await asyncio.sleep(1.0)
        for k in range(kills):
            before = await cl.states(topic)
            victim = cl.nsqd_at(before[0].leader)
            victim.kill()
            killed = time.monotonic()  # dead: kill() waited for it
            await cl.until_states(topic, lambda s: s[0].leader not in (None, before[0].leader),
                              30, "a new leader")
            # the first publish invoked after the kill (an OK already on its way when the
            # leader died is not the new leader's)
            while not on_partition0 or on_partition0[-1][0] <= killed:
                await asyncio.sleep(0.01)
                if time.monotonic() - killed > 30:
                    raise RuntimeError("partition 0 took no publish within 30 s")
            first = min(acked_at for invoked, acked_at in on_partition0 if invoked > killed)
            times.append(first - killed)
            report.note(f"kill {k + 1}: {times[-1]:.2f} s to the first acknowledged publish")
            await asyncio.to_thread(victim.start)
            await cl.until_states(topic, lambda s: all(len(p.isr) == 3 for p in s.values()),
                              60, "the restarted node back in sync")
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await producer.close()
    report.add("failover_median_s", statistics.median(times), "kill to first OK: median (s)",
               fmt=",.2f")
    report.add("failover_max_s", max(times), "kill to first OK: max (s)", fmt=",.2f")
    total = len(acked) + failed
    report.add("publish_success_rate", len(acked) / total if total else 0.0,
               "publish calls acknowledged (retry budget 10 s)", fmt=",.4f",
               target=(">= 0.99", total and len(acked) / total >= 0.99))
    expected = set(acked)
    seen: dict[bytes, int] = {}
    done = asyncio.Event()

    async def handler(m) -> None:
        seen[m.body] = seen.get(m.body, 0) + 1
        if expected <= seen.keys():
            done.set()

    consumer = await Consumer(topic, "bench", [cl.lookupds[0].http_address], handler,
                              max_in_flight=500, lookup_interval=0.5).start()
    try:
        await asyncio.wait_for(done.wait(), 120)
    except asyncio.TimeoutError:
        pass
    await consumer.close()
    lost = len(expected - seen.keys())
    report.add("acknowledged", len(expected), "messages acknowledged", fmt=",")
    report.add("lost", lost, "acknowledged and never consumed", fmt=",",
               target=("== 0", lost == 0))
    report.add("redeliveries_per_failover", sum(n - 1 for n in seen.values()) / kills,
               "duplicates consumed per failover", fmt=",.1f")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller: about a minute")
    ap.add_argument("--kills", type=int, default=None, help="leader kills in part 2 (0: skip it)")
    ap.add_argument("--py-spy", metavar="DIR",
                    help="py-spy record every nsqd over each throughput part, into DIR")
    args = ap.parse_args()
    P = dict(QUICK if args.quick else FULL, py_spy=args.py_spy)
    if args.kills is not None:
        P["kills"] = args.kills
    P_DUR[0] = P["dur_s"]
    report = Report("replication")
    report.figures.update(common.machine_info())
    report.figures["quick"] = args.quick
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as tmp:
        cl = Cluster(os.path.join(tmp, "cluster"), 3, 1).start()
        try:
            throughput(report, cl, P)
            if P["kills"] > 0:
                asyncio.run(failover(report, cl, P["kills"]))
        finally:
            cl.stop()
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
