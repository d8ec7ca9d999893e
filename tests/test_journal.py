"""The node journal (diskqueue/journal.py): one sync a round for every partition, and replay.

A lost segment write is modelled by cutting the segment file back after the answers (what a
power cut leaves of data that was never synced); tests/test_power_loss.py runs the same on
PowerFS against a real nsqd."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import pytest

import fdhooks
from diskqueue import groupcommit, journal as journal_mod
from diskqueue.journal import Journal
from diskqueue.queue import DiskQueue, QueueFailedError, QueueOptions
from diskqueue.segments import segment_name


@pytest.fixture(autouse=True)
def journal_every_round(monkeypatch):
    """A round of one record syncs its segment instead of the journal; these tests write
    one partition at a time and need the journal itself (but for the test of that rule)."""
    monkeypatch.setattr(journal_mod, "ALONE_SYNCS_ITS_SEGMENT", False)


async def open_queues(root, journal, n, **kw):
    return [await DiskQueue.open(os.path.join(root, f"p{i}"),
                                 QueueOptions(partition=i, journal=journal, **kw))
            for i in range(n)]


def lose_unsynced(q: DiskQueue, keep: int = 0) -> None:
    """Cut the active segment's file to `keep` bytes, as a power cut may leave it."""
    seg = q._segments
    os.truncate(seg.file(seg.active_base), keep)


async def bodies_after_restart(root, n: int) -> list[list[bytes]]:
    """The bodies of queues p0 .. p<n-1>, opened again with the journal (its replay first)."""
    journal = Journal.open(str(root))
    out = []
    for q in await open_queues(str(root), journal, n):
        out.append(await bodies_of(q))
        await q.close()
    journal.close()
    return out


async def bodies_of(q: DiskQueue) -> list[bytes]:
    r = q.reader(q.start_offset)
    out = []
    while recs := await r.read(1000):
        out += [rec.body for rec in recs]
    r.close()
    return out


async def test_a_round_syncs_the_journal_once_for_every_partition(tmp_path):
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 8)
    await asyncio.gather(*(q.append([b"m%d" % k]) for k in range(20) for q in qs))
    assert sum(q.stats["batches"] for q in qs) >= 8
    assert j.stats["records"] == sum(q.stats["batches"] for q in qs)
    assert j.stats["syncs"] < j.stats["records"]  # partitions shared rounds
    for q in qs:
        await q.close()
    j.close()


async def test_a_round_of_one_batch_syncs_its_segment_not_the_journal(tmp_path, monkeypatch):
    """One busy partition (an MPUB stream) writes nothing twice; it survives a cut all the
    same (here: the journal file is emptied, as if never written)."""
    monkeypatch.setattr(journal_mod, "ALONE_SYNCS_ITS_SEGMENT", True)
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    for k in range(20):
        await q.append([b"m%d" % k] * 50)
    assert j.stats["alone"] == q.stats["batches"] == 20
    assert j.stats["bytes"] == 0 and os.path.getsize(journal_file(tmp_path)) == 0
    j2 = Journal.open(str(tmp_path))  # no close: a crash
    (q2,) = await open_queues(str(tmp_path), j2, 1)
    assert len(await bodies_of(q2)) == 1000
    await q2.close()
    j2.close()


async def test_a_partition_writing_alone_syncs_its_segment_in_the_write(tmp_path, monkeypatch):
    """While no other partition writes, a batch takes the path it takes without a journal
    (its write syncs it): the journal gets nothing; with two writing, they share rounds."""
    j = Journal.open(str(tmp_path))
    a, b = await open_queues(str(tmp_path), j, 2)
    monkeypatch.setattr(journal_mod, "ALONE_SYNCS_ITS_SEGMENT", True)
    for k in range(10):
        await a.append([b"a%d" % k])
    assert j.stats["alone"] == a.stats["batches"] == 10 and j.stats["records"] == 0
    assert a.stats["syncs"] == 10
    await asyncio.gather(*(q.append([b"m%d" % k]) for k in range(20) for q in (a, b)))
    assert j.stats["records"] > 0 and j.stats["syncs"] < j.stats["records"]
    assert j.writers == 0  # every batch answered
    for q in (a, b):
        await q.close()
    j.close()


