"""The replica side of DiskQueue (diskqueue/README.md, "Replication API"): parked batches,
commits, raw appends and reads, epochs, truncation, the persisted committed end; and the
raw-batch checks of diskqueue/raw.py on their own. Real files in tmp_path; kill -9 of a
subprocess (tests/repl_writer.py) where a crash matters."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from powerfs import PowerFS
from test_diskqueue import body, read_all, segment_files, small_disk  # noqa: F401 (a fixture)

from commitlog.entry import ENTRY_SIZE, decode, encode
from diskqueue.queue import (
    DiskFullError,
    DiskQueue,
    GapError,
    OffsetOutOfRange,
    QueueOptions,
)
from diskqueue.raw import BadBatch, check_batch, renumber
from diskqueue.committed import COMMITTED_FILE, decode_position, encode_position
from nsqwire.ids import PARTITION_SHIFT

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repl_writer.py")


@pytest.fixture
async def queues():
    """Open queues (closed at the end of the test)."""
    opened = []

    async def open_queue(path, options=None):
        q = await DiskQueue.open(str(path), options or QueueOptions(replicated=True))
        opened.append(q)
        return q

    yield open_queue
    for q in opened:
        await q.close()


def entries_of(raw: bytes):
    return [decode(raw, i) for i in range(0, len(raw), ENTRY_SIZE)]


async def fill(q, batches, first=0, per=3):
    """Append `batches` requests of 1..per bodies each, one at a time; return their Appendeds."""
    out = []
    for i in range(batches):
        out.append(await q.append([body(first + i * per + k) for k in range(1 + i % per)]))
    return out


async def write_uncommitted(q, batches, first=0, per=3):
    """Append `batches` requests one batch each, without a commit; return their entries."""
    await fill(q, batches, first, per)
    return list(q.commitlog.entries())[-batches:]


# ---- committing ------------------------------------------------------------------

async def test_a_replicated_queue_commits_only_when_told(tmp_path, queues):
    """An append is answered once written; readers see it once `commit_to` says the ISR holds
    it (`auto_commit` is ignored), never past the written end."""
    q = await queues(tmp_path / "q", QueueOptions(replicated=True, auto_commit=True))
    a = await q.append([b"a", b"b"])
    await q.append([b"c"])
    await asyncio.sleep(0.02)  # auto-commit would have committed by now
    assert q.written_count == 3 and q.committed_count == 0 and await read_all(q) == []
    q.commit_to(a.end_offset, 2)
    assert [r.body for r in await read_all(q)] == [b"a", b"b"]
    q.commit_to(10**9, 10**6)  # more than written: the written end
    assert (q.committed_end, q.committed_count) == (q.written_end, 3)
    q.commit_to(a.end_offset, 2)  # never back
    assert q.committed_count == 3


# ---- the persisted committed end ----------------------------------------------

async def test_a_replicated_queue_reopens_at_its_persisted_committed_end(tmp_path, queues):
    path = tmp_path / "q"
    q = await queues(path)
    await fill(q, 4)
    q.commit_to(q.written_end, q.written_count)
    committed = (q.written_end, q.written_count)
    for i in range(3):
        q.append([body(100 + i)])
    while q.written_count < committed[1] + 3:
        await asyncio.sleep(0.001)
    written = (q.written_end, q.written_count)
    await q.close()
    q = await queues(path)
    assert (q.committed_end, q.committed_count) == committed
    assert (q.written_end, q.written_count) == written
    assert len(await read_all(q)) == committed[1]
    await q.close()

    stored = path / COMMITTED_FILE
    good = stored.read_bytes()
    stored.write_bytes(encode_position(written[0] + 1000, written[1] + 9))  # ahead of the data
    q = await queues(path)
    assert (q.committed_end, q.committed_count) == written
    await q.close()
    for bad in (b"", good[:-1], bytes([good[0] ^ 1]) + good[1:]):  # missing, torn, flipped
        stored.write_bytes(bad)
        q = await queues(path)
        assert (q.committed_end, q.committed_count) == (0, 0)
        await q.close()
    stored.unlink()
    q = await queues(path)
    assert (q.committed_end, q.committed_count) == (0, 0)
    q.commit_to(*committed)
    await q.close()
    assert decode_position(stored.read_bytes()) == committed  # stored at close


async def test_the_committed_end_is_stored_with_each_batch(tmp_path, queues):
    path = tmp_path / "q"
    q = await queues(path)
    for i in range(3):
        q.append([body(i)])
    while q.written_count < 3:
        await asyncio.sleep(0.001)
    q.commit_to(q.written_end, q.written_count)
    mark = (q.committed_end, q.committed_count)
    q.append([b"next batch"])
    while q.written_count < mark[1] + 1:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert decode_position((path / COMMITTED_FILE).read_bytes()) == mark


async def test_a_queue_that_is_not_replicated_writes_no_committed_file(tmp_path, queues):
    q = await queues(tmp_path / "q", QueueOptions())
    assert (await q.append([b"a"])).first_id == 0 and q.committed_count == 1
    await q.close()
    assert not (tmp_path / "q" / COMMITTED_FILE).exists()


def _run_commit_writer(path, seconds: float) -> tuple[int, int]:
    """Run a busy replicated writer, kill -9 it; return the last commit it printed."""
    out = path.parent / "commit.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, WRITER, "commit", str(path), str(64 * 1024)],
                                stdout=f, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while b"ready" not in out.read_bytes():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        time.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    last = (0, 0)
    for line in out.read_text().splitlines():  # one write each: a kill never cuts one
        if line.startswith("commit "):
            _, end, count = line.split()
            last = max(last, (int(end), int(count)))
    return last


async def test_the_persisted_committed_end_is_never_ahead_after_a_kill(tmp_path):
    path = tmp_path / "q"
    for seconds in (0.3, 0.5, 0.2):
        printed = _run_commit_writer(path, seconds)
        stored = decode_position((path / COMMITTED_FILE).read_bytes())
        assert stored is not None and stored[0] <= printed[0] and stored[1] <= printed[1]
        q = await DiskQueue.open(str(path), QueueOptions(segment_bytes=64 * 1024,
                                                         replicated=True))
        try:
            assert (q.committed_end, q.committed_count) == stored
            assert q.committed_end < q.written_end  # the commit lagged the writes
            assert stored == (0, 0) or await q.find("offset", stored[0] - 1) is not None
            assert len(await read_all(q)) == stored[1]
        finally:
            await q.close()


# ---- raw batches: leader to follower -----------------------------------------

async def test_an_announced_batch_and_append_raw_copy_a_leader_to_a_follower(tmp_path, queues):
    leader = await queues(tmp_path / "leader")
    follower = await queues(tmp_path / "follower", QueueOptions(replicated=True,
                                                               segment_bytes=4096))
    await leader.set_epoch(3)
    pushed = []
    written = asyncio.get_running_loop().create_future()
    requests = [leader.request([body(i) for i in range(k)], trace_id=k, ext=b"e" * k)
                for k in (1, 2, 3)]
    leader.write_batch(requests, announce=lambda *batch: pushed.append(batch),
                       done=lambda results, error: written.set_result((results, error)))
    assert len(pushed) == 0  # announced as it is encoded, on a later turn of the loop
    results, error = await written
    assert error is None and [r.count for r in results] == [1, 2, 3] and len(pushed) == 1
    for offset, count, entries, n, data, epoch in pushed:
        assert epoch == 3 and n == len(entries) // ENTRY_SIZE
        assert await follower.append_raw(offset, count, entries, data) == (
            offset + len(data), entries_of(entries)[-1].count_after)
    leader.commit_to(follower.written_end, follower.written_count)
    assert (follower.written_end, follower.written_count) == (leader.written_end, 6)
    assert follower.last_epoch == 3 and follower.committed_count == 0  # committed by the leader
    follower.commit_to(leader.committed_end, leader.committed_count)
    assert await read_all(follower) == await read_all(leader)
    mine, theirs = list(follower.commitlog.entries()), list(leader.commitlog.entries())
    assert [e._replace(log_id=0, flags=0) for e in mine] == [
        e._replace(log_id=0, flags=0) for e in theirs]
    assert [e.log_id for e in mine] == list(range(len(mine)))
    await follower.close()
    follower = await queues(tmp_path / "follower", QueueOptions(replicated=True,
                                                               segment_bytes=4096))
    assert follower.written_count == 6 and follower.last_epoch == 3


async def test_append_raw_renumbers_with_its_own_log_ids(tmp_path, queues):
    leader = await queues(tmp_path / "leader", QueueOptions())
    await fill(leader, 6)
    follower = await queues(tmp_path / "follower", QueueOptions())
    raw = await leader.read_raw(0, 1 << 20)
    assert raw.n_entries == 6
    # the leader's log ids differ from the follower's (a power-cut repair, a retention)
    theirs = b"".join(encode(e._replace(log_id=e.log_id + 100)) for e in entries_of(raw.entries))
    await follower.append_raw(raw.offset, raw.count, theirs, raw.data)
    assert [e.log_id for e in follower.commitlog.entries()] == list(range(6))
    assert await read_all(follower) == await read_all(leader)


async def test_append_raw_refuses_a_gap_and_takes_a_duplicate_as_done(tmp_path, queues):
    leader = await queues(tmp_path / "leader", QueueOptions())
    await fill(leader, 6)
    follower = await queues(tmp_path / "follower")
    raws = []
    offset = 0
    while offset < leader.written_end:
        raws.append(await leader.read_raw(offset, 1))  # one entry each
        offset = raws[-1].offset + len(raws[-1].data)
    with pytest.raises(GapError) as gap:
        await follower.append_raw(raws[1].offset, raws[1].count, raws[1].entries, raws[1].data)
    assert gap.value.end == (0, 0)
    for raw in raws[:3]:
        await follower.append_raw(raw.offset, raw.count, raw.entries, raw.data)
    end = (follower.written_end, follower.written_count)
    syncs = follower.stats["syncs"]
    for raw in raws[:3]:  # pushed again: nothing written
        assert await follower.append_raw(raw.offset, raw.count, raw.entries, raw.data) == end
    assert follower.stats["syncs"] == syncs and len(follower.commitlog) == 3
    assert await follower.append_raw(end[0], end[1], b"", b"") == end
    # pipelined pushes are taken in order
    await asyncio.gather(*(follower.append_raw(r.offset, r.count, r.entries, r.data)
                           for r in raws[3:]))
    assert (follower.written_end, follower.written_count) == (leader.written_end,
                                                              leader.written_count)


async def test_append_raw_then_answers_by_callback_in_order(tmp_path, queues):
    """The follower's hot path: each batch's `done` gets None (written, or a duplicate) or
    the error append_raw raises; a duplicate never answers from inside the call; batches
    given while the writer slot is busy (an exclusive job) go after it, in order."""
    leader = await queues(tmp_path / "leader", QueueOptions())
    await fill(leader, 6)
    follower = await queues(tmp_path / "follower")
    raws, offset = [], 0
    while offset < leader.written_end:
        raws.append(await leader.read_raw(offset, 1))  # one entry each
        offset = raws[-1].offset + len(raws[-1].data)
    loop = asyncio.get_running_loop()
    answers = []

    async def then(raw, tag):
        fut = loop.create_future()
        follower.append_raw_then(raw.offset, raw.count, raw.entries, raw.data,
                                 lambda e: (answers.append((tag, e)), fut.set_result(e)))
        return await fut

    assert isinstance(await then(raws[1], "gap"), GapError)
    assert await then(raws[0], "first") is None
    assert follower.written_end == raws[1].offset and follower.stats["batches"] == 1
    follower.append_raw_then(raws[0].offset, raws[0].count, raws[0].entries, raws[0].data,
                             lambda e: answers.append(("duplicate", e)))
    assert answers[-1][0] == "first"  # not from inside the call
    for _ in range(200):  # a duplicate is checked against the entries held (write worker)
        if answers[-1][0] != "first":
            break
        await asyncio.sleep(0.005)
    assert answers[-1] == ("duplicate", None)
    find = asyncio.ensure_future(follower.find("offset", 0))
    await asyncio.sleep(0)
    assert follower._busy  # the find holds the writer slot
    rest = []
    for i, r in enumerate(raws[1:], 1):
        rest.append(loop.create_future())
        follower.append_raw_then(r.offset, r.count, r.entries, r.data,
                                 lambda e, i=i, f=rest[-1]: (answers.append((i, e)), f.set_result(e)))
    await find
    assert await asyncio.gather(*rest) == [None] * len(rest)
    assert [tag for tag, _ in answers[-len(rest):]] == list(range(1, len(raws)))
    assert (follower.written_end, follower.written_count) == (leader.written_end,
                                                              leader.written_count)


async def test_append_raw_is_durable_when_it_returns(tmp_path, queues):
    leader = await queues(tmp_path / "leader", QueueOptions())
    await fill(leader, 3)
    follower = await queues(tmp_path / "follower")
    raw = await leader.read_raw(0, 1 << 20)
    syncs = follower.stats["syncs"]
    await follower.append_raw(raw.offset, raw.count, raw.entries, raw.data)
    assert follower.stats["syncs"] == syncs + 1


async def test_a_bad_batch_writes_nothing(tmp_path, queues):
    leader = await queues(tmp_path / "leader", QueueOptions())
    await fill(leader, 3)
    raw = await leader.read_raw(0, 1 << 20)
    follower = await queues(tmp_path / "follower")
    data = bytearray(raw.data)
    data[-1] ^= 1
    first = entries_of(raw.entries)[0]
    bad = {
        "record checksum": (raw.entries, bytes(data)),
        "data past the entries": (raw.entries, raw.data + raw.data[:40]),
        "entries past the data": (raw.entries, raw.data[:-1]),
        "torn entry": (raw.entries[:-1], raw.data),
        "entry checksum": (raw.entries[:8] + bytes([raw.entries[8] ^ 1]) + raw.entries[9:],
                           raw.data),
        "wrong message id": (encode(first._replace(first_msg_id=7)) + raw.entries[64:], raw.data),
    }
    for name, (entries, data) in bad.items():
        with pytest.raises(BadBatch):
            await follower.append_raw(0, 0, entries, data)
        assert (follower.written_end, len(follower.commitlog)) == (0, 0), name
        assert os.path.getsize(segment_files(follower.path)[0]) == 0, name
    await follower.append_raw(0, 0, raw.entries, raw.data)
    assert follower.written_count == leader.written_count


async def test_append_raw_on_a_full_disk_raises_disk_full(small_disk, queues):  # noqa: F811
    leader = await queues(small_disk / "leader", QueueOptions())
    big = [os.urandom(200_000) for _ in range(5)]
    for b in big:
        await leader.append([b])
    follower = await queues(small_disk / "follower")
    (small_disk / "ballast").write_bytes(os.urandom(1024 * 1024))
    offset, count = 0, 0
    with pytest.raises(DiskFullError):
        while True:
            raw = await leader.read_raw(offset, 1)
            await follower.append_raw(raw.offset, raw.count, raw.entries, raw.data)
            offset, count = raw.offset + len(raw.data), raw.count + 1
    assert (follower.written_end, follower.written_count) == (offset, count)
    assert sum(os.path.getsize(f) for f in segment_files(follower.path)) == offset
    (small_disk / "ballast").unlink()
    raw = await leader.read_raw(offset, 1)
    await follower.append_raw(raw.offset, raw.count, raw.entries, raw.data)


async def test_retention_never_drops_uncommitted_records(tmp_path, queues):
    """A leader's segments its ISR may lack stay, whatever the age and size bounds say."""
    q = await queues(tmp_path / "q", QueueOptions(replicated=True, segment_bytes=2048))
    await fill(q, 12)
    q.commit_to(q.written_end, q.written_count)
    await write_uncommitted(q, 30, first=100)
    committed = q.committed_end
    assert len(segment_files(q)) > 3 and committed < q.written_end
    start = await q.retain(before_offset=10**9, max_age_s=0, max_bytes=0)
    assert 0 < start <= committed
    q.commit_to(q.written_end, q.written_count)
    assert await q.retain(before_offset=10**9) > committed


