"""One nsqd per core: two nsqd on this machine's two cores against one.

    .venv/bin/python bench/pernode.py [--quick] [--rounds 3]

One nsqd is one Python process and uses about one core; a host runs one per core
(nsqd/README.md, "Cluster mode"). Each round, alternated: (a) one nsqd (classic, durable:
every batch synced before OK) takes the whole load; (b) two nsqd, each on its own data
path, take half of it each. The load: 100 producer connections, one 200-byte PUB at a
time each, then 6 connections of MPUB 200 (bench/loadgen.py processes, which share the
two cores with the nodes). Figures: msgs/s of (a) and (b) and their ratio, the CPU each
nsqd used over the span, medians over the rounds.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench import common  # noqa: E402
from bench.cluster import run, spec  # noqa: E402
from bench.common import Report  # noqa: E402
from nsqwire.commands import cmd_mpub, cmd_pub  # noqa: E402
from servers import NsqdProcess  # noqa: E402

BODY = b"x" * 200
MPUB_BATCH = 200
FULL = dict(pub_conns=100, mpub_conns=6, warm_s=1.0, dur_s=8.0)
QUICK = dict(pub_conns=100, mpub_conns=6, warm_s=0.5, dur_s=3.0)


def measure(nodes: int, P: dict, tmp: str) -> dict:
    """The load over `nodes` nsqd (connection i to node i % nodes): msgs/s and CPUs."""
    procs = [NsqdProcess(os.path.join(tmp, f"n{nodes}-{i}")).start() for i in range(nodes)]
    try:
        at = [("127.0.0.1", p.tcp_port) for p in procs]
        pids = [p.proc.pid for p in procs]
        pub = run([spec([(*at[i % nodes], cmd_pub("t", BODY)) for i in range(P["pub_conns"])])],
                  pids, P, 1)
        mpub = run([spec([(*at[i % nodes], cmd_mpub("t", [BODY] * MPUB_BATCH))
                          for i in range(P["mpub_conns"])])], pids, P, MPUB_BATCH)
    finally:
        for p in procs:
            p.stop()
    return {"pub": pub, "mpub": mpub}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    P = QUICK if args.quick else FULL
    report = Report("pernode")
    report.figures.update(common.machine_info())
    rounds: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="bench-pernode-") as tmp:
        for r in range(args.rounds):
            for nodes in (1, 2) if r % 2 == 0 else (2, 1):
                rounds[nodes].append(measure(nodes, P, os.path.join(tmp, f"r{r}")))
    for kind, what in (("pub", f"{P['pub_conns']} connections, PUB"),
                       ("mpub", f"{P['mpub_conns']} connections, MPUB 200")):
        report.section(what)
        one = [x[kind]["msgs_per_s"] for x in rounds[1]]
        two = [x[kind]["msgs_per_s"] for x in rounds[2]]
        report.add(f"{kind}_one_node_msgs_per_s", statistics.median(one), "one nsqd: msgs/s",
                   fmt=",.0f")
        report.add(f"{kind}_two_nodes_msgs_per_s", statistics.median(two),
                   "two nsqd: msgs/s", fmt=",.0f")
        report.add(f"{kind}_two_over_one", statistics.median(b / a for a, b in zip(one, two)),
                   "two / one (median of rounds)", fmt=".2f")
        cpus = [[round(c / P["dur_s"], 2) for c in x[kind]["cpu_s"]] for x in rounds[2]]
        report.figures[f"{kind}_two_node_cpus"] = cpus
        report.note(f"CPU share of each of the two nsqd, per round: {cpus}")
        report.figures[f"{kind}_one_node_cpus"] = [
            round(x[kind]["cpu_s"][0] / P["dur_s"], 2) for x in rounds[1]]
        report.note(f"CPU share of the one nsqd, per round: "
                    f"{report.figures[f'{kind}_one_node_cpus']}")
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
