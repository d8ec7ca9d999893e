"""What listing a channel's held messages costs each channel-state push (issue 10).

In-process, like checkpoint.py: a real DelayStore (LMDB, in a temporary folder) holding H
log messages (200-byte bodies, one due class), and one channel checkpoint. Per H, what
one push of the channel's state to the followers costs:
  before   replica_state capped at the store's min_origin, no list (the state followers
           got before the list existed: everything after the oldest held message counts
           unfinished)
  after    DelayStore.first_held(MAX_HELD + 1) read (as ChannelDelay.held does when the
           store changed since the last push; unchanged, it is not read again), the list
           encoded into the state (at most MAX_HELD), then the wire form
Figures: `*_bytes_h<H>`, the JSON of the channel's wire state (what the CHANNELS header
carries for it); `*_cpu_us_h<H>`, process CPU per push (median of ROUNDS), of which
`read_cpu_us_h<H>` is the LMDB read (a worker thread in nsqd; the encode runs on the event
loop). A push happens at most once per checkpoint interval (1 s) per changed channel.

The redeliveries after a failover are counted by tests/test_delay_failover.py (it prints
them): run it in this tree and in a worktree of the commit before the list.

    .venv/bin/python bench/delayrepl.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.common import Report, machine_info  # noqa: E402
from delayqueue.entry import DelayedMessage  # noqa: E402
from delayqueue.store import DelayStore  # noqa: E402
from nsqd.cursor import Ranges  # noqa: E402
from nsqd.replica import MAX_HELD, Held, checkpoint_of, replica_state  # noqa: E402
from nsqd.replication import state_to_wire  # noqa: E402

SIZE = 200  # body bytes
RECORD = 250  # bytes between held origins in the log (a record each)
ROUNDS = 21


def checkpoint(end: int) -> dict:
    """A channel that finished everything up to `end` but 10 messages (10 ranges)."""
    ranges = Ranges()
    for i in range(10):
        ranges.add(end - 10_000 + 1000 * i + RECORD, end - 10_000 + 1000 * (i + 1),
                   i * 4 + 1, i * 4 + 4)
    return {"confirmed": end - 10_000, "confirmed_count": 0, "next_read": end,
            "finished": ranges.encode(4096), "attempts": b"", "paused": False,
            "ordered": False, "delay_store": True}


def wire_bytes(state: dict) -> int:
    return len(json.dumps({"c": state_to_wire(state)}, separators=(",", ":")))


def measure(report: Report, store: DelayStore, held: int, end: int) -> None:
    state = checkpoint(end)
    before, after, reads = [], [], []
    for _ in range(ROUNDS):
        t0 = time.process_time()
        old = replica_state(state, None, store.min_origin())
        wire_bytes(old)
        t1 = time.process_time()
        rows = store.first_held(MAX_HELD + 1)
        t2 = time.process_time()
        new = replica_state(state, [Held(*r) for r in rows], None)
        wire_bytes(new)
        t3 = time.process_time()
        before.append(t1 - t0)
        reads.append(t2 - t1)
        after.append(t3 - t1)
    report.add(f"before_bytes_h{held}", wire_bytes(old), f"{held:>6} held: bytes before", ",d")
    report.add(f"after_bytes_h{held}", wire_bytes(new), f"{held:>6} held: bytes after", ",d")
    report.add(f"before_cpu_us_h{held}", statistics.median(before) * 1e6,
               f"{held:>6} held: CPU us a push before")
    report.add(f"after_cpu_us_h{held}", statistics.median(after) * 1e6,
               f"{held:>6} held: CPU us a push after")
    report.add(f"read_cpu_us_h{held}", statistics.median(reads) * 1e6,
               f"{held:>6} held: of it, the LMDB read")
    listed = len(rows[:MAX_HELD])
    opened = checkpoint_of(new)["confirmed"]
    report.note(f"listed {listed}; a new leader opens at {opened:,} (before: "
                f"{old['confirmed']:,}) of {state['confirmed']:,} confirmed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="0, 100, 1,000 held only")
    args = parser.parse_args()
    sizes = [0, 100, 1000] if args.quick else [0, 10, 100, 1000, 10_000]
    report = Report("delayrepl")
    report.figures.update(machine_info())
    report.figures.update(max_held=MAX_HELD, body_bytes=SIZE)
    folder = tempfile.mkdtemp(prefix="bench-delayrepl-")
    try:
        store = DelayStore.open(os.path.join(folder, "c.channel"))
        now = int(time.time() * 1000)
        have = 0
        report.section(f"one channel-state push, H messages held (list of at most {MAX_HELD})")
        for held in sizes:
            store.put([DelayedMessage(now + 3_600_000, i, 0, 0, 3, b"", b"x" * SIZE,
                                      i * RECORD) for i in range(have, held)])
            have = held
            measure(report, store, held, held * RECORD + 20_000)
        store.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.emit_json()


if __name__ == "__main__":
    main()
