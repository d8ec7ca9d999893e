"""How far is nsqd from the floor? Single PUBs against bench/floor_server.py and our nsqd,
in one run, with the same load generator.

    .venv/bin/python bench/floor.py [--quick] [--rounds N] [--topics 1,6,16] [--kinds K,...]

Nine servers: the floor in `ack` mode (answer at once, keep nothing), the floor in `sync`
mode (the simplest durable group commit: a file and a thread per topic, one write and one
fdatasync a batch), the floor in `journal` mode (the simplest node-wide group commit: one
thread, a write per topic and one journal write and fdatasync a round), in `behind` mode
(the same with each topic's write made after the round is answered), in `bulk` mode (the
topics' data kept and written once 64 MiB of it waits, a write a topic), in `once` mode (no
write per topic: the data written once, the design of RocketMQ's CommitLog), in `index`
mode (`once` with its partitions encoded as nsqd's, ids, offsets and commitlog entries
kept: the floor of that design with partitions that are real), nsqd with its
defaults (durable: one fdatasync of the node journal a round) and nsqd with `--journal
false` (each batch synced in its own segment by its partition's thread); `--kinds` picks
some. Each takes 100 producer connections, one 200-byte PUB at a time each, on 1 topic
(bench/nsqd.py's (a)), spread over 6 topics (bench/cluster.py's partitions) and over 16
(bench/nsqd.py's (g)), or over the counts `--topics` gives (nsqd's topics are made before
the timing). Each gives msgs/s and the server's CPU per message, split into its event
loop's thread and the others (bench/nsqd.py's `Phase`), and the ratios to 1 topic. The
rounds alternate the servers; every figure is the median of the rounds.

What it answers: issue #31's targets are nsqd's CPU per durable single PUB at most the
`sync` floor's, and 16 topics at least 0.9x one topic. Each floor spends what any Python
asyncio server of its design spends at least (a thread per partition; one journal a node);
if a floor misses a target, no change inside nsqd of that design meets it on this machine;
if another design's floor meets it, that design is the step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # see bench/nsqd.py
if ROOT not in sys.path:
    sys.path.append(ROOT)

from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from bench.nsqd import BODY_LEN, timed_produce  # noqa: E402
from bench.nsqd_server import Server  # noqa: E402
from nsqwire.commands import cmd_pub  # noqa: E402

TOPIC_COUNTS = (1, 6, 16)  # (a), the cluster bench's 6 partitions, (g)
CONNS = 100
KINDS = ("floor-ack", "floor-sync", "floor-journal", "floor-behind", "floor-bulk", "floor-once",
         "floor-index", "nsqd", "nsqd-threads")


class FloorProcess:
    """bench/floor_server.py in a subprocess: the `Server` interface that run_load uses
    (pid, host, port)."""

    def __init__(self, mode: str, base_dir: str | None):
        self.mode, self.base_dir = mode, base_dir

    def __enter__(self) -> "FloorProcess":
        self.tmp = tempfile.mkdtemp(prefix="bench-floor-", dir=self.base_dir)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.host = "127.0.0.1"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "floor_server.py"), "--mode", self.mode,
             "--port", str(self.port), "--dir", self.tmp], stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor server did not start")
        self.pid = self.proc.pid
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def server(kind: str, base_dir: str | None):
    if kind == "nsqd":
        return Server([], base_dir)
    if kind == "nsqd-threads":
        return Server(["--journal", "false"], base_dir)
    return FloorProcess(kind[6:], base_dir)


def per_msg(phase, rate: float) -> dict:
    msgs = rate * phase.wall
    t = phase.threads
    return {"cpu_us": phase.server_cpus / rate * 1e6,
            "loop_us": (t["loop_user"] + t["loop_sys"]) / msgs * 1e6,
            "threads_us": (t["threads_user"] + t["threads_sys"]) / msgs * 1e6}


def one_round(kind: str, topic_counts: list[int], warm_s: float, dur_s: float, args) -> dict:
    """One server of `kind`: each topic count in turn, the same 100 connections spread over
    that many topics; per count its msgs/s and CPU per message."""
    body = b"x" * BODY_LEN
    out = {}
    with server(kind, args.dir) as srv:
        made = 1
        for n in topic_counts:
            cmds = [cmd_pub(f"floor{i:04d}", body) for i in range(n)]
            if isinstance(srv, Server) and n > made:  # nsqd's topics made before the timing
                srv.command(b"".join(cmds[made:]), replies=n - made)
                made = n
            rate, _, phase = timed_produce(srv, cmds[0], 1, CONNS, warm_s, dur_s, args,
                                           cmds=cmds)
            out[n] = {"msgs_per_s": rate, **per_msg(phase, rate)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s a part, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--dir", default=None, help="where the data goes (default: /tmp)")
    parser.add_argument("--topics", default=",".join(map(str, TOPIC_COUNTS)),
                        help="topic counts, 1 among them (default %(default)s)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="servers to run (default %(default)s)")
    args = parser.parse_args()
    topic_counts = sorted({1, *(int(x) for x in args.topics.split(","))})
    kinds = args.kinds.split(",")
    if any(k not in KINDS for k in kinds):
        parser.error(f"--kinds: each one of {', '.join(KINDS)}")
    args.procs, args.py_spy_rate, args.py_spy_native = 1, 0, False  # timed_produce's
    warm_s, dur_s = (0.5, 2.0) if args.quick else (1.0, 5.0)
    rounds = args.rounds or (2 if args.quick else 3)

    report = Report("floor")
    report.figures.update(common.machine_info())
    report.section(f"{CONNS} connections, one {BODY_LEN}-byte PUB at a time each, spread over "
                   f"{', '.join(map(str, topic_counts))} topics; {', '.join(kinds)}, alternated, "
                   f"{rounds} rounds, medians")
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(rounds):
        report.note(f"round {r + 1} of {rounds} ...")
        for kind in kinds:
            got[kind].append(one_round(kind, topic_counts, warm_s, dur_s, args))
    for kind in kinds:
        key = kind.replace("-", "_")
        med = {n: {f: statistics.median(x[n][f] for x in got[kind]) for f in got[kind][0][n]}
               for n in topic_counts}
        for n in topic_counts:
            m = med[n]
            report.add(f"{key}_{n}_topics_msgs_per_s", m["msgs_per_s"],
                       f"{kind}, {n} topic(s): msgs/s", fmt=",.0f")
            report.add(f"{key}_{n}_topics_cpu_us_per_msg", m["cpu_us"],
                       f"{kind}, {n} topic(s): server CPU per message (µs)", fmt=".1f")
            report.note(f"of it: event loop {m['loop_us']:.1f} µs, other threads "
                        f"{m['threads_us']:.1f} µs")
            if n != 1:
                report.add(f"{key}_{n}_to_1_ratio", m["msgs_per_s"] / med[1]["msgs_per_s"],
                           f"{kind}: {n} topics / 1 topic, msgs/s", fmt=".2f")
        report.figures[f"{key}_rounds"] = {str(n): [x[n] for x in got[kind]]
                                          for n in topic_counts}
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
