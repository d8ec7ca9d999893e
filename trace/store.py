"""The embedded trace store: one SQLite file in the node's data path, through `sqlite3`.

One table of events (rowid order = order written), indexed by message id and by trace id
(only rows that have one), so a search by either is one index range. A search by topic
goes through `topic_spans`: one row per written batch and topic in it (the batch's rowid
range and its earliest and latest time), so a topic's events are the rows of its spans,
read span by span in time order, each a rowid range (never a scan of the table). Why not
an index on (topic, time_ns): it cost each event about 0.6 µs of the store's 2 µs, a span
costs a batch one row.
WAL mode: the writer thread appends while searches read a snapshot, neither waits on
the other. `synchronous=NORMAL`: a power cut may lose the last batches of events, never
the file (trace events are a record of what happened, not the messages themselves).

Versions (`PRAGMA user_version`): 1 (0 in the file) had the (topic, time_ns) index and no
spans; a store of version 1 is converted when it is opened: spans made for its rows
(one pass over them, in rowid ranges of SPAN_ROWS), its topic index dropped, all in one
transaction (a crash meanwhile leaves version 1, converted at the next open).

Retention: rows older than `max_age_s`, then the oldest rows while the live pages pass
`max_bytes` (freed pages are reused, so the file stops growing there; it never shrinks
by itself).

Writes are multi-row INSERTs of up to ROWS_PER_INSERT events, not one statement per event
(one statement's overhead per event cost 2.7 µs of CPU an event against 1.5). The statements
have a few fixed sizes (ROWS_PER_INSERT, then its halves down to 1 for the rest of a batch),
so each is prepared once: a statement sized to each batch's remainder was prepared again for
nearly every batch (a quarter of the store's CPU with batches of 1,000 events).

Every method runs on the thread that owns the connection it uses: `write` and `retain`
on the writer's thread (TraceStore is made there), `search` on any thread through its own
short-lived read connection.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import time
from operator import itemgetter

from .events import FIELDS

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    time_ns INTEGER NOT NULL,
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    channel TEXT NOT NULL,
    msg_id INTEGER NOT NULL,
    trace_id INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_msg_id ON events (msg_id);
CREATE INDEX IF NOT EXISTS events_trace_id ON events (trace_id) WHERE trace_id != 0;
CREATE TABLE IF NOT EXISTS topic_spans (
    topic TEXT NOT NULL,
    first_id INTEGER NOT NULL,
    last_id INTEGER NOT NULL,
    min_time INTEGER NOT NULL,
    max_time INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS topic_spans_topic ON topic_spans (topic, max_time);
"""
VERSION = 2
SPAN_ROWS = 5000  # the rowid range of a converted version-1 store's spans
_INSERT = ("INSERT INTO events (node, time_ns, kind, topic, partition, channel, msg_id, "
           "trace_id, offset, attempts, detail) VALUES ")
