"""python -m jepsen --nemesis partition,kill,pause --time-limit 120 --nodes 5
[--replicas R] [--store DIR] [--long]: one run; exit 0 when every checker passes, 1 when
one fails, 2 when the run itself could not be done."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jepsen.cluster import cleanup_leftovers
from jepsen.nemesis import KINDS
from jepsen.runner import RunOptions, run

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jepsen", description=__doc__)
    ap.add_argument("--nemesis", default="partition,kill,pause",
                    help=f"comma-separated, of {','.join(KINDS)}, or none")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds of faults (120; 3600 with --long)")
    ap.add_argument("--long", action="store_true",
                    help="an hour (--time-limit 3600) unless --time-limit is given too")
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--lookupds", type=int, default=3, help="hosts with an nsqlookupd")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--interval", type=float, default=10.0,
                    help="seconds of quiet, then of fault, in turn")
    ap.add_argument("--store", help="report folder (default jepsen/store/<time>)")
    ap.add_argument("--loopback", action="store_true",
                    help="processes on 127.0.0.1 (no root needed; partitions by user-space "
                         "relays; no disk-full, no power-cut)")
    ap.add_argument("--nsqd-flag", action="append", default=[],
                    help="an extra nsqd flag (repeatable), e.g. --nsqd-flag=--sync-every=1")
    ap.add_argument("--pause", type=float, default=0.05,
                    help="each producer's pause between operations (s)")
    ap.add_argument("--unkeyed", type=int, default=2,
                    help="unkeyed producer processes (beside one keyed per partition)")
    ap.add_argument("--disk-mb", type=int, default=64,
                    help="size of each nsqd's tmpfs (what disk-full fills)")
    ap.add_argument("--sync-every", type=int, default=1,
                    help="the topic's syncdisk: messages per fsync (1: every batch before its "
                         "OK; more acknowledges unsynced data, which only power-cut shows)")
    ap.add_argument("--no-classic", action="store_true", help="without the pynsq producer")
    ap.add_argument("--ordered", action="store_true",
                    help="an ordered topic, ordered consumers (and no pynsq producer: a PUB "
                         "without a partition is E_BAD_PARTITION there)")
    ap.add_argument("--poison", type=int, default=0, metavar="N",
                    help="every Nth message of an nsqclient producer always fails its "
                         "consumer: the channel buries it (dead letters), checked at the end")
    ap.add_argument("--max-attempts", type=int, default=3,
                    help="the channel's max_attempts with --poison")
    ap.add_argument("--halves", type=int, default=0, metavar="N",
                    help="every Nth message of an nsqclient producer is a half message, "
                         "committed or rolled back by its producer or by the check-back "
                         "(nsqd --half-check-timeout 2s): one rolled back must never be "
                         "delivered")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drain-timeout", type=float, default=90.0)
    ap.add_argument("--drain-quiet", type=float, default=10.0,
                    help="the drain gives up after this long with nothing new dequeued")
    ap.add_argument("--keep-data", action="store_true", help="keep the hosts' data")
    ap.add_argument("--cleanup", action="store_true",
                    help="only remove what an earlier run left behind, then exit")
    args = ap.parse_args(argv)
    if args.cleanup:
        print("\n".join(cleanup_leftovers()) or "nothing left behind")
        return 0
    nemesis = [] if args.nemesis == "none" else [k for k in args.nemesis.split(",") if k]
    store = args.store or os.path.join(HERE, "store", time.strftime("%Y%m%dT%H%M%S"))
    opts = RunOptions(nemesis=nemesis, time_limit=args.time_limit if args.time_limit is not None else (
                          3600.0 if args.long else 120.0),
                      nodes=args.nodes, lookupds=args.lookupds, replicas=args.replicas,
                      partitions=args.partitions, interval=args.interval, store=store,
                      loopback=args.loopback, nsqd_flags=args.nsqd_flag, seed=args.seed,
                      drain_timeout=args.drain_timeout,
                      drain_quiet=args.drain_quiet, keep_data=args.keep_data,
                      classic=not args.no_classic, pause_s=args.pause,
                      unkeyed=args.unkeyed, disk_mb=args.disk_mb, ordered=args.ordered,
                      sync_every=args.sync_every, poison=args.poison,
                      max_attempts=args.max_attempts, halves=args.halves)
    try:
        summary = run(opts)
    except ValueError as e:
        ap.error(str(e))
    except (RuntimeError, KeyboardInterrupt) as e:
        print(f"jepsen: run aborted: {e!r}; what was recorded is in {store}", file=sys.stderr)
        return 2
    tq, av, fo = summary["total_queue"], summary["availability"], summary["failover"]
    rp = summary["replicas"]
    print(json.dumps({"valid": summary["valid"], "lost": tq["lost"],
                      "unexpected": tq["unexpected"], "acknowledged": tq["acknowledged"],
                      "attempted": tq["attempted"], "duplicated": tq["duplicated"],
                      "stored_twice": tq["stored_twice"],
                      "named_stored_twice": tq["named_stored_twice"],
                      "poison_acknowledged": tq["poison_acknowledged"], "dead": tq["dead"],
                      "dead_twice": tq["dead_twice"], "dead_not_poison": tq["dead_not_poison"],
                      "halves": tq["halves"], "halves_acknowledged": tq["halves_acknowledged"],
                      "rolled_back_delivered": tq["rolled_back_delivered"],
                      "check_backs": tq["check_backs"],
                      "duplicate_rate": tq["duplicate_rate"],
                      "order": summary["order"]["valid"],
                      "divergent": rp.get("divergent"), "missing": rp.get("missing"),
                      "replicas": rp["valid"], "liveness": summary["liveness"]["valid"],
                      "success_rate": av["success_rate"], "latency_ms": av["latency_ms"],
                      "failover_median_s": fo["median_s"], "failover_max_s": fo["max_s"],
                      "report": summary["index"]}))
    return 0 if summary["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