async def test_followers_appending_at_once_share_rounds(tmp_path, monkeypatch):
    """A follower's raw appends count as writers, as a leader's batches do: two followers
    appending at once (and no leader) share rounds; one alone syncs its own segment; both
    survive the loss of every unsynced segment byte (the journal replays them)."""
    monkeypatch.setattr(journal_mod, "ALONE_SYNCS_ITS_SEGMENT", True)
    leader = await DiskQueue.open(str(tmp_path / "leader"), QueueOptions())
    for k in range(20):
        await leader.append([b"m%d" % k])
    raws, offset = [], 0
    while offset < leader.written_end:
        raws.append(await leader.read_raw(offset, 1))  # one entry each
        offset = raws[-1].offset + len(raws[-1].data)
    await leader.close()
    root = tmp_path / "node"

    async def followers(journal):  # two copies of the leader's partition 0
        return [await DiskQueue.open(str(root / name), QueueOptions(journal=journal,
                                                                    replicated=True))
                for name in ("a", "b")]

    j = Journal.open(str(root))
    a, b = await followers(j)
    await a.append_raw(raws[0].offset, raws[0].count, raws[0].entries, raws[0].data)
    assert j.stats["alone"] == 1 and j.stats["records"] == 0 and j.writers == 0

    async def copy(q, raw):
        done = asyncio.get_running_loop().create_future()
        q.append_raw_then(raw.offset, raw.count, raw.entries, raw.data,
                          lambda error: done.set_result(error))
        assert await done is None

    await copy(b, raws[0])
    for raw in raws[1:]:
        await asyncio.gather(copy(a, raw), copy(b, raw))
    assert j.stats["records"] >= 2 * (len(raws) - 1) - 2  # the first two may go alone
    assert j.stats["syncs"] < j.stats["records"]
    assert j.writers == 0
    with open(journal_file(root), "rb") as f:
        journaled = list(journal_mod.decode(f.read()))
    assert len(journaled) == j.stats["records"]
    for _id, path, base, position, data in journaled:  # lost: only the journal has them
        with open(os.path.join(root, path, "data", segment_name(base)), "r+b") as f:
            f.seek(position)
            f.write(b"\0" * len(data))
    j2 = Journal.open(str(root))  # no close: a crash
    for q in await followers(j2):
        assert await bodies_of_written(q) == [b"m%d" % k for k in range(20)]
        await q.close()
    j2.close()


async def test_the_jobs_of_one_turn_reach_the_thread_in_one_hand_over(tmp_path, monkeypatch):
    """Once two partitions write, the jobs of a turn wait for its end and go together."""
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 16)
    hand_overs = []
    put = j.worker._put
    monkeypatch.setattr(j.worker, "_put", lambda jobs: (hand_overs.append(len(jobs)), put(jobs)))
    await asyncio.gather(*(q.append([b"m"]) for q in qs))
    assert sum(hand_overs) >= 16 and max(hand_overs) >= 14  # the first two go at once
    assert j.stats["syncs"] <= 2
    for q in qs:
        await q.close()
    j.close()


async def test_a_round_that_ends_with_no_job_left_is_synced_by_the_write_thread(
        tmp_path, monkeypatch):
    """No job left: the write thread syncs the round itself (the sync thread's hand-off
    saved). Jobs left (here: a round full at 2 answers): the round goes to the sync
    thread, and the write thread goes on with them."""
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 8)
    threads = []  # of each round's journal sync
    fdhooks.hook(monkeypatch, "fdatasync", fdhooks.under(j.folder),
                 lambda *_: threads.append(threading.current_thread().name))
    await asyncio.gather(*(q.append([b"m"]) for q in qs[:4]))
    assert threads and set(threads) == {"diskqueue:journal"}
    threads.clear()
    monkeypatch.setattr(journal_mod, "ROUND_POSTS", 2)
    await asyncio.gather(*(q.append([b"n"]) for q in qs))
    assert "diskqueue:journal-sync" in threads, threads
    for i, q in enumerate(qs):
        assert await bodies_of(q) == ([b"m", b"n"] if i < 4 else [b"n"])
        await q.close()
    j.close()


