"""What a node journal checkpoint costs the publishes around it.

    .venv/bin/python bench/journal_checkpoint.py [--topics 1000] [--seconds 15] [--rounds 2]
                                                 [--nsqd-root DIR]

A fresh nsqd (durable defaults, the node journal) gets 100 connections of single 200-byte
PUBs spread over `--topics` topics (bench/nsqd.py's (g) load) for `--seconds`: long
enough for the journal file to pass CHECKPOINT_BYTES (64 MiB) at least once, so that its
checkpoint (every segment journaled since the file began synced: diskqueue/journal.py)
falls inside the measured span. Figures: msgs/s, the PUB latency's p99, p99.9 and longest,
and the checkpoints the journal finished (`/stats` journal.checkpoints). With
`--nsqd-root DIR` the rounds alternate this checkout's nsqd with the one in DIR (a worktree
of another commit, built with scripts/compile.py there); each figure is the median of the
rounds.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import nsqd_server  # noqa: E402
from bench.common import Report, machine_info, percentile  # noqa: E402
from bench.nsqd import BODY_LEN, timed_produce  # noqa: E402
from nsqwire.commands import cmd_pub  # noqa: E402

CONNS = 100
WARM_S = 0.5


def journal_stats(srv: nsqd_server.Server) -> dict:
    url = f"http://127.0.0.1:{srv.proc.http_port}/stats?format=json"
    with urllib.request.urlopen(url, timeout=30) as resp:
        doc = json.load(resp)
    return doc.get("data", doc)["journal"]


def one_round(root: str, args) -> dict:
    """One fresh nsqd of the checkout at `root`, loaded as the module docstring says."""
    nsqd_server.ROOT = root  # Server starts the nsqd of this checkout
    body = b"x" * BODY_LEN
    with nsqd_server.Server([], None) as srv:
        topics = [f"ckpt{i:04d}" for i in range(args.topics)]
        for t in topics:
            srv.command(cmd_pub(t, body))
        before = journal_stats(srv)
        rate, lat, _phase = timed_produce(srv, cmd_pub(topics[0], body), 1, CONNS, WARM_S,
                                          args.seconds, args,
                                          cmds=[cmd_pub(t, body) for t in topics])
        after = journal_stats(srv)
    return {"msgs_per_s": rate, "p99_ms": percentile(lat, 99) * 1000,
            "p999_ms": percentile(lat, 99.9) * 1000, "max_ms": lat[-1] * 1000,
            "checkpoints": after["checkpoints"] - before["checkpoints"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--nsqd-root", metavar="DIR", help="alternate with the nsqd in DIR")
    args = ap.parse_args()
    args.py_spy_rate, args.py_spy_native = 0, False  # timed_produce's profiling: off
    builds = {"this": ROOT}
    if args.nsqd_root:
        builds["other"] = os.path.abspath(args.nsqd_root)
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, root in builds.items():
            runs[name].append(one_round(root, args))
    report = Report("journal_checkpoint")
    report.figures.update(machine_info(), topics=args.topics, seconds=args.seconds,
                          rounds=args.rounds, nsqd_root=builds.get("other"))
    report.section(f"{CONNS} connections of single PUBs over {args.topics} topics, "
                   f"{args.seconds:g} s; medians of {args.rounds} alternated rounds")
    for name in builds:
        for key, label, fmt in (("msgs_per_s", "msgs/s", ",.0f"), ("p99_ms", "p99 (ms)", ",.2f"),
                                ("p999_ms", "p99.9 (ms)", ",.2f"),
                                ("max_ms", "longest PUB (ms)", ",.1f"),
                                ("checkpoints", "checkpoints finished", ",.1f")):
            value = statistics.median(r[key] for r in runs[name])
            report.add(f"{name}_{key}", value, f"{name:5} {label}", fmt=fmt)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
