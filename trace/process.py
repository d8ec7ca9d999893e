"""A trace store run in a child process of its own (`ProcessStore`), so that its CPU never
competes with the node's event loop for the GIL: the SQLite store (store.py) or the
Elasticsearch store (es.py), the same mechanism for both.

Why a process: written on a thread of the node, the store's work per event held the
node's GIL (SQLite: binding the values, the row, the indexes; Elasticsearch: the
documents' dicts, their JSON, the client's HTTP), and the event loop waited for the GIL
behind it. On a 2-core machine, tracing every message into SQLite cost 22-30% of the
throughput that way; in a child process 0-15% in the same run (bench/trace.py), the node
paying only the pickling of each batch (about 0.15 µs an event).

The node's side (`ProcessStore`, on the EventWriter's thread) and the child's side
(`serve`, `python -m nsqtrace.process SINK`) talk over the child's stdin and stdout: each
frame is a 4-byte big-endian length and a pickle (a private pipe between two processes of
the same program, never a socket). The first frame a child reads is its sink's settings
(a dict, and where its numbering of events resumes): over the pipe, never on the command
line, which `ps` shows to every user (an Elasticsearch password or API key is one of
them). Then requests ("write", events) (Elasticsearch), ("write_chunks", chunks) (SQLite:
store.py's `encode` of the events) and ("retain", max_age_s, max_bytes); answers
("ok", value), ("unavailable", text) or ("error", text). One request at a time: the
writer thread waits for each answer.

Invariants:
- The child never outlives the node for long: it exits at the end of its stdin, which the
  kernel closes when the node exits, however it exits (kill -9 too). It runs in a session
  of its own, so a Ctrl-C or a signal to the node's process group reaches only the node,
  which closes the child's stdin itself once the writer has written what it holds.
- A batch the store refuses (full disk, read-only file, a bulk Elasticsearch rejects) is
  an "error" answer: the writer drops and counts it. A store that cannot be reached
  (Elasticsearch down) is "unavailable", and a child that died (killed, crashed)
  StoreUnavailable too: the writer keeps the batch, retries with backoff, and the next
  request starts a new child.
- A new child numbers events from `sent`, the events of every batch an earlier child
  answered "ok" to; so a batch sent again after a child died unanswered gets the numbers
  it had: Elasticsearch documents the same `_id`s (written once), SQLite, which numbers
  nothing, its rows twice (duplicate events, never a lost one).
"""

from __future__ import annotations

import pickle
import signal
import struct
import subprocess
import sys

from .store import StoreUnavailable, TraceStore, encode

_LENGTH = struct.Struct(">I")
CLOSE_TIMEOUT_S = 10.0
SINKS = ("sqlite", "elasticsearch")
REQUESTS = ("write", "write_chunks", "retain")


class ProcessStore:
    """A sink's store in a child process: the same write/retain/close as TraceStore.
    `settings`: the store's keyword arguments (sqlite: path, node; elasticsearch: es.py's
    EsStore's, id_base fixed by the node so that every child names documents alike)."""

    def __init__(self, sink: str, settings: dict):
        assert sink in SINKS, sink
        self.sink = sink
        self.settings = settings
        self.sent = 0  # events of the batches a child answered "ok" to
        self._child: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "nsqtrace.process", self.sink],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._told = False  # the child has its settings (sent before its first request)

    def write(self, events: list[tuple]):
        # SQLite's chunks are pickled here, on the writer's thread, and stored by the child
        # as they come: the node pays what pickling the batch for the pipe cost anyway
        value = self._ask(("write_chunks", encode(events)) if self.sink == "sqlite"
                          else ("write", events))
        self.sent += len(events)
        return value

    def retain(self, max_age_s: float | None, max_bytes: int | None) -> int:
        return self._ask(("retain", max_age_s, max_bytes))

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            child.stdin.close()  # the child's end of input: it exits
        except OSError:
            pass
        try:
            child.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()

    def _ask(self, request: tuple):
        if self._child is None or self._child.poll() is not None:
            self.close()
            self._start()
        child = self._child
        try:
            if not self._told:
                _write_frame(child.stdin, (self.settings, self.sent))
                self._told = True
            _write_frame(child.stdin, request)
            answer = _read_frame(child.stdout)
        except OSError as e:
            answer = None
            why = f"{type(e).__name__}: {e}"
        else:
            why = "no answer"
        if answer is None:
            code = child.poll()
            self.close()
            raise StoreUnavailable(f"the trace store process exited ({why}, code {code})")
        status, value = pickle.loads(answer)
        if status == "unavailable":
            raise StoreUnavailable(value)
        if status != "ok":
            raise RuntimeError(value)
        return value


def _write_frame(stream, value) -> None:
    data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    """One length-prefixed frame, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def open_store(sink: str, settings: dict, sent: int):
    """The child's store; Elasticsearch's client is imported only by a child that uses it."""
    if sink == "sqlite":
        return TraceStore(**settings)
    from .es import EsStore
    return EsStore(**settings, seq=sent)


def serve(sink: str, requests, answers) -> None:
    """The child: read the settings, then answer each request until the end of `requests`.
    The store opens with the first request, and again with the next one after it failed
    to."""
    frame = _read_frame(requests)
    if frame is None:
        return
    settings, sent = pickle.loads(frame)
    store = None
    while (frame := _read_frame(requests)) is not None:
        kind, *args = pickle.loads(frame)
        try:
            if store is None:
                store = open_store(sink, settings, sent)
            if kind not in REQUESTS:
                raise ValueError(f"no such request: {kind!r}")
            value = getattr(store, kind)(*args)
            answer = ("ok", value)
        except StoreUnavailable as e:
            answer = ("unavailable", str(e))
        except Exception as e:
            answer = ("error", f"{type(e).__name__}: {e}")
        _write_frame(answers, answer)
    if store is not None:
        store.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node decides when to stop: end of stdin
    serve(sys.argv[1], sys.stdin.buffer, sys.stdout.buffer)
