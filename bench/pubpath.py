"""The PUB path's own CPU per message: nsqd's work with the sockets taken away.

    .venv/bin/python bench/pubpath.py [--rounds 5] [--seconds 2] [--conns 100] [--topics 1]
                                      [--nsqd-root DIR]

A real node (nsqd.main.build, default durable options, the node journal) runs in this
process on uvloop, in a temporary folder, under nsqd's process policy
(`diskqueue.runtime.tune_gc`: its collector thresholds and switch interval). `--conns`
connections are `nsqd.tcp.ClientConnection`s on a transport that keeps no socket: each
gets one `PUB <topic>` (200-byte body) and sends the next when its OK is written, as
bench/loadgen.py's producers do (100 connections, one in flight each; `--topics` spreads
them over that many topics, and with more topics than connections each connection sends
to its topics in turn: connection i to topics i, i + 100, ...). The loop's CPU (its
thread's own time) and the whole process's are read over `--seconds`, for `--rounds`
rounds, with the journal's rounds (one topic writes alone: none); each figure is the
median.

With one PUB in flight a connection the work goes in a cycle, and the bench stamps its
phases (medians, in ms; the journal's functions, and its `fdatasync`, are wrapped in the
child to stamp them):
`answers -> answered`, the loop running a round's answers (the OKs, each connection's next
PUB scheduled); `answered -> handed over`, the loop taking the next PUBs (parse, append,
encode) until their batches reach the write thread; `handed over -> sync begins`, the write
thread writing them into their segments, and the round into the journal's file;
`sync begins -> synced`, the journal's `fdatasync`. A partition writing alone
has only the first two (its batch syncs in its write).

What it leaves out is what bench/floor.py's `ack` floor measures: the kernel's loopback
TCP and uvloop's socket calls. What it keeps is every Python step of a PUB from its bytes to
its OK, and the write threads. With `--nsqd-root DIR` the rounds alternate this checkout's
nsqd with the one in DIR (a worktree of the previous commit), for a before/after ratio.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The child: runs one round against the nsqd importable from its sys.path[0].
CHILD = r"""
import asyncio, json, os, statistics, sys, tempfile, time
import uvloop
from diskqueue.runtime import tune_gc
from nsqd.main import build
from nsqd.options import from_args
from nsqd.tcp import ClientConnection, TurnFlush, identify_limits
from nsqwire import protocol as p
from nsqwire.commands import cmd_pub

conns_n, topics_n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
OK = b"\x00\x00\x00\x06\x00\x00\x00\x00OK"
stamps = {}  # phase -> [seconds], while `timing`
timing = False
last = {}


def stamped(fn, start, end=None, after=None):
    "fn, stamping when it starts and ends; a phase is from the last `after` stamp to `start`."
    def wrapper(*args, **kw):
        if timing:
            now = time.perf_counter()
            if after is not None and after in last:
                stamps.setdefault(f"{after} -> {start}", []).append(now - last.pop(after))
            last[start] = now
        result = fn(*args, **kw)
        if timing and end is not None:
            now = time.perf_counter()
            stamps.setdefault(f"{start} -> {end}", []).append(now - last.get(start, now))
            last[end] = now
        return result
    return wrapper


def stamp_the_round():
    "The phases of a round of the node journal (bench/README.md, pubpath.py)."
    from diskqueue import journal as j
    j._run_all = stamped(j._run_all, "answers", "answered", after="synced")
    put = j.JournalWorker._put
    j.JournalWorker._put = stamped(lambda self, jobs: put(self, jobs), "handed over",
                                   after="answered")
    # the journal's class is compiled: its sync is stamped at the os call (a file of its
    # folder), where both builds make it
    real_sync = os.fdatasync
    sync = stamped(real_sync, "sync begins", "synced", after="handed over")
    os.fdatasync = lambda fd: (sync if os.readlink(f"/proc/self/fd/{fd}").endswith(j.SUFFIX)
                               else real_sync)(fd)


stamp_the_round()


class Transport:
    "A transport with no socket: an OK written makes its connection send its next PUB."

    def __init__(self, cmds):
        self.cmds, self.turn, self.conn, self.oks, self.closing = cmds, 0, None, 0, False

    def next_cmd(self):
        self.turn += 1
        return self.cmds[self.turn % len(self.cmds)]

    def write(self, data):
        n = data.count(OK)
        self.oks += n
        for _ in range(n):
            asyncio.get_running_loop().call_soon(self.conn.data_received, self.next_cmd())

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def get_write_buffer_size(self):
        return 0


