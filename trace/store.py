"""The embedded trace store: one SQLite file in the node's data path, through `sqlite3`.

Events are kept in chunks: up to CHUNK_EVENTS events written together, pickled as one list
(`encode`), one row of `chunks` with the node that wrote them, their count and their
earliest and latest time. Three small tables find the chunks a search reads:
- `msg_runs`: each topic's message ids in a chunk, as runs `lo..hi` of its sorted ids (a
  new run past a gap of RUN_GAP ids or a width of RUN_WIDTH). A partition's ids are a
  sequence, so a chunk has about one run per topic partition it touches. A search by id
  reads the runs whose `lo` is in `[id - RUN_WIDTH, id]` and whose `hi` is at least `id`.
- `trace_keys`: one row per trace id (not 0) and chunk.
- `topic_chunks`: one row per topic and chunk, with the chunk's time range.
A search decodes the chunks these name and keeps the events that match, in time order
(time, then write order). Message ids are below 2^60 (partition << 50 | sequence); trace
ids are unsigned 64-bit, kept in `trace_keys` as SQLite's signed INTEGER (the same bits).

Why chunks, not a row per event (versions 1 and 2): a row cost the store's process about
2.2 µs an event (binding 11 values, the record, the table's b-tree) and its message-id
index 1.2 more; a chunk costs about 1.5 µs an event in all, 0.7 of it the unpickling that
finds its keys (the node's writer pickles the chunks: `encode`). The price is paid by
searches, which decode the chunks they read (about 0.7 ms for a whole chunk).

A chunk is read with an unpickler that refuses every global (`_ChunkReader`): a chunk holds
only tuples, str and int, so a file that is not the store's own can never run code here.

Versions (`PRAGMA user_version`): 3 is this one. 1 (0 in the file) and 2 kept a row per
event in a table `events`; such a store is converted when it is opened (its rows, in
rowid order, become chunks; `events` and version 2's `topic_spans` are dropped), all in
one transaction (a crash meanwhile leaves the old version, converted at the next open).
Until then `search` reads the old rows (`_search_rows`).

WAL mode: the store's process appends while searches read a snapshot, neither waits on
the other. `synchronous=NORMAL`: a power cut may lose the last batches of events, never
the file (trace events are a record of what happened, not the messages themselves).

Retention: whole chunks, from the oldest: those whose newest event is older than
`max_age_s`, then the oldest tenth at a time while the live pages pass `max_bytes` (freed
pages are reused, so the file stops growing there; it never shrinks by itself).

Every method of TraceStore runs on the thread that made it; `search` runs on any thread
through its own short-lived read-only connection.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import sqlite3
import time
from collections import defaultdict
from operator import itemgetter

from .events import FIELDS, NO_MESSAGE

_SCHEMA = """
CREATE TABLE chunks (
    id INTEGER PRIMARY KEY,
    node TEXT NOT NULL,
    count INTEGER NOT NULL,
    min_time INTEGER NOT NULL,
    max_time INTEGER NOT NULL,
    events BLOB NOT NULL
);
CREATE TABLE msg_runs (
    topic TEXT NOT NULL,
    lo INTEGER NOT NULL,
    hi INTEGER NOT NULL,
    chunk INTEGER NOT NULL
);
CREATE INDEX msg_runs_lo ON msg_runs (lo);
CREATE INDEX msg_runs_chunk ON msg_runs (chunk);
CREATE TABLE trace_keys (trace_id INTEGER NOT NULL, chunk INTEGER NOT NULL);
CREATE INDEX trace_keys_trace_id ON trace_keys (trace_id);
CREATE INDEX trace_keys_chunk ON trace_keys (chunk);
CREATE TABLE topic_chunks (
    topic TEXT NOT NULL,
    chunk INTEGER NOT NULL,
    min_time INTEGER NOT NULL,
    max_time INTEGER NOT NULL
);
CREATE INDEX topic_chunks_topic ON topic_chunks (topic, max_time);
CREATE INDEX topic_chunks_chunk ON topic_chunks (chunk);
"""
VERSION = 3
CHUNK_EVENTS = 1000
RUN_GAP = 256
RUN_WIDTH = 4096
PICKLE_PROTOCOL = 5  # fixed, not HIGHEST_PROTOCOL: a file must stay readable by older Pythons
_KEY_TABLES = ("msg_runs", "trace_keys", "topic_chunks")
_NAMES = ("node",) + FIELDS
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class StoreUnavailable(Exception):
    """A store (any: this one, es.py's, process.py's) cannot be reached now; the same
    batch may succeed later (the writer keeps it and retries)."""


def _signed(v: int) -> int:
    """A 64-bit unsigned id as SQLite's signed INTEGER (the same bits)."""
    return v - _U64 if v > _I64_MAX else v


