"""Async tests of DiskQueue: the write path, readers, sync policies, retention, recovery, faults."""

import asyncio
import threading
import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import time

import pytest

import fdhooks
from commitlog.entry import ENTRY_SIZE
from diskqueue.queue import (AppendError, DiskFullError, DiskQueue, QueueFailedError,
                             QueueClosedError, QueueOptions, SyncPolicy)
from nsqwire.ids import PARTITION_SHIFT
from diskqueue.record import HEAD_SIZE, MAX_EXT, MAX_RECORD, CorruptRecordError, Record, encode_into
from diskqueue.segments import DSYNC, MissingSegmentError


def body(i: int, size: int | None = None) -> bytes:
    """A body unique to `i` (its size derived from `i` unless given)."""
    seed = hashlib.sha256(str(i).encode()).digest()
    if size is None:
        size = 1 + int.from_bytes(seed[:2], "big") % 700
    return hashlib.shake_128(seed).digest(size)


def data_dir(q_or_path) -> str:
    path = q_or_path if isinstance(q_or_path, (str, os.PathLike)) else q_or_path.path
    return os.path.join(path, "data")


def segment_files(path) -> list[str]:
    d = data_dir(path)
    return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".dat")]


def base_of(file: str) -> int:
    return int(os.path.basename(file)[:-4])


async def read_all(q, offset=None, max_count=1000, read_ahead=1 << 20):
    r = q.reader(offset, read_ahead)
    out = []
    try:
        while True:
            recs = await r.read(max_count)
            if not recs:
                return out
            out.extend(recs)
    finally:
        r.close()


async def read_until_error(q, offset=None, max_count=7, read_ahead=1 << 20):
    """(records read, the CorruptRecordError that stopped the reader) - it must stop on one."""
    r = q.reader(offset, read_ahead)
    out = []
    try:
        while True:
            try:
                recs = await r.read(max_count)
            except CorruptRecordError as e:
                # reached again, it raises again: the bad record is never skipped
                with pytest.raises(CorruptRecordError) as again:
                    await r.read(max_count)
                assert again.value.offset == e.offset
                return out, e
            assert recs, "the reader reached the end without meeting the corrupt record"
            out.extend(recs)
    finally:
        r.close()


async def append_singles(q, n: int, start: int = 0, size: int | None = None):
    """Append n single-message requests one after the other; return their `Appended`s."""
    return [await q.append([body(start + i, size)]) for i in range(n)]


def flip_bit(file: str, pos: int, bit: int = 3) -> None:
    with open(file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ (1 << bit)]))


def check_commitlog_matches(q, records) -> None:
    """Each commitlog entry describes exactly its records; the last ends at the data end."""
    by_count = {r.msg_id & ((1 << PARTITION_SHIFT) - 1): r for r in records}
    entries = list(q.commitlog.entries())
    assert entries, "empty commitlog"
    prev = None
    for e in entries:
        first = by_count[e.count_before]
        assert (e.offset, e.first_msg_id) == (first.offset, first.msg_id)
        last = by_count[e.count_before + e.msg_count - 1]
        assert e.end_offset == last.end
        if prev is not None:
            assert (e.offset, e.count_before, e.log_id) == (
                prev.end_offset, prev.count_after, prev.log_id + 1)
        prev = e
    assert prev.end_offset == q.written_end and prev.count_after == q.written_count


@pytest.fixture
async def queues():
    """Opened queues, closed at the end of the test."""
    opened = []

    async def open_queue(path, options=QueueOptions()):
        q = await DiskQueue.open(str(path), options)
        opened.append(q)
        return q

    yield open_queue
    for q in opened:
        await q.close()


# ---- the write path ----------------------------------------------------------

async def test_concurrent_appends_get_contiguous_ids_and_each_its_own(tmp_path, queues):
    q = await queues(tmp_path)
    rng = random.Random(1)
    requests = []
    n = 0
    for _ in range(300):
        k = rng.choice([1, 1, 1, 2, 5])
        requests.append([body(n + i) for i in range(k)])
        n += k
    rng.shuffle(requests)

    async def one(bodies):
        await asyncio.sleep(rng.random() / 100)
        return await q.append(bodies)

    results = await asyncio.gather(*(one(b) for b in requests))
    by_offset = {r.offset: r for r in await read_all(q)}
    for bodies, a in zip(requests, results):
        assert a.count == len(bodies) == len(a.offsets)
        assert a.offsets[0] == a.offset
        got = [by_offset[off] for off in a.offsets]
        assert [r.body for r in got] == bodies  # its own bodies, not another caller's
        assert [r.msg_id for r in got] == list(range(a.first_id, a.first_id + a.count))
        assert a.end_offset == got[-1].end
        assert all(r.timestamp == a.timestamp for r in got)
    ordered = sorted(results, key=lambda a: a.first_id)
    assert ordered[0].first_id == 0 and ordered[0].offset == 0
    for prev, a in zip(ordered, ordered[1:]):
        assert a.first_id == prev.first_id + prev.count
        assert a.offset == prev.end_offset
        assert a.log_id == prev.log_id + 1
    assert sorted(a.log_id for a in results) == list(range(300))
    assert q.written_count == q.committed_count == n
    assert q.written_end == q.committed_end == ordered[-1].end_offset
    assert q.stats["batches"] < 300  # group commit: many requests per write
    check_commitlog_matches(q, list(by_offset.values()))


async def test_multi_body_append(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(partition=5))
    a = await q.append([body(1)])
    b = await q.append([body(2), b"", body(3), body(4, 3000)])
    prefix = 5 << PARTITION_SHIFT
    assert (a.first_id, b.first_id, b.count, b.log_id) == (prefix, prefix | 1, 4, 1)
    sizes = [HEAD_SIZE + len(x) for x in (body(2), b"", body(3), body(4, 3000))]
    assert b.offsets == [a.end_offset + sum(sizes[:i]) for i in range(4)]
    assert b.end_offset == b.offset + sum(sizes)
    records = await read_all(q)
    assert [r.body for r in records] == [body(1), body(2), b"", body(3), body(4, 3000)]
    assert [r.msg_id for r in records] == [prefix | i for i in range(5)]
    entry = await q.find("msg_id", prefix | 3)
    assert (entry.log_id, entry.msg_count, entry.offset, entry.size, entry.count_before) == (
        1, 4, b.offset, b.end_offset - b.offset, 1)
    assert len(q.commitlog) == 2


async def test_ext_trace_id_and_attempts_round_trip(tmp_path, queues):
    q = await queues(tmp_path)
    ext = json.dumps({"trace_id": "abc", "key": "k1", "tags": ["x"] * 20}).encode()
    a = await q.append([b"one", b"two"], trace_id=2**64 - 1, ext=ext, attempts=7)
    b = await q.append([b"three"], ext=b"\x00" * MAX_EXT, attempts=0xFFFF)
    c = await q.append([b"four"])
    records = await read_all(q)
    assert [(r.body, r.ext, r.trace_id, r.attempts) for r in records] == [
        (b"one", ext, 2**64 - 1, 7), (b"two", ext, 2**64 - 1, 7),
        (b"three", b"\x00" * MAX_EXT, 0, 0xFFFF), (b"four", b"", 0, 0)]
    assert records[2].size == HEAD_SIZE + MAX_EXT + 5
    assert [r.offset for r in records] == a.offsets + b.offsets + c.offsets


@pytest.mark.parametrize("kwargs", [dict(ext=b"x" * (MAX_EXT + 1)), dict(attempts=0x10000),
                                    dict(attempts=-1), dict(trace_id=2**64), dict(trace_id=-1)])
async def test_out_of_range_fields_are_refused_and_the_queue_keeps_working(tmp_path, queues,
                                                                         kwargs):
    q = await queues(tmp_path)
    await q.append([b"before"])
    with pytest.raises(ValueError):
        q.append([b"x"], **kwargs)
    a = await asyncio.wait_for(q.append([b"after"]), 5)
    assert a.first_id == 1
    assert [r.body for r in await read_all(q)] == [b"before", b"after"]


