"""The history of a run: one JSON object a line, written as it happens, replayable by any
checker later (`read`).

    {"type": "invoke"|"ok"|"fail"|"info", "f": "enqueue"|"dequeue"|<nemesis op>,
     "time": seconds since the start, "process": "p3"|"c1"|"nemesis", "value": {...},
     "node": "10.213.0.2:4150"|null}

Every client operation is an `invoke` followed by at most one completion of the same
process and `f`: `ok` (it happened), `fail` (it certainly did not) or `info` (unknown: a
timeout, a lost connection). An invoke without a completion counts as `info`. A
dequeue is recorded as `ok` only (it is observed, never attempted). Enqueue values are
`{"id": unique, "key": str|null, "seq": n, "partition": n|null}`. `node` is the nsqd that
answered when the client tells (pynsq's connection, a consumer's subscription); null for
the partition-aware producer, whose keyed values name their `partition` instead.
"""

from __future__ import annotations

import json
import threading
import time


class History:
    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()  # the classic client records from its own thread
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, type_: str, f: str, process: str, value=None, node: str | None = None
               ) -> dict:
        op = {"type": type_, "f": f, "time": round(self.now(), 6), "process": process,
              "value": value, "node": node}
        line = json.dumps(op, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
        return op

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read(path: str) -> list[dict]:
    """Every operation of a history file, in the order written (a torn last line, from a
    killed harness, is skipped)."""
    ops = []
    with open(path) as f:
        for line in f:
            try:
                ops.append(json.loads(line))
            except ValueError:
                pass
    return ops
