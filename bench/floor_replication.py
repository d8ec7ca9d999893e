"""Is issue #7's R=3 target within reach of any Python server on this machine? The floor
(bench/floor_server.py in `sync` mode, with its push replication) against our nsqd
cluster (bench/replication.py's throughput part), R=1 and R=3, in one run.

    .venv/bin/python bench/floor_replication.py [--quick] [--rounds N]

Both sides have 3 server processes on this machine's cores, 6 partitions (the floor: 6
topics, two led by each process; R=3: each process pushes every batch of its topics to
the other two and answers once both synced it too, as an ISR of 3 does) and the same load
as bench/replication.py: (a) 100 connections, one 200-byte PUB at a time each; (b) 6
connections of MPUB 200. Figures: msgs/s and msgs per server CPU-second, the median of
the rounds (floor and nsqd alternated), and each side's R=3 / R=1.

What it answers: the issue asks R=3 >= 0.6x R=1 for MPUB and >= 0.5x for single PUB. The
floor does the least a durable push ISR of 3 must do (one write and one fdatasync a batch
on each replica, one send and one answer a follower), with no records, offsets, epochs or
checks; if the floor's ratio misses a target here, no change inside nsqd meets it here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
sys.path += [ROOT, os.path.join(ROOT, "tests")]
from bench import common  # noqa: E402
from bench.cluster import run, spec  # noqa: E402
from bench.common import Report  # noqa: E402
from bench.replication import (FULL, MPUB_BATCH, PARTITIONS, QUICK, TARGET_MPUB,  # noqa: E402
                               TARGET_PUB, throughput)
from cluster import Cluster  # noqa: E402
from nsqwire.commands import cmd_mpub, cmd_pub  # noqa: E402
from servers import free_port  # noqa: E402

BODY = b"x" * 200
NODES = 3
PARTS = ("pub", "mpub")


class FloorCluster:
    """NODES floor servers in `sync` mode; with `replicas` 3 each pushes to the others."""

    def __init__(self, replicas: int, base_dir: str | None):
        self.replicas, self.base_dir = replicas, base_dir

    def __enter__(self) -> "FloorCluster":
        self.tmp = tempfile.mkdtemp(prefix="bench-floorrepl-", dir=self.base_dir)
        self.ports = [free_port() for _ in range(NODES)]
        follow = [free_port() for _ in range(NODES)]
        self.procs = []
        for i in range(NODES):
            data = os.path.join(self.tmp, f"n{i}")
            os.makedirs(data)
            others = [f"127.0.0.1:{follow[j]}" for j in range(NODES) if j != i]
            args = [sys.executable, os.path.join(HERE, "floor_server.py"), "--mode", "sync",
                    "--port", str(self.ports[i]), "--dir", data,
                    "--follow-port", str(follow[i])]
            if self.replicas > 1:
                args += ["--followers", ",".join(others)]
            self.procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, text=True))
        for p in self.procs:  # every follower listens before any leader connects
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a floor server did not start")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def leader_of(self, partition: int) -> tuple[str, int]:
        return "127.0.0.1", self.ports[partition % NODES]


def floor_round(P: dict, replicas: int, base_dir: str | None) -> dict:
    with FloorCluster(replicas, base_dir) as fc:
        pids = [p.pid for p in fc.procs]
        pub = run([spec([(*fc.leader_of(k % PARTITIONS), cmd_pub(f"p{k % PARTITIONS}", BODY))
                         for k in range(P["pub_conns"])])], pids, P, 1)
        mpub = run([spec([(*fc.leader_of(k), cmd_mpub(f"p{k}", [BODY] * MPUB_BATCH))
                          for k in range(P["mpub_conns"])])], pids, P, MPUB_BATCH)
    return {"pub": pub, "mpub": mpub}


def nsqd_round(P: dict, base_dir: str | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-floorrepl-nsqd-", dir=base_dir)
    cl = Cluster(tmp, NODES, 1).start()
    try:
        return throughput(Report("floor_replication/nsqd"), cl, P)
    finally:
        cl.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def per_cpu(r: dict) -> float:
    cpu = sum(r["cpu_s"])
    return r["msgs"] / cpu if cpu else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s a part, 1 round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where the data goes (default: /tmp)")
    args = parser.parse_args()
    P = dict(QUICK if args.quick else FULL)
    rounds = args.rounds or (1 if args.quick else 3)

    report = Report("floor_replication")
    report.figures.update(common.machine_info())
    got: dict[str, dict[int, list[dict]]] = {"floor": {1: [], 3: []}, "nsqd": {1: [], 3: []}}
    for r in range(rounds):
        report.section(f"round {r + 1} of {rounds}: the floor (R=1, R=3), then nsqd")
        for replicas in (1, 3):
            got["floor"][replicas].append(floor_round(P, replicas, args.dir))
        out = nsqd_round(P, args.dir)
        for replicas in (1, 3):
            got["nsqd"][replicas].append(out[replicas])

    report.section(f"medians of {rounds} round(s): {PARTITIONS} partitions on {NODES} "
                   f"processes; (a) {P['pub_conns']} connections of PUB, (b) "
                   f"{P['mpub_conns']} of MPUB {MPUB_BATCH}")
    for side in ("floor", "nsqd"):
        for part in PARTS:
            med = {}
            for replicas in (1, 3):
                runs = got[side][replicas]
                med[replicas] = (statistics.median(x[part]["msgs_per_s"] for x in runs),
                                 statistics.median(per_cpu(x[part]) for x in runs))
                report.add(f"{side}_r{replicas}_{part}_msgs_per_s", med[replicas][0],
                           f"{side}, R={replicas}, {part.upper()}: msgs/s", fmt=",.0f")
                report.add(f"{side}_r{replicas}_{part}_msgs_per_cpu_s", med[replicas][1],
                           f"{side}, R={replicas}, {part.upper()}: msgs per server CPU-s",
                           fmt=",.0f")
            target = TARGET_PUB if part == "pub" else TARGET_MPUB
            ratio = med[3][0] / med[1][0]
            report.add(f"{side}_{part}_r3_over_r1", ratio,
                       f"{side}, {part.upper()}: msgs/s, R=3 / R=1", fmt=".2f",
                       target=(f">= {target:g}", ratio >= target))
            report.add(f"{side}_{part}_per_cpu_r3_over_r1", med[3][1] / med[1][1],
                       f"{side}, {part.upper()}: msgs per CPU-s, R=3 / R=1", fmt=".2f")
    report.figures["rounds"] = {
        side: {str(r): [{part: {k: x[part][k] for k in ("msgs_per_s", "msgs", "cpu_s")}
                         for part in PARTS} for x in got[side][r]] for r in (1, 3)}
        for side in got}
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