async def test_a_body_too_big_for_one_record_is_refused(tmp_path, queues):
    # such a record would be acknowledged, then unreadable, then cut at the next open
    q = await queues(tmp_path)
    with pytest.raises(ValueError):
        q.append([b"small", bytes(MAX_RECORD)])
    await q.append([b"small"])
    await q.close()
    q = await queues(tmp_path)
    assert q.written_count == 1


async def test_append_with_a_callback(tmp_path, queues):
    q = await queues(tmp_path)
    got = []

    def raising(result, error):
        got.append((result, error))
        raise RuntimeError("a caller's bug")

    assert q.append([b"a"], callback=lambda r, e: got.append((r, e))) is None
    q.append([b"b", b"c"], callback=raising)
    after = await asyncio.wait_for(q.append([b"d"]), 5)  # the writer is still alive
    assert [(r.first_id, r.count, e) for r, e in got] == [(0, 1, None), (1, 2, None)]
    assert got[1][0].offsets == [got[0][0].end_offset, got[0][0].end_offset + HEAD_SIZE + 1]
    assert after.first_id == 3
    assert [r.body for r in await read_all(q)] == [b"a", b"b", b"c", b"d"]


async def test_reader_sees_only_committed(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(auto_commit=False))
    a = await q.append([b"a1", b"a2"])
    b = await q.append([b"b1"])
    assert (q.written_end, q.written_count) == (b.end_offset, 3)
    assert (q.committed_end, q.committed_count) == (0, 0)
    r = q.reader()
    assert await r.read() == []
    assert await r.read_wait(timeout=0.05) == []
    q.commit_to(b.end_offset + 100, 9)  # past the written end: the written end
    assert (q.committed_end, q.committed_count) == (b.end_offset, 3)
    await q.close()
    q = await queues(tmp_path / "again", QueueOptions(auto_commit=False))
    a = await q.append([b"a1", b"a2"])
    b = await q.append([b"b1"])
    r = q.reader()
    q.commit_to(a.end_offset, 2)
    assert [x.body for x in await r.read()] == [b"a1", b"a2"]
    assert await r.read() == []
    q.commit_to(a.end_offset, 2)  # idempotent
    q.commit_to(b.end_offset, 3)
    assert [x.body for x in await r.read()] == [b"b1"]
    assert q.committed_count == 3
    r.close()