async def test_read_raw(tmp_path, queues):
    q = await queues(tmp_path / "q", QueueOptions(replicated=True, segment_bytes=2048,
                                                  clog_entries_per_segment=4))
    done = await fill(q, 12)
    q.commit_to(q.written_end, q.written_count)
    q.append([b"written, not committed"])
    while q.written_count < done[-1].first_id + done[-1].count + 1:
        await asyncio.sleep(0.001)
    end = (q.written_end, q.written_count)
    whole = await q.read_raw(0, 1 << 30)
    assert whole.n_entries == 13 and whole.end == end and len(whole.data) == end[0]
    assert b"written, not committed" in whole.data  # the uncommitted tail too
    mid = done[5]
    part = await q.read_raw(mid.offset, 1)  # at least one entry
    assert (part.offset, part.count, part.n_entries) == (mid.offset, mid.first_id, 1)
    assert part.data == whole.data[mid.offset:mid.end_offset]
    some = await q.read_raw(mid.offset, done[7].end_offset - mid.offset)
    assert some.n_entries == 3 and len(some.data) == done[7].end_offset - mid.offset
    assert entries_of(some.entries) == entries_of(whole.entries)[5:8]
    assert (await q.read_raw(end[0], 100)).n_entries == 0
    with pytest.raises(ValueError):
        await q.read_raw(mid.offset + 1, 100)
    with pytest.raises(ValueError):
        await q.read_raw(end[0] + 1, 100)
    q.commit_to(*end)
    start = await q.retain(before_offset=done[8].offset)
    assert start > 0
    with pytest.raises(OffsetOutOfRange) as out:
        await q.read_raw(0, 100)
    assert out.value.start == (start, q.start_count)


