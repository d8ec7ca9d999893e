"""The kill test: SIGKILL a busy writer again and again; no acknowledged message may be lost.

tests/kill_writer.py appends from 200 coroutines and prints a line per acknowledged
append. Each round starts it on the same folder (so the history and its crashes pile
up), kills it at a random moment (mostly while appending, sometimes while it starts and
recovers), then reopens the queue here and checks, against everything ever acknowledged:
- every acknowledged message is at its offset with its id, byte for byte;
- the whole history reads without error, ids contiguous, no partial record;
- the commitlog describes the data exactly and ends where the data ends;
- appending continues with the next id.
When the history passes `retain_bytes`, old segments are dropped by retention, which
the next round checks too.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

import kill_writer as kw
from commitlog.entry import ENTRY_SIZE
from commitlog.log import DEFAULT_SYNC_EVERY
from diskqueue.queue import DiskQueue
from diskqueue.record import HEAD_SIZE

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_writer.py")
VERIFY_RUN = 1 << 20  # `run` of the bodies this test appends itself (writers use 0, 1, ...)


@dataclass
class History:
    """Everything acknowledged so far (and not dropped by retention)."""

    messages: dict = field(default_factory=dict)  # msg_id -> (offset, run, ctr, request ctr)
    requests: dict = field(default_factory=dict)  # log_id -> (first_id, offset, count)
    start_offset: int = 0  # where retention last moved the start of the history
    acknowledged: int = 0  # messages acknowledged, all rounds
    checks: int = 0  # acknowledged messages verified byte for byte, summed over rounds

    def add(self, first_id, offset, count, log_id, run, ctr, sizes):
        assert log_id not in self.requests, f"log id {log_id} acknowledged twice"
        self.requests[log_id] = (first_id, offset, count)
        for i in range(count):
            assert first_id + i not in self.messages, f"id {first_id + i} acknowledged twice"
            self.messages[first_id + i] = (offset, run, ctr + i, ctr)
            offset += sizes[i]
        self.acknowledged += count

    def drop_before(self, start_offset):
        self.start_offset = start_offset
        self.messages = {k: v for k, v in self.messages.items() if v[0] >= start_offset}
        self.requests = {k: v for k, v in self.requests.items() if v[1] >= start_offset}


def sizes_of(run, ctr, count):
    head = HEAD_SIZE + len(kw.ext(run, ctr))
    return [head + len(kw.body(run, ctr + i)) for i in range(count)]


def read_acks(out_path):
    """The acknowledged requests in the writer's output (a last partial line is ignored)."""
    with open(out_path, "rb") as f:
        lines = f.read().split(b"\n")[:-1]
    return [tuple(map(int, line.split())) for line in lines if line != b"ready"]


def run_writer(path, run, rng, out_path):
    """Start a writer, kill it at a random moment; return its acknowledged requests."""
    with open(out_path, "wb") as out, open(out_path + ".err", "wb") as err:
        proc = subprocess.Popen([sys.executable, WRITER, path, str(run)], stdout=out, stderr=err)
    try:
        if rng.random() < 0.2:  # anywhere: while it imports, opens, recovers or appends
            time.sleep(rng.uniform(0, 0.3))
        else:
            deadline = time.monotonic() + 20
            while os.path.getsize(out_path) == 0:
                assert proc.poll() is None, open(out_path + ".err").read()
                assert time.monotonic() < deadline, "the writer never got ready"
                time.sleep(0.002)
            time.sleep(rng.uniform(0.05, 0.4))
        assert proc.poll() is None, open(out_path + ".err").read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return read_acks(out_path)