async def test_the_next_round_is_written_while_one_is_synced(tmp_path, monkeypatch):
    """The sync thread holds a round of partitions a and b (its sync held up here): c and d
    are written meanwhile, into the next round; a's next batch waits until a's round is
    synced (at most one batch of a partition is not durable); all are answered after. (A
    round that ends with no job left is synced by the write thread itself, the test above:
    here the sync thread takes every round.)"""
    monkeypatch.setattr(journal_mod, "IDLE_WRITER_SYNCS", False)
    j = Journal.open(str(tmp_path))
    a, b, c, d = await open_queues(str(tmp_path), j, 4)
    held, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    def slow_sync(*_):  # the journal's sync of a round
        loop.call_soon_threadsafe(held.set)
        release.wait(10)

    fdhooks.hook(monkeypatch, "fdatasync", fdhooks.under(j.folder), slow_sync)
    first = asyncio.gather(a.append([b"a1"]), b.append([b"b1"]))
    await asyncio.wait_for(held.wait(), 5)
    a_size = os.path.getsize(a._segments.file(a._segments.active_base))
    second = asyncio.gather(c.append([b"c1"]), d.append([b"d1"]), a.append([b"a2"]))
    for _ in range(100):
        if len(j._round_keys) == 2:
            break
        await asyncio.sleep(0.01)
    assert set(j._round_keys) == {c._journal_key, d._journal_key}  # written meanwhile
    assert os.path.getsize(a._segments.file(a._segments.active_base)) == a_size
    assert not first.done() and not second.done()
    release.set()
    await asyncio.wait_for(first, 5)
    await asyncio.wait_for(second, 5)
    assert await bodies_of(a) == [b"a1", b"a2"]
    for q in (a, b, c, d):
        await q.close()
    j.close()


async def answered_in_order(q: DiskQueue, then_again: bool) -> tuple[list, int]:
    """r1 is written; r2 comes while r1 is in flight; when r1 is answered, its client sends
    r3 at once if `then_again`. Returns the answers' (name, loop time) and the batches."""
    loop = asyncio.get_running_loop()
    answers, all_done = [], loop.create_future()

    def answer(name: str):
        def callback(appended, error):
            assert error is None
            answers.append((name, loop.time()))
            if name == "r1" and then_again:
                q.append([b"r3"], callback=answer("r3"))
            if len(answers) == (3 if then_again else 2):
                all_done.set_result(None)
        return callback

    batches = q.stats["batches"]
    q.append([b"r1"], callback=answer("r1"))
    await asyncio.sleep(0)  # r1 goes to the write thread
    assert len(q._flight) == 1
    q.append([b"r2"], callback=answer("r2"))
    await asyncio.wait_for(all_done, 5)
    return answers, q.stats["batches"] - batches


async def test_a_batch_answered_beside_other_writers_waits_for_its_clients(tmp_path):
    """While other partitions write in the journal's rounds, a partition's next batch waits
    (at most LINGER) until as many requests are pending as its last batch answered: the
    client just answered sends again and joins the request that came meanwhile."""
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    j.writers += 1  # another partition writes meanwhile
    answers, batches = await answered_in_order(q, then_again=True)
    assert [name for name, _ in answers] == ["r1", "r2", "r3"]
    assert batches == 2  # r2 and r3 in one
    answers, batches = await answered_in_order(q, then_again=False)
    assert batches == 2  # no one came: r2 went alone, once LINGER passed
    assert answers[1][1] - answers[0][1] >= 0.9 * groupcommit.LINGER
    j.writers -= 1
    answers, batches = await answered_in_order(q, then_again=True)
    assert batches == 3  # writing alone: each batch goes at once (its segment syncs it)
    assert await bodies_of(q) == [b"r1", b"r2", b"r3", b"r1", b"r2", b"r1", b"r2", b"r3"]
    await q.close()
    j.close()