async def test_read_wait_wakes_on_append(tmp_path, queues):
    q = await queues(tmp_path)
    r = q.reader()
    t0 = time.monotonic()
    assert await r.read_wait(timeout=0.1) == []
    assert time.monotonic() - t0 >= 0.09
    waiting = asyncio.ensure_future(r.read_wait(timeout=10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    t0 = time.monotonic()
    await q.append([b"wake up"])
    records = await asyncio.wait_for(waiting, 2)
    assert time.monotonic() - t0 < 1
    assert [x.body for x in records] == [b"wake up"]
    r.close()


async def test_acknowledged_only_after_its_data_is_synced(tmp_path, queues, monkeypatch):
    """The data is synced before OK; the commitlog, an index recovery rebuilds from the
    data, lags by at most `clog_sync_every` entries and never across a data segment."""
    synced = {}  # inode -> file size at its last fdatasync
    listed = {}  # folder -> the names in it at its last fsync
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def fdatasync(fd):
        real_fdatasync(fd)
        st = os.fstat(fd)
        synced[st.st_ino] = st.st_size

    real_pwritev = os.pwritev

    def pwritev(fd, buffers, pos, flags=0):  # DSYNC: synced up to its end (nothing before it
        n = real_pwritev(fd, buffers, pos, flags)  # is unsynced: Segments.write's rule)
        if flags & DSYNC:
            synced[os.fstat(fd).st_ino] = pos + n
        return n

    def fsync(fd):
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            listed[path] = set(os.listdir(path))

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "fsync", fsync)
    q = await queues(tmp_path, QueueOptions(segment_bytes=4096, clog_entries_per_segment=64,
                                        clog_sync_every=48))
    lagged = []

    def holding(folder, suffix, value):
        files = [n for n in os.listdir(folder) if n.endswith(suffix)]
        name = max((n for n in files if int(n[:-len(suffix)]) <= value),
                   key=lambda n: int(n[:-len(suffix)]))
        return name, int(name[:-len(suffix)])

    def check(a):
        """At the moment the caller hears OK: its bytes and its file's name are on disk."""
        name, base = holding(data_dir(q), ".dat", a.offset)
        assert synced.get(os.stat(os.path.join(data_dir(q), name)).st_ino, -1) >= (
            a.end_offset - base)
        assert name in listed[data_dir(q)]
        if base > 0:  # every entry of an older data segment is synced
            assert synced_entries() > q.commitlog.find_by_offset(base - 1).log_id
        assert synced_entries() >= a.log_id + 1 - 48
        lagged.append(synced_entries() <= a.log_id)
        name, _ = holding(q.commitlog.path, ".clog", a.log_id)
        assert name in listed[q.commitlog.path]

    def synced_entries():
        """How many commitlog entries from the first are all synced."""
        n = 0
        for name in sorted(os.listdir(q.commitlog.path)):
            file = os.path.join(q.commitlog.path, name)
            held, done = os.path.getsize(file) // ENTRY_SIZE, synced.get(os.stat(file).st_ino, 0)
            n = int(name[:-5]) + done // ENTRY_SIZE
            if done < held * ENTRY_SIZE:
                break
        return n

    loop = asyncio.get_running_loop()

    def one(i):
        """Checked in the writer's own callback, the moment the append is acknowledged:
        no later batch can have been synced yet."""
        heard = loop.create_future()

        def acknowledged(a, err):
            try:
                if err is not None:
                    raise err
                check(a)
            except BaseException as e:  # the writer logs callback errors: hand it over
                heard.set_exception(e)
            else:
                heard.set_result(a)

        q.append([body(i), body(i + 1000)], callback=acknowledged)
        return heard

    for start in range(0, 200, 20):
        await asyncio.gather(*(one(i) for i in range(start, start + 20)))
    assert len(segment_files(q)) > 5 and len(os.listdir(q.commitlog.path)) > 2
    assert any(lagged), "the commitlog was synced with every batch"


async def test_segments_rotate_and_readers_cross_them(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(segment_bytes=4096))
    results = []
    for i in range(0, 150, 3):
        results.append(await q.append([body(i), body(i + 1), body(i + 2)]))
    files = segment_files(q)
    assert len(files) > 10
    bases = [base_of(f) for f in files]
    assert bases[0] == 0
    for f, nxt in zip(files, bases[1:]):
        assert base_of(f) + os.path.getsize(f) == nxt
        assert os.path.getsize(f) <= 4096
    want = [body(i) for i in range(150)]
    for read_ahead, max_count in ((1 << 20, 1000), (100, 1), (5000, 4), (4096, 1000)):
        records = await read_all(q, read_ahead=read_ahead, max_count=max_count)
        assert [r.body for r in records] == want
        assert [r.msg_id for r in records] == list(range(150))
    # a reader may start at any record, in any segment
    for idx in (0, 1, 44, 75, 149):
        a = results[idx // 3]
        records = await read_all(q, a.offsets[idx % 3], read_ahead=300)
        assert [r.body for r in records] == want[idx:]
    r = q.reader()
    await r.read(10)
    r.seek(results[40].offset)
    assert [x.body for x in await r.read(3)] == want[120:123]
    r.close()


def open_descriptors(path: str) -> int:
    """This process's descriptors open on the file `path`."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return found


async def test_a_reader_holds_no_descriptor(tmp_path, queues):
    """A refill opens, reads and closes the segment; a read that reaches the committed end
    drops the buffer. The writer's own descriptor is the only one a queue holds on its
    active segment, reading or not."""
    q = await queues(tmp_path, QueueOptions(segment_bytes=1 << 20))
    await q.append([body(i, 100) for i in range(50)])
    (active,) = segment_files(q)
    assert open_descriptors(active) == 1  # the writer's
    r = q.reader(read_ahead=1000)
    first = await r.read(5)
    assert [x.body for x in first] == [body(i, 100) for i in range(5)]
    assert open_descriptors(active) == 1 and r._buf, "reading, not caught up: the buffer stays"
    rest = []
    while len(rest) < 45:
        rest += await r.read(1000)
    assert [x.body for x in rest] == [body(i, 100) for i in range(5, 50)]
    assert open_descriptors(active) == 1 and r._buf == b"", "caught up: nothing held"
    assert await r.read(10) == []
    await q.append([body(i, 100) for i in range(50, 53)])
    assert [x.body for x in await r.read(10)] == [body(i, 100) for i in range(50, 53)]
    assert open_descriptors(active) == 1
    r.close()


async def test_a_reader_whose_segment_retention_dropped_meanwhile_says_so(tmp_path, queues):
    """Retention may drop a segment between a refill finding it and reading it (the reader
    holds no descriptor to keep it): the read raises MissingSegmentError, as a read of an
    offset before the log's start does (a channel then seeks to the start)."""
    q = await queues(tmp_path, QueueOptions(segment_bytes=2048))
    for i in range(0, 60, 3):
        await q.append([body(j, 100) for j in range(i, i + 3)])
    r = q.reader(read_ahead=300)
    assert [x.body for x in await r.read(2)] == [body(0, 100), body(1, 100)]
    second = segment_files(q)[1]
    os.unlink(second)  # the file goes, the log still lists it: as a drop racing the refill
    with pytest.raises(MissingSegmentError, match="dropped before"):
        for _ in range(60):  # what the buffer holds, then the refill from the second
            assert await r.read(2)
    assert q.segment_of(r.offset)[0] == second
    r.close()


async def test_a_caught_up_reader_goes_on_across_retention_and_rotation(tmp_path, queues):
    """Segments rotate and retention drops the old ones while a reader waits caught up
    with no descriptor: it opens the segment its offset is in, never a dropped one."""
    q = await queues(tmp_path, QueueOptions(segment_bytes=2048, clog_entries_per_segment=8))
    r = q.reader(read_ahead=300)
    got = []
    for i in range(0, 60, 3):
        await q.append([body(j, 100) for j in range(i, i + 3)])
        while len(got) < i + 3:
            got += await r.read(2)
        assert sum(open_descriptors(f) for f in segment_files(q)) == 1  # the writer's
        await q.retain(before_offset=r.offset, min_age_s=0)
    assert [x.body for x in got] == [body(j, 100) for j in range(60)]
    assert len(segment_files(q)) == 1 and q.start_offset > 0
    r.close()


async def test_reopen_keeps_everything_and_appending_continues(tmp_path, queues):
    opts = QueueOptions(segment_bytes=4096, clog_entries_per_segment=16)
    q = await queues(tmp_path, opts)
    results = [await q.append([body(2 * i), body(2 * i + 1)]) for i in range(60)]
    before = await read_all(q)
    end, count, next_log = q.written_end, q.written_count, q.commitlog.next_log_id
    await q.close()
    with pytest.raises(QueueClosedError):
        q.append([b"late"])
    q = await queues(tmp_path, opts)
    assert (q.written_end, q.committed_end, q.written_count, q.commitlog.next_log_id) == (
        end, end, count, next_log)
    assert q.corrupt == []
    assert await read_all(q) == before
    for a in results:
        e = await q.find("msg_id", a.first_id + 1)
        assert (e.log_id, e.offset, e.msg_count) == (a.log_id, a.offset, 2)
    a = await q.append([b"next"])
    assert (a.first_id, a.offset, a.log_id) == (count, end, next_log)
    check_commitlog_matches(q, await read_all(q))


async def test_close_writes_what_is_pending(tmp_path, queues):
    q = await queues(tmp_path)
    futures = [q.append([body(i)]) for i in range(50)]
    await q.close()
    assert all(f.done() and not f.exception() for f in futures)
    q = await queues(tmp_path)
    assert [r.body for r in await read_all(q)] == [body(i) for i in range(50)]


# ---- partitions apart: each queue's own workers -------------------------------

async def test_a_slow_sync_of_one_partition_never_delays_another(tmp_path, queues, monkeypatch):
    """Eight partitions whose data sync takes a second (more partitions than a shared
    thread pool of 2 cores has threads) and one healthy partition: the healthy one's
    appends and reads finish long before any slow sync does.

    The slowness is a test hook on the slow queues' files (their synced writes and syncs
    sleep first): this machine's kernel has no device-mapper (no dm-delay), and no FUSE
    binding is installed for a slow file system."""
    slow = [await queues(tmp_path / f"slow{i}") for i in range(8)]
    healthy = await queues(tmp_path / "healthy")
    await healthy.append([b"before"])
    real = os.pwritev, os.fdatasync
    for name in ("pwritev", "fdatasync"):
        fdhooks.hook(monkeypatch, name, fdhooks.under(*(q.path for q in slow)),
                     lambda *_: time.sleep(1.0))
    stuck = [q.append([b"waits for a slow disk"]) for q in slow]
    await asyncio.sleep(0.1)  # every slow partition is in its sync now
    t0 = time.monotonic()
    for i in range(20):
        await healthy.append([body(i)])
    records = await read_all(healthy, read_ahead=4096)
    elapsed = time.monotonic() - t0
    assert [r.body for r in records] == [b"before"] + [body(i) for i in range(20)]
    assert not any(f.done() for f in stuck)
    assert elapsed < 0.5, f"the healthy partition took {elapsed:.2f} s"
    await asyncio.gather(*stuck)
    for name, fn in zip(("pwritev", "fdatasync"), real):
        monkeypatch.setattr(os, name, fn)  # the real ones again, for close


def queue_threads(q) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(q.thread_prefix + ":")]


async def test_each_queue_has_its_own_workers_from_open_to_close(tmp_path, queues):
    q = await queues(tmp_path / "a")
    other = await queues(tmp_path / "b")
    await q.append([b"x"])
    await read_all(q)
    assert sorted(queue_threads(q)) == [q.thread_prefix + ":read", q.thread_prefix + ":write"]
    assert not set(queue_threads(q)) & set(queue_threads(other))
    await q.close()
    deadline = time.monotonic() + 2
    while queue_threads(q) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert queue_threads(q) == [], "close left the queue's threads running"
    with pytest.raises(QueueClosedError):
        await q.find("offset", 0)
    assert (await other.append([b"y"])).first_id == 0  # the other queue is untouched


async def test_a_failed_open_leaves_no_thread(tmp_path):
    path = tmp_path / "q"
    q = await DiskQueue.open(str(path), QueueOptions(segment_bytes=1024))
    await append_singles(q, 30, size=100)
    await q.close()
    os.unlink(segment_files(path)[1])  # a gap: open refuses
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(MissingSegmentError):
        await DiskQueue.open(str(path), QueueOptions(segment_bytes=1024))
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        left = [n for n in {t.name for t in threading.enumerate()} - before
                if n.startswith("diskqueue:")]
        if not left:
            break
        await asyncio.sleep(0.01)
    assert not left


# ---- sync policies -----------------------------------------------------------

async def test_durable_policy_syncs_every_batch(tmp_path, queues):
    q = await queues(tmp_path)
    await append_singles(q, 12)
    assert q.stats["batches"] == q.stats["syncs"] == 12


async def test_one_fdatasync_per_durable_batch(tmp_path, queues, monkeypatch):
    """A durable batch syncs its data file only: the commitlog is synced at close (or every
    `clog_sync_every` entries, or at a data rotation), not once per batch."""
    q = await queues(tmp_path)
    synced = []
    real, real_pwritev = os.fdatasync, os.pwritev

    def folder(fd):
        return os.path.basename(os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")))

    def fdatasync(fd):
        synced.append(folder(fd))
        real(fd)

    def pwritev(fd, buffers, pos, flags=0):  # DSYNC: write + sync in one call
        if flags & DSYNC:
            synced.append(folder(fd))
        return real_pwritev(fd, buffers, pos, flags)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "pwritev", pwritev)
    await append_singles(q, 30)
    await asyncio.gather(*(q.append([body(100 + i)]) for i in range(20)))
    assert q.stats["batches"] == q.stats["syncs"] == 31
    assert synced == ["data"] * 31
    await q.close()
    assert synced[31:] == ["commitlog"]


async def test_a_reopen_syncs_one_folder_and_no_file(tmp_path, queues, monkeypatch):
    """Opening a log that has its meta.json again syncs the partition's folder only (its
    folders were synced before meta.json was written), and no file: its commitlog is synced
    before its first entry after the open (a start of 10,000 partitions spent 5 syncs on
    each, most of its time: bench/scale.py). An empty log's open syncs nothing more."""
    for path, n in ((tmp_path / "a", 3), (tmp_path / "empty", 0)):
        q = await queues(path)
        await append_singles(q, n)
        await q.close()
    synced = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def name(fd):
        return os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)

    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(name(fd)), real_fsync(fd)))
    monkeypatch.setattr(os, "fdatasync",
                        lambda fd: (synced.append(name(fd)), real_fdatasync(fd)))
    q = await queues(tmp_path / "a")
    empty = await queues(tmp_path / "empty")
    assert synced == ["a", "empty"]
    await append_singles(q, 1, start=3)
    assert synced[2:] == [os.path.join("a", "commitlog", f"{0:020d}.clog")]  # then the data's
    assert [r.body for r in await read_all(q)] == [body(i) for i in range(4)]  # (RWF_DSYNC)
    assert empty.written_count == 0


