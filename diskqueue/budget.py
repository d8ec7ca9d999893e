"""FileBudget: how many logs of a node may hold their files open at once.

A log holds its files (its active segment, its commitlog, a replica's committed end) open
while it writes, and none once they are released (`DiskQueue.release_files`) or it is
closed. Invariants:
- a log takes a place before a batch of its own opens its files, and gives it back when they
  are closed: at most `limit` logs hold a place;
- a log that finds no place free fails nothing: its batches wait in its queue, it is given
  the next place given back (in the order the logs asked), and `on_full` asks the host to
  release logs now;
- `holders` are the logs holding a place, each with the (monotonic) time it took it: the
  host looks there for logs to release, never at every log it holds.
A job on a log without a place (a `find`, retention, a follower's write while it waits)
opens its files for that job alone and closes them after (`GroupCommit._keeping_closed`).
Loop only: places are taken and given back on the event loop.
"""

from __future__ import annotations

import time
from typing import Callable


class FileBudget:
    def __init__(self, limit: int, on_full: Callable[[], None] | None = None):
        if limit < 1:
            raise ValueError(f"a budget of {limit} logs")
        self.limit = limit
        self.on_full = on_full
        self.holders: dict = {}  # log -> time.monotonic() when it took its place
        self._waiting: dict = {}  # log -> None, in the order they asked
        self.waits = 0  # times a log found no place free (stats)

    def take(self, log, force: bool = False) -> bool:
        """A place for `log` now (True), or it waits for one (False): `log.given_place()` is
        called when it has one. A log that waits never jumps the ones that asked before it.
        `force` (a closing log writing what it has left): a place now, over the limit if
        need be, so a close never waits for other logs to be released."""
        if log in self.holders:
            return True
        if force or (len(self.holders) < self.limit and not self._waiting):
            self._waiting.pop(log, None)
            self.holders[log] = time.monotonic()
            return True
        if log not in self._waiting:
            self._waiting[log] = None
            self.waits += 1
        if self.on_full is not None:
            self.on_full()
        return False

    def give_back(self, log) -> None:
        """`log` closed its files (or closes for good): its place goes to the first waiting."""
        self._waiting.pop(log, None)
        if self.holders.pop(log, None) is not None:
            while self._waiting and len(self.holders) < self.limit:
                first = next(iter(self._waiting))
                del self._waiting[first]
                self.holders[first] = time.monotonic()
                first.given_place()

    @property
    def waiting(self) -> int:
        """Logs waiting for a place."""
        return len(self._waiting)

    def stats(self) -> dict:
        return {"limit": self.limit, "held": len(self.holders), "waiting": len(self._waiting),
                "waits": self.waits}
