"""Segments: the data files of one partition, named by the virtual offset of their first byte.

Invariants:
- segment i covers [bases[i], bases[i+1]) and the last one [bases[-1], end);
  records never span two segments;
- only the last (active) segment is ever written, and only at `end`;
- a new segment is created only after the previous one is synced, and the
  folder is synced after the file is created, so a rotation is durable;
- `bases` is replaced, never changed in place: the event loop reads it while a
  worker thread rotates or drops segments;
- `newest.json` names the newest segment ever created, written (atomically)
  before any byte goes into it: if that segment is not on disk at open, it
  was lost, not torn, and open refuses with MissingSegmentError instead of
  letting recovery cut the commitlog back to the older segments.

Synchronous and blocking: the queue calls it from a worker thread.
"""

from __future__ import annotations

import bisect
import errno
import os

from commitlog.log import fsync_dir, list_folder

from .atomic import read_json, write_json_atomic
from .errors import _Unrecoverable

SUFFIX = ".dat"
NEWEST_FILE = "newest.json"


class MissingSegmentError(Exception):
    """A segment the history needs is not on disk."""


def segment_name(base: int) -> str:
    return f"{base:020d}{SUFFIX}"


DSYNC = getattr(os, "RWF_DSYNC", 0)  # pwritev's flag: the write returns once its range is synced
NOTHING_WRITTEN = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a failed write that wrote nothing


def pwrite_all(fd: int, data, pos: int, flags: int = 0) -> None:
    """Write all of `data` at `pos`; `flags` (DSYNC): each piece is synced as it is written."""
    view = memoryview(data)
    while view:
        n = os.pwritev(fd, (view,), pos, flags) if flags else os.pwrite(fd, view, pos)
        view = view[n:]
        pos += n


