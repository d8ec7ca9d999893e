"""Replication core benchmark (isr): one process, one event loop (uvloop), a leader and two
followers with real DiskQueues (durable: every batch synced) and real TCP over 127.0.0.1.

    .venv/bin/python bench/replication_core.py [--quick] [--dir DIR]

For R=1 (the leader alone, solo) and R=3 (leader + 2 followers, min_isr 2), each for a few
seconds: single appends (200 coroutines, one 200-byte message each, awaited) and MPUB-sized
appends (8 coroutines, 100 messages of 200 bytes each). A message counts once its append is
acknowledged (R=3: synced on all three). CPU per message is the whole process (all three
nodes: loop + disk threads), so R=3 pays three nodes' work on the same cores.
Prints readable lines, then ONE line of JSON with every figure (units in the names).
The host is tests/repl_host.py (the test host with an in-memory partition state).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.append(p)

import structlog
import uvloop
from repl_host import Host, States

from bench.common import CpuWatch, Report, cpu_seconds, machine_info
from diskqueue.runtime import tune_gc
from isr.state import PartitionState

NODES = ("127.0.0.1:4101", "127.0.0.1:4102", "127.0.0.1:4103")
BODY = b"m" * 200


async def run_case(base: str, replicas: int, single: bool, seconds: float) -> dict:
    states = States()
    nodes = NODES[:replicas]
    states.put("t", 0, PartitionState(leader=nodes[0], isr=nodes, epoch=1))
    hosts = [await Host(states, n, os.path.join(base, n.replace(":", "_")),
                        min_isr=min(2, replicas)).start() for n in nodes]
    for h in reversed(hosts):
        await h.open("t", 0)
    q = hosts[0].queues[("t", 0)]
    msgs = 0
    stop = False
    per, workers = (1, 200) if single else (100, 8)
    bodies = [BODY] * per

    async def producer():
        nonlocal msgs
        while not stop:
            await q.append(bodies)
            msgs += per

    tasks = [asyncio.create_task(producer()) for _ in range(workers)]
    await asyncio.sleep(0.3)  # warm up
    m0, c0 = msgs, cpu_seconds()
    with CpuWatch() as w:
        await asyncio.sleep(seconds)
        m1, c1 = msgs, cpu_seconds()
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    assert states.states[("t", 0)].isr == nodes, "a follower was dropped during the run"
    for h in hosts:
        await h.stop()
    n = m1 - m0
    return {"msgs_per_s": n / w.wall, "cpu_us_per_msg": (c1 - c0) / max(n, 1) * 1e6,
            "process_cpus": w.own_cpus, "other_cpus": w.other_cpus}


async def run_all(base: str, quick: bool) -> Report:
    rep = Report("replication_core")
    info = machine_info()
    rep.figures.update(quick=quick, python=info["python"], cpus=info["cpus"])
    seconds = 2.0 if quick else 8.0
    print(f"replication core benchmark ({'quick' if quick else 'full'}), {seconds:.0f} s a "
          f"case, data in {base}", flush=True)
    results = {}
    for kind, single in (("single", True), ("mpub", False)):
        rep.section(f"{kind} appends ({'1 message' if single else '100 messages'} each)")
        for r in (1, 3):
            case = await run_case(os.path.join(base, f"{kind}-r{r}"), r, single, seconds)
            results[(kind, r)] = case
            rep.add(f"{kind}_r{r}_msgs_per_s", case["msgs_per_s"], f"R={r} msgs/s", ",.0f")
            rep.add(f"{kind}_r{r}_cpu_us_per_msg", case["cpu_us_per_msg"],
                    f"R={r} CPU per message (all nodes, us)", ",.1f")
            rep.add(f"{kind}_r{r}_other_cpus", case["other_cpus"],
                    f"R={r} CPUs used by other processes", ".2f")
        ratio = results[(kind, 3)]["msgs_per_s"] / max(results[(kind, 1)]["msgs_per_s"], 1)
        rep.add(f"{kind}_r3_over_r1", ratio, "R=3 / R=1 throughput", ".2f")
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s a case, under a minute")
    ap.add_argument("--dir", help="folder for the data (default: the system temp folder)")
    args = ap.parse_args()
    tune_gc()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    base = tempfile.mkdtemp(prefix="bench-repl-", dir=args.dir)
    t0 = time.monotonic()
    try:
        rep = uvloop.run(run_all(base, args.quick))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rep.figures["wall_s"] = round(time.monotonic() - t0, 1)
    rep.emit_json()


if __name__ == "__main__":
    main()
