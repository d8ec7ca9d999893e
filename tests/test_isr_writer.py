"""isr/writer.py: a led partition's write path on a real DiskQueue, with the push and the
commit in the test's hands: one batch in replication at a time, answers only once
committed, the linger after a commit, solo, failing what cannot commit, the commit
deadline, and a batch whose local write fails after it was pushed."""

import asyncio
import os
import time

import pytest
from test_diskqueue import body, read_all, small_disk  # noqa: F401 (a fixture)

from diskqueue.queue import (AppendError, CommitTimeout, DiskFullError, DiskQueue, NotCommitted,
                             QueueClosedError, QueueFailedError, QueueOptions)
from diskqueue.journal import Journal
from isr import writer as writer_module
from isr.writer import LeaderWriter


class Leader:
    """A LeaderWriter over a replicated DiskQueue: `pushed` holds each batch as the log
    encoded it (said to go out unless `went_out` is False: no follower), `written` each
    written end, `unwritten` counts the batches that failed; nothing commits unless the
    test says so (`commit`), as when no follower has acked, or `solo` is set (a commit on
    each write, as the core makes when the ISR is the leader alone)."""

    def __init__(self, q):
        self.q = q
        self.pushed: list = []
        self.written: list = []
        self.unwritten = 0
        self.solo = False
        self.went_out = True
        self.w = LeaderWriter(q, self._push, self._written, self._unwritten)

    def _push(self, *batch) -> bool:
        self.pushed.append(batch)
        return self.went_out

    def _unwritten(self) -> None:
        self.unwritten += 1

    def _written(self, end) -> None:
        self.written.append(end)
        if self.solo:
            self.w.commit_to(end)

    def commit(self) -> None:
        self.w.commit_to((self.q.written_end, self.q.written_count))

    async def until_written(self, count: int) -> None:
        for _ in range(1000):
            if self.q.written_count >= count:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"not written to {count}: {self.q.written_count}")


@pytest.fixture
async def leader(tmp_path):
    opened = []

    async def make(options=QueueOptions(replicated=True), path=None):
        q = await DiskQueue.open(str(path or tmp_path / f"q{len(opened)}"), options)
        opened.append(q)
        return Leader(q)

    yield make
    for q in opened:
        await q.close()


async def test_a_batch_is_answered_only_once_committed(leader):
    lw = await leader()
    first, second = lw.w.append([b"a", b"b"]), lw.w.append([b"c"])  # one batch
    await lw.until_written(3)
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done() and len(lw.pushed) == 1
    assert lw.written == [(lw.q.written_end, 3)] and lw.q.committed_end == 0
    assert await read_all(lw.q) == []
    lw.w.commit_to((lw.q.written_end - 1 - 36, 2))  # the first request's end: the batch waits
    await asyncio.sleep(0.01)
    assert lw.q.committed_count == 2 and not first.done() and not second.done()
    lw.w.commit_to((10**9, 10**6))  # more than written: the written end
    a, c = await first, await second
    assert (a.first_id, c.first_id) == (0, 2)
    assert (lw.q.committed_end, lw.q.committed_count) == (lw.q.written_end, 3)
    assert [r.body for r in await read_all(lw.q)] == [b"a", b"b", b"c"]


async def test_what_arrives_while_a_batch_replicates_goes_as_one_next_batch(leader):
    lw = await leader()
    first = lw.w.append([body(0)])
    await lw.until_written(1)
    later = []
    for i in range(1, 6):  # the local disk is free: each would be a batch of its own
        later.append(lw.w.append([body(i)]))
        await asyncio.sleep(0.005)
    assert len(lw.pushed) == 1 and lw.q.written_count == 1 and lw.w.pending_requests == 5
    lw.commit()
    await first
    await lw.until_written(6)
    assert len(lw.pushed) == 2 and lw.pushed[1][3] == 5  # one batch of five entries
    lw.commit()
    assert [(await f).first_id for f in later] == [1, 2, 3, 4, 5]


async def _one_held(lw):
    """A batch of two requests written and uncommitted, and one request held behind it."""
    first = [lw.w.append([body(0)]), lw.w.append([body(1)])]
    await lw.until_written(2)
    held = lw.w.append([body(2)])
    await asyncio.sleep(0.01)
    assert len(lw.pushed) == 1 and lw.pushed[0][3] == 2 and lw.q.written_count == 2
    return first, held


