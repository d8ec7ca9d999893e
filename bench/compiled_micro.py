"""Each compiled module's own per-message work, pure against compiled, in one process.

    .venv/bin/python bench/compiled_micro.py [--n 200000] [--repeat 7]

The compiled modules are the ones scripts/compile.py built (build/mypyc); the pure ones are
the same .py files loaded again under another name (`<module>__pure`, same package, so their
relative imports resolve). Each case is the call the PUB path makes per message (or per
request), timed best of --repeat runs of --n calls; prints µs per call and the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pure(name: str):
    "The .py of module `name`, loaded as `name + '__pure'` beside the compiled one."
    path = os.path.join(ROOT, *name.split(".")) + ".py"
    spec = importlib.util.spec_from_file_location(name + "__pure", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def best(fn, n: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - t0)
    return min(times) / n * 1e6


def case_entry(m):
    enc = m.encode_fields

    def run(n):
        for i in range(n):
            enc(i, 3, 1000 + i, 4096 * i, i, 1_700_000_000_000_000_000, 236, 1, 1)
    return run


def case_record(m):
    enc = m.encode_records
    body = (b"x" * 200,)

    def run(n):
        pieces: list = []
        add = pieces.append
        for i in range(n):
            offsets: list = []
            enc(add, offsets, 4096 * i, i, 0, 1_700_000_000_000_000_000, 0, b"", body)
            if len(pieces) > 1000:
                pieces.clear()
    return run


def case_parser(m):
    cmd = b"PUB bench\n" + (200).to_bytes(4, "big") + b"x" * 200
    parser = m.CommandParser(state_check=lambda name: None)
    parser.feed(m.MAGIC_V2)
    parser.next_command()

    def run(n):
        feed, nxt = parser.feed, parser.next_command
        for _ in range(n):
            feed(cmd)
            nxt()
            nxt()  # None: the buffer is empty, as _work sees it
    return run


def case_mpub(m):
    body = b"x" * 200
    cmd = (b"MPUB bench\n" + (4 + 200 * 204).to_bytes(4, "big") + (200).to_bytes(4, "big")
           + ((200).to_bytes(4, "big") + body) * 200)
    parser = m.CommandParser(state_check=lambda name: None)
    parser.feed(m.MAGIC_V2)
    parser.next_command()

    def run(n):  # n messages: n / 200 MPUBs
        feed, nxt = parser.feed, parser.next_command
        for _ in range(n // 200):
            feed(cmd)
            nxt()
            nxt()
    return run


def case_records200(m):
    enc = m.encode_records
    bodies = [b"x" * 200] * 200

    def run(n):  # n records, 200 a call
        for i in range(n // 200):
            pieces: list = []
            enc(pieces.append, [], 4096 * i, i, 0, 1_700_000_000_000_000_000, 0, b"", bodies)
    return run


CASES = {"commitlog.entry": ("encode_fields (one entry a request)", case_entry),
         "diskqueue.record": ("encode_records (one 200-byte body)", case_record),
         "nsqwire.protocol": ("CommandParser.feed + next_command x2 (one PUB)", case_parser),
         "nsqwire.protocol:mpub": ("MPUB of 200 x 200 B parsed, per message", case_mpub),
         "diskqueue.record:200": ("encode_records of 200 bodies, per record", case_records200)}
EXTRA: dict = {}  # more cases, added as modules are compiled


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    out = {}
    for key, (label, case) in {**CASES, **EXTRA}.items():
        if args.only and key not in args.only.split(","):
            continue
        name = key
        name, _, _variant = name.partition(":")
        compiled = importlib.import_module(name)
        if not compiled.__file__.endswith(".so"):
            print(f"{name}: not compiled ({compiled.__file__}); run scripts/compile.py")
            continue
        p = pure(name)
        # alternate pure and compiled, best of each
        t_pure, t_comp = [], []
        for _ in range(3):
            t_pure.append(best(case(p), args.n, args.repeat))
            t_comp.append(best(case(compiled), args.n, args.repeat))
        tp, tc = min(t_pure), min(t_comp)
        out[key] = {"pure_us": round(tp, 4), "compiled_us": round(tc, 4),
                     "ratio": round(tc / tp, 3)}
        print(f"{key:22} {label:48} pure {tp:7.3f} µs  compiled {tc:7.3f} µs  "
              f"compiled/pure {tc / tp:5.2f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
