"""CommitLog: a partition's index of write requests, in segment files of fixed-size entries.

Invariants:
- log ids are contiguous from `first_log_id` to `next_log_id - 1`;
- entry N lives in the segment whose base is the largest base <= N, at
  byte (N - base) * 64;
- offsets, message ids and cumulative counts increase with the log id, and
  timestamps never decrease (the writer makes them monotonic), so every
  search is a binary search.

- at most `sync_every` entries are ever unsynced: `append` syncs by itself, and a
  writer using `append_encoded` calls `sync()` whenever `sync_due` says so; a
  rotation syncs the segment it leaves. So after a power loss only the last
  `sync_every` entries can be lost, torn or stale, and `open` checks each of them
  (checksum, place, and that it follows the one before) and cuts at the first bad one;
- a cut (`truncate_after`, a bad tail at `open`, `reset`) is synced before the call
  returns; one that cuts nothing writes and syncs nothing;
- `open` syncs only what it cuts: what it found (a crash may have left entries, or a cut,
  unsynced) is synced before the first entry is appended, and by `sync()`. So nothing is
  ever written over what may not be durable, as when `open` synced it (a start of many
  partitions spends no sync on those that are not written).

The API is synchronous: it does blocking file calls, so async callers run
it off the event loop. Nothing here decides what is durable; `sync()` does.
"""

from __future__ import annotations

import bisect
import os

from .entry import ENTRY_SIZE, CorruptEntryError, Entry, decode, encode

SUFFIX = ".clog"
DEFAULT_ENTRIES_PER_SEGMENT = 1 << 20  # 64 MiB per segment
DEFAULT_SYNC_EVERY = 4096  # entries (256 KiB): the most ever unsynced, checked at open


class CommitLogError(Exception):
    """The commitlog on disk cannot be used as it is (gap, corruption in the middle)."""


def _segment_name(base: int) -> str:
    return f"{base:020d}{SUFFIX}"


