"""Unit and property tests of commitlog/log.py."""

import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commitlog.entry import ENTRY_SIZE, CorruptEntryError, Entry, decode, encode
from commitlog.log import CommitLog, CommitLogError

EPS = 7  # entries per segment: small, so that rotation happens all the time
# the property tests make hundreds of logs: on tmpfs when there is one, where a sync costs nothing
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None


def make_entries(first_log_id: int, n: int, offset: int = 0, count: int = 0, ts: int = 1000,
                 size: int = 100, msgs: int = 2) -> list[Entry]:
    out = []
    for i in range(n):
        out.append(Entry(first_log_id + i, 3, count, offset, count, ts, size, msgs))
        offset += size
        count += msgs
        ts += 5
    return out


def open_log(path, eps=EPS, start=0) -> CommitLog:
    log = CommitLog(str(path), eps)
    log.open(start)
    return log


def segment_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".clog"))


def all_entries(log: CommitLog) -> list[Entry]:
    return list(log.entries())


def test_entry_codec_round_trip_and_checksum():
    e = Entry(1, 2, 3, 4, 5, 6, 7, 8)
    raw = encode(e)
    assert len(raw) == ENTRY_SIZE and decode(raw) == e
    for i in range(60 * 8):
        bad = bytearray(raw)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptEntryError):
            decode(bytes(bad))


def test_append_get_last(tmp_path):
    log = open_log(tmp_path)
    assert len(log) == 0 and log.last() is None
    with pytest.raises(KeyError):
        log.get(0)
    entries = make_entries(0, 5)
    log.append(entries[:2])
    log.append(entries[2:])
    assert len(log) == 5 and log.next_log_id == 5
    assert [log.get(i) for i in range(5)] == entries
    assert log.last() == entries[-1]
    assert all_entries(log) == entries
    assert list(log.entries(3)) == entries[3:]
    for bad in (-1, 5, 100):
        with pytest.raises(KeyError):
            log.get(bad)


@pytest.mark.parametrize("ids", [[1], [4], [6], [5, 7], [5, 6, 6], [5, 6, 8]])
def test_append_rejects_log_ids_that_do_not_continue_the_log(tmp_path, ids):
    log = open_log(tmp_path)
    log.append(make_entries(0, 5))
    with pytest.raises(ValueError):
        log.append([Entry(i, 0, 0, 0, 0, 0, 0, 0) for i in ids])
    assert log.next_log_id == 5
    assert os.path.getsize(tmp_path / segment_files(tmp_path)[0]) == 5 * ENTRY_SIZE
    log.append(make_entries(5, 1, offset=500, count=10))  # the right id still goes in
    assert log.last().log_id == 5


def test_rotation_and_reopen(tmp_path):
    log = open_log(tmp_path)
    entries = make_entries(0, 50)
    chunks = [1, 6, 7, 8, 3, 13, 12]
    pos = 0
    for n in chunks:
        log.append(entries[pos:pos + n])
        pos += n
    assert pos == 50
    log.sync()
    assert all_entries(log) == entries
    files = segment_files(tmp_path)
    assert files == [f"{b:020d}.clog" for b in range(0, 50, EPS)]
    for name in files[:-1]:
        assert os.path.getsize(tmp_path / name) == EPS * ENTRY_SIZE
    assert os.path.getsize(tmp_path / files[-1]) == (50 % EPS) * ENTRY_SIZE
    log.close()
    log = open_log(tmp_path)
    assert (log.first_log_id, log.next_log_id) == (0, 50)
    assert all_entries(log) == entries
    log.append(make_entries(50, 1, offset=5000, count=100, ts=2000))
    assert log.last().log_id == 50


def test_truncate_after(tmp_path):
    log = open_log(tmp_path)
    entries = make_entries(0, 30)
    log.append(entries)
    log.truncate_after(29)
    assert len(log) == 30
    log.truncate_after(16)
    assert log.next_log_id == 17 and all_entries(log) == entries[:17]
    assert segment_files(tmp_path) == [f"{b:020d}.clog" for b in (0, 7, 14)]
    log.truncate_after(13)  # exactly at a segment boundary: the next segment is emptied
    assert log.next_log_id == 14 and all_entries(log) == entries[:14]
    log.truncate_after(2)
    assert log.next_log_id == 3 and segment_files(tmp_path) == [f"{0:020d}.clog"]
    assert os.path.getsize(tmp_path / segment_files(tmp_path)[0]) == 3 * ENTRY_SIZE
    log.truncate_after(-1)
    assert len(log) == 0 and log.last() is None
    log.append(entries[:9])  # the log continues where it was cut
    log.close()
    log = open_log(tmp_path)
    assert all_entries(log) == entries[:9]