# ---- epochs -------------------------------------------------------------------

async def test_epochs_and_epoch_end(tmp_path, queues):
    path = tmp_path / "q"
    q = await queues(path)
    assert q.last_epoch == 0 and await q.epoch_end(0) == (0, 0)
    await q.set_epoch(1)
    assert q.last_epoch == 0  # nothing written at epoch 1 yet
    a = await fill(q, 2)
    assert q.last_epoch == 1
    await q.set_epoch(4)
    b = await fill(q, 2, first=50)
    end = (q.written_end, q.written_count)
    assert await q.epoch_end(0) == (0, 0)
    assert await q.epoch_end(1) == (b[0].offset, b[0].first_id)
    assert await q.epoch_end(3) == (b[0].offset, b[0].first_id)
    assert await q.epoch_end(4) == end
    with pytest.raises(ValueError):
        await q.set_epoch(2)
    assert [e.epoch for e in q.commitlog.entries()] == [1, 1, 4, 4]
    await q.close()
    q = await queues(path)
    assert q.last_epoch == 4 and q.epoch == 4
    assert a[0].first_id == 0


# ---- truncation -----------------------------------------------------------------

async def test_truncate_to_across_segments(tmp_path, queues):
    path = tmp_path / "q"
    opts = QueueOptions(replicated=True, segment_bytes=2048, clog_entries_per_segment=8)
    q = await queues(path, opts)
    await q.set_epoch(2)
    done = await write_uncommitted(q, 10)
    await q.set_epoch(5)
    more = await write_uncommitted(q, 30, first=100)
    done += more
    cut = done[8]
    q.commit_to(cut.offset, cut.count_before)
    committed = await read_all(q)
    files = segment_files(path)
    with pytest.raises(ValueError):  # below committed
        await q.truncate_to(done[7].offset, done[7].count_before)
    with pytest.raises(ValueError):  # not an entry boundary
        await q.truncate_to(cut.offset + 1, cut.count_before)
    with pytest.raises(ValueError):  # the count does not match
        await q.truncate_to(cut.offset, cut.count_before + 1)
    await q.truncate_to(cut.offset, cut.count_before)
    assert (q.written_end, q.written_count) == (cut.offset, cut.count_before)
    assert q.last_epoch == 2 and q.epoch == 5
    left = segment_files(path)
    assert len(left) < len(files) - 2 and left == files[:len(left)]
    newest = json.loads((path / "data" / "newest.json").read_text())["base"]
    assert os.path.basename(left[-1]) == f"{newest:020d}.dat"
    assert sum(os.path.getsize(f) for f in left) == cut.offset
    assert list(q.commitlog.entries()) == done[:8]
    # it goes on from there
    a = await q.append([b"after"])
    q.commit_to(a.end_offset, a.first_id + 1)
    assert (a.first_id, a.offset, a.log_id) == (cut.count_before, cut.offset, 8)
    assert await q.epoch_end(2) == (a.offset, a.first_id)
    await q.close()
    q = await queues(path, opts)
    assert (q.written_end, q.written_count) == (a.end_offset, cut.count_before + 1)
    assert (q.committed_end, q.committed_count) == (q.written_end, q.written_count)
    got = await read_all(q)
    assert got[:-1] == committed and got[-1].body == b"after"