async def main():
    with tempfile.TemporaryDirectory(prefix="bench-pubpath-") as d:
        nsqd = build(from_args(["--data-path", d, "--tcp-address", "127.0.0.1:0",
                                "--http-address", "127.0.0.1:0", "--log-level", "warn"]))
        tune_gc()  # nsqd's process policy, before and after the start, as `nsqd` runs
        await nsqd.start()
        limits, flush = identify_limits(nsqd, None), TurnFlush()
        transports = []
        for i in range(topics_n):
            await nsqd.get_topic(f"pub{i}")
        for i in range(conns_n):  # as bench/loadgen.py: topics i, i + conns_n, ... in turn
            topics = [f"pub{t}" for t in range(i % topics_n, topics_n, conns_n)]
            t = Transport([cmd_pub(topic, b"x" * 200) for topic in topics])
            t.conn = ClientConnection(nsqd, limits, None, flush)
            t.conn.connection_made(t)
            t.conn.data_received(p.MAGIC_V2)
            transports.append(t)
        for t in transports:
            t.conn.data_received(t.cmds[0])
        tune_gc()  # freezes what the start and the topics built
        await asyncio.sleep(0.5)  # warm
        global timing
        timing = True
        oks0 = sum(t.oks for t in transports)
        j0 = dict(nsqd.journal.stats)
        loop0, proc0, wall0 = time.thread_time(), time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        loop1, proc1, wall1 = time.thread_time(), time.process_time(), time.monotonic()
        j1 = dict(nsqd.journal.stats)
        timing = False
        msgs = sum(t.oks for t in transports) - oks0
        for t in transports:
            t.closing = True
        await asyncio.sleep(0.2)
        await nsqd.stop()
        print(json.dumps({"msgs_per_s": msgs / (wall1 - wall0),
                          "loop_us": (loop1 - loop0) / msgs * 1e6,
                          "process_us": (proc1 - proc0) / msgs * 1e6,
                          "rounds_per_s": (j1["syncs"] - j0["syncs"]) / (wall1 - wall0),
                          "records_per_round": ((j1["records"] - j0["records"])
                                                / max(1, j1["syncs"] - j0["syncs"])),
                          "sync_ms": ((j1["sync_seconds_total"] - j0["sync_seconds_total"])
                                      / max(1, j1["syncs"] - j0["syncs"]) * 1000),
                          "phases_ms": {k: statistics.median(v) * 1000
                                        for k, v in stamps.items()}}))


uvloop.run(main())
"""


PHASES = ("answers -> answered", "answered -> handed over", "handed over -> sync begins",
          "sync begins -> synced", "synced -> answers")


def one_round(root: str, conns: int, topics: int, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(conns), str(topics), str(seconds)],
                         cwd=root, env=dict(os.environ, PYTHONPATH=root), check=True,
                         capture_output=True, text=True, timeout=seconds + 60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--conns", type=int, default=100)
    ap.add_argument("--topics", type=int, default=1)
    ap.add_argument("--nsqd-root", metavar="DIR", help="alternate with the nsqd in DIR")
    args = ap.parse_args()
    builds = {"this": ROOT}
    if args.nsqd_root:
        builds["other"] = os.path.abspath(args.nsqd_root)
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, root in builds.items():
            runs[name].append(one_round(root, args.conns, args.topics, args.seconds))
    figures = {"bench": "pubpath", "conns": args.conns, "topics": args.topics,
               "rounds": args.rounds, "nsqd_root": builds.get("other")}
    print(f"PUB path, {args.conns} connections over {args.topics} topic(s), no sockets; "
          f"medians of {args.rounds} alternated rounds of {args.seconds:g} s")
    for name in builds:
        for key, label in (("msgs_per_s", "msgs/s"), ("loop_us", "loop CPU per message (µs)"),
                           ("process_us", "process CPU per message (µs)"),
                           ("rounds_per_s", "journal rounds synced a second"),
                           ("records_per_round", "journal records a round"),
                           ("sync_ms", "journal round write + sync (ms)")):
            value = statistics.median(r[key] for r in runs[name])
            figures[f"{name}_{key}"] = round(value, 3)
            print(f"   {name:5} {label:34} {value:12,.2f}  [{name}_{key}]")
        phases = {}
        for r in runs[name]:
            for phase, ms in r["phases_ms"].items():
                phases.setdefault(phase, []).append(ms)
        for phase in PHASES:
            if phase in phases:
                value = statistics.median(phases[phase])
                key = f"{name}_{phase.replace(' -> ', '_to_').replace(' ', '_')}_ms"
                figures[key] = round(value, 4)
                print(f"   {name:5} {'round: ' + phase + ' (ms)':34} {value:12,.3f}  [{key}]")
    if "other" in builds:
        for key in ("loop_us", "process_us"):
            ratio = figures[f"this_{key}"] / figures[f"other_{key}"]
            figures[f"{key}_this_over_other"] = round(ratio, 3)
            print(f"   this / other, {key:27} {ratio:12,.3f}  [{key}_this_over_other]")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
