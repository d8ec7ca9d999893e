"""Duplicates that retried publishes write through leader kills (issue 30's "measure first").

    .venv/bin/python bench/duplicates.py [--kills 50] [--modes idempotent,plain]

A real cluster (tests/cluster.py: etcd, one nsqlookupd, three nsqd), a topic of 3
partitions, R=3. Eight publishers of the partition-aware client (nsqclient.Producer,
keyed, each publish retried for up to 10 s: tests/test_replication.py KeyedLoad) publish
unique bodies while the leader of a random partition is SIGKILLed, replaced, restarted
and back in the ISR, `--kills` times; once for each of `--modes`: the client idempotent
(its default: a producer id and a sequence per partition, nsqd/producers.py) and plain
(PUB and MPUB, at-least-once). Then one channel reads the whole topic from its
start. Figures: publishes acknowledged, calls that failed, acknowledged bodies not read
(lost), duplicate writes (a body stored under two or more message ids: a retry of a
publish that had been written), and redeliveries (one message id delivered again).

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from cluster import LEASE_TTL_S, Cluster  # noqa: E402
from nsqclient.consumer import Consumer  # noqa: E402
from test_replication import KeyedLoad  # noqa: E402

TOPIC = "dup"


async def kills(cl: Cluster, count: int) -> None:
    rng = random.Random(7)
    for k in range(count):
        before = await cl.states(TOPIC)
        n = rng.randrange(len(before))
        victim = cl.nsqd_at(before[n].leader)
        victim.kill()
        await cl.until_states(TOPIC, lambda s: s[n].leader not in (None, before[n].leader),
                              LEASE_TTL_S + 10, f"kill {k}: a new leader")
        await asyncio.to_thread(victim.start)
        await cl.until_states(TOPIC, lambda s: all(len(p.isr) == 3 for p in s.values()), 60,
                              f"kill {k}: back in sync")
        print(f"   kill {k + 1}/{count} done", flush=True)


async def read_all(cl: Cluster, acked: set[bytes], timeout: float) -> dict[bytes, list]:
    """body -> the message ids it was delivered under (one per delivery), until every
    acknowledged body came or `timeout` passed without one more message."""
    ids: dict[bytes, list] = {}
    progress = asyncio.Event()

    def handler(m) -> None:
        ids.setdefault(m.body, []).append(m.id)
        progress.set()

    consumer = await Consumer(TOPIC, "check", [cl.lookupds[0].http_address], handler,
                              max_in_flight=500, lookup_interval=0.5).start()
    try:
        while not acked <= ids.keys():
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), timeout)
            except TimeoutError:
                break
    finally:
        await consumer.close()
    return ids


async def run(count: int, report: Report, mode: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-dup-") as tmp:
        cl = Cluster(tmp, 3, 1).start()
        try:
            status, body = cl.create_topic(TOPIC, 3, replicas=3)
            assert status == 200, body
            await cl.until_states(TOPIC, lambda s: all(len(p.isr) == 3 for p in s.values()),
                                  15, "3 in sync")
            load = KeyedLoad(cl, TOPIC, 32, idempotent=mode == "idempotent")
            try:
                await kills(cl, count)
            finally:
                await load.stop()
            ids = await read_all(cl, load.acked, 20)
        finally:
            cl.stop()
    lost = load.acked - ids.keys()
    duplicates = sum(len(set(v)) - 1 for v in ids.values())
    redelivered = sum(len(v) - len(set(v)) for v in ids.values())
    report.section(f"{count} leader kills, 8 keyed publishers (nsqclient, {mode}), R=3")
    report.add(f"{mode}_acked", len(load.acked), "publishes acknowledged", fmt=",d")
    report.add(f"{mode}_failed_calls", load.failed, "publish calls that failed (after retries)",
               fmt=",d")
    report.add(f"{mode}_lost", len(lost), "acknowledged, never read", fmt=",d")
    report.add(f"{mode}_duplicate_writes", duplicates,
               "extra copies written (a body under 2+ ids)", fmt=",d")
    report.add(f"{mode}_duplicated_bodies", sum(1 for v in ids.values() if len(set(v)) > 1),
               "bodies written twice or more", fmt=",d")
    report.add(f"{mode}_redeliveries", redelivered, "deliveries of a message id again",
               fmt=",d")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--modes", default="idempotent,plain",
                    help="the client's modes to run, in turn: idempotent, plain")
    args = ap.parse_args()
    report = Report("duplicates")
    report.figures.update(common.machine_info())
    for mode in args.modes.split(","):
        if mode not in ("idempotent", "plain"):
            ap.error(f"unknown mode {mode!r}")
        asyncio.run(run(args.kills, report, mode))
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