def test_reset(tmp_path):
    log = open_log(tmp_path)
    log.append(make_entries(0, 20))
    log.reset(20)
    assert len(log) == 0 and log.last() is None
    assert (log.first_log_id, log.next_log_id) == (20, 20)
    assert segment_files(tmp_path) == [f"{20:020d}.clog"]
    with pytest.raises(ValueError):
        log.append(make_entries(0, 1))
    more = make_entries(20, 10, offset=2000, count=40)
    log.append(more)
    log.close()
    log = open_log(tmp_path)
    assert (log.first_log_id, log.next_log_id) == (20, 30)
    assert all_entries(log) == more
    log.reset(25)  # back to a place inside the old entries: still nothing survives
    log.close()
    log = open_log(tmp_path)
    assert (log.first_log_id, log.next_log_id) == (25, 25)


def test_open_at_a_start_log_id(tmp_path):
    log = open_log(tmp_path, start=40)
    assert (log.first_log_id, log.next_log_id) == (40, 40)
    entries = make_entries(40, 10)
    log.append(entries)
    assert all_entries(log) == entries
    assert segment_files(tmp_path) == [f"{40:020d}.clog", f"{47:020d}.clog"]


def _tail_file(path):
    return path / segment_files(path)[-1]


@pytest.mark.parametrize("garbage", [b"\x01" * 30, b"\x00" * 63, os.urandom(64), bytes(64),
                                     os.urandom(64 * 3 + 17)],
                         ids=["ones-30", "zeros-63", "random-64", "zeros-64", "random-209"])
def test_torn_tail_is_cut_on_open(tmp_path, garbage):
    log = open_log(tmp_path)
    entries = make_entries(0, 10)
    log.append(entries)
    log.close()
    with open(_tail_file(tmp_path), "ab") as f:
        f.write(garbage)
    log = open_log(tmp_path)
    assert all_entries(log) == entries
    assert os.path.getsize(_tail_file(tmp_path)) == (10 - 7) * ENTRY_SIZE
    log.append(make_entries(10, 1, offset=1000, count=20))  # appends go where the tail was
    log.close()
    log = open_log(tmp_path)
    assert len(log) == 11 and log.get(10).offset == 1000


def test_torn_tail_filling_a_new_segment_is_cut(tmp_path):
    log = open_log(tmp_path)
    entries = make_entries(0, 7)
    log.append(entries)
    log.close()
    with open(tmp_path / f"{7:020d}.clog", "wb") as f:
        f.write(os.urandom(ENTRY_SIZE * 2 + 5))
    log = open_log(tmp_path)
    assert all_entries(log) == entries and log.next_log_id == 7
    log.append(make_entries(7, 1, offset=700, count=14))
    assert log.get(7).offset == 700


def test_bad_last_entries_are_cut_on_open(tmp_path):
    log = open_log(tmp_path)
    entries = make_entries(0, 10)
    log.append(entries)
    log.close()
    tail = _tail_file(tmp_path)
    with open(tail, "r+b") as f:
        f.seek(2 * ENTRY_SIZE + 20)  # entry 9: a flipped bit
        byte = f.read(1)
        f.seek(2 * ENTRY_SIZE + 20)
        f.write(bytes([byte[0] ^ 0x10]))
    log = open_log(tmp_path)
    assert all_entries(log) == entries[:9]
    # a well-formed entry at the wrong place (log id 3 written at place 9) is cut too
    with open(tail, "ab") as f:
        f.write(encode(entries[3]))
    log.close()
    log = open_log(tmp_path)
    assert all_entries(log) == entries[:9]
    assert os.path.getsize(tail) == 2 * ENTRY_SIZE