async def test_a_commit_lets_the_writer_linger_for_the_clients_it_answered(leader, monkeypatch):
    """After a commit, the next batch waits for as many requests as the commit answered
    (they come from the clients it just answered), and they all go as one."""
    monkeypatch.setattr(writer_module, "LINGER", 10.0)
    lw = await leader()
    first, held = await _one_held(lw)
    lw.commit()
    assert all(f.done() for f in first)
    await asyncio.sleep(0.02)
    assert len(lw.pushed) == 1 and lw.q.written_count == 2  # lingering: 1 of the 3 came
    again = [lw.w.append([body(3)])]
    await asyncio.sleep(0.02)
    assert len(lw.pushed) == 1  # 2 of 3
    again.append(lw.w.append([body(4)]))  # the last: the linger ends, one batch of three
    await lw.until_written(5)
    assert len(lw.pushed) == 2 and lw.pushed[1][3] == 3
    lw.commit()
    assert [(await f).first_id for f in (held, *again)] == [2, 3, 4]


async def test_a_linger_ends_after_linger_seconds_or_at_close(leader, monkeypatch):
    monkeypatch.setattr(writer_module, "LINGER", 0.05)
    lw = await leader()
    _, held = await _one_held(lw)
    started = time.monotonic()
    lw.commit()
    await lw.until_written(3)  # nobody came back: the held request goes after LINGER
    assert time.monotonic() - started >= 0.05 and len(lw.pushed) == 2
    monkeypatch.setattr(writer_module, "LINGER", 10.0)
    lw.commit()
    assert (await held).first_id == 2
    late = lw.w.append([body(3)])
    await lw.until_written(4)
    later = lw.w.append([body(4)])  # held behind `late`
    await asyncio.sleep(0.01)
    lw.commit()  # lingers (10 s) for one more request
    await asyncio.sleep(0.02)
    assert (await late).first_id == 3 and lw.q.written_count == 4
    lw.w.close(AppendError("closing"))  # ends the linger: the held request was never stored
    with pytest.raises(AppendError, match="closing"):
        await asyncio.wait_for(later, 1)
    with pytest.raises(AppendError, match="closing"):
        lw.w.append([b"after close"])
    assert lw.q.written_count == 4


async def test_no_linger_when_solo_or_when_nothing_was_answered(leader, monkeypatch):
    monkeypatch.setattr(writer_module, "LINGER", 10.0)
    lw = await leader()
    _, held = await _one_held(lw)
    lw.w.set_solo(True)
    lw.commit()  # solo: the held request goes at once
    await lw.until_written(3)
    lw.commit()
    assert (await asyncio.wait_for(held, 5)).first_id == 2
    lw.w.set_solo(False)
    uncommitted = lw.w.append([body(3)])
    await lw.until_written(4)
    after = lw.w.append([body(4)])
    lw.w.fail_uncommitted(AppendError("below min_isr"))  # answers the pending one too
    with pytest.raises(NotCommitted):
        await uncommitted
    with pytest.raises(AppendError, match="below min_isr"):
        await after
    last = lw.w.append([body(5)])  # nothing was answered: goes at once
    await lw.until_written(5)
    held = lw.w.append([body(6)])
    await asyncio.sleep(0.01)
    lw.commit()  # lingers (10 s) for one more request
    await asyncio.sleep(0.02)
    assert (await last).first_id == 4 and lw.q.written_count == 5
    lw.w.set_solo(True)  # ends the linger
    await lw.until_written(6)
    lw.commit()
    assert (await asyncio.wait_for(held, 5)).first_id == 5


async def test_a_solo_writer_lingers_while_other_partitions_write_in_the_journal(
        leader, tmp_path, monkeypatch):
    """Solo (the leader alone in the ISR), a commit lingers as a DiskQueue's own batch does:
    only while other partitions write in the node journal's rounds."""
    monkeypatch.setattr(writer_module, "LINGER", 10.0)
    j = Journal.open(str(tmp_path / "node"))
    lw = await leader(QueueOptions(replicated=True, journal=j))
    lw.solo = True
    lw.w.set_solo(True)

    async def held_behind(i: int):
        first = lw.w.append([body(i)])
        await asyncio.sleep(0)  # in replication (being written)
        held = lw.w.append([body(i + 1)])
        await asyncio.wait_for(first, 5)  # written: committed at once (solo)
        await asyncio.sleep(0.02)
        return held

    j.writers += 1  # another partition writes meanwhile
    held = await held_behind(0)
    assert lw.q.written_count == 1 and not held.done()  # lingering for one more
    again = lw.w.append([body(2)])  # it came: one batch of both
    assert [(await f).first_id for f in (held, again)] == [1, 2]
    assert len(lw.pushed) == 2 and lw.pushed[1][3] == 2
    j.writers -= 1  # writing alone: no linger
    held = await held_behind(3)
    assert (await asyncio.wait_for(held, 5)).first_id == 4
    await lw.q.close()
    j.close()


