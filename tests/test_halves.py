"""Half messages (issue 30, item 2), the pure table (nsqd/halves.py): records folded in,
check-backs scheduled with backoff, roll-calls that let a new leader find every undecided
half from the log's tail."""

from __future__ import annotations

import json

import nsqd.halves
from nsqd.halves import (BACKOFF_S, COMMITTED, KEEP_DECIDED_S, ROLL_EVERY_REQUESTS, ROLL_EVERY_S,
                         ROLLED_BACK, WAITING, HalfTable)


def _half(t: HalfTable, offset: int, at: float = 0.0, url: str = "http://app/check"):
    t.apply(offset, 1000 + offset, at, {"check": url})


def test_a_half_is_decided_once_by_the_first_commit_or_rollback():
    t = HalfTable()
    _half(t, 10)
    _half(t, 20)
    assert t.state_of(1010) == WAITING
    t.apply(30, 1030, 1.0, {"commit": 10})
    t.apply(40, 1040, 1.0, {"rollback": 10})  # too late: it was committed
    t.apply(50, 1050, 1.0, {"rollback": 20})
    t.apply(60, 1060, 1.0, {"commit": 99})  # no such half: nothing
    assert (t.state_of(1010), t.state_of(1020)) == (COMMITTED, ROLLED_BACK)
    assert t.waiting() == [] and t.waiting_count == 0


def test_check_backs_come_after_the_timeout_then_back_off_then_give_up():
    t = HalfTable(check_after_s=6.0, max_checks=3)
    _half(t, 10, at=100.0)
    assert t.due(105.9) == [] and [h.offset for h in t.due(106.0)] == [10]
    [h] = t.due(106.0)
    assert t.checked(h, 106.0) and h.next_check_s == 106.0 + BACKOFF_S[0]
    assert t.due(106.5) == []
    assert t.checked(h, 107.0) and h.next_check_s == 107.0 + BACKOFF_S[1]
    assert not t.checked(h, 109.0)  # the third without a decision: roll it back


def test_a_roll_call_read_back_gives_the_same_undecided_halves():
    old = HalfTable()
    for offset in (10, 20, 30):
        _half(old, offset, at=1.0)
    old.apply(40, 1040, 2.0, {"commit": 20})
    [h10, _] = old.waiting()
    old.checked(h10, 8.0)
    call = old.roll_call()
    new = HalfTable()  # a new leader reads back: the roll-call, then what came after it
    new.read_roll_call(9.0, call)
    _half(new, 60, at=9.5)
    new.apply(70, 1070, 10.0, {"rollback": 30})
    assert [(h.offset, h.msg_id, h.checks, h.url) for h in new.waiting()] == [
        (10, 1010, 1, "http://app/check"), (60, 1060, 0, "http://app/check")]
    assert new.state_of(1030) == ROLLED_BACK
    assert new.state_of(1020) is None  # decided before the roll-call: not named by it


def test_a_roll_call_is_due_by_time_or_by_requests_while_a_half_waits():
    t = HalfTable()
    assert not t.roll_call_due(1000.0, 10**9)  # nothing undecided: none
    _half(t, 10, at=0.0)
    t.rolled_call(100.0, 500)
    assert not t.roll_call_due(100.0 + ROLL_EVERY_S - 1, 500 + ROLL_EVERY_REQUESTS - 1)
    assert t.roll_call_due(100.0 + ROLL_EVERY_S, 500)
    assert t.roll_call_due(100.0, 500 + ROLL_EVERY_REQUESTS)
    t.apply(20, 1020, 101.0, {"commit": 10})
    assert not t.roll_call_due(10**6, 10**9)


def test_decided_halves_are_forgotten_by_age_and_by_count_and_undecided_ones_kept(
        monkeypatch):
    t = HalfTable()
    for offset in (10, 20, 30):
        _half(t, offset)
    t.apply(40, 1040, 1.0, {"commit": 10}, now_s=100.0)
    t.apply(50, 1050, 1.0, {"commit": 30}, now_s=200.0)
    t.forget_decided(100.0 + KEEP_DECIDED_S)
    assert sorted(t.by_offset) == [20, 30] and t.state_of(1010) is None
    assert t.kept_from() == 20 and t.state_of(1030) == COMMITTED
    monkeypatch.setattr(nsqd.halves, "KEEP_DECIDED", 0)
    t.forget_decided(0.0)
    assert sorted(t.by_offset) == [20] and t.waiting_count == 1