def _unsigned(v: int) -> int:
    return v + _U64 if v < 0 else v


def encode(events: list[tuple]) -> list[bytes]:
    """A batch of events (events.py's tuples) as chunks for `TraceStore.write_chunks`."""
    return [pickle.dumps(events[i:i + CHUNK_EVENTS], PICKLE_PROTOCOL)
            for i in range(0, len(events), CHUNK_EVENTS)]


class _ChunkReader(pickle.Unpickler):
    """Reads a chunk, which holds only lists, tuples, str and int: any global is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"not a trace chunk: it names {module}.{name}")


def _decode(blob: bytes) -> list[tuple]:
    return _ChunkReader(io.BytesIO(blob)).load()


def runs(ids) -> list[tuple[int, int]]:
    """Sorted ids as runs (lo, hi): a new run past a gap of RUN_GAP or a width of
    RUN_WIDTH."""
    out = []
    it = iter(sorted(ids))
    lo = prev = next(it, None)
    if lo is None:
        return out
    for i in it:
        if i - prev > RUN_GAP or i - lo >= RUN_WIDTH:
            out.append((lo, prev))
            lo = i
        prev = i
    out.append((lo, prev))
    return out


class TraceStore:
    def __init__(self, path: str, node: str):
        self.path = path
        self.node = node
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        # a locked store fails a batch after 1 s (dropped and counted) rather than let the
        # buffer fill behind it for sqlite3's default 5 s
        self._db = sqlite3.connect(path, isolation_level=None, timeout=1.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._open_schema()

    def _open_schema(self) -> None:
        """Make the tables, or convert a store of version 1 or 2 (module docstring), in one
        transaction."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("PRAGMA user_version").fetchone()[0] < VERSION:
                old = _has_table(db, "events")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                if old:
                    self._convert_rows()
                db.execute(f"PRAGMA user_version = {VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _convert_rows(self) -> None:
        """An old store's rows as chunks, in rowid order (a chunk's events are one node's);
        then its tables dropped."""
        db = self._db
        first, last = db.execute("SELECT min(id), max(id) FROM events").fetchone()
        columns = ", ".join(_NAMES)
        for start in range(first or 1, (last or 0) + 1, CHUNK_EVENTS):
            rows = db.execute(f"SELECT {columns} FROM events WHERE id BETWEEN ? AND ? "
                              "ORDER BY id", (start, start + CHUNK_EVENTS - 1)).fetchall()
            # a chunk's equal strings as one object, which pickle writes once (as a batch's are)
            same = {}.setdefault
            for node, group in itertools.groupby(rows, itemgetter(0)):
                events = [(r[1], same(r[2], r[2]), same(r[3], r[3]), r[4], same(r[5], r[5]),
                           r[6], _unsigned(r[7]), r[8], r[9], same(r[10], r[10]))
                          for r in group]
                self._add_chunk(pickle.dumps(events, PICKLE_PROTOCOL), events, node)
        db.execute("DROP TABLE events")
        db.execute("DROP TABLE IF EXISTS topic_spans")

    def close(self) -> None:
        self._db.close()

    def write(self, events: list[tuple]) -> None:
        """Write a batch of events (events.py's tuples) in one transaction."""
        self.write_chunks(encode(events))

    def write_chunks(self, chunks: list[bytes]) -> None:
        """Write `encode`'s chunks of a batch in one transaction."""
        db = self._db
        db.execute("BEGIN")
        try:
            for blob in chunks:
                self._add_chunk(blob, pickle.loads(blob), self.node)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _add_chunk(self, blob: bytes, events: list[tuple], node: str) -> None:
        """One chunk's row and its keys (module docstring)."""
        if not events:
            return
        db = self._db
        times = list(map(itemgetter(0), events))
        low, high = min(times), max(times)
        chunk = db.execute("INSERT INTO chunks (node, count, min_time, max_time, events) "
                           "VALUES (?, ?, ?, ?, ?)",
                           (node, len(events), low, high, blob)).lastrowid
        topics = set(map(itemgetter(2), events))
        if len(topics) == 1:
            ids = {topics.pop(): set(map(itemgetter(5), events))}
        else:
            ids = defaultdict(set)
            for e in events:
                ids[e[2]].add(e[5])
        db.executemany("INSERT INTO msg_runs (topic, lo, hi, chunk) VALUES (?, ?, ?, ?)",
                       [(topic, lo, hi, chunk) for topic, its in ids.items()
                        for lo, hi in runs(its - {NO_MESSAGE})])
        db.executemany("INSERT INTO topic_chunks (topic, chunk, min_time, max_time) "
                       "VALUES (?, ?, ?, ?)", [(topic, chunk, low, high) for topic in ids])
        traces = set(map(itemgetter(6), events))
        traces.discard(0)
        if traces:
            db.executemany("INSERT INTO trace_keys (trace_id, chunk) VALUES (?, ?)",
                           [(_signed(t), chunk) for t in traces])

    def retain(self, max_age_s: float | None, max_bytes: int | None,
               now_ns: int | None = None) -> int:
        """Delete the chunks whose newest event is older than `max_age_s`, then the oldest
        while the live pages pass `max_bytes`; return how many events went."""
        db = self._db
        gone = 0
        if max_age_s:
            cutoff = (now_ns or time.time_ns()) - int(max_age_s * 1e9)
            # chunks are in write order, about time order: from the front while the oldest
            # is wholly too old (never a scan of the whole table)
            while True:
                front = db.execute("SELECT id, max_time FROM chunks ORDER BY id LIMIT 1000"
                                   ).fetchall()
                old = list(itertools.takewhile(lambda row: row[1] < cutoff, front))
                if old:
                    gone += self._drop_through(old[-1][0])
                if len(old) < 1000:
                    break
        while max_bytes and self.used_bytes() > max_bytes:
            count = db.execute("SELECT count(*) FROM chunks").fetchone()[0]
            if not count:
                break
            step = max(1, count // 10)  # the oldest tenth at a time: few passes, small overshoot
            last = db.execute("SELECT id FROM chunks ORDER BY id LIMIT 1 OFFSET ?",
                              (step - 1,)).fetchone()[0]
            gone += self._drop_through(last)
        return gone

    def _drop_through(self, last: int) -> int:
        """Delete chunks up to id `last` and their keys, in one transaction; their events."""
        db = self._db
        db.execute("BEGIN")
        try:
            gone = db.execute("SELECT coalesce(sum(count), 0) FROM chunks WHERE id <= ?",
                              (last,)).fetchone()[0]
            db.execute("DELETE FROM chunks WHERE id <= ?", (last,))
            for table in _KEY_TABLES:
                db.execute(f"DELETE FROM {table} WHERE chunk <= ?", (last,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return gone

    def used_bytes(self) -> int:
        """Bytes of the pages in use (the file less its free pages)."""
        db = self._db
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * db.execute("PRAGMA page_size").fetchone()[0]


def search(path: str, *, msg_id: int | None = None, trace_id: int | None = None,
           topic: str | None = None, channel: str | None = None, since_ns: int | None = None,
           until_ns: int | None = None, limit: int = 1000) -> list[dict]:
    """Events matching every given condition, in time order, at most `limit` (the oldest).
    One of msg_id, trace_id, topic must be given: each is a key. A channel's events
    include its topic's (channel ""). A store not made yet (no file, or no schema in it
    yet) holds nothing. A file SQLite cannot read (not a database, malformed, locked past
    the timeout) raises StoreUnavailable, saying why."""
    if msg_id is None and trace_id is None and topic is None:
        raise ValueError("search needs msg_id, trace_id or topic")
    if not os.path.exists(path):
        return []
    conditions = (msg_id, trace_id, topic, channel, since_ns, until_ns)
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
        try:
            if _has_table(db, "chunks"):
                found = _search_chunks(db, conditions, limit)
            elif _has_table(db, "events"):
                found = _search_rows(db, conditions, limit)
            else:
                found = []  # the file made, its schema not yet: nothing written
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        raise StoreUnavailable(f"{path}: {type(e).__name__}: {e}") from e
    return [dict(zip(_NAMES, event)) for event in found]


def _search_chunks(db, conditions: tuple, limit: int) -> list[tuple]:
    """The oldest `limit` matching events (node first) of the chunks the keys name: by
    message id or trace id, all of those chunks; by topic, its chunks earliest first, done
    once `limit` events are older than the next chunk's earliest."""
    msg_id, trace_id, topic, _, since_ns, until_ns = conditions
    if msg_id is not None:
        chunks = db.execute("SELECT DISTINCT chunk FROM msg_runs WHERE lo BETWEEN ? AND ? "
                            "AND hi >= ? AND topic = coalesce(?, topic) ORDER BY chunk",
                            (msg_id - RUN_WIDTH, msg_id, msg_id, topic)).fetchall()
    elif trace_id is not None:
        chunks = db.execute("SELECT DISTINCT chunk FROM trace_keys WHERE trace_id = ? "
                            "ORDER BY chunk", (_signed(trace_id),)).fetchall()
    else:
        window, bounds = "", []
        if since_ns is not None:
            window += " AND max_time >= ?"
            bounds.append(since_ns)
        if until_ns is not None:
            window += " AND min_time < ?"
            bounds.append(until_ns)
        chunks = db.execute(f"SELECT chunk, min_time FROM topic_chunks WHERE topic = ?"
                            f"{window} ORDER BY min_time, chunk", (topic, *bounds)).fetchall()
    found: list[tuple] = []  # (time_ns, chunk, position, node, event)
    for chunk, *earliest in chunks:
        if earliest and len(found) >= limit and earliest[0] > found[-1][0]:
            break  # every later chunk's events come after the `limit` found
        node, blob = db.execute("SELECT node, events FROM chunks WHERE id = ?",
                                (chunk,)).fetchone() or (None, None)
        if blob is None:
            continue  # deleted by retention since its key was read
        found += [(e[0], chunk, i, node, e) for i, e in enumerate(_decode(blob))
                  if _matches(e, conditions)]
        found.sort(key=itemgetter(0, 1, 2))
        del found[limit:]
    return [(node, *e) for _, _, _, node, e in found]


def _matches(event: tuple, conditions: tuple) -> bool:
    msg_id, trace_id, topic, channel, since_ns, until_ns = conditions
    return ((msg_id is None or event[5] == msg_id)
            and (trace_id is None or (trace_id != 0 and event[6] == trace_id))
            and (topic is None or event[2] == topic)
            and (channel is None or event[4] in (channel, ""))
            and (since_ns is None or event[0] >= since_ns)
            and (until_ns is None or event[0] < until_ns))


def _search_rows(db, conditions: tuple, limit: int) -> list[tuple]:
    """A store of version 1 or 2, not converted yet: its rows, through its own indexes
    (message id, trace id; version 1's topic and time, while version 2 reads the topic's
    rows whole)."""
    msg_id, trace_id, topic, channel, since_ns, until_ns = conditions
    where, args = [], []
    for sql, value in (("msg_id = ?", msg_id), ("trace_id = ? AND trace_id != 0", trace_id),
                       ("topic = ?", topic), ("(channel = ? OR channel = '')", channel),
                       ("time_ns >= ?", since_ns), ("time_ns < ?", until_ns)):
        if value is not None:
            where.append(sql)
            args.append(_signed(value) if isinstance(value, int) else value)
    rows = db.execute(f"SELECT {', '.join(_NAMES)} FROM events WHERE {' AND '.join(where)} "
                      "ORDER BY time_ns, id LIMIT ?", (*args, limit)).fetchall()
    return [(*r[:7], _unsigned(r[7]), *r[8:]) for r in rows]


def _has_table(db, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                      (name,)).fetchone() is not None