async def test_truncate_to_a_segment_base_and_to_the_end(tmp_path, queues):
    path = tmp_path / "q"
    opts = QueueOptions(replicated=True, segment_bytes=2048)
    q = await queues(path, opts)
    done = await write_uncommitted(q, 20)
    bases = [int(os.path.basename(f)[:-4]) for f in segment_files(path)]
    at = next(e for e in done if e.offset == bases[2])
    await q.truncate_to(q.written_end, q.written_count)  # nothing to cut
    assert q.written_count == done[-1].count_after
    await q.truncate_to(at.offset, at.count_before)
    assert [int(os.path.basename(f)[:-4]) for f in segment_files(path)] == bases[:3]
    assert os.path.getsize(segment_files(path)[-1]) == 0
    await q.close()
    q = await queues(path, opts)
    assert (q.written_end, q.written_count) == (at.offset, at.count_before)


async def test_nothing_commits_past_a_truncation_under_way(tmp_path, queues):
    q = await queues(tmp_path / "q")
    done = await write_uncommitted(q, 6)
    cut = done[3]
    truncating = asyncio.ensure_future(q.truncate_to(cut.offset, cut.count_before))
    await asyncio.sleep(0)  # it holds the writer now
    q.commit_to(q.written_end, q.written_count)  # a leader's commit arrives meanwhile
    await truncating
    assert (q.committed_end, q.committed_count) == (cut.offset, cut.count_before)
    assert (q.written_end, q.written_count) == (cut.offset, cut.count_before)
    q.commit_to(10**9, 10**9)
    assert q.committed_end == q.written_end == cut.offset