async def test_a_lingering_batch_is_written_at_once_when_its_queue_closes(tmp_path, monkeypatch):
    monkeypatch.setattr(groupcommit, "LINGER", 30.0)
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    j.writers += 1
    loop = asyncio.get_running_loop()
    closed = []
    q.append([b"r1"], callback=lambda appended, error: closed.append(loop.create_task(q.close())))
    await asyncio.sleep(0)
    r2 = q.append([b"r2"])
    await asyncio.wait_for(r2, 5)  # not 30 s: the close writes what is pending
    await asyncio.wait_for(closed[0], 5)
    j.writers -= 1
    (q,) = await open_queues(str(tmp_path), j, 1)
    assert await bodies_of(q) == [b"r1", b"r2"]
    await q.close()
    j.close()


async def test_a_round_holds_one_batch_of_a_partition(tmp_path):
    """A partition's second batch ends the round first, so at most its last batch can be
    unsynced at a cut (the recovery rule)."""
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    for _ in range(30):
        await asyncio.gather(*(q.append([b"x" * 100]) for _ in range(50)))
    assert j.stats["syncs"] >= q.stats["batches"] == j.stats["records"]
    await q.close()
    j.close()


async def written_then_lost(root: str, partitions: int, per: int) -> None:
    """`per` messages to each of `partitions` queues, then a crash: nothing closed, and no
    segment byte ever reached the disk (the journal alone holds them)."""
    j = Journal.open(root)
    qs = await open_queues(root, j, partitions)
    await asyncio.gather(*(q.append([b"%d-%d" % (q.partition, k)]) for k in range(per)
                           for q in qs))
    for q in qs:
        lose_unsynced(q)


async def replayed(root: str, partitions: int, per: int) -> None:
    """A journal opened again (its replay) gives every queue back all it was written."""
    j = Journal.open(root)
    for q in await open_queues(root, j, partitions):
        assert await bodies_of(q) == [b"%d-%d" % (q.partition, k) for k in range(per)]
        assert q.corrupt == []
        await q.close()
    j.close()


async def test_replay_restores_what_the_segments_lost(tmp_path):
    await written_then_lost(str(tmp_path), 4, 50)
    await replayed(str(tmp_path), 4, 50)
    assert len(os.listdir(tmp_path / "journal")) == 1


async def test_replay_holds_a_bounded_number_of_segments_open(tmp_path, monkeypatch):
    """Replay syncs and closes the segments it wrote into whenever REPLAY_OPEN are open: a
    journal covering more segments than the process has descriptors replays all the same
    (a node of 1,000 partitions at 300 descriptors could not start again: EMFILE)."""
    await written_then_lost(str(tmp_path), 5, 3)
    monkeypatch.setattr(journal_mod, "REPLAY_OPEN", 2)
    is_segment = fdhooks.under(*(tmp_path / f"p{i}" / "data" for i in range(5)))
    open_now, most, opened = set(), [0], [0]
    real_open, real_close = os.open, os.close

    def opening(path, *args):
        fd = real_open(path, *args)
        if is_segment(path):
            open_now.add(fd)
            opened[0] += 1
            most[0] = max(most[0], len(open_now))
        return fd

    def closing(fd):
        open_now.discard(fd)
        real_close(fd)

    with monkeypatch.context() as m:  # replay alone: the queues opened after it are not
        m.setattr(os, "open", opening)
        m.setattr(os, "close", closing)
        Journal.open(str(tmp_path)).close()
    assert most[0] == 2 and opened[0] >= 5 and not open_now
    await replayed(str(tmp_path), 5, 3)


