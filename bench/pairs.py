"""Alternated pairs of bench/nsqd.py: this checkout's nsqd against another's, in one run.

    .venv/bin/python bench/pairs.py --against DIR [--pairs 6] [--keys K,...] -- NSQD_ARGS...
    .venv/bin/python bench/pairs.py --against /tmp/base -- --quick --only g --configs durable --topics 16

Runs `bench/nsqd.py NSQD_ARGS --nsqd-root` this checkout, then DIR, `--pairs` times, the
order swapped every pair (on this machine the side that runs second often wins by 5-15%,
so a one-sided order measures the order). For each figure of nsqd.py's JSON line whose key
holds one of `--keys` (default: msgs/s, CPU a message, p99 and the ratios), it prints
each side's runs, their medians, the ratio of the medians, and how many pairs each side's
figure was the higher in. The machine's figures move by up to 1.5x within an hour here:
compare within pairs, never against an earlier run's absolute figures.

Prints readable lines, then ONE line of JSON: `<key>_this` and `<key>_against` (medians),
`<key>_ratio` (this over against), `<key>_this_higher` (pairs of `--pairs`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import emit_json  # noqa: E402

KEYS = "msgs_per_s,cpu_us_per_msg,p99_ms,ratio"


def one_run(root: str, nsqd_args: list[str]) -> dict:
    out = subprocess.run([sys.executable, os.path.join(HERE, "nsqd.py"), *nsqd_args,
                          "--nsqd-root", root], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    return {k: v for k, v in figures.items() if isinstance(v, (int, float))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, metavar="DIR",
                    help="the other checkout (a worktree of the commit before, built)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--keys", default=KEYS, help="figures whose key holds one of these")
    ap.add_argument("nsqd_args", nargs=argparse.REMAINDER,
                    help="after --: bench/nsqd.py's arguments (not --nsqd-root)")
    args = ap.parse_args()
    nsqd_args = [a for a in args.nsqd_args if a != "--"]
    sides = {"this": ROOT, "against": os.path.abspath(args.against)}
    runs: dict[str, list[dict]] = {"this": [], "against": []}
    for i in range(args.pairs):
        order = ("this", "against") if i % 2 == 0 else ("against", "this")
        for side in order:
            runs[side].append(one_run(sides[side], nsqd_args))
        print(f"pair {i + 1} of {args.pairs} done ({order[0]} first)", flush=True)
    wanted = args.keys.split(",")
    keys = [k for k in runs["this"][0]
            if any(w in k for w in wanted) and all(k in r for r in runs["this"] + runs["against"])]
    figures: dict = {"bench": "pairs", "against": sides["against"], "pairs": args.pairs,
                     "nsqd_args": " ".join(nsqd_args)}
    for key in keys:
        mine = [r[key] for r in runs["this"]]
        theirs = [r[key] for r in runs["against"]]
        m, t = statistics.median(mine), statistics.median(theirs)
        higher = sum(a > b for a, b in zip(mine, theirs))
        print(f"{key}\n   this    {' '.join(f'{v:,.2f}' for v in mine)}  median {m:,.2f}"
              f"\n   against {' '.join(f'{v:,.2f}' for v in theirs)}  median {t:,.2f}"
              f"\n   this / against {m / t if t else float('nan'):.3f}; this higher in "
              f"{higher} of {args.pairs} pairs", flush=True)
        figures.update({f"{key}_this": m, f"{key}_against": t,
                        f"{key}_ratio": round(m / t, 3) if t else None,
                        f"{key}_this_higher": higher})
    emit_json(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