async def test_sync_every_n_messages(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(sync=SyncPolicy(every_messages=10)))
    await append_singles(q, 25)
    assert (q.stats["batches"], q.stats["syncs"]) == (25, 2)
    await q.append([b"x"] * 4)
    assert q.stats["syncs"] == 2  # 5 + 4 unsynced
    await q.append([b"y"])
    assert q.stats["syncs"] == 3
    await asyncio.sleep(0.1)
    assert q.stats["syncs"] == 3  # no time rule


async def test_sync_every_ms_when_idle(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(sync=SyncPolicy(every_messages=10**9, every_ms=50)))
    await q.append([b"x"])
    await q.append([b"y"])
    assert q.stats["syncs"] == 0
    await asyncio.sleep(0.3)
    assert q.stats["syncs"] == 1  # one sync, once the oldest unsynced write was 50 ms old
    await asyncio.sleep(0.1)
    assert q.stats["syncs"] == 1  # nothing left to sync


async def test_sync_every_ms_under_sustained_load(tmp_path, queues):
    # the writer is never idle: the time rule must still hold between batches (without it,
    # never a sync). At least 0.6 s, and on until the third sync (at most 5 s: a sync of
    # megabytes can take a quarter of a second on a disk another test keeps busy)
    q = await queues(tmp_path, QueueOptions(sync=SyncPolicy(every_messages=10**9, every_ms=50),
                                            max_batch_bytes=1 << 20))
    futures = []
    t0 = time.monotonic()
    while (elapsed := time.monotonic() - t0) < 0.6 or (q.stats["syncs"] < 3 and elapsed < 5):
        futures.append(q.append([bytes(300_000)]))
        if len(futures) > 10:
            await futures.pop(0)
    await asyncio.gather(*futures)
    assert q.stats["batches"] > 10
    assert q.stats["syncs"] >= 3


# ---- retention and emptying ---------------------------------------------------

async def _four_segments(tmp_path, queues):
    """60 records of 136 bytes in segments of 15: bases 0, 2040, 4080, 6120 (active)."""
    q = await queues(tmp_path, QueueOptions(segment_bytes=2048, clog_entries_per_segment=8))
    await append_singles(q, 60, size=100)
    assert [base_of(f) for f in segment_files(q)] == [0, 2040, 4080, 6120]
    return q


def meta(q) -> dict:
    with open(os.path.join(q.path, "meta.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("kwargs,start", [
    (dict(before_offset=2039), 0), (dict(before_offset=2040), 2040),
    (dict(before_offset=4095), 4080), (dict(before_offset=10**9), 6120),
    (dict(max_bytes=8160), 0), (dict(max_bytes=6120), 2040), (dict(max_bytes=5000), 4080),
    (dict(max_bytes=0), 6120)])
async def test_retention_by_offset_and_size(tmp_path, queues, kwargs, start):
    q = await _four_segments(tmp_path, queues)
    assert await q.retain(**kwargs) == start
    await _check_retained(q, start, queues)