async def test_replay_syncs_its_segments_together_and_keeps_the_journal_if_one_fails(
        tmp_path, monkeypatch):
    """Replay syncs the segments it wrote into at once, on REPLAY_SYNCS threads (10,000
    segments after a kill -9: 0.97-1.29 s against 1.6-2.1 s one by one); a sync that fails
    fails the replay once the others have ended, and the journal stays for the next start."""
    await written_then_lost(str(tmp_path), 5, 3)
    segments = fdhooks.under(*(tmp_path / f"p{i}" / "data" for i in range(5)))
    together = threading.Barrier(5, timeout=10)  # broken unless all five sync at once
    sick = fdhooks.under(tmp_path / "p2" / "data")

    def sync(fd):
        together.wait()
        if sick(fdhooks.fd_path(fd)):
            raise OSError(errno.EIO, "injected: the disk failed")

    with monkeypatch.context() as m:
        fdhooks.hook(m, "fdatasync", segments, sync)
        with pytest.raises(OSError, match="injected"):
            Journal.open(str(tmp_path))
    assert not together.broken
    assert [n for n in os.listdir(tmp_path / "journal") if n.endswith(journal_mod.SUFFIX)]
    await replayed(str(tmp_path), 5, 3)


async def test_a_log_cut_back_is_never_replayed_over(tmp_path):
    """A replica cuts its log back and writes less at the same place: the journal's older
    record of the longer batch must not come back at replay (the journal id changes). Its
    records are the new one's size, so what came back would read as valid records."""
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1, replicated=True)
    first = await q.append([b"a"])
    await q.append([b"L%02d" % i for i in range(20)])
    assert await cut_back_then_replayed(tmp_path, q, first) == [b"a", b"new"]


async def test_a_log_opened_again_then_cut_back_is_never_replayed_over(tmp_path):
    """As above, with the replica closed and opened again between its long batch and the
    cut, while the journal still holds that batch's record: it takes a new journal id at
    open, so the record is not replayed over what it writes at that place after the cut."""
    j = Journal.open(str(tmp_path))
    q, other = await open_queues(str(tmp_path), j, 2, replicated=True)
    first = await q.append([b"a"])
    await asyncio.gather(q.append([b"L%02d" % i for i in range(20)]), other.append([b"o"]))
    assert j.holds(q._journal_key)  # written while another partition wrote: journaled
    await q.close()
    q = await DiskQueue.open(os.path.join(tmp_path, "p0"),
                             QueueOptions(partition=0, journal=j, replicated=True))
    assert await cut_back_then_replayed(tmp_path, q, first) == [b"a", b"new"]
    await other.close()


async def cut_back_then_replayed(root, q: DiskQueue, first) -> list[bytes]:
    """Cut replica `q` (of partition 0) back to the end of `first`, write b"new" there, lose
    what was not synced (a power cut), and return the bodies its log holds after the
    journal's replay."""
    await q.truncate_to(first.end_offset, 1)
    await q.append([b"new"])
    lose_unsynced(q, keep=first.end_offset)  # what truncate_to synced survives
    j2 = Journal.open(str(root))
    (q2,) = await open_queues(str(root), j2, 1, replicated=True)
    try:
        return await bodies_of_written(q2)
    finally:
        await q2.close()
        j2.close()


async def bodies_of_written(q: DiskQueue) -> list[bytes]:
    q.commit_to(q.written_end, q.written_count)
    return await bodies_of(q)


async def test_emptied_then_written_again(tmp_path):
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    await q.append([b"old-%d" % i for i in range(10)])
    await q.empty()
    await q.append([b"new"])
    lose_unsynced(q)
    j2 = Journal.open(str(tmp_path))
    (q2,) = await open_queues(str(tmp_path), j2, 1)
    assert await bodies_of(q2) == [b"new"]
    await q2.close()
    j2.close()