async def verify(path, hist, run, retain_bytes):
    q = await DiskQueue.open(path, kw.options())
    try:
        assert q.corrupt == []
        assert q.committed_end == q.written_end
        start, start_count = q.start_offset, q.start_count
        assert start == hist.start_offset
        problems = []
        # the whole history, from the start, in order, with no error and no gap
        r = q.reader()
        offsets = []  # offset of message start_count + i
        pos, seq, checked = start, start_count, 0
        while True:
            records = await r.read(4096)
            if not records:
                break
            for rec in records:
                assert (rec.offset, rec.msg_id) == (pos, seq), "history not contiguous"
                want = hist.messages.get(seq)
                if want is not None:
                    offset, wrun, ctr, req_ctr = want
                    if (rec.offset != offset or rec.body != kw.body(wrun, ctr)
                            or rec.trace_id != kw.trace_id(wrun, req_ctr)
                            or rec.ext != kw.ext(wrun, req_ctr)):
                        problems.append(f"id {seq}: offset {rec.offset}, want {offset} / "
                                        "body, trace id or ext differ")
                    checked += 1
                offsets.append(pos)
                pos, seq = rec.end, seq + 1
        r.close()
        assert pos == q.committed_end and seq == q.written_count
        offsets.append(pos)
        lost = sorted(i for i in hist.messages if i >= seq)
        if lost:
            problems.append(f"{len(lost)} acknowledged ids from {lost[0]} on are gone "
                            f"(the history ends at {seq})")
        assert not problems, f"acknowledged messages lost or damaged: {problems[:20]}"
        assert checked == len(hist.messages)
        hist.checks += checked

        # the commitlog describes exactly the data
        prev = None
        for e in q.commitlog.entries():
            if prev is not None:
                assert (e.log_id, e.offset, e.count_before) == (
                    prev.log_id + 1, prev.end_offset, prev.count_after), (prev, e)
            i = e.count_before - start_count
            if i >= 0:  # older entries may describe data that retention dropped
                assert e.first_msg_id == e.count_before
                assert (e.offset, e.end_offset) == (offsets[i], offsets[i + e.msg_count]), e
            prev = e
        if prev is None:  # killed before its first write
            assert (q.written_end, q.written_count) == (start, start_count)
        else:
            assert (prev.end_offset, prev.count_after) == (q.written_end, q.written_count)
        next_log_id = q.commitlog.next_log_id
        assert next_log_id == (prev.log_id + 1 if prev else q.commitlog.first_log_id)
        for log_id, (first_id, offset, count) in hist.requests.items():
            if log_id >= q.commitlog.first_log_id:
                e = q.commitlog.get(log_id)
                assert (e.first_msg_id, e.offset, e.msg_count) == (first_id, offset, count)

        # appending continues where the history ends
        vrun = VERIFY_RUN + run
        a = await q.append([kw.body(vrun, 0)], trace_id=kw.trace_id(vrun, 0), ext=kw.ext(vrun, 0))
        assert (a.first_id, a.offset, a.log_id) == (seq, pos, next_log_id)
        hist.add(a.first_id, a.offset, 1, a.log_id, vrun, 0, sizes_of(vrun, 0, 1))
        if q.written_end - start > retain_bytes:
            new_start = await q.retain(max_bytes=retain_bytes // 2)
            assert new_start > start
            hist.drop_before(new_start)
    finally:
        await q.close()


async def kill_rounds(tmp_path, kills, capsys, retain_bytes=24 << 20, progress_every=0):
    path = str(tmp_path / "q")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    hist = History()
    t0 = time.monotonic()
    for run in range(kills):
        out_path = str(tmp_path / "out")
        for first_id, offset, count, log_id, wrun, ctr in run_writer(path, run, rng, out_path):
            assert wrun == run
            hist.add(first_id, offset, count, log_id, run, ctr, sizes_of(run, ctr, count))
        try:
            await verify(path, hist, run, retain_bytes)
        except AssertionError as e:
            raise AssertionError(f"kill {run + 1} (seed {seed}): {e}") from e
        if progress_every and (run + 1) % progress_every == 0:
            with capsys.disabled():
                print(f"\n{run + 1} kills, {hist.acknowledged} acknowledged, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
    with capsys.disabled():
        print(f"\nkill test: {kills} kills, {hist.acknowledged} acknowledged messages, "
              f"{hist.checks} byte-for-byte checks of acknowledged messages, losses=0 "
              f"({time.monotonic() - t0:.0f} s, seed {seed})")
    return hist


async def test_kill_writer_repeatedly(tmp_path, capsys):
    hist = await kill_rounds(tmp_path, 30, capsys)  # thousands with --long
    assert hist.acknowledged > 6_000  # the kills really landed on a busy writer


@pytest.mark.long
async def test_kill_writer_repeatedly_long(tmp_path, capsys):
    # a smaller history keeps each round short: 2000 rounds take about an hour
    await kill_rounds(tmp_path, 2000, capsys, retain_bytes=8 << 20, progress_every=100)


@pytest.mark.parametrize("damage", ["truncated", "page_lost"])
async def test_commitlog_tail_lost_after_a_kill(tmp_path, damage):
    """A power loss can take the commitlog's unsynced tail (it is synced lazily: every
    `clog_sync_every` entries, at a data rotation, at close) while the data, synced
    before each OK, stays. Simulated after a kill: the last commitlog file is cut in the
    middle of an entry, or one of its pages is zeroed while the pages after it survive
    (out-of-order writeback). Recovery must find every acknowledged message with its id,
    offset and bytes, and every commitlog search must find it; the requests before the
    damage keep their entries (log ids), those after it get one entry per record."""
    path = str(tmp_path / "q")
    hist = History()
    rng = random.Random(11)
    while len(hist.requests) < 300:
        for first_id, offset, count, log_id, wrun, ctr in run_writer(path, 0, rng,
                                                                     str(tmp_path / "out")):
            hist.add(first_id, offset, count, log_id, wrun, ctr, sizes_of(wrun, ctr, count))
        if len(hist.requests) < 300:  # killed too early: start over
            hist = History()
            shutil.rmtree(path)
    clog_dir = os.path.join(path, "commitlog")
    last = os.path.join(clog_dir, max(os.listdir(clog_dir)))
    base = int(os.path.basename(last)[:-5])
    entries = os.path.getsize(last) // ENTRY_SIZE
    acked_entries = max(hist.requests) + 1 - base
    # only the last `sync_every` entries can be unsynced: the damage falls among them (a
    # long run's older entries were synced, and open rightly checks only the window)
    window = max(0, entries - DEFAULT_SYNC_EVERY)
    if damage == "truncated":
        cut = base + max(acked_entries // 2, window)
        os.truncate(last, (cut - base) * ENTRY_SIZE + 17)
    else:
        first_page = -(-window * ENTRY_SIZE // 4096) * 4096  # the first whole page in it
        page = max((acked_entries // 2) * ENTRY_SIZE // 4096 * 4096, first_page)
        cut = base + page // ENTRY_SIZE
        with open(last, "r+b") as f:
            f.seek(page)
            f.write(bytes(4096))
        assert entries > cut - base + 4096 // ENTRY_SIZE, "no page survives after the lost one"
    regrouped = {k: v for k, v in hist.requests.items() if k >= cut}
    hist.requests = {k: v for k, v in hist.requests.items() if k < cut}
    assert regrouped, "the damage took no acknowledged request's entry"
    await verify(path, hist, 1, retain_bytes=1 << 40)

    q = await DiskQueue.open(path, kw.options())
    try:
        assert len(q.commitlog) > len(hist.requests)
        by_count = {}
        r = q.reader()
        while records := await r.read(4096):
            for rec in records:
                by_count[rec.msg_id] = rec
        r.close()
        for msg_id in range(min(regrouped.values())[0] - 50, q.written_count):
            rec = by_count[msg_id]
            for method, value in (("msg_id", msg_id), ("count", msg_id), ("offset", rec.offset)):
                e = await q.find(method, value)
                assert e.offset <= rec.offset < e.end_offset, (method, value, e)
                assert e.first_msg_id <= msg_id < e.first_msg_id + e.msg_count
            e = await q.find("timestamp", rec.timestamp)
            assert e.timestamp == rec.timestamp and e.offset <= rec.offset
        for log_id, (first_id, offset, count) in regrouped.items():
            e = await q.find("msg_id", first_id)
            assert (e.first_msg_id, e.offset, e.msg_count) == (first_id, offset, 1)
    finally:
        await q.close()