@pytest.mark.parametrize("damage", ["zeroed", "stale"])
def test_the_first_bad_entry_of_the_unsynced_window_cuts_the_log(tmp_path, damage):
    """A power loss can lose any page of the last `sync_every` entries and keep later
    ones: open checks each of them and cuts at the first bad one, even when good entries
    follow it. Entries before the window were synced and are not read again."""
    log = CommitLog(str(tmp_path), 1000, sync_every=20)
    log.open()
    entries = make_entries(0, 50)
    log.append(entries)
    log.close()
    [file] = [os.path.join(tmp_path, n) for n in segment_files(tmp_path)]
    with open(file, "r+b") as f:
        f.seek(40 * ENTRY_SIZE)
        if damage == "zeroed":
            f.write(bytes(2 * ENTRY_SIZE))  # entries 40 and 41; 42..49 survive
        else:  # well-formed entries that do not follow the one before (an older write)
            f.write(encode(entries[40]._replace(offset=7, count_before=1)))
    log = CommitLog(str(tmp_path), 1000, sync_every=20)
    log.open()
    assert all_entries(log) == entries[:40]
    # a bad entry before the window is not looked for (it was synced): open leaves it
    log.close()
    with open(file, "r+b") as f:
        f.seek(5 * ENTRY_SIZE)
        f.write(bytes(ENTRY_SIZE))
    log = CommitLog(str(tmp_path), 1000, sync_every=20)
    log.open()
    assert len(log) == 40


def test_append_syncs_every_sync_every_entries(tmp_path, monkeypatch):
    log = open_log(tmp_path, eps=1000)
    log.sync_every = 8
    log.sync()  # what open found (see the next test)
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    log.append(make_entries(0, 20))
    assert synced == [8 * ENTRY_SIZE, 16 * ENTRY_SIZE] and not log.sync_due
    log.append_encoded(b"".join(map(encode, make_entries(20, 8, offset=2000, count=40))), 8)
    assert log.sync_due and synced == [8 * ENTRY_SIZE, 16 * ENTRY_SIZE]  # its caller syncs
    log.sync()
    assert synced[-1] == 28 * ENTRY_SIZE and not log.sync_due


def test_open_syncs_only_a_cut_and_what_it_found_is_synced_before_the_first_append(
        tmp_path, monkeypatch):
    """A start of many partitions spends no sync on a log it does not cut (one cost 0.3 ms,
    two of them most of a partition's open: bench/scale.py); what it found is synced before
    anything is written after it, as when `open` synced it."""
    log = open_log(tmp_path, eps=1000)
    log.append(make_entries(0, 5))
    log.close()
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    log = open_log(tmp_path, eps=1000)
    log.truncate_after(4)  # cuts nothing: writes nothing
    assert synced == [] and len(log) == 5
    log.append(make_entries(5, 1, offset=500, count=10))
    assert synced == [5 * ENTRY_SIZE]  # what open found, before the first entry after it
    log.truncate_after(4)  # a cut is synced at once
    assert synced == [5 * ENTRY_SIZE, 5 * ENTRY_SIZE]
    log.close()
    log = open_log(tmp_path, eps=1000)
    log.sync()  # nothing appended since open: still synced by sync() (and so by a close)
    assert synced == [5 * ENTRY_SIZE] * 3
    log.close()
    with open(os.path.join(tmp_path, segment_files(tmp_path)[0]), "ab") as f:
        f.write(b"torn")  # a torn entry: open cuts it, and syncs the cut
    log = open_log(tmp_path, eps=1000)
    assert synced == [5 * ENTRY_SIZE] * 4 and len(log) == 5
    log.sync()
    assert len(synced) == 4
    empty = CommitLog(str(tmp_path / "empty"), 1000)
    empty.open()
    empty.close()
    empty.open()
    empty.reset(0)  # an empty log reset where it is: nothing written
    assert len(synced) == 4


def test_gap_between_segments_is_an_error(tmp_path):
    log = open_log(tmp_path)
    log.append(make_entries(0, 20))
    log.close()
    with open(tmp_path / f"{7:020d}.clog", "r+b") as f:
        f.truncate(3 * ENTRY_SIZE)
    with pytest.raises(CommitLogError, match="gap"):
        open_log(tmp_path)
    os.unlink(tmp_path / f"{7:020d}.clog")
    with pytest.raises(CommitLogError, match="gap"):
        open_log(tmp_path)


def test_drop_before_offset(tmp_path):
    log = open_log(tmp_path)
    entries = make_entries(0, 30, size=10)  # entry i covers offsets [10 i, 10 i + 10)
    log.append(entries)
    assert log.drop_before_offset(69) == 0  # segment 0's last entry ends at 70
    assert log.drop_before_offset(70) == 1
    assert log.first_log_id == 7 and all_entries(log) == entries[7:]
    assert segment_files(tmp_path)[0] == f"{7:020d}.clog"
    assert log.drop_before_offset(215) == 2
    assert log.first_log_id == 21
    assert log.drop_before_offset(10**9) == 1  # never the last segment
    assert log.first_log_id == 28 and all_entries(log) == entries[28:]
    assert log.get(29) == entries[29]
    with pytest.raises(KeyError):
        log.get(27)
    log.close()
    log = open_log(tmp_path)
    assert (log.first_log_id, log.next_log_id) == (28, 30)
    assert log.find_by_offset(5) is None
    assert log.find_by_offset(285) == entries[28]