async def _prepared_log(path, segment_bytes, clog_entries):
    q = await DiskQueue.open(str(path), QueueOptions(segment_bytes=segment_bytes,
                                                     clog_entries_per_segment=clog_entries))
    done = await fill(q, 40)
    records = await read_all(q)
    entries = list(q.commitlog.entries())
    await q.close()
    return done, records, entries


async def _truncate_at_every_point(tmp_path, power: bool, every: int = 1) -> int:
    """SIGKILL the truncating process before its 1st, 1 + every-th, ... file-changing call
    (and, with `power`, cut the power of its PowerFS mount then) until one run gets through;
    after each, the log must open and hold a prefix of what it held, at least what the cut
    keeps; after the run that got through, exactly that. Returns the runs."""
    seg, clog = 2048, 8
    src = tmp_path / "src"
    done, records, entries = await _prepared_log(src, seg, clog)
    cut = done[11]
    disk, mnt = tmp_path / "disk", tmp_path / "mnt"
    crash_at, runs, finished = 1, 0, False
    while not finished:
        assert crash_at < 200
        fs = None
        if power:
            shutil.rmtree(disk, ignore_errors=True)
            shutil.copytree(src, disk / "q")  # the disk, all of it synced
            fs = PowerFS(str(disk), str(mnt)).mount()
            path = mnt / "q"
        else:
            path = tmp_path / f"run{crash_at}"
            shutil.copytree(src, path)
        try:
            res = await asyncio.to_thread(
                subprocess.run, [sys.executable, WRITER, "truncate", str(path), str(seg),
                                 str(clog), str(cut.offset), str(cut.first_id), str(crash_at)],
                capture_output=True, timeout=60, check=False)
            finished = res.stdout == b"done\n"
            assert finished or res.returncode == -signal.SIGKILL, res.stderr.decode()[-2000:]
            if fs is not None:
                fs.cut()
            q = await DiskQueue.open(str(path), QueueOptions(
                segment_bytes=seg, max_batch_bytes=1024, clog_entries_per_segment=clog))
            try:
                got = await read_all(q)
                assert got == records[:len(got)] and len(got) >= cut.first_id, crash_at
                assert q.written_end == (got[-1].end if got else 0)
                kept = list(q.commitlog.entries())
                assert kept[-1].end_offset == q.written_end
                assert [e._replace(log_id=0, flags=0) for e in kept[:11]] == [
                    e._replace(log_id=0, flags=0) for e in entries[:11]]
                if finished:
                    assert (q.written_end, q.written_count) == (cut.offset, cut.first_id)
                    assert kept == entries[:11]
            finally:
                await q.close()
        finally:
            if fs is not None:
                fs.unmount()
        if not power:
            shutil.rmtree(path)
        crash_at += every
        runs += 1
    return runs