async def test_fail_uncommitted_answers_and_keeps_the_data(leader):
    """What was written stays in the log: whoever leads next may still commit it
    (at-least-once); the writer goes on with the next batch."""
    lw = await leader()
    fut = lw.w.append([b"x", b"y"])
    await lw.until_written(2)
    lw.w.fail_uncommitted(AppendError("below min_isr"))
    with pytest.raises(NotCommitted, match="below min_isr.*may still be delivered"):
        await fut
    assert lw.q.written_count == 2 and lw.q.committed_count == 0
    nxt = lw.w.append([b"z"])
    await lw.until_written(3)
    lw.commit()
    assert (await nxt).first_id == 2
    assert [r.body for r in await read_all(lw.q)] == [b"x", b"y", b"z"]


async def test_a_closed_log_refuses_at_once(leader):
    lw = await leader()
    fut = lw.w.append([b"never committed"])
    await lw.until_written(1)
    await lw.q.close()
    with pytest.raises(QueueClosedError):
        lw.w.append([b"after"])
    lw.w.close(AppendError("not leading"))
    with pytest.raises(NotCommitted, match="not leading"):  # written: its outcome is unknown
        await fut


async def test_every_request_is_answered_within_the_commit_timeout(leader):
    """Nothing commits (a follower failed while etcd is away): within the commit timeout the
    batch in replication is answered "may still be delivered" and the one held behind it
    "nothing of it is stored" (it leaves); each is answered once, also when the first
    commits later; the writer goes on."""
    lw = await leader(QueueOptions(replicated=True, commit_timeout=0.3))
    calls = []
    t0 = time.monotonic()
    uncommitted = lw.w.append([b"written"])
    await lw.until_written(1)
    lw.w.append([b"held"], callback=lambda result, error: calls.append((result, error)))
    with pytest.raises(CommitTimeout, match="may still be delivered"):
        await asyncio.wait_for(uncommitted, 5)
    while not calls:
        await asyncio.sleep(0.01)
    assert 0.3 <= time.monotonic() - t0 < 2
    [(result, error)] = calls
    assert result is None and "nothing of it is stored" in str(error)
    assert lw.q.written_count == 1  # the held request was never written
    lw.commit()  # the first commits after all: no second answer
    assert lw.q.committed_count == 1 and len(calls) == 1
    later = lw.w.append([b"later"])
    await lw.until_written(2)
    lw.commit()
    assert (await asyncio.wait_for(later, 5)).first_id == 1  # `held` took no id
    await asyncio.sleep(0.4)  # its deadline passes after it was answered: nothing happens
    assert len(calls) == 1
    assert [r.body for r in await read_all(lw.q)] == [b"written", b"later"]


async def test_a_batch_pushed_and_not_written_here_fails_the_log(small_disk, leader):  # noqa: F811
    """Its followers may hold the batch: no other batch may take its place, so the log
    takes nothing more until it is reopened (and the followers truncate by epoch)."""
    lw = await leader(path=small_disk / "leader")
    lw.w.set_solo(True)
    lw.solo = True
    (small_disk / "ballast").write_bytes(os.urandom(1024 * 1024))
    with pytest.raises(NotCommitted, match="announced before its write"):  # they may hold it
        for i in range(20):
            await lw.w.append([os.urandom(100_000)])
    assert len(lw.pushed) == i + 1 and lw.q.written_count == i
    with pytest.raises(QueueFailedError):
        lw.w.append([b"x"])


async def test_a_batch_that_went_nowhere_and_was_not_written_fails_alone(small_disk, leader):  # noqa: F811
    """A leader alone in its ISR (a topic of one replica) pushed its batch to nobody: a full
    disk refuses that batch (nothing of it stored) and the log goes on once there is room,
    as an unreplicated log does."""
    lw = await leader(path=small_disk / "leader")
    lw.w.set_solo(True)
    lw.solo = True
    lw.went_out = False
    ballast = small_disk / "ballast"
    ballast.write_bytes(os.urandom(1024 * 1024))
    with pytest.raises(DiskFullError):
        for i in range(20):
            await lw.w.append([os.urandom(100_000)])
    assert lw.q.failed is None and lw.unwritten == 1 and lw.q.written_count == i
    ballast.unlink()
    assert (await lw.w.append([b"after"])).first_id == i  # the refused batch took no id
    assert lw.q.written_count == i + 1
