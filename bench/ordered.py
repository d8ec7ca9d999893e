"""Ordered consumption: throughput of an ordered partition-channel, and what bounds it.

    .venv/bin/python bench/ordered.py [--quick]

An ordered partition-channel has one message out at a time (nsqd/ordered.py): the next is
sent only after the FIN of the one before, so one partition carries at most
1 / (handler time + round trip) messages a second. This measures, on real processes:

1. the round trip (RTT) of a command answered at once (a TOUCH of an unknown id on a
   subscribed connection: no disk), median of many, and its ceiling 1 / RTT;
2. one nsqd (durable), a topic created ordered with 16 partitions, backlog written first:
   - one partition, handler 0 ms (FIN as soon as it arrives): msgs/s, beside 1 / RTT;
   - one partition, handler 1 ms (asyncio.sleep(0.001), then FIN): msgs/s, beside
     1 / (1 ms + RTT);
   - 16 partitions at once, handler 0 ms, one connection each: the total;
3. an R=3 cluster (tests/cluster.py: etcd, an nsqlookupd, 3 nsqd), one ordered partition,
   handler 0 ms: each FIN is pushed to both followers and awaited before the next message
   is released, so it costs one more replication round trip.

The consumer is one asyncio process with raw connections (SUB_ORDERED, RDY 100: the server
still sends one at a time). Everything shares this machine's 2 cores. Prints a table, then
ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from cluster import Cluster, http_json, wait_until  # noqa: E402
from nsqclient.conn import Connection, NSQError  # noqa: E402
from nsqclient.consumer import partitions_needed  # noqa: E402
from nsqwire import commands as c  # noqa: E402
from nsqwire.protocol import MAGIC_V2  # noqa: E402
from servers import NsqdProcess  # noqa: E402

TOPIC = "ordered_bench"
PARTITIONS = 16
BODY = b"x" * 200
FULL = dict(dur_s=5.0, rtt_n=2000, backlog=80_000, backlog_each=8_000)
QUICK = dict(dur_s=2.0, rtt_n=500, backlog=30_000, backlog_each=3_000)


async def rtt_s(host: str, port: int, n: int) -> float:
    """Median round trip of a TOUCH of an unknown id on a subscribed connection: answered at
    once with E_TOUCH_FAILED (not fatal), no disk. Raw frames: the client's Connection
    answers no waiter for the errors of FIN, REQ and TOUCH."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(MAGIC_V2 + c.cmd_sub_ordered(TOPIC, "rtt", 0))

    async def frame() -> bytes:
        size = int.from_bytes(await reader.readexactly(4), "big")
        return await reader.readexactly(size)

    await frame()  # OK
    touch = c.cmd_touch(b"0" * 16)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(touch)
        while b"E_TOUCH_FAILED" not in await frame():  # (a heartbeat may come between)
            pass
        times.append(time.perf_counter() - t)
    writer.close()
    return statistics.median(times)


async def fill(host: str, port: int, partitions: list[int], count: int) -> None:
    conn = await Connection(host, port).connect()
    for p in partitions:
        for start in range(0, count, 500):
            await conn.command(c.cmd_mpub(TOPIC, [BODY] * min(500, count - start), p))
    await conn.close()


async def consume(host: str, port: int, channel: str, partitions: list[int],
                  handler_s: float, dur_s: float) -> float:
    """Messages finished a second over one ordered connection per partition: for `dur_s`,
    or until the backlog is done (the time then ends at the last FIN)."""
    done = 0
    start = time.monotonic()
    stop = start + dur_s
    last = start

    async def one(p: int) -> None:
        nonlocal done, last
        conn = await Connection(host, port).connect()
        await conn.command(c.cmd_sub_ordered(TOPIC, channel, p))
        conn.rdy(100)
        while time.monotonic() < stop:
            try:
                m = await asyncio.wait_for(conn.messages.get(), 1.0)
            except TimeoutError:
                break  # the backlog is done
            if handler_s:
                await asyncio.sleep(handler_s)
            m.fin()
            done += 1
            last = time.monotonic()
        await conn.close()

    await asyncio.gather(*(one(p) for p in partitions))
    return done / max(last - start, 1e-6)


def make_channels(http_address: str, names: list[str]) -> None:
    """Channels made before the backlog is written (a later channel starts at the end);
    retried while a just-elected leader has not opened the topic yet."""
    def made(name: str) -> bool:
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"http://{http_address}/channel/create?topic={TOPIC}&channel={name}",
                data=b""), timeout=10).read()
            return True
        except OSError:
            return False

    for name in names:
        wait_until(lambda: made(name), 15, f"channel {name} made", 0.2)