def list_folder(path: str) -> list[str]:
    """The names in folder `path`; a missing folder is made (not synced) and lists none.
    One system call for a folder that exists (a log's open lists two: its segments' and
    its commitlog's)."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)
        return []


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommitLog:
    """The commitlog of one partition, in folder `path`."""

    __slots__ = ("_bases", "_fds", "_found_unsynced", "_unsynced", "entries_per_segment",
                 "first_log_id", "next_log_id", "path", "sync_every")

    def __init__(self, path: str, entries_per_segment: int = DEFAULT_ENTRIES_PER_SEGMENT,
                 sync_every: int = DEFAULT_SYNC_EVERY):
        self.path = path
        self.entries_per_segment = entries_per_segment
        self.sync_every = sync_every
        self._bases: list[int] = []
        self._fds: dict[int, int] = {}
        self.first_log_id = 0
        self.next_log_id = 0
        self._unsynced = 0  # entries written since the last sync
        self._found_unsynced = False  # what `open` found may not be synced (see the invariants)

    # ---- lifecycle -------------------------------------------------------

    def open(self, start_log_id: int = 0) -> None:
        """Load the segments and cut a torn tail (a partial or bad-checksum last entry).

        A folder with no segment starts at `start_log_id`.
        """
        names = sorted(n for n in list_folder(self.path) if n.endswith(SUFFIX))
        self._bases = [int(n[:-len(SUFFIX)]) for n in names]
        if not self._bases:  # a new log: its empty file, synced into its folder
            self._bases = [start_log_id]
            self._fd(start_log_id)
            fsync_dir(self.path)
        else:
            self._found_unsynced = True  # what a crash left may not be synced
        counts = []
        for base in self._bases:
            size = os.fstat(self._fd(base)).st_size
            counts.append(size // ENTRY_SIZE)
        for i in range(len(self._bases) - 1):
            if self._bases[i] + counts[i] != self._bases[i + 1]:
                raise CommitLogError(
                    f"gap in commitlog {self.path}: segment {self._bases[i]} holds {counts[i]} "
                    f"entries but the next starts at {self._bases[i + 1]}")
        last = self._bases[-1]
        self.first_log_id = self._bases[0]
        self.next_log_id = last + counts[-1]
        self._cut_bad_tail()

    def _cut_bad_tail(self) -> None:
        """Cut the log at the first bad entry among the last `sync_every` (the only ones a
        power loss can have lost, torn or left stale): one that is partial, fails its
        checksum, sits at the wrong place, or does not follow the entry before it."""
        keep = self.next_log_id
        prev = None
        for log_id in range(max(self.first_log_id, self.next_log_id - self.sync_every),
                            self.next_log_id):
            try:
                entry = self._read(log_id)
            except CorruptEntryError:
                keep = log_id
                break
            if entry.log_id != log_id or (prev is not None and (
                    entry.offset != prev.end_offset or entry.count_before != prev.count_after)):
                keep = log_id
                break
            prev = entry
        self._truncate_to(keep)

    def ready(self) -> None:
        """Open the active file when it is closed, before an append."""
        self._fd(self._bases[-1])

    def close(self) -> None:
        """Close its files (each opens again when next used: an idle log holds none)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ---- writing ---------------------------------------------------------

    def append(self, entries: list[Entry]) -> None:
        """Append entries; their log ids must continue the log exactly."""
        for i, entry in enumerate(entries):
            if entry.log_id != self.next_log_id + i:
                raise ValueError(
                    f"log id {entry.log_id} does not follow {self.next_log_id + i - 1}")
        for i in range(0, len(entries), self.sync_every):
            chunk = entries[i:i + self.sync_every]
            self.append_encoded(b"".join(map(encode, chunk)), len(chunk))
            if self.sync_due:
                self.sync()

    def append_encoded(self, data: bytes, count: int) -> None:
        """Append `count` already-encoded entries starting at `next_log_id`.

        On failure the log is cut back to what it held before, and the error raised.
        """
        if self._found_unsynced:  # the first append since open: what it found, synced first
            self._sync_active()
        before = self.next_log_id
        try:
            pos = 0
            while pos < len(data):
                base = self._bases[-1]
                room = base + self.entries_per_segment - self.next_log_id
                if room <= 0:
                    self._rotate()
                    continue
                n = min(room, (len(data) - pos) // ENTRY_SIZE)
                chunk = data[pos:pos + n * ENTRY_SIZE]
                _pwrite_all(self._fd(base), chunk, (self.next_log_id - base) * ENTRY_SIZE)
                self.next_log_id += n
                self._unsynced += n
                pos += n * ENTRY_SIZE
        except BaseException:
            self._truncate_to(before)
            raise
        assert self.next_log_id - before == count

    def _rotate(self) -> None:
        base = self.next_log_id
        self._sync_active()
        self._bases.append(base)
        self._fd(base)
        fsync_dir(self.path)

    @property
    def sync_due(self) -> bool:
        """`sync_every` entries are unsynced: sync before appending more."""
        return self._unsynced >= self.sync_every

    def sync(self) -> None:
        if self._unsynced or self._found_unsynced:
            self._sync_active()

    def _sync_active(self) -> None:
        os.fdatasync(self._fd(self._bases[-1]))
        self._unsynced = 0
        self._found_unsynced = False

    def truncate_after(self, log_id: int) -> None:
        """Keep entries up to and including `log_id`."""
        self._truncate_to(max(self.first_log_id, min(log_id + 1, self.next_log_id)))

    def _truncate_to(self, next_log_id: int) -> None:
        """Keep the entries before `next_log_id`: a cut is synced; no cut, nothing written."""
        cut = False
        while len(self._bases) > 1 and self._bases[-1] > next_log_id:
            self._remove_segment(self._bases.pop())
            cut = True
        base = self._bases[-1]
        if next_log_id < base:
            next_log_id = base
        fd = self._fd(base)
        size = (next_log_id - base) * ENTRY_SIZE
        self.next_log_id = next_log_id
        if cut or os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
            self._sync_active()

    def reset(self, next_log_id: int) -> None:
        """Drop every entry; the log continues at `next_log_id` (nothing is written when it
        is an empty log there already)."""
        old = self._bases
        if old == [next_log_id] and os.fstat(self._fd(next_log_id)).st_size == 0:
            self.first_log_id = self.next_log_id = next_log_id
            return
        self._bases = [next_log_id]
        for base in old:
            if base != next_log_id:
                self._remove_segment(base)
        fd = self._fd(next_log_id)
        os.ftruncate(fd, 0)
        os.fdatasync(fd)
        self._unsynced = 0
        self._found_unsynced = False
        fsync_dir(self.path)
        self.first_log_id = self.next_log_id = next_log_id

    def drop_before_offset(self, offset: int) -> int:
        """Remove whole segments whose every entry ends at or before `offset`; return how many."""
        dropped = 0
        while len(self._bases) > 1:
            next_base = self._bases[1]
            if next_base >= self.next_log_id or self._read(next_base).offset > offset:
                break
            self._remove_segment(self._bases.pop(0))
            dropped += 1
        self.first_log_id = self._bases[0]
        if dropped:
            fsync_dir(self.path)
        return dropped

    def _remove_segment(self, base: int) -> None:
        fd = self._fds.pop(base, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(os.path.join(self.path, _segment_name(base)))
        except FileNotFoundError:
            pass

    # ---- reading ---------------------------------------------------------

    def __len__(self) -> int:
        return self.next_log_id - self.first_log_id

    def get(self, log_id: int) -> Entry:
        if not self.first_log_id <= log_id < self.next_log_id:
            raise KeyError(log_id)
        entry = self._read(log_id)
        if entry.log_id != log_id:
            raise CorruptEntryError(f"entry at place {log_id} carries log id {entry.log_id}")
        return entry

    def last(self) -> Entry | None:
        return self.get(self.next_log_id - 1) if len(self) else None

    def entries(self, start_log_id: int | None = None):
        """Yield entries from `start_log_id` (default: the first) to the end."""
        log_id = self.first_log_id if start_log_id is None else start_log_id
        while log_id < self.next_log_id:
            yield self.get(log_id)
            log_id += 1

    def find_by_offset(self, offset: int) -> Entry | None:
        """The entry whose records contain `offset` (the last one starting at or before it)."""
        return self._last_at_or_before(lambda e: e.offset, offset)

    def find_by_msg_id(self, msg_id: int) -> Entry | None:
        """The entry that wrote `msg_id`, or None."""
        entry = self._last_at_or_before(lambda e: e.first_msg_id, msg_id)
        if entry is None or msg_id >= entry.first_msg_id + entry.msg_count:
            return None
        return entry

    def find_by_count(self, count: int) -> Entry | None:
        """The entry holding the message with this cumulative index (0-based)."""
        entry = self._last_at_or_before(lambda e: e.count_before, count)
        if entry is None or count >= entry.count_after:
            return None
        return entry

    def find_by_timestamp(self, timestamp_ns: int) -> Entry | None:
        """The first entry written at or after `timestamp_ns`, or None."""
        lo, hi = self.first_log_id, self.next_log_id
        while lo < hi:
            mid = (lo + hi) // 2
            if self.get(mid).timestamp < timestamp_ns:
                lo = mid + 1
            else:
                hi = mid
        return self.get(lo) if lo < self.next_log_id else None

    def first_after_epoch(self, epoch: int) -> Entry | None:
        """The first entry whose epoch is above `epoch`, or None (epochs never decrease)."""
        lo, hi = self.first_log_id, self.next_log_id
        while lo < hi:
            mid = (lo + hi) // 2
            if self.get(mid).epoch <= epoch:
                lo = mid + 1
            else:
                hi = mid
        return self.get(lo) if lo < self.next_log_id else None

    def read_encoded(self, log_id: int, n: int) -> bytes:
        """Entries log_id .. log_id + n - 1 (fewer at the end of the log) as stored: 64 bytes
        each, not checked (callers decode them)."""
        n = min(n, self.next_log_id - log_id)
        parts = []
        while n > 0:
            i = bisect.bisect_right(self._bases, log_id) - 1
            base = self._bases[i]
            k = n if i + 1 == len(self._bases) else min(n, self._bases[i + 1] - log_id)
            parts.append(os.pread(self._fd(base), k * ENTRY_SIZE, (log_id - base) * ENTRY_SIZE))
            log_id += k
            n -= k
        return b"".join(parts)

    def _last_at_or_before(self, key, value: int) -> Entry | None:
        lo, hi = self.first_log_id, self.next_log_id
        while lo < hi:
            mid = (lo + hi) // 2
            if key(self.get(mid)) <= value:
                lo = mid + 1
            else:
                hi = mid
        return self.get(lo - 1) if lo > self.first_log_id else None

    def _read(self, log_id: int) -> Entry:
        i = bisect.bisect_right(self._bases, log_id) - 1
        base = self._bases[i]
        buf = os.pread(self._fd(base), ENTRY_SIZE, (log_id - base) * ENTRY_SIZE)
        if len(buf) < ENTRY_SIZE:
            raise CorruptEntryError(f"entry {log_id} is cut short")
        return decode(buf)

    def _fd(self, base: int) -> int:
        fd = self._fds.get(base)
        if fd is None:
            fd = os.open(os.path.join(self.path, _segment_name(base)), os.O_RDWR | os.O_CREAT, 0o644)
            self._fds[base] = fd
        return fd


def _pwrite_all(fd: int, data: bytes, pos: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view = view[n:]
        pos += n