async def test_the_epochs_of_the_last_batches_survive_a_power_cut(tmp_path):
    """A replicated log writes 3 durable batches at epoch 3 and 3 at epoch 7, then the power
    goes (PowerFS: what was not synced is lost): it reopens with the entries' epochs as
    written. (Before, the commitlog's lag lost the epoch-7 entries and recovery rebuilt them
    from the data with epoch 3: a replica restarted so asked its leader for the end of epoch
    3 and cut committed records; jepsen's power-cut run lost an acknowledged message.)"""
    disk, mnt = tmp_path / "disk", tmp_path / "mnt"
    fs = PowerFS(str(disk), str(mnt)).mount()
    try:
        path = mnt / "q"
        res = await asyncio.to_thread(subprocess.run, [sys.executable, WRITER, "epochs",
                                                       str(path)],
                                      capture_output=True, timeout=60, check=False)
        assert res.stdout == b"done\n", res.stderr.decode()[-2000:]
        fs.cut()
        q = await DiskQueue.open(str(path), QueueOptions(replicated=True))
        try:
            assert [e.epoch for e in q.commitlog.entries()] == [3, 3, 3, 7, 7, 7]
            assert q.last_epoch == 7
            q.commit_to(q.written_end, q.written_count)
            assert [r.body for r in await read_all(q)] == [b"3-0", b"3-1", b"3-2", b"7-0",
                                                         b"7-1", b"7-2"]
        finally:
            await q.close()
    finally:
        fs.unmount()


