"""EventWriter: a bounded in-memory buffer of trace events, written to the TraceStore in
batches by one thread of its own.

The event loop only appends tuples to a deque (`add`, `add_many`: no lock, no system
call, no wait); past `bound` events waiting, new ones are dropped and counted in
`dropped_full`. The thread takes up to `batch` events at a time and writes them in one
transaction, then waits `idle_s` unless a whole batch is waiting already (fewer, larger
batches: the store's cost per event falls with the batch's size, and the node's thread wakes
less often); a batch the store refuses (read-only file, full disk, locked) is dropped and
counted in `dropped_failed`, and the thread goes on with the next (the store may come
back). So tracing never waits on SQLite, and SQLite never waits on anything but itself.

The store runs in a process of its own (process.py's ProcessStore): SQLite's, unless
`open_store` makes another (Elasticsearch's, nsqd/tracing.py). A
store that cannot be reached raises StoreUnavailable: the thread keeps that batch and
sends it again with backoff (0.1 s doubling to 5 s) while new events wait in the bounded
buffer (past the bound, dropped and counted as always); on shutdown what it still could
not send is counted in `dropped_failed`.

Retention runs on the same thread every `retain_every_s`. The store's file is made with
the first event: a node that never traces has none, and its thread sleeps until
`want_store` or `close` (events come only once tracing is on, which calls `want_store`
first).
"""

from __future__ import annotations

import collections
import os
import threading
import time

import structlog

from .process import ProcessStore
from .store import StoreUnavailable

log = structlog.get_logger("nsqtrace.writer")

MAX_BACKOFF_S = 5.0


class EventWriter:
    def __init__(self, path: str, node: str, *, bound: int = 100_000, batch: int = 5000,
                 max_age_s: float | None = None, max_bytes: int | None = None,
                 retain_every_s: float = 10.0, idle_s: float = 0.05, open_store=None,
                 sink: str = "sqlite"):
        self.path = path  # the SQLite file; None for a store elsewhere (open_store)
        self.sink = sink
        self.node = node  # the events' `node`, final once started (start's argument)
        self._open_store = open_store or (
            lambda: ProcessStore("sqlite", {"path": path, "node": self.node}))
        self.bound = bound
        self.batch = batch
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.retain_every_s = retain_every_s
        self.idle_s = idle_s
        self._buffer: collections.deque = collections.deque()
        self.written = 0
        self.writing = 0  # taken from the buffer by the thread, not yet written or dropped
        self.dropped_full = 0  # past the bound
        self.dropped_failed = 0  # the store refused their batch
        self.retained = 0  # deleted by retention
        self.retries = 0  # batches sent again after StoreUnavailable
        self.error: str | None = None  # the store's last failure, None once it writes again
        self._stop = threading.Event()
        self._wanted = False  # open the store before the first event (want_store)
        self._kick = threading.Event()  # set by want_store and close: the thread's wait when off
        self._thread: threading.Thread | None = None
        self._last_failure_log = 0.0

    # ---- the event loop's side ------------------------------------------------

    def add(self, event: tuple) -> None:
        buf = self._buffer
        if len(buf) >= self.bound:
            self.dropped_full += 1
        else:
            buf.append(event)

    def add_many(self, events: list) -> None:
        buf = self._buffer
        room = self.bound - len(buf)
        if room >= len(events):
            buf.extend(events)
        else:
            room = max(room, 0)
            buf.extend(events[:room])
            self.dropped_full += len(events) - room

    def want_store(self) -> None:
        """Events are coming: open the store now rather than with the first of them (a
        store in a process of its own takes a tenth of a second to start)."""
        self._wanted = True
        self._kick.set()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def stats(self) -> dict:
        return {"sink": self.sink, "buffered": len(self._buffer), "writing": self.writing,
                "bound": self.bound,
                "written": self.written, "retries": self.retries,
                "dropped": self.dropped_full + self.dropped_failed,
                "dropped_full": self.dropped_full, "dropped_failed": self.dropped_failed,
                "retained": self.retained, "error": self.error}

    # ---- lifecycle --------------------------------------------------------------

    def start(self, node: str | None = None) -> None:
        """Start the thread; `node`, when given, names the node in every event (a port
        known only once the node listens)."""
        if node is not None:
            self.node = node
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is buffered (within `timeout`), then stop the thread. Blocking: call
        it from a thread (asyncio.to_thread), never on the event loop."""
        self._stop.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        store = None
        next_retain = time.monotonic() + self.retain_every_s
        buf = self._buffer
        pending: list = []  # the batch being written (kept while the store is unavailable)
        backoff = 0.0
        while True:
            stopping = self._stop.is_set()
            if not pending and buf:
                count = min(len(buf), self.batch)
                self.writing = count  # first: a reader never misses them (buffered + writing)
                pending = [buf.popleft() for _ in range(count)]
            try:
                if store is None and (pending or self._wanted
                                      or (self.path and os.path.exists(self.path))):
                    store = self._open()  # none made while off
                if pending:
                    self._write(store, pending)
                    pending, backoff, self.writing = [], 0.0, 0
                    if stopping or len(buf) >= self.batch:
                        continue  # else the rest waits `idle_s`, so that batches grow
            except StoreUnavailable as e:
                self._failed("trace_store_unavailable", e)
                if stopping:  # shutting down: what could not be sent is lost, counted
                    self.dropped_failed += len(pending) + len(buf)
                    buf.clear()
                    self.writing = 0
                    break
                self.retries += 1
                backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF_S)
                self._stop.wait(backoff)
                continue
            if stopping:
                break
            if store is not None and time.monotonic() >= next_retain:
                next_retain = time.monotonic() + self.retain_every_s
                self._retain(store)
            if store is None and not (self._wanted or buf
                                      or (self.path and os.path.exists(self.path))):
                self._kick.wait()  # off, no file: no event comes before want_store
            else:  # writing, or a store to open (tried again every `idle_s`)
                self._stop.wait(self.idle_s)
        if store is not None:
            store.close()

    def _open(self):
        try:
            return self._open_store()
        except StoreUnavailable:
            raise
        except Exception as e:
            self._failed("trace_store_open_failed", e)
            return None

    def _write(self, store, events: list) -> None:
        if store is None:
            self.dropped_failed += len(events)
            return
        try:
            refused = store.write(events) or 0  # documents a server refused one by one
        except StoreUnavailable:
            raise
        except Exception as e:
            self.dropped_failed += len(events)
            self._failed("trace_store_write_failed", e)
        else:
            self.written += len(events) - refused
            self.dropped_failed += refused
            self.error = None

    def _retain(self, store) -> None:
        if not (self.max_age_s or self.max_bytes):
            return
        try:
            self.retained += store.retain(self.max_age_s, self.max_bytes)
        except Exception as e:
            self._failed("trace_store_retain_failed", e)

    def _failed(self, event: str, e: Exception) -> None:
        """One log line a minute at most; /stats shows the last error."""
        self.error = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        if now - self._last_failure_log >= 60:
            self._last_failure_log = now
            log.error(event, path=self.path, error=self.error,
                      dropped=self.dropped_full + self.dropped_failed)