def single_node(report: Report, P: dict, tmp: str) -> dict:
    report.section(f"one nsqd, an ordered topic of {PARTITIONS} partitions (durable)")
    node = NsqdProcess(os.path.join(tmp, "nsqd")).start()
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"http://{node.http_address}/topic/create?topic={TOPIC}"
            f"&partition_num={PARTITIONS}&ordered=true", data=b""), timeout=10).read()
        make_channels(node.http_address, ["h0", "h1", "all"])  # before the backlog: theirs
        host, port = "127.0.0.1", node.tcp_port
        asyncio.run(fill(host, port, [0], P["backlog"]))
        asyncio.run(fill(host, port, list(range(1, PARTITIONS)), P["backlog_each"]))
        rtt = asyncio.run(rtt_s(host, port, P["rtt_n"]))
        d = P["dur_s"]
        one0 = asyncio.run(consume(host, port, "h0", [0], 0, d))
        one1 = asyncio.run(consume(host, port, "h1", [0], 0.001, d))
        many = asyncio.run(consume(host, port, "all", list(range(PARTITIONS)), 0, d))
    finally:
        node.stop()
    return {"rtt_s": rtt, "one0": one0, "one1": one1, "many": many}


def replicated(report: Report, P: dict, tmp: str) -> dict:
    report.section("R=3 cluster: 3 nsqd, one ordered partition, FIN awaited by the ISR")
    cl = Cluster(os.path.join(tmp, "cluster"), 3, 1).start()
    try:
        wait_until(lambda: cl.master() is not None, 10, "a master nsqlookupd")
        status, body = http_json("POST", f"http://{cl.lookupds[cl.master()].http_address}"
                                         f"/topic/create?topic={TOPIC}&partition_num=1"
                                         f"&replicator=3&orderedmulti=true")
        assert status == 200, body
        leader = wait_until(lambda: cl.leaders(TOPIC).get(0), 15, "partition 0 led")
        host, port = leader.rsplit(":", 1)
        make_channels(cl.nsqd_at(leader).http_address, ["r3"])

        async def filled() -> bool:
            try:
                await fill(host, int(port), [0], P["backlog_each"])
                return True
            except NSQError:
                return False

        wait_until(lambda: asyncio.run(filled()), 15, "partition 0 writable", 0.2)
        rtt = asyncio.run(rtt_s(host, int(port), P["rtt_n"] // 4))
        d = P["dur_s"]
        r3 = asyncio.run(consume(host, int(port), "r3", [0], 0, d))
    finally:
        cl.stop()
    return {"rtt_s": rtt, "r3": r3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (under a minute)")
    args = ap.parse_args()
    P = QUICK if args.quick else FULL
    report = Report("ordered")
    report.figures.update(common.machine_info())
    with tempfile.TemporaryDirectory(prefix="ordered-bench-") as tmp:
        s = single_node(report, P, tmp)
        r = replicated(report, P, tmp)
    rtt = s["rtt_s"]
    rows = [
        ("1 partition, handler 0 ms", s["one0"], 1 / rtt),
        ("1 partition, handler 1 ms", s["one1"], 1 / (0.001 + rtt)),
        (f"{PARTITIONS} partitions, handler 0 ms (total)", s["many"], PARTITIONS / rtt),
        ("R=3, 1 partition, handler 0 ms", r["r3"], 1 / r["rtt_s"]),
    ]
    report.section("table (ceiling: 1 / (handler + RTT) per partition)")
    print(f"   {'case':<40} {'msgs/s':>10} {'ceiling':>10} {'share':>7} {'ms/msg':>8}")
    for name, rate, ceiling in rows:
        print(f"   {name:<40} {rate:>10,.0f} {ceiling:>10,.0f} {rate / ceiling:>7.2f} "
              f"{1000 / rate if rate else float('inf'):>8.3f}")
    report.note("16 partitions: the ceiling is the wire's; here the server and this client share")
    report.note("2 cores, so the total is CPU-bound. R=3: the ceiling leaves out the FIN's push to")
    report.note("both followers (CHANNELS, awaited), which is what the extra time per message is.")
    report.section("figures")
    report.add("rtt_single_ms", rtt * 1000, "RTT, one nsqd (median, ms)", fmt=",.3f")
    report.add("rtt_r3_leader_ms", r["rtt_s"] * 1000, "RTT, R=3 leader (median, ms)", fmt=",.3f")
    report.add("ceiling_1_over_rtt_msgs_per_s", 1 / rtt, "1 / RTT (msgs/s)", fmt=",.0f")
    report.add("ordered_1p_0ms_msgs_per_s", s["one0"], "1 partition, handler 0 ms", fmt=",.0f")
    report.add("ordered_1p_1ms_msgs_per_s", s["one1"], "1 partition, handler 1 ms", fmt=",.0f")
    report.add("ordered_16p_0ms_msgs_per_s", s["many"], "16 partitions, handler 0 ms",
               fmt=",.0f")
    report.add("ordered_r3_1p_0ms_msgs_per_s", r["r3"], "R=3, 1 partition, handler 0 ms",
               fmt=",.0f")
    per_msg = 1 / s["one1"] if s["one1"] else 1.0
    need = partitions_needed(10_000, per_msg)
    report.add("partitions_for_10k_msgs_per_s_1ms_handler", need,
               "partitions for 10,000 msgs/s with a 1 ms handler", fmt="d")
    report.figures["loadavg_1m_end"] = os.getloadavg()[0]
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
