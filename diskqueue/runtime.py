"""The process policy a host of the storage engine runs under (nsqd, and the storage
benchmarks that measure the engine as nsqd runs it): garbage-collector thresholds and the
interpreter's thread-switch interval."""

from __future__ import annotations

import gc
import sys

SWITCH_INTERVAL_S = 0.0002


def tune_gc() -> None:
    """The process's garbage-collector and thread-switch policy: call it before start-up
    builds what lives long, and again once it has (each call freezes what was built).

    The hot paths make many short-lived objects and few cycles: collect the young
    generation less often, and keep what start-up built out of every collection
    (full collections were 14-33 ms pauses that set the publish p99). Start-up itself
    builds much and frees little: at Python's default thresholds, a start of 10,000
    partitions spent 2.2 s in 2,000 collections, 0.25 s at these (bench/scale.py). The
    storage benchmarks run the engine under this same policy.

    File work runs in each partition's worker threads, which take the interpreter lock
    back after every system call. While the event loop is busy, Python's default switch
    interval (5 ms) made each such hand-over wait up to 5 ms: beside a client flooding
    commands, a PUB took 100-400 ms to be answered and delivered; at 0.2 ms it takes 3-4
    ms (tests/test_tcp_flood.py)."""
    gc.set_threshold(50_000, 50, 100)
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