async def test_a_kill_at_any_point_of_truncate_to_leaves_a_prefix(tmp_path):
    assert await _truncate_at_every_point(tmp_path, power=False) > 10  # many points


async def test_a_power_cut_during_truncate_to_leaves_a_prefix(tmp_path):
    """As above, with a power cut after the kill (PowerFS: what was not synced is lost),
    at every 7th point; a truncation that returned is kept."""
    assert await _truncate_at_every_point(tmp_path, power=True, every=7) > 3


@pytest.mark.long
async def test_a_power_cut_at_any_point_of_truncate_to_leaves_a_prefix(tmp_path):
    await _truncate_at_every_point(tmp_path, power=True)


# ---- diskqueue/raw.py on its own -------------------------------------------------

def _batch(partition=2, offset=0, count=0, n=3, epoch=1, per=2):
    """A valid raw batch: entries and data, as a leader writes them."""
    from commitlog.entry import encode_fields
    from diskqueue.record import encode_records
    parts, entries = [], []
    for i in range(n):
        start = offset
        first = partition << PARTITION_SHIFT | count
        offset = encode_records(parts.append, [], offset, first, 0, 1000 + i, 0, b"",
                                [body(count + k) for k in range(per)])
        entries.append(encode_fields(50 + i, epoch, first, start, count, 1000 + i,
                                     offset - start, per, 1))
        count += per
    return b"".join(entries), b"".join(parts)


def test_check_batch_takes_a_valid_batch_and_renumber_keeps_the_leaders_fields():
    entries, data = _batch(offset=0, count=0)
    checked = check_batch(0, 0, entries, data, 2, 1)
    assert [e.count_before for e in checked] == [0, 2, 4]
    out = entries_of(renumber(checked, 7, 0))
    assert [e.log_id for e in out] == [7, 8, 9] and [e.flags for e in out] == [0, 0, 0]
    assert [e._replace(log_id=0, flags=0) for e in out] == [
        e._replace(log_id=0, flags=0) for e in checked]
    assert renumber(checked, 7, 1)[:64] != renumber(checked, 7, 0)[:64]


@pytest.mark.parametrize("change, reason", [
    (lambda e, d: (e, d, 2, 1, 64, 0), "does not follow"),  # wrong start
    (lambda e, d: (e, d, 3, 1, 0, 0), "message id"),  # other partition
    (lambda e, d: (e, d, 2, 2, 0, 0), "epoch"),  # the log's last epoch is above the batch's
    (lambda e, d: (e[:64] + e[128:], d, 2, 1, 0, 0), "does not follow"),  # an entry missing
    (lambda e, d: (e, d[:-3], 2, 1, 0, 0), "do not fit"),
    (lambda e, d: (e, d + b"x", 2, 1, 0, 0), "cover"),
    (lambda e, d: (b"", d, 2, 1, 0, 0), "whole number"),
    (lambda e, d: (e, d[:5] + bytes([d[5] ^ 1]) + d[6:], 2, 1, 0, 0), "length"),
    (lambda e, d: (e, d[:-1] + bytes([d[-1] ^ 1]), 2, 1, 0, 0), "checksum"),
])
def test_check_batch_refuses(change, reason):
    entries, data = _batch()
    e, d, partition, last_epoch, offset, count = change(entries, data)
    with pytest.raises(BadBatch, match=reason):
        check_batch(offset, count, e, d, partition, last_epoch)