def test_a_roll_call_names_each_url_once_and_skips_a_damaged_entry():
    t = HalfTable()
    for offset in (10, 20, 30):
        _half(t, offset, url="http://a/" if offset != 20 else "http://b/")
    body = t.roll_call()
    call = json.loads(body)
    assert call["urls"] == ["http://a/", "http://b/"]
    assert [w[4] for w in call["waiting"]] == [0, 1, 0]
    call["waiting"][1][4] = 7  # no such url
    new = HalfTable()
    new.read_roll_call(5.0, json.dumps(call).encode())
    assert [(h.offset, h.url) for h in new.waiting()] == [(10, "http://a/"), (30, "http://a/")]


# ---- the driver on a real log ----

import asyncio  # noqa: E402

from diskqueue.queue import DiskQueue  # noqa: E402
from nsqd.errors import HalfDecided  # noqa: E402
from nsqd.halves import DELIVER, SKIP, Halves, half_control, role  # noqa: E402
from nsqd.topic import Solo  # noqa: E402


async def _records(q: DiskQueue) -> list:
    reader = q.reader(q.start_offset)
    try:
        return await reader.read(1000)
    finally:
        reader.close()


async def test_a_commit_writes_the_message_once_and_a_rollback_after_it_is_refused(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"))
    asked = []

    async def check(url, payload):
        asked.append(payload)
        return None
    h = Halves(q, "t", lambda: Solo(q), check)
    h.start()
    try:
        half = await h.publish(b"debit 42", "http://app/check", 7, b'{"k":"v"}')
        assert await h.decide(half.first_id, True) == COMMITTED
        assert await h.decide(half.first_id, True) == COMMITTED  # sent again: answered
        try:
            await h.decide(half.first_id, False)
            raise AssertionError("a rollback after the commit was taken")
        except HalfDecided:
            pass
        recs = await _records(q)
        assert [role(r.ext) for r in recs] == [SKIP, DELIVER]  # the half, then its commit
        assert (recs[1].body, recs[1].trace_id) == (b"debit 42", 7)
        assert half_control(recs[1].ext) == {"commit": recs[0].offset}
        assert b'"k":"v"' in recs[1].ext and asked == []
    finally:
        await h.close()
        await q.close()


async def test_an_undecided_half_is_checked_back_then_committed_or_rolled_back(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"))
    answers = {"http://a/": "commit", "http://b/": None}

    async def check(url, payload):
        return answers[url]
    h = Halves(q, "t", lambda: Solo(q), check, check_after_s=0.1, max_checks=2)
    h.start()
    try:
        a = await h.publish(b"a", "http://a/")
        b = await h.publish(b"b", "http://b/")
        for _ in range(100):
            if h.table.state_of(b.first_id) != WAITING:
                break
            await asyncio.sleep(0.1)
        assert (h.table.state_of(a.first_id), h.table.state_of(b.first_id)) == (
            COMMITTED, ROLLED_BACK)
        assert h.expired == 1 and h.checks >= 3
    finally:
        await h.close()
    again = Halves(q, "t", lambda: Solo(q), check)  # a new leader reads the table back
    again.start()
    try:
        await again.ready()
        assert (again.table.state_of(a.first_id), again.table.state_of(b.first_id)) == (
            COMMITTED, ROLLED_BACK)
    finally:
        await again.close()
        await q.close()


async def _until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not in time")


async def _read_back(q: DiskQueue) -> Halves:
    h = Halves(q, "t", lambda: Solo(q), _no_answer)
    h.start()
    await h.ready()
    return h


async def _no_answer(url, payload):
    return None


async def test_a_new_leader_finds_an_old_half_by_the_roll_calls_and_misses_it_without(
        tmp_path, monkeypatch):
    """A half older than the read-back window (READ_BACK_REQUESTS) is found by a new driver
    because roll-calls name it; with roll-calls off it is not (the invariant is what finds
    it)."""
    monkeypatch.setattr(nsqd.halves, "LOOP_S", 0.02)
    monkeypatch.setattr(nsqd.halves, "CHECK_AFTER_S", 1000.0)
    monkeypatch.setattr(nsqd.halves, "READ_BACK_REQUESTS", 20)
    for roll_every, found in ((10, True), (10**9, False)):
        monkeypatch.setattr(nsqd.halves, "ROLL_EVERY_REQUESTS", roll_every)
        monkeypatch.setattr(nsqd.halves, "ROLL_EVERY_S", 1000.0 if roll_every > 10 else 0.5)
        q = await DiskQueue.open(str(tmp_path / f"q{roll_every}"))
        h = await _read_back(q)
        try:
            old = await h.publish(b"old", "http://app/check")
            decided = await h.publish(b"decided", "http://app/check")
            await h.decide(decided.first_id, True)
            for i in range(60):  # plain publishes push the half out of the window
                await Solo(q).append([b"x%d" % i])
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)
        finally:
            await h.close()
        again = await _read_back(q)
        try:
            got = [w.msg_id for w in again.table.waiting()]
            assert got == ([old.first_id] if found else []), (roll_every, got)
            if found:  # and it can be committed there
                assert await again.decide(old.first_id, True) == COMMITTED
                recs = await _records(q)
                assert recs[-1].body == b"old" and role(recs[-1].ext) == DELIVER
        finally:
            await again.close()
            await q.close()


async def test_a_partition_holds_max_waiting_halves_and_keeps_the_log_from_the_first(
        tmp_path, monkeypatch):
    from nsqd.errors import HalfFailed

    monkeypatch.setattr(nsqd.halves, "MAX_WAITING", 3)
    q = await DiskQueue.open(str(tmp_path / "q"))
    await Solo(q).append([b"before"])
    h = await _read_back(q)
    try:
        assert h.kept_from() is None
        ids = [(await h.publish(b"h%d" % i, "http://app/")).first_id for i in range(3)]
        first = h.table.by_id[ids[0]].offset
        assert h.kept_from() == first > q.start_offset
        try:
            await h.publish(b"one too many", "http://app/")
            raise AssertionError("a fourth half was taken")
        except HalfFailed:
            pass
        await h.decide(ids[0], False)
        assert h.kept_from() == h.table.by_id[ids[1]].offset
        await h.publish(b"room again", "http://app/")
        for msg_id in ids[1:]:
            await h.decide(msg_id, True)
        assert h.table.waiting_count == 1
    finally:
        await h.close()
        await q.close()


async def test_a_read_back_waits_for_a_stale_committed_end_then_finds_the_halves(
        tmp_path, monkeypatch):
    """After a power cut a partition's committed end may lag its log (it is not synced) and
    the last roll-call lie past it: the read-back waits for it to be committed (commands
    meanwhile get HalfFailed, which clients retry), never gives up."""
    from nsqd.errors import HalfFailed

    monkeypatch.setattr(nsqd.halves, "LOOP_S", 0.05)
    monkeypatch.setattr(nsqd.halves, "READY_WAIT_S", 0.2)
    q = await DiskQueue.open(str(tmp_path / "q"))
    h = await _read_back(q)
    try:
        half = await h.publish(b"paid", "http://app/")
        await h._turn()  # its roll-call
    finally:
        await h.close()
    end = q.committed_end
    q.committed_end = half.offset + 1  # the roll-call past it, as a power cut can leave it
    again = Halves(q, "t", lambda: Solo(q), _no_answer)
    again.start()
    try:
        try:
            await again.decide(half.first_id, True)
            raise AssertionError("decided before the read-back")
        except HalfFailed:
            pass
        assert again.kept_from() == q.start_offset  # retention waits for the read-back
        q.committed_end = end  # the new leader's ISR took its tail
        await again.ready()
        assert [w.msg_id for w in again.table.waiting()] == [half.first_id]
        assert await again.decide(half.first_id, True) == COMMITTED
    finally:
        await again.close()
        await q.close()
