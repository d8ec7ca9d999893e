"""python -m tests.sim --seed N [--trace] [--steps S] [--min-isr M] [--mutation NAME]
python -m tests.sim --seeds 1000 [--mutation NAME]: run many, print the failing ones."""

import argparse
import sys
import time

from .mutations import COMBINED, MUTATIONS, mutated
from .world import World
from .invariants import Violation

STEPS = 3000  # as tests/test_sim.py runs each seed


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tests.sim")
    p.add_argument("--seed", type=int)
    p.add_argument("--seeds", type=int, default=0)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--min-isr", type=int, default=0, help="1 or 2 (default: by seed)")
    p.add_argument("--mutation", choices=sorted(MUTATIONS) + sorted(COMBINED))
    p.add_argument("--trace", action="store_true")
    a = p.parse_args(argv)
    with mutated(a.mutation):
        if a.seed is not None:
            w = World(a.seed, min_isr=a.min_isr or min_isr_for(a.seed), trace=a.trace)
            try:
                w.run(a.steps)
            except Violation as v:
                print("\n".join(w.log_lines))
                print(f"seed {a.seed} step {v.step}: {v}")
                return 1
            print("\n".join(w.log_lines))
            print(f"seed {a.seed}: ok ({w.pubs} publishes, {len(w.checker.acks)} acked, "
                  f"{w.leaderships} leaderships)")
            return 0
        t = time.monotonic()
        bad = []
        totals = {}
        for s in range(a.first, a.first + a.seeds):
            w = World(s, min_isr=a.min_isr or min_isr_for(s))
            try:
                w.run(a.steps)
            except Violation as v:
                bad.append(s)
                print(f"seed {s} step {v.step}: {v}")
            for k, n in dict(w.stats, pubs=w.pubs, acked=len(w.checker.acks)).items():
                totals[k] = totals.get(k, 0) + n
        dt = time.monotonic() - t
        print("per seed:", ", ".join(f"{k} {n / a.seeds:.1f}" for k, n in totals.items()))
        print(f"{a.seeds} seeds, {len(bad)} failed, {a.seeds / dt:.0f} seeds/s")
        return 1 if bad else 0


def min_isr_for(seed):
    return 1 + seed % 2


if __name__ == "__main__":
    sys.exit(main())
