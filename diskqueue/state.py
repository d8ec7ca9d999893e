"""QueueState: the state of one partition's log, and the moves of it that every part of the
queue makes. `DiskQueue` is one chain of classes, each adding a concept and declaring the
fields it adds: QueueState (here) <- GroupCommit (the write path, groupcommit.py) <-
Replicated (a replica's needs, replicated.py) <- DiskQueue (open, append, read, retain,
queue.py). One chain, every field declared in the class body: scripts/compile.py compiles
the four as native classes, whose fields are C struct members and whose calls to each
other are direct; the same classes keep their fields in `__slots__` when run as Python.

Invariants: `committed_end <= written_end`; `_committed_at` is (committed_end,
committed_count) as one object, for the write worker; meta.json names where the log
starts and its journal id, and is written atomically before the files it describes move.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import structlog

from commitlog.log import DEFAULT_ENTRIES_PER_SEGMENT, DEFAULT_SYNC_EVERY, CommitLog

from .atomic import write_json_atomic
from .budget import FileBudget
from .committed import CommittedFile
from .errors import QueueFailedError
from .journal import Journal
from .reader import SharedChunks
from .segments import Segments
from .worker import Worker, WorkerPool

log = structlog.get_logger("diskqueue")

META_FILE = "meta.json"


def new_journal_id() -> int:
    """A log's id in the node journal: random, so a log made again in the same folder never
    takes the records of the one before (diskqueue/journal.py)."""
    return int.from_bytes(os.urandom(8), "big")


@dataclasses.dataclass(frozen=True, slots=True)
class SyncPolicy:
    """When the writer syncs. The default syncs every batch before acknowledging it (durable)."""

    every_messages: int = 1  # sync once this many messages are unsynced; 1 = every batch
    every_ms: int = 0  # also sync when the oldest unsynced write is this old; 0 = never by time

    @property
    def durable(self) -> bool:
        return self.every_messages <= 1


@dataclasses.dataclass(frozen=True, slots=True)
class QueueOptions:
    partition: int = 0
    segment_bytes: int = 100 * 1024 * 1024
    sync: SyncPolicy = SyncPolicy()
    max_batch_bytes: int = 4 * 1024 * 1024
    max_batch_count: int = 20_000
    clog_entries_per_segment: int = DEFAULT_ENTRIES_PER_SEGMENT
    clog_sync_every: int = DEFAULT_SYNC_EVERY  # the most commitlog entries ever unsynced
    auto_commit: bool = True  # commit as soon as written; replication turns this off
    replicated: bool = False  # one replica of a partition: see diskqueue/replicated.py
    commit_timeout: float = 0.0  # s: every request is answered within it (0: no limit)
    journal: Journal | None = None  # the node's journal: its worker writes, one sync a round
    files: FileBudget | None = None  # the node's logs with files open (None: no limit)
    read_workers: WorkerPool | None = None  # the node's read threads (None: one of its own)


class QueueState:
    """The fields of a partition's log that every part reads (set in DiskQueue.__init__)."""

    # Every batch reads them: in slots (or, compiled, a native struct) they sit in the
    # queue's own object (11% of the CPU a message at 1,000 busy partitions against an
    # instance dict; bench/README.md, "Partition state in slots").
    __slots__ = (
        "_closing", "_committed_at", "_committed_file", "_committed_waiters", "_files",
        "_journal", "_journal_id", "_journal_key", "_loop", "_meta", "_segments", "_shut",
        "_write_worker", "commit_listeners", "commitlog", "committed_count", "committed_end",
        "corrupt", "epoch", "failed", "files_used_at", "histograms", "options", "partition",
        "path", "read_worker", "shared_chunks", "start_count", "stats", "thread_prefix",
        "written_count", "written_end",
    )
    path: str
    options: QueueOptions
    partition: int
    epoch: int
    _segments: Segments
    commitlog: CommitLog
    _loop: Any  # the loop open() ran on (an asyncio or uvloop loop)
    thread_prefix: str
    _write_worker: Worker | None  # writes, syncs and exclusive jobs (the journal's, with one)
    read_worker: Worker | None  # its readers' read-ahead
    _journal: Journal | None
    _files: FileBudget | None
    _journal_id: int  # this log's id in the node journal (meta.json)
    _journal_key: tuple | None
    _meta: dict[str, int]
    files_used_at: float | None  # monotonic time its files were last used; None: closed
    _closing: bool
    _shut: bool  # the files are closed and the workers shut down
    failed: QueueFailedError | None
    _committed_waiters: list[Any]
    commit_listeners: list[Any]  # plain callables, called when committed_end moves
    written_end: int
    written_count: int
    committed_end: int
    committed_count: int
    _committed_at: tuple[int, int]
    _committed_file: CommittedFile | None  # a replica's persisted committed end
    start_count: int
    corrupt: list[tuple[int, str]]
    shared_chunks: SharedChunks  # what its Readers decoded lately, for each other
    stats: dict[str, Any]
    histograms: dict[str, list[int]]

    @property
    def start_offset(self) -> int:
        return self._segments.start

    def _commit(self, end_offset: int, count: int) -> None:
        if end_offset <= self.committed_end:
            return
        self.committed_end = end_offset
        self.committed_count = count
        self._committed_at = (end_offset, count)
        self._wake_readers()
        for listener in self.commit_listeners:
            try:
                listener()
            except Exception:  # a listener's bug must never stop the writer
                log.exception("commit_listener_failed", path=self.path)

    def _wake_readers(self) -> None:
        waiters, self._committed_waiters = self._committed_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _store_committed(self) -> None:
        """Write worker, with each batch: the committed end as the loop last set it."""
        if self._committed_file is not None:
            self._committed_file.store(self._committed_at)

    def _release_files_sync(self) -> None:
        self._segments.release()
        self.commitlog.close()
        if self._committed_file is not None:
            self._committed_file.release()
        self.files_used_at = None

    def _leave_journal(self) -> None:
        """(write worker) Before the log is cut or emptied, or when it opens again: no record
        the node journal holds of it may be replayed over what comes next. Syncs what those
        records cover, then takes a new journal id (meta.json, durable)."""
        if self._journal is None or not self._journal.holds(self._journal_key):
            return
        self._segments.sync(force=True)
        self._journal_id = new_journal_id()
        self._journal_key = self._journal.key(self.path, self._journal_id)
        self._write_meta(self._meta["start_offset"], self._meta["start_count"],
                         self._meta["start_log_id"])

    def _write_meta(self, start_offset: int, start_count: int, start_log_id: int) -> None:
        self._meta = {"partition": self.partition, "start_offset": start_offset,
                      "start_count": start_count, "start_log_id": start_log_id,
                      "journal_id": self._journal_id}
        self.start_count = start_count
        write_json_atomic(os.path.join(self.path, META_FILE), self._meta)
