"""The errors a DiskQueue raises (importable from diskqueue.queue as well)."""

from __future__ import annotations


class AppendError(Exception):
    """A batch could not be written; nothing of it was acknowledged and the queue is as before."""


class DiskFullError(AppendError):
    """The disk is full (ENOSPC)."""


class QueueClosedError(Exception):
    """The queue is closed or closing."""


class NotCommitted(Exception):
    """A replicated queue's batch written here but never committed (the in-sync replicas
    fell below min_isr, the leader stepped down, the queue closed): its outcome is unknown,
    since replicas may hold it and a new leader may still commit it. The text says why."""


class CommitTimeout(NotCommitted):
    """A request not answered within the queue's commit timeout (QueueOptions): one never
    written is taken out of the queue (nothing of it is stored: `unwritten`), one written
    or being written stays (its outcome is unknown, as NotCommitted says). The text says
    which."""

    def __init__(self, text: str, unwritten: bool = False):
        super().__init__(text)
        self.unwritten = unwritten


class _Unrecoverable(Exception):
    """Raised by the worker thread when the queue must fail (see QueueFailedError)."""


class QueueFailedError(AppendError):
    """A sync failed, or a failed write could not be undone: what the kernel still holds
    for these files is unknown, so the queue takes no more appends until it is reopened
    (recovery then trusts only what is on disk)."""


class GapError(Exception):
    """A follower's append does not start at this log's written end, `end` = (offset, count)."""

    def __init__(self, end_offset: int, end_count: int):
        self.end = (end_offset, end_count)
        super().__init__(f"the batch does not start at the written end {self.end}")


class OffsetOutOfRange(Exception):
    """A raw read before the log's start (retention dropped it); `start` = (offset, count)."""

    def __init__(self, start_offset: int, start_count: int):
        self.start = (start_offset, start_count)
        super().__init__(f"the log starts at {self.start}")


class Diverged(Exception):
    """A raw batch overlaps this log where it holds other entries (not a duplicate: the
    leader's log and this one differ there); the replica must reconcile."""