# ---- searches against a brute force ------------------------------------------

@st.composite
def monotonic_entries(draw):
    """A log as the writer makes it: offsets, ids and counts contiguous, timestamps non-decreasing.

    Empty requests (no message, no byte) and repeated timestamps are allowed.
    """
    first_log_id = draw(st.integers(0, 20))
    n = draw(st.integers(0, 40))
    offset = draw(st.integers(0, 10**6))
    count = draw(st.integers(0, 10**6))
    prefix = draw(st.integers(0, 3)) << 50
    ts = draw(st.integers(0, 10**12))
    entries = []
    for i in range(n):
        msgs = draw(st.integers(0, 5))
        size = 0 if msgs == 0 else draw(st.integers(msgs * 36, msgs * 500))
        entries.append(Entry(first_log_id + i, 1, prefix | count, offset, count, ts, size, msgs))
        offset += size
        count += msgs
        ts += draw(st.sampled_from([0, 0, 1, 1000, 10**6]))
    return first_log_id, entries


def brute(entries, method, value):
    if method == "offset":
        found = [e for e in entries if e.offset <= value]
        return found[-1] if found else None
    if method == "msg_id":
        found = [e for e in entries if e.first_msg_id <= value < e.first_msg_id + e.msg_count]
    elif method == "count":
        found = [e for e in entries if e.count_before <= value < e.count_after]
    else:
        found = [e for e in entries if e.timestamp >= value][:1]
    assert len(found) <= 1
    return found[0] if found else None


def probes(entries, method, extra):
    values = set(extra)
    for e in entries:
        v = {"offset": e.offset, "msg_id": e.first_msg_id, "count": e.count_before,
             "timestamp": e.timestamp}[method]
        top = {"offset": e.end_offset, "msg_id": e.first_msg_id + e.msg_count,
               "count": e.count_after, "timestamp": e.timestamp}[method]
        values.update((v - 1, v, v + 1, top - 1, top, top + 1))
    return sorted(values)


@settings(max_examples=150, deadline=None)
@given(monotonic_entries(), st.lists(st.integers(0, 2**53), max_size=10), st.integers(1, 9))
def test_searches_agree_with_a_linear_search(log_and_entries, extra, eps):
    first_log_id, entries = log_and_entries
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        log = CommitLog(d, eps)
        log.open(first_log_id)
        log.append(entries)
        for reopened in (False, True):
            if reopened:
                log.close()
                log = CommitLog(d, eps)
                log.open(first_log_id)
            assert all_entries(log) == entries
            for method in ("offset", "msg_id", "count", "timestamp"):
                find = getattr(log, f"find_by_{method}")
                for value in probes(entries, method, extra):
                    assert find(value) == brute(entries, method, value), (method, value)
        # after dropping old segments, the searches cover what is left
        if entries:
            cut = entries[len(entries) // 2].offset
            log.drop_before_offset(cut)
            kept = entries[log.first_log_id - first_log_id:]
            assert all(e.end_offset > cut for e in kept[eps:])
            for method in ("offset", "msg_id", "count", "timestamp"):
                find = getattr(log, f"find_by_{method}")
                for value in probes(kept, method, extra):
                    assert find(value) == brute(kept, method, value), (method, value)
        log.close()


@settings(max_examples=60, deadline=None)
@given(monotonic_entries(), st.integers(1, 9), st.data())
def test_drop_before_offset_agrees_with_a_linear_search(log_and_entries, eps, data):
    first_log_id, entries = log_and_entries
    end = entries[-1].end_offset if entries else 0
    cut = data.draw(st.integers(0, end + 10), label="cut")
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        log = CommitLog(d, eps)
        log.open(first_log_id)
        log.append(entries)
        # segments in order; drop each that is not the last, whose next segment has an entry,
        # and whose entries all end at or before `cut`
        segs = [entries[i:i + eps] for i in range(0, len(entries), eps)] or [[]]
        want = 0
        while want + 1 < len(segs) and segs[want + 1] and all(
                e.end_offset <= cut for e in segs[want]):
            want += 1
        assert log.drop_before_offset(cut) == want
        kept = entries[want * eps:]
        assert all_entries(log) == kept
        assert log.first_log_id == first_log_id + want * eps
        log.close()
        log = CommitLog(d, eps)
        log.open(0)
        assert all_entries(log) == kept
        log.close()
