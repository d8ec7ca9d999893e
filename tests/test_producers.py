"""Idempotent producers (issue 30, item 1): a request named by (producer id, sequence) is
written once however often it is sent; a gap is refused; the table is read back from the
log when the partition opens again (a restart here; a new leader: test_producers_cluster)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

import fdhooks
from diskqueue.errors import DiskFullError, NotCommitted
from diskqueue.groupcommit import Appended
from diskqueue.queue import DiskQueue
from nodes import connect
from nsqclient.conn import NSQError
from nsqd.errors import BadSequence
from nsqd.producers import (KEPT, MARKER, UNKNOWN, WRITE, ProducerTable, answer_of, mark_of,
                            marked)
from nsqd.stats import partition_stats
from nsqwire import commands as c
from test_http import call
from test_tcp_ext import raw_consumer
from test_tcp_publish import bodies_of


def _answer(first_id: int) -> Appended:
    return Appended(first_id, 1, first_id * 10, first_id * 10 + 10, first_id, 0, [])


# ---- the table (pure) ----

def test_the_next_sequence_is_written_and_a_kept_one_is_answered_again():
    t = ProducerTable()
    assert t.check("p", 7, 0.0) is WRITE  # a new producer starts where it likes
    waiters = ["w"]
    t.begin("p", 7, 0.0, waiters)
    assert t.check("p", 7, 0.0) is waiters  # in flight: answered with it
    t.settle("p", 7, waiters, _answer(1), False)
    again = t.check("p", 7, 1.0)
    assert again.duplicate and again.first_id == 1 and t.duplicates == 1
    assert t.check("p", 8, 1.0) is WRITE


def test_a_gap_and_a_sequence_older_than_those_kept_are_refused():
    t = ProducerTable()
    for s in range(KEPT + 2):
        w = []
        t.begin("p", s, 0.0, w)
        t.settle("p", s, w, _answer(s), False)
    with pytest.raises(BadSequence, match="gap: the next is 7"):
        t.check("p", 9, 0.0)
    with pytest.raises(BadSequence, match="older than"):
        t.check("p", 0, 0.0)
    assert t.check("p", 2, 0.0).first_id == 2  # the last KEPT are kept


def test_a_failed_write_goes_back_or_stays_unknown():
    t = ProducerTable()
    w = []
    t.begin("p", 0, 0.0, w)
    t.settle("p", 0, w, None, maybe_stored=False)  # nothing of it stored: may be sent again
    assert t.check("p", 0, 0.0) is WRITE
    w = []
    t.begin("p", 0, 0.0, w)
    t.settle("p", 0, w, None, maybe_stored=True)
    assert t.check("p", 0, 0.0) is UNKNOWN and t.unknown()
    t.replayed("p", 0, answer_of(3, 1, 30, 40), 0.0)  # found in the log
    assert t.check("p", 0, 0.0).first_id == 3 and not t.unknown()


def test_producers_are_forgotten_after_expiry_and_beyond_the_bound():
    t = ProducerTable(max_producers=2, expiry=10.0)
    for i, name in enumerate("abc"):
        w = []
        t.begin(name, 5, float(i), w)
        t.settle(name, 5, w, _answer(i), False)
    assert len(t) == 2 and t.check("a", 9, 2.0) is WRITE  # the oldest forgotten: new again
    assert t.check("c", 5, 2.0).duplicate
    assert t.check("c", 5, 13.0) is WRITE and len(t) == 0  # idle past the expiry


def test_a_rebuild_from_the_log_keeps_the_last_sequences_in_log_order():
    t = ProducerTable()
    for s in range(3):
        t.replayed("p", s, answer_of(s, 1, s * 10, s * 10 + 10), 0.0)
    assert t.check("p", 3, 0.0) is WRITE and t.check("p", 1, 0.0).first_id == 1


def test_the_mark_round_trips_beside_a_clients_keys():
    ext = marked(b'{"k":1}', ("p-1", 42))
    assert mark_of(ext) == ("p-1", 42) and b'"k":1' in ext
    assert mark_of(b'{"k":1}') is None and mark_of(marked(b"", ("x", 0))) == ("x", 0)
    assert mark_of(b'{"##producer":["x",]}') is None  # not one `marked` wrote


async def test_the_log_is_read_back_by_bytes_or_by_time_whichever_reaches_further(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"))
    try:
        await q.append([b"named"], 0, marked(b"", ("p", 0)))
        await q.append([b"plain"] * 50)
        end = q.written_end
        assert await q.marked_requests(end, MARKER) == []  # no bytes back: nothing
        found = await q.marked_requests(end, MARKER, 60 * 10**9)  # the last minute: it
        assert [mark_of(ext) for _, ext in found] == [("p", 0)]
        assert found[0][0].msg_count == 1 and found[0][0].offset == q.start_offset
        assert len(await q.marked_requests(0, MARKER)) == 1  # the whole log
        assert await q.marked_requests(0, MARKER, 60 * 10**9, 1) == []  # 1 request back: not it
    finally:
        await q.close()


async def test_the_log_is_read_back_in_jobs_that_let_writes_through(tmp_path, monkeypatch):
    import diskqueue.queue as dq
    monkeypatch.setattr(dq, "MARKED_PER_JOB", 3)  # 10 named requests: 4 jobs
    q = await DiskQueue.open(str(tmp_path / "q"))
    try:
        for s in range(10):
            await q.append([b"m%d" % s], 0, marked(b"", ("p", s)))
        found, written = await asyncio.gather(q.marked_requests(0, MARKER),
                                              q.append([b"plain"]))  # between two jobs
        assert [mark_of(ext) for _, ext in found] == [("p", s) for s in range(10)]
        assert written.count == 1
    finally:
        await q.close()


# ---- a node, over TCP and HTTP ----

def _pub(topic: str, body: bytes, producer: str, seq: int, partition: int | None = None):
    return c.cmd_pub_ext(topic, {"##producer_id": producer, "##sequence": seq}, body, partition)


async def test_a_request_sent_again_is_written_once(node):
    n = await node()
    pub = await connect(n)
    await pub.command(_pub("t", b"a", "p1", 0))
    await pub.command(_pub("t", b"a", "p1", 0))  # a retry: OK, nothing written
    await pub.command(c.cmd_mpub_ext("t", [({"##producer_id": "p1", "##sequence": 1}, b"b"),
                                          ({}, b"c")]))
    await pub.command(c.cmd_mpub_ext("t", [({"##producer_id": "p1", "##sequence": 1}, b"b"),
                                          ({}, b"c")]))
    with pytest.raises(NSQError, match="E_BAD_SEQUENCE.*gap: the next is 2"):
        await pub.command(_pub("t", b"z", "p1", 5))
    await pub.command(_pub("t", b"d", "p1", 2))  # the connection goes on: not fatal
    assert await bodies_of(n, "t") == [b"a", b"b", b"c", b"d"]
    assert n.topics["t"].message_count == 4
    got = partition_stats(n.topics["t"].partition(0))
    assert (got["producers"], got["producer_duplicates"]) == (1, 2)


async def test_pipelined_retries_of_one_in_flight_request_get_its_answer(node):
    n = await node()
    pub = await connect(n)
    await asyncio.gather(*[pub.command(_pub("t", b"x", "p1", 0)) for _ in range(5)])
    assert await bodies_of(n, "t") == [b"x"]


async def test_producer_keys_are_checked_and_never_delivered(node):
    n = await node()
    pub = await connect(n)
    for header in ({"##producer_id": "p"}, {"##sequence": 1}, {"##producer_id": "", "##sequence": 1},
                   {"##producer_id": "p", "##sequence": -1}, {"##producer_id": "a b", "##sequence": 0}):
        with pytest.raises(NSQError, match="E_INVALID_JSON_HEADER"):
            await pub.command(c.cmd_pub_ext("t", header, b"x"))
    with pytest.raises(NSQError, match="only its first message"):
        await pub.command(c.cmd_mpub_ext("t", [({}, b"a"), ({"##producer_id": "p",
                                                             "##sequence": 0}, b"b")]))
    await pub.command(c.cmd_pub_ext("t", {"##producer_id": "p", "##sequence": 0, "k": "v"}, b"m"))
    [data] = await raw_consumer(n.tcp_port, {"extend_support": True}, "t", "ch", 1)
    *_, header, body = c.parse_ext_message(data)
    assert (json.loads(header), body) == ({"k": "v"}, b"m")  # no ##producer, no request keys


async def test_http_pub_and_mpub_take_a_producer(node):
    n = await node()
    at = types.SimpleNamespace(http_address=f"127.0.0.1:{n.http_port}")
    for _ in range(2):
        assert (await call(at, "POST", "/pub?topic=t&producer_id=h&sequence=0", b"a")).text == "OK"
        assert (await call(at, "POST", "/mpub?topic=t&producer_id=h&sequence=1",
                           b"b\nc")).text == "OK"
    r = await call(at, "POST", "/pub?topic=t&producer_id=h&sequence=9", b"z")
    assert (r.status, r.json["message"]) == (400, "BAD_SEQUENCE")
    r = await call(at, "POST", "/pub?topic=t&producer_id=h", b"z")
    assert (r.status, r.json["message"]) == (400, "INVALID_PRODUCER")
    assert await bodies_of(n, "t") == [b"a", b"b", b"c"]


async def test_a_restart_reads_the_table_back_from_the_log(node, tmp_path):
    n = await node()
    pub = await connect(n)
    for s in range(3):
        await pub.command(_pub("t", b"m%d" % s, "p1", s))
    await pub.close()
    await n.stop()
    n = await node()
    pub = await connect(n)
    await pub.command(_pub("t", b"m2", "p1", 2))  # the last one, again: answered, not written
    with pytest.raises(NSQError, match="gap: the next is 3"):
        await pub.command(_pub("t", b"m9", "p1", 9))
    await pub.command(_pub("t", b"m3", "p1", 3))
    assert await bodies_of(n, "t") == [b"m0", b"m1", b"m2", b"m3"]


class _FailingOnce:
    """A partition's writer whose first append fails with `error` (after a loop turn, as a
    log answers), and whose later ones go to the real writer."""

    def __init__(self, writer, error):
        self.writer, self.error = writer, error
        self.writable, self.starting, self.reason = True, False, ""

    def append(self, bodies, trace_id=0, ext=b"", callback=None, **kw):
        if self.error is None:
            return self.writer.append(bodies, trace_id, ext, callback=callback, **kw)
        error, self.error = self.error, None
        asyncio.get_running_loop().call_soon(callback, None, error)


async def test_a_write_that_stored_nothing_may_be_sent_again_under_its_sequence(node):
    n = await node()
    pub = await connect(n)
    await pub.command(_pub("t", b"a", "p1", 0))
    part = n.topics["t"].partition(0)
    part.writer = _FailingOnce(part.writer, DiskFullError("disk full"))
    with pytest.raises(NSQError, match="E_PUB_FAILED"):  # fatal, as in classic nsqd
        await pub.command(_pub("t", b"b", "p1", 1))
    pub = await connect(n)
    await pub.command(_pub("t", b"b", "p1", 1))  # nothing was stored: written now
    assert await bodies_of(n, "t") == [b"a", b"b"]


async def test_a_write_whose_outcome_is_unknown_is_answered_once_the_log_shows_it(node):
    """The write went to the log but its answer said "may still be delivered": its retries
    are refused as not writable (retry) until the partition finds it in its log, then
    answered with it; nothing is written twice."""
    n = await node()
    pub = await connect(n)
    await pub.command(_pub("t", b"a", "p1", 0))
    part = n.topics["t"].partition(0)
    real = part.writer

    class Unknown:  # writes it, then answers as a leader that lost its ISR would
        writable, starting, reason = True, False, ""

        def append(self, bodies, trace_id=0, ext=b"", callback=None, **kw):
            def done(appended, exc):
                callback(None, NotCommitted("not committed (test): it may still be delivered"))
            return real.append(bodies, trace_id, ext, callback=done, **kw)

    part.writer = Unknown()
    with pytest.raises(NSQError, match="E_FAILED_ON_NOT_WRITABLE.*may still be delivered"):
        await pub.command(_pub("t", b"b", "p1", 1))
    part.writer = real
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:  # the client's retries
        try:
            reply = await pub.command(_pub("t", b"b", "p1", 1))
            break
        except NSQError as e:
            assert "not known yet" in str(e) and loop.time() < deadline
            await asyncio.sleep(0.05)
    assert reply == b"OK" and await bodies_of(n, "t") == [b"a", b"b"]


async def test_a_table_that_cannot_be_read_fails_the_publish_and_is_read_again_next(node,
                                                                                  monkeypatch):
    n = await node()
    pub = await connect(n)
    await pub.command(c.cmd_pub("t", b"plain"))  # the topic, its partition open
    failures = [OSError("EIO (test)")]

    def failing_once(*_):  # the table's read of this partition's commitlog
        if failures:
            raise failures.pop()

    fdhooks.hook(monkeypatch, "pread",
                 fdhooks.under(n.topics["t"].partition(0).queue.commitlog.path), failing_once)
    with pytest.raises(NSQError, match="E_PUB_FAILED.*producers could not be read.*EIO"):
        await pub.command(_pub("t", b"a", "p1", 0))
    pub = await connect(n)  # E_PUB_FAILED is fatal, as in classic nsqd
    await pub.command(_pub("t", b"a", "p1", 0))
    await pub.command(_pub("t", b"a", "p1", 0))
    assert await bodies_of(n, "t") == [b"plain", b"a"]