class Segments:
    __slots__ = ("_fd", "_journaled", "_unsynced", "bases", "end", "path", "segment_bytes")

    def __init__(self, path: str, segment_bytes: int):
        self.path = path
        self.segment_bytes = segment_bytes
        self.bases: list[int] = []
        self.end = 0  # virtual offset just past the last written byte
        self._fd = -1  # the active segment, opened for writing
        self._unsynced = False  # bytes written that are neither synced nor journaled
        self._journaled = False  # bytes written that are durable in the node journal only

    def open(self, start_offset: int) -> None:
        """Load the segment list; an empty folder starts at `start_offset`.

        Raises MissingSegmentError if a non-last segment does not reach the next one.
        """
        names = sorted(n for n in list_folder(self.path) if n.endswith(SUFFIX))
        self.bases = [int(n[:-len(SUFFIX)]) for n in names]
        newest = read_json(os.path.join(self.path, NEWEST_FILE), {}).get("base")
        # With no file at all, `newest` at or past the start means that segment was lost
        # (reset() never leaves the folder without a file that an open would still need).
        if newest is not None and (newest > self.bases[-1] if self.bases
                                   else newest >= start_offset):
            raise MissingSegmentError(
                f"{self.path}: segment {segment_name(newest)}, the newest one created, is not on "
                f"disk: the data from offset {newest} on is missing")
        if not self.bases:
            self.bases = [start_offset]
            os.close(os.open(self.file(start_offset), os.O_RDWR | os.O_CREAT, 0o644))
            fsync_dir(self.path)
        if newest != self.bases[-1]:
            self._record_newest()
        for i in range(len(self.bases) - 1):
            size = os.path.getsize(self.file(self.bases[i]))
            if self.bases[i] + size != self.bases[i + 1]:
                raise MissingSegmentError(
                    f"{self.path}: segment {segment_name(self.bases[i])} ends at "
                    f"{self.bases[i] + size} but the next segment starts at {self.bases[i + 1]}: "
                    f"offsets [{self.bases[i] + size}, {self.bases[i + 1]}) are missing")
        self._open_active()
        self.end = self.active_base + os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def release(self) -> None:
        """Sync what is unsynced and close the active segment (an idle log holds no
        descriptor); the next write opens it again."""
        self.sync()
        self.close()

    def ready(self) -> None:
        """Open the active segment when its file is closed (a released log), before it is
        written or cut."""
        if self._fd < 0:
            self._open_active()

    @property
    def start(self) -> int:
        return self.bases[0]

    @property
    def active_base(self) -> int:
        return self.bases[-1]

    def file(self, base: int) -> str:
        return os.path.join(self.path, segment_name(base))

    def locate(self, offset: int) -> tuple[int, int]:
        """(segment base, end of that segment) for the segment holding `offset`."""
        i = bisect.bisect_right(self.bases, offset) - 1
        if i < 0:
            raise MissingSegmentError(f"offset {offset} is before the first retained segment "
                                      f"({self.bases[0]})")
        seg_end = self.bases[i + 1] if i + 1 < len(self.bases) else self.end
        return self.bases[i], seg_end

    def write(self, data, sync: bool = False) -> bool:
        """Append `data` at `end`, rotating first when the active segment is full. With
        `sync` and nothing unsynced before it, written and synced in one system call (DSYNC:
        as write + fdatasync, for its range, which is all that is unsynced): returns True.
        Such a write that fails raises _Unrecoverable (its sync may have failed, and the
        kernel may have dropped its pages), unless it wrote nothing (a full disk)."""
        self.ready()
        self._make_room(len(data))
        if sync and DSYNC and not self._unsynced:
            try:
                pwrite_all(self._fd, data, self.end - self.active_base, DSYNC)
            except OSError as e:
                if e.errno in NOTHING_WRITTEN:
                    raise
                raise _Unrecoverable(f"sync failed: {e}") from e
            self.end += len(data)
            return True
        pwrite_all(self._fd, data, self.end - self.active_base)
        self.end += len(data)
        self._unsynced = True
        return False

    @property
    def unsynced(self) -> bool:
        return self._unsynced

    def write_journaled(self, data) -> tuple[int, int]:
        """Append `data` at `end` without a sync, for the node journal (diskqueue/journal.py),
        rotating first when the active segment is full; returns (segment base, position)."""
        self.ready()
        self._make_room(len(data))
        pos = self.end - self.active_base
        pwrite_all(self._fd, data, pos)
        self.end += len(data)
        self._journaled = True
        return self.active_base, pos

    def _make_room(self, size: int) -> None:
        """Rotate first when `size` more bytes would overfill a non-empty active segment."""
        active_size = self.end - self.active_base
        if active_size > 0 and active_size + size > self.segment_bytes:
            self.rotate()

    def sync(self, force: bool = False) -> None:
        """Sync the active segment when this object wrote to it unsynced; `force`: whatever
        it wrote (an earlier writer of the file may not have synced)."""
        if (force or self._unsynced or self._journaled) and self._fd >= 0:
            os.fdatasync(self._fd)
            self._unsynced = self._journaled = False

    def rotate(self) -> None:
        """Start a new segment at `end`; if its file cannot be made, the old one stays active."""
        self.sync()
        fd = os.open(self.file(self.end), os.O_RDWR | os.O_CREAT, 0o644)
        os.close(self._fd)
        self._fd = fd
        self.bases = self.bases + [self.end]
        fsync_dir(self.path)
        self._record_newest()

    def _record_newest(self) -> None:
        write_json_atomic(os.path.join(self.path, NEWEST_FILE), {"base": self.active_base})

    def truncate_to(self, offset: int) -> None:
        """Cut the active segment back to `offset` (a failed write, or a torn tail)."""
        if offset < self.active_base:
            raise ValueError(f"cannot cut to {offset}: before the active segment {self.active_base}")
        self.ready()
        os.ftruncate(self._fd, offset - self.active_base)
        os.fdatasync(self._fd)
        self.end = offset

    def read(self, start: int, end: int) -> bytes:
        """The bytes of the history in [start, end), across segments."""
        parts = []
        while start < end:
            base, seg_end = self.locate(start)
            n = min(end, seg_end) - start
            fd = os.open(self.file(base), os.O_RDONLY)
            try:
                data = os.pread(fd, n, start - base)
            finally:
                os.close(fd)
            if len(data) < n:
                raise OSError(f"{self.file(base)} ends before offset {start + n}")
            parts.append(data)
            start += n
        return b"".join(parts)

    def cut_to(self, offset: int) -> None:
        """Cut the history back to `offset`, across segments; a kill at any point leaves
        contiguous segments from the start, a prefix of what was there.

        `newest.json` first names the segment that will be the active one (a newer segment
        on disk is then no loss at open); newer segments go newest first, each unlink synced
        into the folder (so no gap opens, even at a power cut); then the new active segment
        is cut and synced."""
        i = bisect.bisect_right(self.bases, offset) - 1
        if i < 0 or offset > self.end:
            raise ValueError(f"cannot cut to {offset}: outside [{self.start}, {self.end}]")
        if i + 1 < len(self.bases):
            keep, newer = self.bases[:i + 1], self.bases[i + 1:]
            write_json_atomic(os.path.join(self.path, NEWEST_FILE), {"base": keep[-1]})
            self.close()
            for base in reversed(newer):
                self.bases = self.bases[:-1]
                os.unlink(self.file(base))
                fsync_dir(self.path)
            self._open_active()
        self.ready()
        os.ftruncate(self._fd, offset - self.active_base)
        os.fdatasync(self._fd)
        self.end = offset
        self._unsynced = self._journaled = False

    def drop_before(self, offset: int) -> int:
        """Delete whole segments that end at or before `offset` (never the active one)."""
        keep = next(i for i, end in enumerate(self.bases[1:] + [None])
                    if end is None or end > offset)
        dropped, self.bases = self.bases[:keep], self.bases[keep:]
        for base in dropped:
            os.unlink(self.file(base))
        if dropped:
            fsync_dir(self.path)
        return len(dropped)

    def reset(self, offset: int) -> None:
        """Delete every segment; the history continues empty at `offset`. A segment that
        already starts at `offset` is emptied in place, so the folder is never left without
        the file `newest.json` names (open would take that for a lost segment)."""
        self.close()
        old, self.bases = self.bases, [offset]
        for base in old:
            if base != offset:
                os.unlink(self.file(base))
        self._open_active()
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        fsync_dir(self.path)
        self.end = offset
        self._record_newest()

    def sizes(self) -> list[tuple[int, int, float]]:
        """(base, bytes, last modification time) of each segment, oldest first."""
        out = []
        for i, base in enumerate(self.bases):
            seg_end = self.bases[i + 1] if i + 1 < len(self.bases) else self.end
            out.append((base, seg_end - base, os.path.getmtime(self.file(base))))
        return out

    def _open_active(self) -> None:
        self._fd = os.open(self.file(self.active_base), os.O_RDWR | os.O_CREAT, 0o644)
