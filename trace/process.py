"""The SQLite trace store run in a child process of its own (`ProcessStore`), so that its
CPU never competes with the node's event loop for the GIL.

Why a process: written on a thread of the node, SQLite's work per event (binding the
values, the row, three indexes: about 1.5 µs alone) held the node's GIL for much of it,
and the event loop waited for the GIL behind it. On a 2-core machine, tracing every
message cost 22-30% of the throughput that way; with the same writes in a child process
it cost 0-15% in the same run (bench/trace.py), the node paying only the pickling of each
batch (about 0.15 µs an event).

The node's side (`ProcessStore`, on the EventWriter's thread) and the child's side
(`serve`, `python -m nsqtrace.process PATH NODE`) talk over the child's stdin and stdout:
each request and each answer is a 4-byte big-endian length and a pickle (a private pipe
between two processes of the same program, never a socket). Requests are
("write", events) and ("retain", max_age_s, max_bytes); answers ("ok", value) or
("error", text). One request at a time: the writer thread waits for each answer.

Invariants:
- The child never outlives the node for long: it exits at the end of its stdin, which the
  kernel closes when the node exits, however it exits (kill -9 too). It runs in a session
  of its own, so a Ctrl-C or a signal to the node's process group reaches only the node,
  which closes the child's stdin itself once the writer has written what it holds.
- A batch SQLite refuses (full disk, read-only file) is an "error" answer: the writer
  drops and counts it, as it did on its own thread. A child that died (killed, crashed)
  is StoreUnavailable: the writer keeps the batch, retries with backoff, and the next
  request starts a new child. A batch the child wrote before it died unanswered is
  written twice then (duplicate events, never a lost one).
"""

from __future__ import annotations

import pickle
import signal
import struct
import subprocess
import sys

from .store import StoreUnavailable, TraceStore

_LENGTH = struct.Struct(">I")
CLOSE_TIMEOUT_S = 10.0


class ProcessStore:
    """A TraceStore in a child process: the same write/retain/close as TraceStore."""

    def __init__(self, path: str, node: str):
        self.path = path
        self.node = node
        self._child: subprocess.Popen | None = None
        self._start()

    def _start(self) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "nsqtrace.process", self.path, self.node],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)

    def write(self, events: list[tuple]) -> None:
        self._ask(("write", events))

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
        data = pickle.dumps(request, pickle.HIGHEST_PROTOCOL)
        try:
            child.stdin.write(_LENGTH.pack(len(data)) + data)
            child.stdin.flush()
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
        if status != "ok":
            raise RuntimeError(value)
        return value


def _read_frame(stream) -> bytes | None:
    """One length-prefixed frame, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def serve(path: str, node: str, requests, answers) -> None:
    """The child: answer each request until the end of `requests`. The store opens with
    the first request, and again with the next one after it failed to."""
    store = None
    while (frame := _read_frame(requests)) is not None:
        kind, *args = pickle.loads(frame)
        try:
            if store is None:
                store = TraceStore(path, node)
            value = store.write(*args) if kind == "write" else store.retain(*args)
            answer = ("ok", value)
        except Exception as e:
            answer = ("error", f"{type(e).__name__}: {e}")
        data = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
        answers.write(_LENGTH.pack(len(data)) + data)
        answers.flush()
    if store is not None:
        store.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node decides when to stop: end of stdin
    serve(sys.argv[1], sys.argv[2], sys.stdin.buffer, sys.stdout.buffer)