async def test_retention_by_age(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    files = segment_files(q)
    now = time.time()
    for f, age in zip(files, (5000, 4000, 10, 3000)):  # the third is young: it stops retention
        os.utime(f, (now - age, now - age))
    assert await q.retain(max_age_s=100) == 4080
    for f in segment_files(q):
        os.utime(f, (now - 5000, now - 5000))
    assert await q.retain(max_age_s=100) == 6120  # never the active segment
    await _check_retained(q, 6120, queues)


async def test_retention_keeps_finished_history_for_its_min_age(tmp_path, queues):
    """What every channel finished stays until its last write is min_age_s old (replay)."""
    q = await _four_segments(tmp_path, queues)
    files = segment_files(q)
    now = time.time()
    for f, age in zip(files, (5000, 4000, 10, 3000)):
        os.utime(f, (now - age, now - age))
    assert await q.retain(before_offset=10**9, min_age_s=3600) == 4080  # the third is young
    assert await q.retain(before_offset=2040, min_age_s=0) == 4080
    for f in segment_files(q):
        os.utime(f, (now - 5000, now - 5000))
    assert await q.retain(before_offset=4095, min_age_s=3600) == 4080  # not finished past it
    assert await q.retain(before_offset=10**9, min_age_s=3600) == 6120
    await _check_retained(q, 6120, queues)


async def _check_retained(q, start, queues):
    first = start // 136
    assert q.start_offset == start and q.start_count == first
    assert [base_of(f) for f in segment_files(q)] == [b for b in (0, 2040, 4080, 6120)
                                                       if b >= start]
    assert (meta(q)["start_offset"], meta(q)["start_count"]) == (start, first)
    records = await read_all(q)
    assert [r.msg_id for r in records] == list(range(first, 60))
    assert [r.body for r in records] == [body(i, 100) for i in range(first, 60)]
    if start:
        with pytest.raises(MissingSegmentError):
            await read_all(q, 0)
    a = await q.append([b"after"])
    assert (a.first_id, a.offset) == (60, 8160)
    path, options = q.path, q.options
    await q.close()
    q = await queues(path, options)
    assert (q.start_offset, q.start_count, q.written_count) == (start, first, 61)
    records = await read_all(q)
    assert [r.msg_id for r in records] == list(range(first, 61))
    assert (await q.find("msg_id", 59)).offset == 59 * 136
    a = await q.append([b"after reopen"])
    assert a.first_id == 61


async def test_empty_then_append_continues(tmp_path, queues):
    opts = QueueOptions(segment_bytes=2048)
    q = await queues(tmp_path, opts)
    await append_singles(q, 40, size=100)
    end, next_log = q.written_end, q.commitlog.next_log_id
    r = q.reader()
    await r.read(5)
    await q.empty()
    assert (q.start_offset, q.start_count, q.written_end, q.written_count) == (end, 40, end, 40)
    assert [base_of(f) for f in segment_files(q)] == [end]
    assert await read_all(q) == []
    assert await q.find("msg_id", 3) is None and len(q.commitlog) == 0
    a = await q.append([b"after empty"])
    assert (a.first_id, a.offset, a.log_id) == (40, end, next_log)
    assert [(x.msg_id, x.body) for x in await read_all(q)] == [(40, b"after empty")]
    r.close()
    await q.close()
    q = await queues(tmp_path, opts)
    assert (q.start_offset, q.written_count) == (end, 41)
    assert [(x.msg_id, x.body) for x in await read_all(q)] == [(40, b"after empty")]
    await q.empty()
    await q.close()
    q = await queues(tmp_path, opts)  # reopening an emptied queue with nothing after it
    assert (q.start_offset, q.written_end, q.written_count) == (a.end_offset, a.end_offset, 41)
    assert (await q.append([b"x"])).first_id == 41


@pytest.mark.parametrize("unlinked", [0, 1])
async def test_a_retention_cut_short_by_a_crash_is_finished_at_open(tmp_path, queues, unlinked):
    q = await _four_segments(tmp_path, queues)
    files = segment_files(q)
    saved = [open(f, "rb").read() for f in files[:2]]
    assert await q.retain(before_offset=4080) == 4080
    await q.close()
    # the crash came after meta.json was written, before the first or the second unlink
    for f, data in list(zip(files, saved))[unlinked:]:
        with open(f, "wb") as out:
            out.write(data)
    q = await queues(tmp_path, q.options)
    assert (q.start_offset, q.start_count) == (4080, 30)  # a pair that agrees
    assert [base_of(f) for f in segment_files(q)] == [4080, 6120]
    assert [r.msg_id for r in await read_all(q)] == list(range(30, 60))
    assert (await q.append([b"x"])).first_id == 60


async def test_an_empty_cut_short_by_a_crash_is_finished_at_open(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    saved = {d: {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}
             for d in (data_dir(q), q.commitlog.path)}
    next_log = q.commitlog.next_log_id
    await q.empty()
    await q.close()
    for d, files in saved.items():  # the crash came after meta.json, before any unlink
        shutil.rmtree(d)
        os.mkdir(d)
        for name, data in files.items():
            with open(os.path.join(d, name), "wb") as out:
                out.write(data)
    q = await queues(tmp_path, q.options)
    assert (q.start_offset, q.start_count, q.written_end, q.written_count) == (8160, 60, 8160, 60)
    assert await read_all(q) == []
    a = await q.append([b"x"])
    assert (a.first_id, a.offset, a.log_id) == (60, 8160, next_log)


async def test_find_by_all_methods(tmp_path, queues):
    q = await queues(tmp_path, QueueOptions(clog_entries_per_segment=5))
    results = []
    n = 0
    for i in range(30):
        k = 1 + i % 4
        results.append(await q.append([body(n + j) for j in range(k)]))
        n += k
    for a in results:
        want = (a.log_id, a.first_id, a.offset, a.end_offset - a.offset, a.count, a.first_id,
                a.timestamp)
        for method, value in (("offset", a.offset), ("offset", a.end_offset - 1),
                              ("msg_id", a.first_id), ("msg_id", a.first_id + a.count - 1),
                              ("count", a.first_id + a.count - 1)):
            e = await q.find(method, value)
            assert (e.log_id, e.first_msg_id, e.offset, e.size, e.msg_count, e.count_before,
                    e.timestamp) == want, (method, value)
        e = await q.find("timestamp", a.timestamp)
        assert e.log_id == min(b.log_id for b in results if b.timestamp >= a.timestamp)
        e = await q.find("timestamp", a.timestamp + 1)
        later = [b.log_id for b in results if b.timestamp > a.timestamp]
        assert (e.log_id if e else None) == (min(later) if later else None)
    assert await q.find("msg_id", n) is None
    assert await q.find("count", n) is None
    assert (await q.find("timestamp", 0)).log_id == 0
    with pytest.raises(AttributeError):
        await q.find("bogus", 1)


# ---- crash safety: faults on disk --------------------------------------------

@pytest.mark.parametrize("keep", [0, 1, 10, 36, 200, 535])
async def test_truncated_tail_is_cut_and_appends_continue(tmp_path, queues, keep):
    opts = QueueOptions(segment_bytes=8192)
    q = await queues(tmp_path, opts)
    results = await append_singles(q, 40, size=500)  # records of 536 bytes
    await q.close()
    last = results[-1]
    files = segment_files(tmp_path)
    assert len(files) > 1 and base_of(files[-1]) <= last.offset
    with open(files[-1], "r+b") as f:
        f.truncate(last.offset + keep - base_of(files[-1]))  # cut inside the last record
    q = await queues(tmp_path, opts)
    assert (q.written_end, q.written_count) == (last.offset, 39)
    assert os.path.getsize(files[-1]) == last.offset - base_of(files[-1])
    assert q.commitlog.last().log_id == 38 and q.commitlog.last().end_offset == last.offset
    records = await read_all(q)
    assert [r.body for r in records] == [body(i, 500) for i in range(39)]
    assert await q.find("msg_id", 39) is None
    a = await q.append([b"again"])
    assert (a.first_id, a.offset, a.log_id) == (39, last.offset, 39)
    check_commitlog_matches(q, await read_all(q))


@pytest.mark.parametrize("junk", ["partial_head", "partial_record", "zeros", "random"])
async def test_partial_bytes_after_the_tail_are_cut(tmp_path, queues, junk):
    q = await queues(tmp_path)
    results = await append_singles(q, 10)
    end = q.written_end
    await q.close()
    rec = bytearray()
    encode_into(rec, 10, 0, time.time_ns(), 0, b"", body(10, 400))
    extra = {"partial_head": bytes(rec[:20]), "partial_record": bytes(rec[:-1]),
             "zeros": bytes(100), "random": os.urandom(3000)}[junk]
    with open(segment_files(tmp_path)[-1], "ab") as f:
        f.write(extra)
    q = await queues(tmp_path)
    assert (q.written_end, q.written_count, len(q.commitlog)) == (end, 10, 10)
    assert os.path.getsize(segment_files(tmp_path)[-1]) == end
    assert [r.body for r in await read_all(q)] == [body(i) for i in range(10)]
    a = await q.append([b"next"])
    assert (a.first_id, a.offset) == (10, results[-1].end_offset)


async def test_records_without_commitlog_entries_get_rebuilt_entries(tmp_path, queues):
    # a crash between the data write and the commitlog write
    q = await queues(tmp_path)
    await q.append([body(0), body(1)])
    end = q.written_end
    await q.close()
    rec = bytearray()
    encode_into(rec, 2, 0, time.time_ns(), 0, b"", body(2))
    encode_into(rec, 3, 0, time.time_ns(), 0, b"{}", body(3))
    with open(segment_files(tmp_path)[-1], "ab") as f:
        f.write(rec)
    q = await queues(tmp_path)
    assert (q.written_end, q.written_count, len(q.commitlog)) == (end + len(rec), 4, 3)
    records = await read_all(q)
    assert [r.body for r in records] == [body(i) for i in range(4)]
    e = await q.find("msg_id", 3)
    assert (e.log_id, e.offset, e.msg_count, e.count_before) == (2, records[3].offset, 1, 3)
    check_commitlog_matches(q, records)
    assert (await q.append([b"x"])).first_id == 4


async def test_commitlog_that_lost_entries_across_a_rotation_is_rebuilt(tmp_path, queues):
    # a power loss with a lazy policy: rotation synced the data segments, but the
    # commitlog's last 35 entries (pointing into the last two segments) never hit the disk
    opts = QueueOptions(segment_bytes=2048, sync=SyncPolicy(every_messages=100))
    q = await queues(tmp_path, opts)
    await append_singles(q, 60, size=100)
    good = await read_all(q)
    await q.close()
    assert [base_of(f) for f in segment_files(tmp_path)] == [0, 2040, 4080, 6120]
    clog_dir = os.path.join(tmp_path, "commitlog")
    os.truncate(os.path.join(clog_dir, os.listdir(clog_dir)[0]), 25 * ENTRY_SIZE)
    q = await queues(tmp_path, opts)
    assert (q.written_end, q.written_count, len(q.commitlog)) == (60 * 136, 60, 60)
    assert await read_all(q) == good
    check_commitlog_matches(q, good)
    assert (await q.find("msg_id", 30)).offset == 30 * 136
    assert (await q.append([b"x"])).first_id == 60


async def test_flipped_bit_in_a_non_last_segment(tmp_path, queues):
    opts = QueueOptions(segment_bytes=2048)
    q = await queues(tmp_path, opts)
    await append_singles(q, 60, size=100)
    good = await read_all(q)
    await q.close()
    files = segment_files(tmp_path)
    assert len(files) == 4
    bad = next(r for r in good if r.offset >= base_of(files[1]) + 800)
    flip_bit(files[1], bad.offset - base_of(files[1]) + HEAD_SIZE + 50)
    q = await queues(tmp_path, opts)
    assert q.corrupt == [] and q.written_count == 60  # only the active segment is checked
    before = [r for r in good if r.offset < bad.offset]
    for read_ahead in (1 << 20, 200, 3000):
        records, err = await read_until_error(q, read_ahead=read_ahead)
        assert records == before
        assert err.offset == bad.offset and err.where == files[1]
    records, err = await read_until_error(q, before[-3].offset, max_count=1)
    assert records == before[-3:] and err.offset == bad.offset
    assert await read_all(q, bad.end) == [r for r in good if r.offset > bad.offset]
    assert (await q.append([b"x"])).first_id == 60


@pytest.mark.parametrize("where", ["body", "crc", "length_low", "length_high", "msg_id"])
async def test_flipped_bit_in_the_last_segment_keeps_the_data_after_it(tmp_path, queues, where):
    q = await queues(tmp_path)
    await append_singles(q, 20, size=300)
    await q.append([body(100), body(101), body(102)])
    good = await read_all(q)
    end = q.written_end
    await q.close()
    bad = good[10]
    pos, bit = {"body": (HEAD_SIZE + 100, 3), "crc": (1, 0), "length_low": (7, 0),
                "length_high": (5, 1), "msg_id": (15, 6)}[where]
    flip_bit(segment_files(tmp_path)[0], bad.offset + pos, bit)
    q = await queues(tmp_path)
    assert [off for off, _ in q.corrupt] == [bad.offset]
    assert (q.written_end, q.written_count, len(q.commitlog)) == (end, 23, 21)
    assert os.path.getsize(segment_files(tmp_path)[0]) == end
    records, err = await read_until_error(q)
    assert records == good[:10] and err.offset == bad.offset
    assert await read_all(q, bad.end) == good[11:]
    a = await q.append([b"after"])
    assert (a.first_id, a.offset) == (23, end)
    await q.close()
    q = await queues(tmp_path)  # and again: still kept, still reported
    assert [off for off, _ in q.corrupt] == [bad.offset] and q.written_count == 24


async def test_a_bad_record_in_the_last_batch_is_a_torn_tail(tmp_path, queues):
    """Power loss mid-sync can leave the last batch with a hole and later parts of it
    (and their commitlog entries) on disk. Nothing of that batch was acknowledged, and no
    entry after the hole says "everything before me was synced": the tail is cut, not
    kept as corruption that every reader would then trip over."""
    q = await queues(tmp_path)
    await append_singles(q, 10, size=300)  # ten batches, each synced
    last = await asyncio.gather(*[q.append([body(100 + i, 300)]) for i in range(3)])
    assert len({a.log_id for a in last}) == 3 and q.stats["batches"] == 11  # one batch
    await q.close()
    flip_bit(segment_files(tmp_path)[0], last[0].offset + HEAD_SIZE + 10, 2)
    q = await queues(tmp_path)
    assert q.corrupt == []
    assert (q.written_count, q.written_end, len(q.commitlog)) == (10, last[0].offset, 10)
    assert [r.body for r in await read_all(q)] == [body(i, 300) for i in range(10)]
    assert (await q.append([b"on"])).first_id == 10


async def test_a_corrupt_commitlog_entry_is_rebuilt_from_the_data(tmp_path, queues):
    """The commitlog is an index: a flipped bit in an entry recovery reads (its searches
    start at the middle entry) makes it rebuild the commitlog from the data, one entry
    per record, instead of refusing to open the partition."""
    q = await queues(tmp_path)
    await append_singles(q, 30, size=100)
    await q.append([body(100 + i, 100) for i in range(5)])  # one request, five records
    good = await read_all(q)
    await q.close()
    [clog_file] = [os.path.join(q.commitlog.path, n) for n in os.listdir(q.commitlog.path)
                   if n.endswith(".clog")]
    flip_bit(clog_file, 64 * 15 + 20, 1)  # entry 15 of 0..30: a binary search's first look
    q = await queues(tmp_path)
    assert (q.written_count, q.written_end) == (35, good[-1].end)
    assert len(q.commitlog) == 35, "rebuilt: one entry per record"
    assert await read_all(q) == good
    check_commitlog_matches(q, good)
    assert (await q.find("msg_id", good[20].msg_id)).offset == good[20].offset
    assert (await q.append([b"on"])).first_id == 35


async def test_readers_share_what_they_decoded(tmp_path, queues):
    """A second reader at a place the first one decoded gets the same records without
    decoding them again (channels of one partition read the same data); where no chunk
    has its place, it decodes for itself."""
    q = await queues(tmp_path)
    await q.append([body(i, 150) for i in range(300)])
    lead, follow = q.reader(), q.reader()
    first = await lead.read(200)
    assert q.shared_chunks.hits == 0
    a = await follow.read(50)
    b = await follow.read(500)
    assert a + b == first and q.shared_chunks.hits == 200
    rest = await follow.read(500)  # past the lead: decoded here, then shared the other way
    assert [r.body for r in rest] == [body(i, 150) for i in range(200, 300)]
    assert await lead.read(500) == rest and q.shared_chunks.hits == 300
    await q.empty()
    assert q.shared_chunks.take(first[0].offset, 10) == []
    lead.close()
    follow.close()


def test_shared_chunks_keep_disjoint_chunks_within_their_limit():
    from diskqueue.reader import SharedChunks

    recs = [Record(i * 10, 10, i, 0, 0, 0, b"", b"x") for i in range(400)]
    shared = SharedChunks(limit=250)
    shared.add(recs[0:100])
    shared.add(recs[50:150])  # overlaps: only 100..149 is new
    shared.add(recs[10:20])  # nothing new
    assert shared.take(recs[120].offset, 1000) == recs[120:150]
    assert shared.take(recs[60].offset, 5) == recs[60:65]
    assert shared.take(recs[60].offset + 3, 5) == []  # not a record boundary
    assert shared.take(recs[150].offset, 5) == []  # past what is held
    shared.add(recs[150:300])  # 300 held > 250: the oldest chunk goes
    assert shared.take(recs[0].offset, 5) == [] and shared.take(recs[299].offset, 5) == [recs[299]]
    assert shared.hits == 30 + 5 + 1


async def test_missing_middle_segment(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    await q.close()
    os.unlink(segment_files(tmp_path)[1])
    with pytest.raises(MissingSegmentError, match=r"\[2040, 4080\)"):
        await DiskQueue.open(str(tmp_path), q.options)


async def test_missing_last_segment_is_refused_not_cut(tmp_path, queues):
    """Even a small newest segment (less than a batch) is reported, never taken for a torn tail."""
    q = await _four_segments(tmp_path, queues)
    await q.append([b"small"])
    files = segment_files(tmp_path)
    assert os.path.getsize(files[-1]) < q.options.max_batch_bytes
    await q.close()
    os.unlink(files[-1])
    with pytest.raises(MissingSegmentError, match=f"{os.path.basename(files[-1])}.*missing"):
        await DiskQueue.open(str(tmp_path), q.options)
    assert len(segment_files(tmp_path)) == len(files) - 1, "nothing cut or created"


@pytest.mark.parametrize("durable", [True, False])
async def test_lost_unsynced_tail_of_a_lazy_policy(tmp_path, queues, durable):
    """Power loss under --sync-every N can take many unsynced batches with it (and the
    commitlog's entries for them). A lazy queue cuts the commitlog to the data and goes
    on; a durable one, where at most one batch is ever unsynced, refuses: for it, data
    missing far behind the commitlog is loss of acknowledged data."""
    small = dict(max_batch_bytes=1024, segment_bytes=1 << 20)
    lazy = QueueOptions(sync=SyncPolicy(every_messages=1000), **small)
    q = await queues(tmp_path, lazy)
    appended = await append_singles(q, 50, size=100)
    await q.close()
    [seg] = segment_files(tmp_path)
    cut = appended[20].offset + 50  # record 20 torn, 21..49 gone
    os.truncate(seg, cut)
    options = QueueOptions(**small) if durable else lazy
    if durable:
        with pytest.raises(MissingSegmentError, match="unsynced batch is missing"):
            await DiskQueue.open(str(tmp_path), options)
        return
    q = await queues(tmp_path, options)
    assert q.written_count == 20 and q.written_end == appended[20].offset
    assert [r.body for r in await read_all(q)] == [body(i, 100) for i in range(20)]
    check_commitlog_matches(q, await read_all(q))
    assert (await q.append([b"on"])).first_id == 20


async def test_missing_only_segment_is_refused(tmp_path, queues):
    """With every data file gone, open refuses: it never starts an empty history that would
    hand out the lost messages' ids again."""
    q = await queues(tmp_path)
    await append_singles(q, 100)
    await q.close()
    [only] = segment_files(tmp_path)
    os.unlink(only)
    with pytest.raises(MissingSegmentError, match=os.path.basename(only)):
        await DiskQueue.open(str(tmp_path), q.options)
    assert segment_files(tmp_path) == [], "nothing created"


async def test_empty_of_an_empty_queue_survives_reopen(tmp_path, queues):
    """empty() when nothing was written since the last empty keeps the file newest.json
    names, so the next open takes nothing for lost."""
    q = await queues(tmp_path)
    await q.empty()
    await q.empty()
    await q.close()
    q = await queues(tmp_path)
    assert (await q.append([b"x"])).first_id == 0


async def test_newest_segment_record_follows_rotation_and_empty(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    newest = os.path.join(tmp_path, "data", "newest.json")
    assert json.load(open(newest))["base"] == base_of(segment_files(tmp_path)[-1])
    await q.empty()
    assert json.load(open(newest))["base"] == q.written_end
    await q.append([b"again"])
    await q.close()
    q = await queues(tmp_path, q.options)
    assert q.written_count == 1 + (await read_all(q))[0].msg_id


async def test_missing_first_segment(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    await q.close()
    os.unlink(segment_files(tmp_path)[0])
    with pytest.raises(MissingSegmentError, match=r"offset 0 .*2040"):
        await DiskQueue.open(str(tmp_path), q.options)


async def test_missing_first_segment_after_retention(tmp_path, queues):
    q = await _four_segments(tmp_path, queues)
    assert await q.retain(before_offset=2040) == 2040
    await q.close()
    assert meta(q)["start_offset"] == 2040
    os.unlink(segment_files(tmp_path)[0])
    with pytest.raises(MissingSegmentError, match="2040") as e:
        await DiskQueue.open(str(tmp_path), q.options)
    assert "4080" in str(e.value)


async def test_deleted_commitlog_is_rebuilt_from_the_data(tmp_path, queues):
    opts = QueueOptions(segment_bytes=2048, clog_entries_per_segment=8)
    q = await queues(tmp_path, opts)
    for i in range(0, 60, 3):
        await q.append([body(i, 100), body(i + 1, 100), body(i + 2, 100)])
    good = await read_all(q)
    await q.close()
    shutil.rmtree(os.path.join(tmp_path, "commitlog"))
    q = await queues(tmp_path, opts)
    assert (q.written_end, q.written_count) == (60 * 136, 60)
    assert await read_all(q) == good
    assert len(q.commitlog) == 60  # the request boundaries are gone: one entry per record
    for r in good:
        for method, value in (("msg_id", r.msg_id), ("count", r.msg_id), ("offset", r.offset),
                              ("offset", r.end - 1)):
            e = await q.find(method, value)
            assert (e.log_id, e.offset, e.size, e.first_msg_id, e.msg_count) == (
                r.msg_id, r.offset, r.size, r.msg_id, 1)
        e = await q.find("timestamp", r.timestamp)
        assert e.timestamp == r.timestamp and e.offset <= r.offset
    check_commitlog_matches(q, good)
    a = await q.append([b"next"])
    assert (a.first_id, a.log_id, a.offset) == (60, 60, 60 * 136)


# ---- failed writes -----------------------------------------------------------

def fail_once(monkeypatch, name, error, when):
    """Make os.<name> raise OSError(error) the first time `when(*args)` is true."""
    real = getattr(os, name)
    state = {"failed": 0}

    def fake(*args, **kwargs):
        if not state["failed"] and when(*args):
            state["failed"] += 1
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)
    return state


def is_data_fd(q):
    def when(fd, *_):
        return os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == data_dir(q)
    return when


@pytest.mark.parametrize("call,what", [("pwritev", "data"), ("pwrite", "commitlog"),
                                       ("open", "new segment")])
async def test_a_failed_batch_leaves_everything_as_before(tmp_path, queues, monkeypatch, call,
                                                          what):
    q = await queues(tmp_path, QueueOptions(segment_bytes=4096))
    await append_singles(q, 5, size=1000)  # the active segment is nearly full
    end, next_log = q.written_end, q.commitlog.next_log_id
    if what == "new segment":
        new_file = os.path.join(data_dir(q), f"{end:020d}.dat")
        state = fail_once(monkeypatch, "open", errno.EMFILE, lambda path, *_: path == new_file)
    elif what == "data":  # a durable write (written and synced in one call) that wrote
        state = fail_once(monkeypatch, call, errno.ENOSPC, is_data_fd(q))  # nothing: disk full
    else:
        state = fail_once(monkeypatch, call, errno.EIO,
                          lambda fd, *_: "commitlog" in os.readlink(f"/proc/self/fd/{fd}"))
    batch = [q.append([body(5 + i, 1000)]) for i in range(3)]
    results = await asyncio.gather(*batch, return_exceptions=True)
    assert state["failed"] == 1
    assert all(type(r) in (AppendError, DiskFullError) for r in results), results
    assert (q.written_end, q.written_count, q.commitlog.next_log_id) == (end, 5, next_log)
    assert sum(os.path.getsize(f) for f in segment_files(q)) == end
    # the error has passed: the queue goes on, with the ids the failed batch did not use
    more = [await q.append([body(100 + i, 1000)]) for i in range(4)]
    assert [a.first_id for a in more] == [5, 6, 7, 8]
    assert more[0].offset == end and more[0].log_id == next_log
    want = [body(i, 1000) for i in range(5)] + [body(100 + i, 1000) for i in range(4)]
    assert [r.body for r in await read_all(q)] == want
    check_commitlog_matches(q, await read_all(q))
    await q.close()
    q = await queues(tmp_path, QueueOptions(segment_bytes=4096))
    assert [r.body for r in await read_all(q)] == want and q.written_count == 9


@pytest.mark.parametrize("what", ["data", "commitlog"])
async def test_a_failed_sync_fails_the_queue_until_reopened(tmp_path, queues, monkeypatch, what):
    """After a failed fdatasync the kernel may have dropped the unsynced pages: the batch
    fails, and so does every later append, until a reopen trusts only what is on disk.
    The commitlog is synced once 8 entries are unsynced: with the failing batch's 3."""
    opts = QueueOptions(segment_bytes=1 << 20, clog_sync_every=8)
    q = await queues(tmp_path, opts)
    await append_singles(q, 5, size=1000)
    end = q.written_end
    if what == "data":  # a durable batch's data is written and synced in one call (DSYNC)
        state = fail_once(monkeypatch, "pwritev", errno.EIO, is_data_fd(q))
    else:
        state = fail_once(monkeypatch, "fdatasync", errno.EIO,
                          lambda fd, *_: "commitlog" in os.readlink(f"/proc/self/fd/{fd}"))
    results = await asyncio.gather(*[q.append([body(5 + i, 1000)]) for i in range(3)],
                                   return_exceptions=True)
    assert state["failed"] == 1
    assert all(type(r) is QueueFailedError for r in results), results
    assert "sync failed" in str(results[0]) and q.failed is not None
    assert q.written_end == end and q.committed_end == end  # nothing of it was acknowledged
    with pytest.raises(QueueFailedError):
        q.append([b"later"])
    assert [r.body for r in await read_all(q)] == [body(i, 1000) for i in range(5)]
    await q.close()
    q = await queues(tmp_path, opts)
    # What was acknowledged is there; the unacknowledged batch may be too (it reached the
    # page cache), never in part, and appending goes on after it.
    got = [r.body for r in await read_all(q)]
    assert got[:5] == [body(i, 1000) for i in range(5)]
    assert got[5:] in ([], [body(5 + i, 1000) for i in range(3)])
    a = await q.append([b"after"])
    assert a.first_id == len(got)
    check_commitlog_matches(q, await read_all(q))


def fail_slowly_once(monkeypatch, name, error, when, delay=0.3):
    """Like fail_once, the failing call first sleeping `delay` s (in the write worker), so
    the loop hands the next batch over while it runs."""
    real = getattr(os, name)
    state = {"failed": 0}

    def fake(*args, **kwargs):
        if not state["failed"] and when(*args):
            state["failed"] += 1
            time.sleep(delay)
            raise OSError(error, os.strerror(error))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)
    return state


async def hand_over_ahead(q, first: list[bytes], second: list[bytes]):
    """Append `first`, then, while its batch is in the worker, `second`: handed over ahead
    (both in flight). Returns both futures."""
    a = q.append(first)
    for _ in range(100):
        await asyncio.sleep(0.002)
        if q._flight:
            break
    b = q.append(second)
    await asyncio.sleep(0.02)
    assert len(q._flight) == 2, "the second batch was not handed over ahead"
    return a, b


async def test_a_batch_handed_over_ahead_of_a_failed_one_is_written_in_its_place(
        tmp_path, queues, monkeypatch):
    """A durable queue hands the next batch to the write worker while one is in flight,
    encoded for the place after it. When the one before fails (and is undone), the next is
    not written there: it comes back and is written in the failed batch's place, with its
    ids."""
    q = await queues(tmp_path)
    await append_singles(q, 5, size=100)
    end, next_log = q.written_end, q.commitlog.next_log_id
    state = fail_slowly_once(monkeypatch, "pwritev", errno.ENOSPC, is_data_fd(q))
    a, b = await hand_over_ahead(q, [body(5, 100)], [body(6, 100), body(7, 100)])
    with pytest.raises(AppendError):
        await a
    got = await b
    assert state["failed"] == 1
    assert (got.first_id, got.offset, got.log_id) == (5, end, next_log)
    want = [body(i, 100) for i in range(5)] + [body(6, 100), body(7, 100)]
    assert [r.body for r in await read_all(q)] == want
    check_commitlog_matches(q, await read_all(q))
    await q.close()
    q = await queues(tmp_path)
    assert [r.body for r in await read_all(q)] == want


async def test_a_batch_handed_over_ahead_of_a_failed_sync_is_never_written(
        tmp_path, queues, monkeypatch):
    """After a failed sync nothing more is written (the unsynced pages may be gone), not
    even a batch already handed to the worker ahead of it: both fail, and the files end
    with the failed batch at most."""
    q = await queues(tmp_path)
    await append_singles(q, 5, size=100)
    state = fail_slowly_once(monkeypatch, "pwritev", errno.EIO, is_data_fd(q))
    a, b = await hand_over_ahead(q, [body(5, 100)], [body(6, 100)])
    results = await asyncio.gather(a, b, return_exceptions=True)
    assert state["failed"] == 1
    assert all(type(r) is QueueFailedError for r in results), results
    await q.close()
    q = await queues(tmp_path)
    got = [r.body for r in await read_all(q)]
    assert got in ([body(i, 100) for i in range(5)], [body(i, 100) for i in range(6)])


async def test_a_failed_timed_sync_fails_the_queue_once(tmp_path, queues, monkeypatch):
    """Under --sync-timeout a failed timed sync fails the queue; the writer then waits
    for close instead of retrying the sync in a busy loop."""
    q = await queues(tmp_path, QueueOptions(sync=SyncPolicy(every_messages=1000, every_ms=50)))
    await q.append([b"unsynced"])
    calls = {"n": 0}
    real = os.fdatasync

    def failing(fd):
        calls["n"] += 1
        raise OSError(errno.EIO, "simulated")

    monkeypatch.setattr(os, "fdatasync", failing)
    await asyncio.sleep(0.5)
    assert q.failed is not None and "sync failed" in str(q.failed)
    assert calls["n"] <= 2, f"{calls['n']} sync attempts: the writer spins"
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(QueueFailedError):
        q.append([b"later"])


async def test_the_writer_survives_a_bad_request(tmp_path, queues):
    """A request the encoder cannot take fails its batch (a batch resolves as one), and
    the writer goes on with the next batches."""
    q = await queues(tmp_path)
    same_batch = await asyncio.gather(q.append(["not bytes"]), q.append([b"fine"]),
                                      return_exceptions=True)
    assert [type(r) for r in same_batch] == [AppendError, AppendError]
    assert q.written_count == 0 and q.failed is None
    a = await q.append([b"next"])
    assert (a.first_id, a.offset) == (0, 0)
    assert [r.body for r in await read_all(q)] == [b"next"]
    with pytest.raises(ValueError):
        q.append([])


# ---- crash safety: a full disk -----------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs to fill (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


async def test_full_disk(small_disk, queues):
    ballast = small_disk / "ballast"
    ballast.write_bytes(os.urandom(256 * 1024))
    opts = QueueOptions(segment_bytes=64 * 1024, clog_entries_per_segment=128)
    path = small_disk / "q"
    q = await queues(path, opts)
    rng = random.Random(7)
    acked = []  # (Appended, bodies)
    failures = 0
    fails_in_a_row = 0
    n = 0
    while fails_in_a_row < 3:
        requests = []
        for _ in range(8):
            k = rng.choice([1, 1, 2, 4])
            requests.append([body(n + i, rng.randint(1, 6000)) for i in range(k)])
            n += k
        results = await asyncio.gather(*(q.append(b) for b in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for r in errors:
            assert isinstance(r, DiskFullError), repr(r)
        failures += len(errors)
        fails_in_a_row = fails_in_a_row + 1 if len(errors) == len(results) else 0
        acked += [(r, b) for r, b in zip(results, requests) if not isinstance(r, BaseException)]
        # whatever failed left nothing behind: the files hold exactly what was acknowledged
        on_disk = sum(os.path.getsize(f) for f in segment_files(path))
        assert on_disk == q.written_end
        assert len(q.commitlog) == len(acked)
        assert n < 100_000, "the disk never filled up"
    assert failures >= 24 and len(acked) > 100
    assert shutil.disk_usage(small_disk).free < 64 * 1024

    async def check_all_acked():
        records = await read_all(q)
        want = [(a.first_id + i, a.offsets[i], b[i]) for a, b in acked for i in range(a.count)]
        want.sort()
        assert [(r.msg_id, r.offset, r.body) for r in records] == want
        assert [r.msg_id for r in records] == list(range(len(records)))
        check_commitlog_matches(q, records)
        return len(records)

    count = await check_all_acked()
    assert q.written_count == count
    with pytest.raises(DiskFullError):
        await q.append([os.urandom(100_000)])
    await q.close()
    q = await queues(path, opts)
    assert q.corrupt == [] and q.written_count == count
    assert await check_all_acked() == count
    ballast.unlink()
    a = await q.append([b"room again"])
    assert (a.first_id, a.offset) == (count, q.written_end - HEAD_SIZE - 10)
    big = await q.append([os.urandom(3000) for _ in range(20)])
    assert big.first_id == count + 1
    await q.close()
    q = await queues(path, opts)
    assert q.written_count == count + 21
    assert (await read_all(q, a.offset))[0].body == b"room again"



async def test_find_waits_for_retention(tmp_path, queues, monkeypatch):
    """A search never reads commitlog segments while retention is dropping them."""
    q = await queues(tmp_path, QueueOptions(segment_bytes=1024, clog_entries_per_segment=4))
    done = [await q.append([body(i)]) for i in range(100)]
    dropping, release = threading.Event(), threading.Event()

    def slow_drop(*_):  # the unlink of a commitlog segment that retention drops
        dropping.set()
        release.wait(5)

    fdhooks.hook(monkeypatch, "unlink", fdhooks.under(q.commitlog.path), slow_drop)
    retain = asyncio.create_task(q.retain(before_offset=done[-1].offset))
    await asyncio.get_running_loop().run_in_executor(None, dropping.wait, 5)
    find = asyncio.create_task(q.find("msg_id", done[-1].first_id))
    await asyncio.sleep(0.2)
    assert not find.done(), "find ran while retention was dropping segments"
    release.set()
    assert await retain > 0
    assert (await find).first_msg_id == done[-1].first_id