_ROW = "({node},?,?,?,?,?,?,?,?,?,?)"  # node is the store's, the rest an event's FIELDS
ROWS_PER_INSERT = 512
_COLUMNS = "node, " + ", ".join(FIELDS)
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
        row = _ROW.format(node="'" + node.replace("'", "''") + "'")
        # never more bound values in one statement than this SQLite takes
        limit = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self._rows = max(1, min(ROWS_PER_INSERT, limit // len(FIELDS)))
        self._inserts = {}  # rows -> the statement of that many rows (a few sizes, prepared once)
        size = self._rows
        while size:
            self._inserts[size] = _INSERT + ",".join([row] * size)
            size //= 2

    def _open_schema(self) -> None:
        """Make the tables, or convert a version-1 store (module docstring), in one
        transaction."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("PRAGMA user_version").fetchone()[0] < VERSION:
                old = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                 "AND name = 'events'").fetchone() is not None
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                if old:
                    self._convert_v1()
                db.execute(f"PRAGMA user_version = {VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _convert_v1(self) -> None:
        """Spans for a version-1 store's rows (one per topic in each SPAN_ROWS rowids), and
        its (topic, time_ns) index dropped."""
        db = self._db
        first, last = db.execute("SELECT min(id), max(id) FROM events").fetchone()
        for start in range(first or 1, (last or 0) + 1, SPAN_ROWS):
            db.execute("INSERT INTO topic_spans (topic, first_id, last_id, min_time, max_time) "
                       "SELECT topic, min(id), max(id), min(time_ns), max(time_ns) FROM events "
                       "WHERE id BETWEEN ? AND ? GROUP BY topic", (start, start + SPAN_ROWS - 1))
        db.execute("DROP INDEX IF EXISTS events_topic_time")

    def close(self) -> None:
        self._db.close()
    def write(self, events: list[tuple]) -> None:
        """Insert a batch of events (events.py's tuples) and its spans in one transaction.
        The tuples go to SQLite as they are; only a batch holding an id of 2^63 or more (a
        trace id) is converted to SQLite's signed form first."""
        if not events:
            return
        db = self._db
        db.execute("BEGIN")
        try:
            first = db.execute("SELECT coalesce(max(id), 0) + 1 FROM events").fetchone()[0]
            try:
                last = self._insert(events)
            except OverflowError:
                db.execute("ROLLBACK")
                db.execute("BEGIN")
                last = self._insert([(*e[:5], _signed(e[5]), _signed(e[6]), *e[7:])
                                     for e in events])
            times = list(map(itemgetter(0), events))
            low, high = min(times), max(times)
            db.executemany("INSERT INTO topic_spans (topic, first_id, last_id, min_time, "
                           "max_time) VALUES (?, ?, ?, ?, ?)",
                           [(topic, first, last, low, high)
                            for topic in set(map(itemgetter(2), events))])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _insert(self, events: list[tuple]) -> int:
        """The events, their fields flattened in order, in statements of the sizes in
        `self._inserts` (the largest that fits, each time); the last row's id."""
        inserts, size = self._inserts, self._rows
        i, n = 0, len(events)
        cursor = None
        while i < n:
            while size > n - i:
                size //= 2
            cursor = self._db.execute(inserts[size],
                                      list(itertools.chain.from_iterable(events[i:i + size])))
            i += size
        return cursor.lastrowid

    def retain(self, max_age_s: float | None, max_bytes: int | None,
               now_ns: int | None = None) -> int:
        """Delete events older than `max_age_s`, then the oldest while the live pages pass
        `max_bytes`; return how many rows went."""
        db = self._db
        gone = 0
        if max_age_s:
            cutoff = (now_ns or time.time_ns()) - int(max_age_s * 1e9)
            # rowid order is write order, about time order: delete from the front while the
            # oldest row is too old (never a scan of the whole table)
            while (first := db.execute("SELECT time_ns FROM events ORDER BY id LIMIT 1")
                   .fetchone()) and first[0] < cutoff:
                gone += db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events "
                                   "ORDER BY id LIMIT 10000) AND time_ns < ?",
                                   (cutoff,)).rowcount
        while max_bytes and self.used_bytes() > max_bytes:
            count = db.execute("SELECT count(*) FROM events").fetchone()[0]
            if not count:
                break
            step = max(1, count // 10)  # the oldest tenth at a time: few passes, small overshoot
            gone += db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events "
                               "ORDER BY id LIMIT ?)", (step,)).rowcount
        if gone:  # the spans of rows all gone (all of them when no row is left)
            db.execute("DELETE FROM topic_spans WHERE last_id < "
                       "(SELECT coalesce(min(id), ?) FROM events)", (_I64_MAX,))
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
    One of msg_id, trace_id, topic must be given: each is an index. A store not made yet
    (no file, or no schema in it yet) holds nothing."""
    if not os.path.exists(path):
        return []
    where, args = [], []
    if msg_id is not None:
        where.append("msg_id = ?")
        args.append(_signed(msg_id))
    if trace_id is not None:
        where.append("trace_id = ? AND trace_id != 0")
        args.append(_signed(trace_id))
    if topic is not None:
        where.append("topic = ?")
        args.append(topic)
    if channel is not None:
        where.append("(channel = ? OR channel = '')")  # a channel's events, and its topic's
        args.append(channel)
    if since_ns is not None:
        where.append("time_ns >= ?")
        args.append(since_ns)
    if until_ns is not None:
        where.append("time_ns < ?")
        args.append(until_ns)
    if not where:
        raise ValueError("search needs msg_id, trace_id or topic")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    try:
        rows = None
        if msg_id is None and trace_id is None and _has_spans(db):
            rows = _topic_rows(db, " AND ".join(where), args, topic, since_ns, until_ns, limit)
        if rows is None:  # by an id; or a version-1 store not converted yet: its topic index
            rows = db.execute(f"SELECT {_COLUMNS} FROM events WHERE {' AND '.join(where)} "
                              f"ORDER BY time_ns, id LIMIT ?", (*args, limit)).fetchall()
    except sqlite3.OperationalError as e:
        if "no such table" not in str(e):
            raise
        return []  # the writer has made the file, not its schema yet: nothing written
    finally:
        db.close()
    names = ("node",) + FIELDS
    out = []
    for row in rows:
        event = dict(zip(names, row))
        event["msg_id"] = _unsigned(event["msg_id"])
        event["trace_id"] = _unsigned(event["trace_id"])
        out.append(event)
    return out


def _topic_rows(db, where: str, args: list, topic: str, since_ns: int | None,
                until_ns: int | None, limit: int) -> list[tuple]:
    """A topic's rows matching `where`, the oldest `limit` in time order: its spans in the
    window, earliest first, each a rowid range; done once `limit` rows are older than the
    next span's earliest event."""
    window, bounds = "", []
    if since_ns is not None:
        window += " AND max_time >= ?"
        bounds.append(since_ns)
    if until_ns is not None:
        window += " AND min_time < ?"
        bounds.append(until_ns)
    spans = db.execute(f"SELECT first_id, last_id, min_time FROM topic_spans WHERE topic = ?"
                       f"{window} ORDER BY min_time, first_id", (topic, *bounds)).fetchall()
    sql = (f"SELECT {_COLUMNS}, id FROM events WHERE id BETWEEN ? AND ? AND {where} "
           f"ORDER BY time_ns, id LIMIT ?")  # a span's oldest `limit`, chosen by SQLite
    rows: list[tuple] = []
    for first, last, min_time in spans:
        if len(rows) >= limit and min_time > rows[-1][1]:
            break  # every later span's events come after the `limit` found
        rows += db.execute(sql, (first, last, *args, limit)).fetchall()
        rows.sort(key=_time_then_id)
        del rows[limit:]
    return [row[:-1] for row in rows]


def _time_then_id(row: tuple) -> tuple:
    return row[1], row[-1]  # (time_ns, id): node is the row's first column


def _has_spans(db) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                      "AND name = 'topic_spans'").fetchone() is not None