async def test_a_checkpoint_syncs_the_segments_and_starts_a_new_file(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "CHECKPOINT_BYTES", 1024)
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 3)
    k = 0
    while True:  # until a checkpoint has deleted the file before the current one
        await asyncio.gather(*(q.append([b"%d-%d" % (q.partition, k)]) for q in qs))
        k += 1
        assert await asyncio.to_thread(j._checkpointed.wait, 10)
        if k >= 40 and len(os.listdir(tmp_path / "journal")) == 1:
            break
    j_file = journal_file(tmp_path)
    assert j.stats["checkpoints"] >= 5
    name = os.path.basename(j_file)
    with open(tmp_path / "journal" / name, "rb") as f:
        first = {}  # what only the current file holds: from each partition's first record on
        for _id, path, _base, pos, _data in journal_mod.decode(f.read()):
            first.setdefault(path, pos)
    assert first
    for q in qs:
        lose_unsynced(q, keep=first.get(f"p{q.partition}", q._segments.end))
    assert await bodies_after_restart(tmp_path, 3) == [
        [b"%d-%d" % (p, i) for i in range(k)] for p in range(3)]


async def test_rounds_go_on_while_a_checkpoint_syncs(tmp_path, monkeypatch):
    """A checkpoint syncs the segments its files cover on a thread of its own: rounds are
    answered while its syncs wait, its old file stays until they are done, and every body
    is there after a restart."""
    monkeypatch.setattr(journal_mod, "CHECKPOINT_BYTES", 1024)
    gate = threading.Event()
    real_fdatasync = os.fdatasync
    synced = set()  # the files the checkpoint thread synced

    def fdatasync(fd):
        if threading.current_thread().name == "diskqueue:journal-checkpoint":
            gate.wait(10)
            synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 3)
    k = 0
    try:
        while j._checkpointed.is_set():  # until a checkpoint begins, and waits at its syncs
            assert k < 1000, "no checkpoint began"
            await asyncio.gather(*(q.append([b"%d-%d" % (q.partition, k)]) for q in qs))
            k += 1
        for _ in range(20):
            await asyncio.wait_for(asyncio.gather(
                *(q.append([b"%d-%d" % (q.partition, k)]) for q in qs)), 5)
            k += 1
        assert len(os.listdir(tmp_path / "journal")) == 2  # the file it checkpoints, and the next
        assert j.stats["checkpoints"] == 0
    finally:
        gate.set()
    assert await asyncio.to_thread(j._checkpointed.wait, 10)
    assert j.stats["checkpoints"] >= 1
    assert {q._segments.file(q._segments.active_base) for q in qs} <= synced
    for q in qs:
        await q.close()
    j.close()
    assert await bodies_after_restart(tmp_path, 3) == [
        [b"%d-%d" % (p, i) for i in range(k)] for p in range(3)]


def test_a_checkpoint_waits_for_a_free_descriptor(tmp_path, monkeypatch):
    """A segment sync that finds every descriptor in use waits for one (bounded), rather
    than failing the checkpoint and turning the journal off."""
    path = tmp_path / "segment"
    path.write_bytes(b"x")
    real_open, refused = os.open, []

    def busy_open(name, flags, *args):
        if len(refused) < 3:
            refused.append(name)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(name, flags, *args)

    monkeypatch.setattr(os, "open", busy_open)
    journal_mod._sync_file(str(path))
    assert len(refused) == 3
    refused.clear()
    monkeypatch.setattr(journal_mod, "OPEN_WAIT_S", 0.01)
    with pytest.raises(OSError) as e:
        journal_mod._sync_file(str(path))
    assert e.value.errno == errno.EMFILE


def journal_file(root) -> str:
    (name,) = os.listdir(os.path.join(root, "journal"))
    return os.path.join(root, "journal", name)


