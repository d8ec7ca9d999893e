"""A forwarded publish against a direct one: what publishing to any node costs.

    .venv/bin/python bench/forward.py [--quick] [--rounds 3]

A real cluster (tests/cluster.py: etcd, one nsqlookupd, two nsqd in cluster mode) and a
topic of one partition, R=1, durable (every batch synced before OK): node A leads it, node
B leads nothing. Each round, alternated: the load goes (a) to A, the leader (direct), or
(b) to B, which forwards every publish to A over the replication port (nsqd/forward.py)
and answers once A did. The load: 100 producer connections, one 200-byte PUB at a time
each, then 6 connections of MPUB 200 (bench/loadgen.py processes; they share the two
cores with both nodes). Figures: msgs/s and p99 of each, forwarded over direct (median of
the rounds' ratios), and the CPU of each nsqd over the span.

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
from cluster import Cluster, wait_until  # noqa: E402
from nsqwire.commands import cmd_mpub, cmd_pub  # noqa: E402

TOPIC = "fwd"
BODY = b"x" * 200
MPUB_BATCH = 200
FULL = dict(pub_conns=100, mpub_conns=6, warm_s=1.0, dur_s=8.0)
QUICK = dict(pub_conns=100, mpub_conns=6, warm_s=0.5, dur_s=3.0)


def measure(target: tuple[str, int], pids: list[int], P: dict) -> dict:
    pub = run([spec([(*target, cmd_pub(TOPIC, BODY)) for _ in range(P["pub_conns"])])],
              pids, P, 1)
    mpub = run([spec([(*target, cmd_mpub(TOPIC, [BODY] * MPUB_BATCH))
                      for _ in range(P["mpub_conns"])])], pids, P, MPUB_BATCH)
    return {"pub": pub, "mpub": mpub}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    P = QUICK if args.quick else FULL
    report = Report("forward")
    report.figures.update(common.machine_info())
    rounds: dict[str, list[dict]] = {"direct": [], "forwarded": []}
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        cl = Cluster(tmp, 2, 1).start()
        try:
            status, body = cl.create_topic(TOPIC, 1)
            assert status == 200, body
            leader = wait_until(lambda: cl.leaders(TOPIC).get(0), 10, "partition 0 led")
            other = next(n for n in cl.nsqds if n.tcp_address != leader)
            host, port = leader.rsplit(":", 1)
            targets = {"direct": (host, int(port)), "forwarded": ("127.0.0.1", other.tcp_port)}
            pids = [cl.nsqd_at(leader).proc.pid, other.proc.pid]
            for r in range(args.rounds):
                for how in ("direct", "forwarded") if r % 2 == 0 else ("forwarded", "direct"):
                    rounds[how].append(measure(targets[how], pids, P))
        finally:
            cl.stop()
    for kind, what in (("pub", f"{P['pub_conns']} connections, PUB"),
                       ("mpub", f"{P['mpub_conns']} connections, MPUB 200")):
        report.section(what)
        for how in ("direct", "forwarded"):
            report.add(f"{kind}_{how}_msgs_per_s",
                       statistics.median(x[kind]["msgs_per_s"] for x in rounds[how]),
                       f"{how}: msgs/s", fmt=",.0f")
            report.add(f"{kind}_{how}_p99_ms",
                       statistics.median(x[kind]["p99_ms"] for x in rounds[how]),
                       f"{how}: p99 (ms)", fmt=",.2f")
            cpus = [[round(c / P["dur_s"], 2) for c in x[kind]["cpu_s"]] for x in rounds[how]]
            report.figures[f"{kind}_{how}_cpus"] = cpus
            report.note(f"{how}: CPU share of the leader and the other node, per round: {cpus}")
        report.add(f"{kind}_forwarded_over_direct", statistics.median(
            f[kind]["msgs_per_s"] / d[kind]["msgs_per_s"]
            for d, f in zip(rounds["direct"], rounds["forwarded"])),
            "forwarded / direct msgs/s (median of rounds)", fmt=".2f")
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