def test_check_batch_refuses_records_that_do_not_match_their_entry():
    from diskqueue.record import encode_records
    entries, _ = _batch(n=1, per=2)
    parts = []
    encode_records(parts.append, [], 0, 2 << PARTITION_SHIFT | 5, 0, 1000, 0, b"",
                   [body(0), body(1)])
    with pytest.raises(BadBatch, match="message id"):
        check_batch(0, 0, entries, b"".join(parts), 2, 0)


async def test_restart_at_drops_the_log_and_goes_on_ahead(tmp_path, queues):
    """restart_at: the log is empty at the new position, appends go on there, and a reopen
    (a kill after it returned) finds the same; a position not ahead is refused."""
    path = tmp_path / "q"
    q = await queues(path, QueueOptions(replicated=True, segment_bytes=2048))
    await fill(q, 12)
    q.commit_to(q.written_end, q.written_count)
    with pytest.raises(ValueError):
        await q.restart_at(q.written_end, q.written_count)
    leader = await queues(tmp_path / "leader", QueueOptions(replicated=True, segment_bytes=2048))
    await fill(leader, 40)
    leader.commit_to(leader.written_end, leader.written_count)
    await leader.retain(before_offset=leader.committed_end)
    assert leader.start_offset > q.written_end
    await q.restart_at(leader.start_offset, leader.start_count)
    assert (q.start_offset, q.start_count) == (leader.start_offset, leader.start_count)
    assert (q.written_end, q.committed_end) == (leader.start_offset, leader.start_offset)
    assert await read_all(q) == []
    raw = await leader.read_raw(leader.start_offset, 1 << 20)
    await q.append_raw(raw.offset, raw.count, raw.entries, raw.data)
    q.commit_to(q.written_end, q.written_count)
    want = [(r.offset, r.msg_id, r.body) for r in await read_all(leader)]
    assert [(r.offset, r.msg_id, r.body) for r in await read_all(q)] == want
    await q.close()
    again = await queues(path, QueueOptions(replicated=True, segment_bytes=2048))
    assert (again.start_offset, again.start_count) == (leader.start_offset, leader.start_count)
    assert [(r.offset, r.msg_id, r.body) for r in await read_all(again)] == want


def test_check_batch_without_records_trusts_them_but_not_the_entries():
    """records=False (a push whose data matched its leader's checksum) skips the record
    walk; the entries are still checked."""
    entries, data = _batch(n=2, per=2)
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    with pytest.raises(BadBatch, match="checksum"):
        check_batch(0, 0, entries, bytes(bad), 2, 0)
    assert len(check_batch(0, 0, entries, bytes(bad), 2, 0, records=False)) == 2
    with pytest.raises(BadBatch, match="cover"):
        check_batch(0, 0, entries, data + b"x", 2, 0, records=False)


async def test_an_overlapping_batch_of_other_entries_is_diverged_not_a_duplicate(tmp_path, queues):
    """A push that covers written data is a duplicate only when its entries are the ones held
    (epoch, timestamp, size, count): another batch of the same size at the same place (a
    leader that lost its write and wrote again) is Diverged, and nothing is written."""
    from diskqueue.errors import Diverged
    a = await queues(tmp_path / "a", QueueOptions())
    b = await queues(tmp_path / "b", QueueOptions())
    await a.append([b"x" * 10])
    await b.append([b"y" * 10])  # same place, same size, another batch
    follower = await queues(tmp_path / "follower")
    raw_a, raw_b = await a.read_raw(0, 1 << 20), await b.read_raw(0, 1 << 20)
    await follower.append_raw(raw_a.offset, raw_a.count, raw_a.entries, raw_a.data)
    end = (follower.written_end, follower.written_count)
    assert await follower.append_raw(raw_a.offset, raw_a.count, raw_a.entries, raw_a.data) == end
    with pytest.raises(Diverged):
        await follower.append_raw(raw_b.offset, raw_b.count, raw_b.entries, raw_b.data)
    assert (follower.written_end, follower.written_count) == end
