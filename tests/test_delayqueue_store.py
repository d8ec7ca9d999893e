"""delayqueue.store.DelayStore: one channel's deferred messages in LMDB.

Round trips, due order, take/finish/requeue, replacement, recovery after a restart,
a real SIGKILL test (this file is also the worker it kills: `python THIS worker ...`),
corrupt or missing files, and memory for a million entries.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from delayqueue import store as store_mod
from delayqueue.entry import CorruptEntry, DelayedMessage, decode_value, encode_value
from delayqueue.store import DelayStore, DelayStoreCorruptError, DelayStoreError

M = DelayedMessage
U64 = (1 << 64) - 1


def msg(msg_id, due_ms, body=None, attempts=0, ext=b"", origin=-1, trace_id=None,
        timestamp=None) -> DelayedMessage:
    if timestamp is None:
        timestamp = 1_700_000_000_000_000_000 + msg_id % 10**12
    return M(due_ms, msg_id, msg_id ^ 0xABCDEF if trace_id is None else trace_id, timestamp,
             attempts, ext, b"body-%d" % msg_id if body is None else body, origin)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "dq")


@pytest.fixture
def store(path):
    s = DelayStore.open(path)
    yield s
    s.close()


# ---- the value codec (pure) ----------------------------------------------------------

messages = st.builds(
    M,
    due_ms=st.integers(0, (1 << 63) - 1),
    msg_id=st.integers(0, U64),
    trace_id=st.integers(0, U64),
    timestamp=st.integers(0, U64),
    attempts=st.integers(0, 0xFFFF),
    ext=st.binary(max_size=300),
    body=st.binary(max_size=3000),
    origin_offset=st.one_of(st.just(-1), st.integers(-(1 << 63), (1 << 63) - 1)),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_value_round_trip(m):
    value = bytes(encode_value(m))
    assert decode_value(value) == m


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_value_any_flipped_bit_is_detected(m, data):
    value = bytearray(encode_value(m))
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        decode_value(bytes(value), "waiting", b"k")


@pytest.mark.parametrize("bad", [
    dict(attempts=0x10000), dict(attempts=-1), dict(due_ms=-1), dict(due_ms=1 << 63),
    dict(msg_id=-1), dict(msg_id=1 << 64), dict(ext=b"x" * 0x10000), dict(origin_offset=1 << 63),
])
def test_bad_fields_raise_value_error_and_write_nothing(store, bad):
    with pytest.raises(ValueError):
        store.put([msg(1, 10), msg(2, 10)._replace(**bad)])
    assert store.stats() == (0, 0, None)


# ---- round trip through LMDB -------------------------------------------------------------

_folders = itertools.count()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=30, unique_by=lambda m: m.msg_id))
def test_round_trip_every_field(tmp_path, items):
    folder = str(tmp_path / f"rt-{next(_folders)}")
    s = DelayStore.open(folder)
    try:
        s.put(items)
        by_id = {m.msg_id: m for m in items}
        assert s.stats()[:2] == (len(items), 0)
        for m in items:
            assert s.get(m.msg_id) == ("waiting", m)
        scanned = [m for _, m in s.scan(batch=7)]
        assert scanned == sorted(items, key=lambda m: (m.due_ms, m.msg_id))
        s.close()
        s = DelayStore.open(folder)  # and from disk, after a reopen
        taken = s.take_due((1 << 63) - 1, 1000)
        assert taken == sorted(items, key=lambda m: (m.due_ms, m.msg_id))
        assert {m.msg_id: m for m in taken} == by_id
    finally:
        s.delete()


def test_large_body_and_ext(store):
    m = msg(7, 5, body=os.urandom(3 << 20), ext=b"{" + b"e" * 65533 + b"}")
    store.put([m])
    assert store.take_due(5, 10) == [m]


# ---- take_due ------------------------------------------------------------------------------

def test_take_due_order_now_and_limit(store):
    rng = random.Random(5)
    items = [msg(i, rng.randrange(0, 1000)) for i in range(500)]
    store.put(items)
    expected = sorted(items, key=lambda m: (m.due_ms, m.msg_id))
    assert store.take_due(-1, 10) == []
    assert store.take_due(10**6, 0) == []
    got = store.take_due(499, 7)  # limit
    assert got == expected[:7]
    rest = [m for m in expected[7:] if m.due_ms <= 499]
    got2 = store.take_due(499, 10_000)  # now: nothing due later than 499
    assert got2 == rest
    assert all(m.due_ms > 499 for where, m in store.scan() if where == "waiting")
    assert store.take_due(499, 10) == []
    got3 = store.take_due(1000, 10_000)
    assert got + got2 + got3 == expected
    assert store.stats() == (0, 500, None)


def test_take_due_boundary_is_inclusive(store):
    store.put([msg(1, 100), msg(2, 101)])
    assert [m.msg_id for m in store.take_due(99, 10)] == []
    assert [m.msg_id for m in store.take_due(100, 10)] == [1]


def test_never_returned_twice_until_requeued(store):
    store.put([msg(i, i % 10) for i in range(100)])
    seen = set()
    for _ in range(30):
        for m in store.take_due(100, 8):
            assert m.msg_id not in seen
            seen.add(m.msg_id)
    assert len(seen) == 100
    assert store.take_due(10**9, 1000) == []
    store.requeue([(5, 3, 2)])
    again = store.take_due(3, 10)
    assert [(m.msg_id, m.due_ms, m.attempts) for m in again] == [(5, 3, 2)]
    assert store.take_due(10**9, 1000) == []


def test_same_due_orders_by_msg_id(store):
    ids = [U64, 0, 1 << 50, 3, (1 << 63) + 1]
    store.put([msg(i, 42) for i in ids])
    assert [m.msg_id for m in store.take_due(42, 10)] == sorted(ids)


# ---- finish / requeue -------------------------------------------------------------------

def test_finish_taken_waiting_and_unknown(store):
    store.put([msg(i, i) for i in range(10)])
    taken = store.take_due(4, 100)
    assert [m.msg_id for m in taken] == [0, 1, 2, 3, 4]
    assert store.finish([0, 1, 8, 999, 1]) == 3  # two taken, one waiting, unknown, repeat
    assert store.stats() == (4, 3, 5)
    assert store.get(8) is None and store.get(0) is None
    assert store.finish([]) == 0
    assert store.finish([2, 3, 4, 5, 6, 7, 9]) == 7
    assert store.stats() == (0, 0, None)


def test_requeue_taken_and_waiting(store):
    store.put([msg(1, 10, attempts=1), msg(2, 20, attempts=1), msg(3, 30)])
    [m1] = store.take_due(10, 1)
    store.requeue([(1, 500, 2), (2, 5, 9), (77, 1, 1)])  # taken, waiting, unknown
    assert store.stats() == (3, 0, 5)
    assert store.get(1) == ("waiting", m1._replace(due_ms=500, attempts=2))
    got = store.take_due(10**6, 10)
    assert [(m.msg_id, m.due_ms, m.attempts) for m in got] == [(2, 5, 9), (3, 30, 0),
                                                               (1, 500, 2)]
    assert got[2].body == m1.body and got[2].origin_offset == m1.origin_offset
    with pytest.raises(ValueError):
        store.requeue([(1, -5, 1)])
    with pytest.raises(ValueError):
        store.requeue([(1, 5, 70000)])
    store.requeue([])


def test_max_origin_and_holding_survive_reopen(path):
    s = DelayStore.open(path)
    assert s.max_origin_offset() == -1 and s.holding([1, 2]) == set()
    s.put([msg(1, 10, origin=500), msg(2, 20, origin=300), msg(3, 30)])
    s.put([msg(4, 40, origin=100)])  # a lower origin never lowers the mark
    assert s.max_origin_offset() == 500
    s.take_due(15, 10)  # 1 is taken now: still held
    s.finish([2])
    assert s.holding([1, 2, 3, 4, 99]) == {1, 3, 4}
    s.close()
    s = DelayStore.open(path)
    assert s.max_origin_offset() == 500 and s.holding([1, 2, 3, 4]) == {1, 3, 4}
    s.close()


def test_min_origin_counts_every_log_message_held(path):
    s = DelayStore.open(path)
    assert s.min_origin() is None
    s.put([msg(7, 10, origin=-1), msg(8, 20)])  # not from the log: never counted
    assert s.min_origin() is None
    s.put([msg(3, 30, origin=900), msg(1, 40, origin=500), msg(2, 5, origin=500)])
    assert s.min_origin() == (500, 1)  # same offset: by id
    assert [m.msg_id for m in s.take_due(10, 10)] == [2, 7]  # taken still counts
    assert s.min_origin() == (500, 1)
    s.finish([1])
    assert s.min_origin() == (500, 2)
    s.requeue([(2, 10**6, 4)])  # a new due time keeps the origin
    s.requeue_all_now(50)
    assert s.min_origin() == (500, 2)
    s.put([msg(2, 60, origin=1000)])  # replaced: its old origin goes
    assert s.min_origin() == (900, 3)
    s.close()
    s = DelayStore.open(path)  # the taken entries come back as waiting: still counted
    assert s.min_origin() == (900, 3)
    s.finish([3, 7, 8])
    assert s.min_origin() == (1000, 2)
    s.finish([2])
    assert s.min_origin() is None
    s.put([msg(4, 1, origin=0), msg(5, 2, origin=(1 << 63) - 1)])
    assert s.min_origin() == (0, 4)
    assert s.empty() == 2 and s.min_origin() is None
    s.close()


def test_min_origin_skips_an_entry_set_aside_as_corrupt(path):
    s = DelayStore.open(path)
    bad_body = b"ROTTEN-ORIGIN-BODY-" * 4
    s.put([msg(1, 10, body=bad_body, origin=100), msg(2, 20, origin=200)])
    s.close()
    assert flip_on_disk(os.path.join(path, "data.mdb"), bad_body) >= 1
    s = DelayStore.open(path)
    assert s.min_origin() == (100, 1)  # its tail still checks: held until it is set aside
    with pytest.raises(DelayStoreCorruptError):
        s.take_due(100, 10)
    assert s.min_origin() == (200, 2)
    s.close()


def test_first_held_lists_log_messages_by_origin_with_due_and_attempts(path):
    """first_held: the first `limit` log messages held, waiting or taken, in origin order,
    each with its due time and attempts as they are now; a corrupt value is left out."""
    s = DelayStore.open(path)
    assert s.first_held(10) == []
    bad_body = b"ROTTEN-HELD-BODY-" * 4
    s.put([msg(7, 10, origin=-1), msg(3, 30, origin=900, attempts=2),
           msg(1, 40, origin=500), msg(2, 5, origin=700, attempts=9),
           msg(4, 50, origin=800, body=bad_body)])
    assert s.first_held(10) == [(500, 1, 40, 0), (700, 2, 5, 9), (800, 4, 50, 0),
                                (900, 3, 30, 2)]
    assert s.first_held(2) == [(500, 1, 40, 0), (700, 2, 5, 9)] and s.first_held(0) == []
    assert [m.msg_id for m in s.take_due(6, 10)] == [2]
    s.requeue([(1, 77, 3)])
    assert s.first_held(2) == [(500, 1, 77, 3), (700, 2, 5, 9)], "taken still held"
    s.close()
    assert flip_on_disk(os.path.join(path, "data.mdb"), bad_body) >= 1
    s = DelayStore.open(path, now_ms=1)
    assert s.first_held(10) == [(500, 1, 77, 3), (700, 2, 1, 9), (900, 3, 30, 2)]
    s.close()


def format_1_store(path: str, waiting, taken) -> None:
    """A store as the format before `origins` made it (no such sub-database)."""
    os.makedirs(path)
    env = lmdb.open(path, max_dbs=8, sync=True, metasync=True)
    with env.begin(write=True) as txn:
        dbs = {n: env.open_db(n.encode(), txn=txn)
               for n in ("waiting", "taken", "due_of", "corrupt", "meta")}
        txn.put(b"format", b"delaystore-1", db=dbs["meta"])
        for m in waiting:
            key = m.due_ms.to_bytes(8, "big") + m.msg_id.to_bytes(8, "big")
            txn.put(key, encode_value(m), db=dbs["waiting"])
            txn.put(key[8:], key, db=dbs["due_of"])
        for m in taken:
            txn.put(m.msg_id.to_bytes(8, "big"), encode_value(m), db=dbs["taken"])
    env.close()


def test_store_without_origins_builds_them_at_open(path, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK", 7)  # the build runs in several transactions
    waiting = [msg(i, 1000 + i, origin=10_000 - i if i % 3 else -1) for i in range(30)]
    taken = [msg(100 + i, 5, origin=50_000 + i) for i in range(20)]
    format_1_store(path, waiting, taken)
    s = DelayStore.open(path, now_ms=0)
    assert s.recovered == 20
    assert s.min_origin() == (10_000 - 29, 29)
    s.finish([i for i in range(30)])
    assert s.min_origin() == (50_000, 100)
    s.close()
    env = lmdb.open(path, max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn)) == store_mod.FORMAT
        assert txn.stat(env.open_db(b"origins", txn=txn))["entries"] == 20
    env.close()
    s = DelayStore.open(path)  # format 2 now: opened as it is
    assert s.min_origin() == (50_000, 100) and s.stats()[0] == 20
    s.close()


def test_build_interrupted_runs_again_at_the_next_open(path, monkeypatch):
    format_1_store(path, [msg(i, i, origin=100 + i) for i in range(20)], [])
    monkeypatch.setattr(store_mod, "CHUNK", 5)
    real = DelayStore._add_origin
    calls = []

    def crash_after_some(self, txn, value, id8):
        calls.append(id8)
        if len(calls) == 12:
            raise OSError("crash")
        real(self, txn, value, id8)
    monkeypatch.setattr(DelayStore, "_add_origin", crash_after_some)
    with pytest.raises(OSError):
        DelayStore.open(path)
    monkeypatch.setattr(DelayStore, "_add_origin", real)
    s = DelayStore.open(path)
    assert s.min_origin() == (100, 0)
    s.finish(list(range(19)))
    assert s.min_origin() == (119, 19)
    s.close()


def test_put_replaces_waiting_and_taken(store):
    store.put([msg(1, 10, body=b"v1"), msg(2, 20, body=b"v1")])
    store.put([msg(1, 30, body=b"v2")])  # was waiting
    [t] = store.take_due(20, 10)
    assert t.msg_id == 2
    store.put([msg(2, 5, body=b"v2", attempts=3)])  # was taken
    assert store.stats() == (2, 0, 5)
    got = store.take_due(100, 10)
    assert [(m.msg_id, m.due_ms, m.body, m.attempts) for m in got] == [
        (2, 5, b"v2", 3), (1, 30, b"v2", 0)]
    # the same id twice in one batch: the last one wins
    store.put([msg(9, 1, body=b"a"), msg(9, 2, body=b"b"), msg(9, 0, body=b"c")])
    assert store.stats()[0] == 1
    assert store.take_due(100, 10)[0].body == b"c"


def test_stats_next_due_requeue_all_now_empty(store):
    assert store.stats() == (0, 0, None) and store.next_due_ms() is None
    store.put([msg(i, 1000 + i) for i in range(50)])
    assert store.stats() == (50, 0, 1000) and store.next_due_ms() == 1000
    store.take_due(1004, 5)
    assert store.stats() == (45, 5, 1005) and store.next_due_ms() == 1005
    assert store.requeue_all_now(1020) == 29  # 1021..1049 move; 1005..1020 already due
    assert store.stats() == (45, 5, 1005)
    got = store.take_due(1020, 1000)
    assert len(got) == 45 and all(m.due_ms <= 1020 for m in got)
    assert store.next_due_ms() is None
    store.put([msg(100, 5), msg(101, 10**12)])
    assert store.empty() == 52
    assert store.stats() == (0, 0, None)
    assert store.take_due(10**13, 100) == []
    store.put([msg(100, 5)])  # usable after empty
    assert store.stats() == (1, 0, 5)


def test_requeue_all_now_in_chunks(store, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK", 7)
    store.put([msg(i, 10**6 + i) for i in range(50)])
    assert store.requeue_all_now(3) == 50
    got = store.take_due(3, 100)
    assert sorted(m.msg_id for m in got) == list(range(50))
    assert all(m.due_ms == 3 for m in got)


def test_close_delete_and_use_after_close(path):
    s = DelayStore.open(path)
    s.put([msg(1, 1)])
    s.close()
    s.close()  # idempotent
    with pytest.raises(DelayStoreError, match="closed"):
        s.put([msg(2, 2)])
    s = DelayStore.open(path)
    assert s.stats() == (1, 0, 1)
    s.delete()
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".deleting")
    s = DelayStore.open(path)  # a new, empty one
    assert s.stats() == (0, 0, None)
    s.close()


def test_open_twice_in_one_process_is_refused(store, path):
    with pytest.raises(DelayStoreError, match="already open"):
        DelayStore.open(path)


def test_calls_from_several_threads(store):
    """The channel calls from a worker thread; a lock serializes callers anyway."""
    def work(k):
        base = k * 1000
        store.put([msg(base + i, i) for i in range(200)])
        got = store.take_due(10**6, 50)
        store.finish([m.msg_id for m in got])
        return len(got)

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(work, range(8))) == 400
    waiting, taken, _ = store.stats()
    assert (waiting, taken) == (1600 - 400, 0)


def test_map_grows_when_full(path):
    s = DelayStore.open(path, map_size=1 << 20)
    body = os.urandom(1000)
    for b in range(8):
        s.put([msg(b * 1000 + i, i, body=body) for i in range(1000)])
    assert s.map_grows >= 1
    assert s.stats()[0] == 8000
    s.close()
    s = DelayStore.open(path, map_size=1 << 20)
    assert s.stats()[0] == 8000
    s.put([msg(10**6, 1, body=body)])
    assert len(s.take_due(10**6, 10**5)) == 8001
    s.close()


# ---- against a model: random sequences of every operation, reopens included ---------------

class StoreMachine(RuleBasedStateMachine):
    """The store against a dict: id -> [where, DelayedMessage]."""

    ids = st.integers(0, 9)
    dues = st.integers(0, 20)  # small ranges: equal due times and boundaries are common
    nows = st.integers(0, 24)

    def __init__(self):
        super().__init__()
        import tempfile

        self.tmp = tempfile.mkdtemp(prefix="dq-machine-")
        self.path = os.path.join(self.tmp, "dq")
        self.store = DelayStore.open(self.path)
        self.model: dict[int, list] = {}

    def waiting(self):
        return sorted((m for w, m in self.model.values() if w == "waiting"),
                      key=lambda m: (m.due_ms, m.msg_id))

    @rule(items=st.lists(st.tuples(ids, dues, st.integers(0, 3), st.binary(max_size=20),
                                   st.integers(-1, 5)),
                         min_size=1, max_size=6))
    def put(self, items):
        batch = [msg(i, due, body=body, attempts=att, origin=origin)
                 for i, due, att, body, origin in items]
        self.store.put(batch)
        for m in batch:
            self.model[m.msg_id] = ["waiting", m]

    @rule(now=st.one_of(nows, st.just(-1)), limit=st.integers(0, 5))
    def take_due(self, now, limit):
        want = [m for m in self.waiting() if m.due_ms <= now][:limit] if now >= 0 else []
        assert self.store.take_due(now, limit) == want
        for m in want:
            self.model[m.msg_id][0] = "taken"

    @rule(ids=st.lists(ids, max_size=5))
    def finish(self, ids):
        want = len({i for i in ids if i in self.model})
        assert self.store.finish(ids) == want
        for i in ids:
            self.model.pop(i, None)

    @rule(items=st.lists(st.tuples(ids, dues, st.integers(0, 9)), max_size=4))
    def requeue(self, items):
        self.store.requeue(items)
        for i, due, att in items:
            if i in self.model:
                self.model[i] = ["waiting", self.model[i][1]._replace(due_ms=due, attempts=att)]

    @rule(now=nows)
    def requeue_all_now(self, now):
        moved = 0
        for entry in self.model.values():
            if entry[0] == "waiting" and entry[1].due_ms > now:
                entry[1] = entry[1]._replace(due_ms=now)
                moved += 1
        assert self.store.requeue_all_now(now) == moved

    @rule(now=nows)
    def reopen(self, now):
        self.store.close()
        self.store = DelayStore.open(self.path, now_ms=now)
        back = 0
        for entry in self.model.values():
            if entry[0] == "taken":
                entry[:] = ["waiting", entry[1]._replace(due_ms=min(entry[1].due_ms, now))]
                back += 1
        assert self.store.recovered == back

    @precondition(lambda self: len(self.model) > 6)
    @rule()
    def empty(self):
        assert self.store.empty() == len(self.model)
        self.model.clear()

    @invariant()
    def stats_agree(self):
        waiting = self.waiting()
        taken = sum(1 for w, _ in self.model.values() if w == "taken")
        oldest = waiting[0].due_ms if waiting else None
        assert self.store.stats() == (len(waiting), taken, oldest)
        assert self.store.next_due_ms() == oldest
        for i, (where, m) in self.model.items():
            assert self.store.get(i) == (where, m)
        origins = [(m.origin_offset, m.msg_id) for _, m in self.model.values()
                   if m.origin_offset >= 0]
        assert self.store.min_origin() == (min(origins) if origins else None)

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---- restart recovery -----------------------------------------------------------------

def test_taken_and_not_finished_come_back_after_reopen(path):
    s = DelayStore.open(path)
    s.put([msg(i, 100 + i, attempts=i) for i in range(10)])
    taken = s.take_due(104, 100)  # ids 0..4
    assert s.finish([0, 1]) == 2
    s.requeue([(2, 50_000, 7)])
    s.close()
    s = DelayStore.open(path, now_ms=1000)
    assert s.recovered == 2  # ids 3 and 4
    assert s.stats() == (8, 0, 103)  # 3 and 4 keep their due times (before now)
    got = {m.msg_id: m for m in s.take_due(10**6, 100)}
    assert set(got) == {2, 3, 4, 5, 6, 7, 8, 9}
    for m in taken[3:]:  # back as they were, due at min(due, now)
        assert got[m.msg_id] == m
    assert got[2].due_ms == 50_000 and got[2].attempts == 7
    s.close()


def test_recovery_due_is_now_when_due_was_later(path):
    s = DelayStore.open(path)
    s.put([msg(1, 5000)])
    s.take_due(5000, 10)
    s.close()
    s = DelayStore.open(path, now_ms=3000)  # the clock went back
    assert s.stats() == (1, 0, 3000)
    assert s.take_due(3000, 10)[0].due_ms == 3000
    s.close()


def test_recovery_in_chunks(path, monkeypatch):
    monkeypatch.setattr(store_mod, "CHUNK", 16)
    s = DelayStore.open(path)
    s.put([msg(i, i) for i in range(100)])
    assert len(s.take_due(10**6, 1000)) == 100
    s.close()
    s = DelayStore.open(path)
    assert s.recovered == 100 and s.stats() == (100, 0, 0)
    s.close()


# ---- corrupt and missing files ----------------------------------------------------------

def filled(path, n=2000, body_len=300):
    s = DelayStore.open(path)
    s.put([msg(i, i, body=os.urandom(body_len)) for i in range(n)])
    s.close()
    return os.path.join(path, "data.mdb")


def open_error(path) -> str:
    with pytest.raises(DelayStoreError) as e:
        DelayStore.open(path)
    return str(e.value)


def test_garbage_data_file(path):
    data = filled(path)
    size = os.path.getsize(data)
    with open(data, "wb") as f:
        f.write(os.urandom(size))
    err = open_error(path)
    assert data in err


def test_garbage_first_pages(path):
    data = filled(path)
    with open(data, "r+b") as f:
        f.write(os.urandom(8192))
    err = open_error(path)
    assert data in err


@pytest.mark.parametrize("keep", [0, 100, 5000, "half"])
def test_truncated_data_file(path, keep):
    data = filled(path)
    size = os.path.getsize(data)
    os.truncate(data, size // 2 if keep == "half" else keep)
    err = open_error(path)
    assert data in err
    # the error is stable: nothing was "repaired" into an empty store
    assert data in open_error(path)


def test_missing_data_file_with_lock_file(path):
    data = filled(path)
    os.unlink(data)
    assert os.path.exists(os.path.join(path, "lock.mdb"))
    err = open_error(path)
    assert data in err and "missing" in err
    assert not os.path.exists(data)  # not silently recreated


def test_folder_that_is_a_file(tmp_path):
    p = tmp_path / "dq"
    p.write_bytes(b"not a folder")
    err = open_error(str(p))
    assert str(p) in err and "not a folder" in err


def test_other_lmdb_file_is_not_a_delay_store(path):
    os.makedirs(path)
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    err = open_error(path)
    assert os.path.join(path, "data.mdb") in err and "not a delay store" in err


def test_empty_folder_becomes_a_store(path):
    os.makedirs(path)
    s = DelayStore.open(path)
    s.put([msg(1, 1)])
    s.close()
    s = DelayStore.open(path)
    assert s.stats() == (1, 0, 1)
    s.close()


def test_leftover_creating_and_deleting_folders_are_cleaned(path):
    for leftover in (path + ".creating", path + ".deleting"):
        os.makedirs(leftover)
        open(os.path.join(leftover, "lock.mdb"), "wb").close()
    s = DelayStore.open(path)
    assert not os.path.exists(path + ".creating") and not os.path.exists(path + ".deleting")
    s.close()


def flip_on_disk(data: str, needle: bytes) -> int:
    """Flip one byte of every copy of `needle` in the file (LMDB may keep old page copies)."""
    with open(data, "r+b") as f:
        raw = bytearray(f.read())
        n, at = 0, raw.find(needle)
        while at >= 0:
            raw[at + len(needle) // 2] ^= 0x40
            n += 1
            at = raw.find(needle, at + 1)
        f.seek(0)
        f.write(raw)
    return n


def test_corrupt_value_on_disk_is_reported_and_set_aside(path):
    s = DelayStore.open(path)
    bad_body = b"THIS-BODY-WILL-ROT-" * 4
    s.put([msg(1, 10), msg(2, 20, body=bad_body), msg(3, 30)])
    s.close()
    assert flip_on_disk(os.path.join(path, "data.mdb"), bad_body) >= 1
    s = DelayStore.open(path)
    assert [m.msg_id for m in s.take_due(15, 10)] == [1]
    with pytest.raises(DelayStoreCorruptError) as e:
        s.take_due(100, 10)
    err = str(e.value)
    key = (20).to_bytes(8, "big") + (2).to_bytes(8, "big")
    assert key.hex() in err and "waiting" in err and s.data_file in err
    assert "checksum" in err
    assert s.corrupt_count() == 1
    # set aside, not deleted; the next call goes on past it, nothing returned twice
    assert [m.msg_id for m in s.take_due(100, 10)] == [3]
    assert s.stats() == (0, 2, None)
    s.close()


def test_corrupt_taken_value_survives_recovery_and_is_reported(path):
    s = DelayStore.open(path)
    bad_body = b"ROTTEN-TAKEN-BODY-" * 4
    s.put([msg(5, 10, body=bad_body)])
    s.take_due(10, 1)
    s.close()
    assert flip_on_disk(os.path.join(path, "data.mdb"), bad_body) >= 1
    s = DelayStore.open(path)  # recovery moves it to waiting, unchanged
    with pytest.raises(DelayStoreCorruptError, match="checksum"):
        s.take_due(10**6, 10)
    assert s.stats() == (0, 0, None) and s.corrupt_count() == 1
    s.close()


# ---- SIGKILL -------------------------------------------------------------------------------

THIS = os.path.abspath(__file__)


def kill_content(msg_id: int, ver: int) -> DelayedMessage:
    """What version `ver` of message `msg_id` holds (due and attempts set by the caller)."""
    h = hashlib.blake2b(b"%d:%d" % (msg_id, ver)).digest()
    body = h * (1 + h[0] % 20)
    ext = b'{"v":%d}' % ver if msg_id % 3 == 0 else b""
    return M(0, msg_id, msg_id ^ ver, msg_id * 1000 + ver, ver % 5, ext, body,
             msg_id * 10 + ver if ver % 2 == 0 else -1)


def kill_worker(path: str, run: int, seed: int) -> None:
    """Loop put/take/finish/requeue on the store until killed. Before each operation one
    line "B ..." says what it will do; after it returned, "A ..." (os.write of a whole
    line: the test reads what was acknowledged from the output file)."""
    def out(line: str) -> None:
        os.write(1, (line + "\n").encode())

    s = DelayStore.open(path)
    out(f"ready {s.recovered}")
    rng = random.Random(seed)
    ctr = 0
    held: set[int] = set()  # taken by this process, not finished or requeued
    waiting: dict[int, int] = {}  # id -> version, put by this process and not taken
    while True:
        r = rng.random()
        now = int(time.time() * 1000)
        if r < 0.4:
            items = []
            for _ in range(rng.randint(1, 12)):
                if waiting and rng.random() < 0.15:  # replace one that waits
                    mid = rng.choice(list(waiting))
                    ver = waiting[mid] + 1
                else:
                    mid, ver = (run << 32) | ctr, 0
                    ctr += 1
                due = now + rng.choice([-5000, 0, 20, 100, 400, 10**8])
                items.append(kill_content(mid, ver)._replace(due_ms=due))
            items = list({m.msg_id: m for m in items}.values())
            out("B P " + " ".join(f"{m.msg_id}:{(m.timestamp % 1000)}:{m.due_ms}" for m in items))
            s.put(items)
            out("A P")
            for m in items:
                waiting[m.msg_id] = m.timestamp % 1000
        elif r < 0.65:
            limit = rng.randint(1, 30)
            out(f"B T {now} {limit}")
            got = s.take_due(now, limit)
            out("A T " + " ".join(str(m.msg_id) for m in got))
            for m in got:
                if m.msg_id in held:
                    out(f"ERR taken twice {m.msg_id}")
                held.add(m.msg_id)
                waiting.pop(m.msg_id, None)
        elif r < 0.85:
            pool = list(held) + (rng.sample(list(waiting), 1) if waiting and rng.random() < 0.2
                                 else [])
            ids = rng.sample(pool, min(len(pool), rng.randint(1, 15)))
            if rng.random() < 0.1:
                ids.append((run << 32) | (1 << 31) | rng.randrange(1000))  # never put
            out("B F " + " ".join(map(str, ids)))
            n = s.finish(ids)
            out(f"A F {n}")
            for i in ids:
                held.discard(i)
                waiting.pop(i, None)
        else:
            ids = rng.sample(list(held), min(len(held), rng.randint(1, 10)))
            reqs = [(i, now + rng.choice([0, 50, 300, 10**8]), rng.randrange(1, 500))
                    for i in ids]
            out("B R " + " ".join(f"{i}:{d}:{a}" for i, d, a in reqs))
            s.requeue(reqs)
            out("A R")
            for i, _, _ in reqs:
                held.discard(i)


class KillModel:
    """What the acknowledged operations say the store holds: id -> [ver, due, attempts,
    where]. `where` is "waiting" or "taken"; finished ids are in `gone`."""

    def __init__(self):
        self.live: dict[int, list] = {}
        self.gone: set[int] = set()
        self.acked = {"P": 0, "T": 0, "F": 0, "R": 0}
        self.acked_msgs = {"P": 0, "T": 0, "F": 0, "R": 0}
        self.pending_kinds: dict[str, int] = {}

    def apply(self, begin: list[str], ack: list[str]) -> None:
        kind = begin[1]
        self.acked[kind] += 1
        if kind == "P":
            for item in begin[2:]:
                mid, ver, due = map(int, item.split(":"))
                self.live[mid] = [ver, due, kill_content(mid, ver).attempts, "waiting"]
                self.gone.discard(mid)
            self.acked_msgs["P"] += len(begin) - 2
        elif kind == "T":
            for mid in map(int, ack[2:]):
                assert mid in self.live, f"take returned {mid}, which is not live"
                assert self.live[mid][3] == "waiting", f"{mid} taken twice"
                assert self.live[mid][1] <= int(begin[2]), f"{mid} taken before due"
                self.live[mid][3] = "taken"
            self.acked_msgs["T"] += len(ack) - 2
        elif kind == "F":
            ids = set(map(int, begin[2:]))
            existed = sum(1 for i in ids if i in self.live)
            assert int(ack[2]) == existed, f"finish said {ack[2]}, model has {existed}"
            for i in ids:
                if self.live.pop(i, None) is not None:
                    self.gone.add(i)
            self.acked_msgs["F"] += existed
        elif kind == "R":
            for item in begin[2:]:
                mid, due, att = map(int, item.split(":"))
                if mid in self.live:
                    self.live[mid][1:] = [due, att, "waiting"]
            self.acked_msgs["R"] += len(begin) - 2

    def check(self, found: dict[int, DelayedMessage], pending: list[str] | None) -> None:
        """`found`: the store's content after a reopen (everything waiting). `pending`: the
        operation that began and was not acknowledged (it may or may not have happened)."""
        kind = pending[1] if pending else None
        if kind:
            self.pending_kinds[kind] = self.pending_kinds.get(kind, 0) + 1
        p_put, p_req, p_fin = {}, {}, set()
        if kind == "P":
            for item in pending[2:]:
                mid, ver, due = map(int, item.split(":"))
                p_put[mid] = (ver, due)
        elif kind == "R":
            for item in pending[2:]:
                mid, due, att = map(int, item.split(":"))
                p_req[mid] = (due, att)
        elif kind == "F":
            p_fin = set(map(int, pending[2:]))
        for mid in self.gone:
            assert mid not in found, f"finished {mid} came back"
        for mid, (ver, due, att, where) in self.live.items():
            if mid not in found:
                assert mid in p_fin, f"LOST: acknowledged {mid} ({where}) is missing"
                continue
            # what it may be: as acknowledged, or as the pending operation left it
            allowed = [(ver, due, att, where)]
            if mid in p_put:
                pver, pdue = p_put[mid]
                allowed.append((pver, pdue, kill_content(mid, pver).attempts, "waiting"))
            if mid in p_req:
                allowed.append((ver, *p_req[mid], "waiting"))
            m = found[mid]
            assert any(self._matches(m, *a) for a in allowed), (mid, m, allowed)
        for mid in found:
            assert mid in self.live or mid in p_put, f"unknown id {mid} in the store"

    @staticmethod
    def _matches(m: DelayedMessage, ver: int, due: int, att: int, where: str) -> bool:
        want = kill_content(m.msg_id, ver)
        # taken and restored: due at min(due, now at reopen), so never later than it was
        due_ok = m.due_ms <= due if where == "taken" else m.due_ms == due
        return due_ok and m.attempts == att and (
            m.body, m.ext, m.trace_id, m.timestamp, m.origin_offset) == (
            want.body, want.ext, want.trace_id, want.timestamp, want.origin_offset)

    def resync(self, found: dict[int, DelayedMessage]) -> None:
        """After a check passed: adopt what the store holds (the pending operation's
        outcome, recovered due times) as the model for the next round."""
        self.gone |= set(self.live) - set(found)
        self.live = {mid: [m.timestamp % 1000, m.due_ms, m.attempts, "waiting"]
                     for mid, m in found.items()}
        self.gone -= set(found)


def parse_output(text: bytes):
    """(acknowledged (begin, ack) pairs, the pending begin or None, errors)."""
    lines = [ln.decode().split() for ln in text.split(b"\n")[:-1]]
    pairs, begin, errors = [], None, []
    for ln in lines:
        if ln[0] == "B":
            assert begin is None, ln
            begin = ln
        elif ln[0] == "A":
            assert begin is not None and begin[1] == ln[1], ln
            pairs.append((begin, ln))
            begin = None
        elif ln[0] == "ERR":
            errors.append(" ".join(ln))
    return pairs, begin, errors


def test_sigkill_loses_nothing_acknowledged(tmp_path):
    path = str(tmp_path / "dq")
    seed = int(os.environ.get("KILL_SEED", "0")) or random.randrange(1 << 30)
    print(f"kill test seed {seed} (KILL_SEED={seed} repeats the kill moments)")
    rng = random.Random(seed)
    model = KillModel()
    rounds, kills_mid_op, ready_rounds = 24, 0, 0
    for run in range(rounds):
        out_path = str(tmp_path / f"out-{run}")
        with open(out_path, "wb") as out, open(out_path + ".err", "wb") as err:
            proc = subprocess.Popen([sys.executable, THIS, "worker", path, str(run),
                                     str(rng.randrange(1 << 30))], stdout=out, stderr=err)
        if rng.random() < 0.25:  # anywhere: while it imports, opens or recovers, or works
            time.sleep(rng.uniform(0.05, 0.5))
        else:  # while it works
            deadline = time.monotonic() + 30
            while os.path.getsize(out_path) == 0:
                assert proc.poll() is None, open(out_path + ".err").read()
                assert time.monotonic() < deadline, "worker never became ready"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.01, 0.4))
        assert proc.poll() is None, open(out_path + ".err").read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with open(out_path, "rb") as f:
            text = f.read()
        if text.startswith(b"ready"):
            ready_rounds += 1
            text = text.split(b"\n", 1)[1]
        pairs, pending, errors = parse_output(text)
        assert not errors, errors
        for begin, ack in pairs:
            model.apply(begin, ack)
        kills_mid_op += pending is not None
        s = DelayStore.open(path)
        try:
            assert s.stats()[1] == 0  # everything taken is waiting again
            found = {}
            for where, m in s.scan():
                assert where == "waiting" and m.msg_id not in found
                found[m.msg_id] = m
            model.check(found, pending)
            model.resync(found)
        finally:
            s.close()
    print(f"\nkill test: {rounds} SIGKILLs ({ready_rounds} after open, {kills_mid_op} in the "
          f"middle of an operation: {model.pending_kinds}); acknowledged operations "
          f"{model.acked}, messages {model.acked_msgs}; {len(model.live)} live at the end, "
          f"{len(model.gone)} finished")
    assert ready_rounds >= rounds // 2
    assert sum(model.acked.values()) > 200
    assert kills_mid_op >= 5


# ---- memory ---------------------------------------------------------------------------------

def vm_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def million_entries(path: str) -> None:
    """Put 1,000,000 entries in batches of 10,000; print VmRSS before, peak, and the size
    of data.mdb (run in a fresh process: RSS freed by earlier tests would hide growth).

    Due times as a channel makes them: now + one of four delays (REQ backoff classes,
    a DPUB for tomorrow), so each class is a front that moves forward. Origins too: the
    channel moves messages in as it reads the log, so their offsets grow (records of
    ~140 bytes)."""
    s = DelayStore.open(path)
    body = os.urandom(100)
    base = 1_700_000_000_000
    delays = [60_000, 1_800_000, 3_600_000, 86_400_000]
    peak = start = vm_rss_mb()
    for b in range(100):
        s.put([M(base + b * 1000 + delays[i % 4] + i // 400, b * 10_000 + i, i, i, 1, b"",
                 body, (b * 10_000 + i) * 140) for i in range(10_000)])
        peak = max(peak, vm_rss_mb())
    assert s.stats() == (1_000_000, 0, base + delays[0])
    got = s.take_due(base + 10**9, 10_000)
    assert len(got) == 10_000 and got[0].due_ms == base + delays[0]
    print(f"{start} {peak} {s.disk_bytes()}")
    s.delete()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_million_entries_cost_disk_not_ram(path):
    """1,000,000 entries in batches of 10,000: VmRSS grows by less than 50 MB."""
    out = subprocess.run([sys.executable, THIS, "million", path], capture_output=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    start, peak, disk = out.stdout.split()[-3:]
    start, peak, disk_mb = float(start), float(peak), int(disk) / (1 << 20)
    print(f"\n1M entries: VmRSS {start:.1f} -> peak {peak:.1f} MB (+{peak - start:.1f}); "
          f"data.mdb {disk_mb:.0f} MB")
    assert disk_mb > 150  # the data is on disk...
    assert peak - start < 50  # ...not in RAM


# ---- the worker, run as a script ------------------------------------------------------

if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    kill_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "million":
    million_entries(sys.argv[2])