async def test_a_failed_journal_falls_back_to_each_segment_and_turns_off(tmp_path, monkeypatch):
    """The journal's write fails: the round's batches are synced in their own segments
    instead (answered OK), unless that sync fails too (that queue fails); the journal is
    off from then on, and each partition syncs its own segment."""
    j = Journal.open(str(tmp_path))
    sick, well = await open_queues(str(tmp_path), j, 2)
    await sick.append([b"before"])
    await well.append([b"before"])
    os.close(j._fd)
    j._fd = os.open(os.path.join(tmp_path, "journal"), os.O_RDONLY)  # its writes fail

    real_sync = os.fdatasync

    def failing_sync(*_):
        raise OSError(errno.EIO, "Input/output error (injected)")

    fdhooks.hook(monkeypatch, "fdatasync", fdhooks.under(sick._segments.path), failing_sync)
    with pytest.raises(QueueFailedError):
        await sick.append([b"lost"])
    assert j.failed is not None
    assert os.listdir(tmp_path / "journal")  # kept: a segment it covers could not be synced
    syncs = j.stats["syncs"]
    await well.append([b"kept"])
    await well.append([b"after"])
    assert j.stats["syncs"] == syncs  # the journal is off
    assert well.stats["syncs"] >= 2  # the segment synced itself
    with pytest.raises(QueueFailedError):
        sick.append([b"refused"])
    await well.close()
    monkeypatch.setattr(os, "fdatasync", real_sync)
    await sick.close()
    j.close()
    j2 = Journal.open(str(tmp_path))
    sick2, well2 = await open_queues(str(tmp_path), j2, 2)
    assert await bodies_of(well2) == [b"before", b"kept", b"after"]
    assert (await bodies_of(sick2))[0] == b"before"
    await sick2.close()
    await well2.close()
    j2.close()


async def test_rounds_write_over_zeros_written_ahead(tmp_path, monkeypatch):
    """The file grows by ZERO_AHEAD bytes of zeros at a time, synced with a round; the
    rounds between write over them (their sync has no file size to commit); replay stops
    at the zeros. Without room for the zeros, a round grows the file itself."""
    monkeypatch.setattr(journal_mod, "ZERO_AHEAD", 4096)
    j = Journal.open(str(tmp_path))
    qs = await open_queues(str(tmp_path), j, 2)
    sizes = []
    for k in range(40):
        await asyncio.gather(*(q.append([b"%d-%d" % (q.partition, k)]) for q in qs))
        sizes.append(os.path.getsize(journal_file(tmp_path)))
    assert j.stats["records"] >= 40 and j._size > 4096
    assert sizes[-1] == j._zeroed > j._size  # zeros past the records
    assert len(set(sizes)) < len(sizes) // 4  # most rounds did not grow the file
    real_pwrite = os.pwrite

    def no_room_for_zeros(fd, data, pos):  # a few zeros fit, then the disk is full
        if len(data) == journal_mod.ZERO_AHEAD and not any(data):
            real_pwrite(fd, data[:100], pos)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    fdhooks.hook(monkeypatch, "pwrite", fdhooks.under(j.folder), no_room_for_zeros)
    for k in range(40, 60):
        await asyncio.gather(*(q.append([b"%d-%d" % (q.partition, k)]) for q in qs))
    assert j.failed is None and os.path.getsize(journal_file(tmp_path)) == j._size
    for q in qs:  # a crash: only the journal holds what was written
        lose_unsynced(q)
    assert await bodies_after_restart(tmp_path, 2) == [
        [b"%d-%d" % (p, k) for k in range(60)] for p in range(2)]


async def test_replay_stops_at_a_torn_record(tmp_path):
    j = Journal.open(str(tmp_path))
    (q,) = await open_queues(str(tmp_path), j, 1)
    for i in range(3):
        await q.append([b"m%d" % i])
    (name,) = os.listdir(tmp_path / "journal")
    path = tmp_path / "journal" / name
    with open(path, "r+b") as f:  # the last round torn: it was never answered
        f.seek(j._size - 3)
        f.write(b"\0" * 3)
    lose_unsynced(q)
    j2 = Journal.open(str(tmp_path))
    (q2,) = await open_queues(str(tmp_path), j2, 1)
    assert await bodies_of(q2) == [b"m0", b"m1"]
    await q2.close()
    j2.close()
