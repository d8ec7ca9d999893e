"""Journal: one group commit for every partition of a node.

The node's one write thread (`JournalWorker`) runs every partition's write jobs, in order
(nsqd's default); while partitions write at once, the jobs given in one turn of the
loop reach it in one hand-over. While
batches of several partitions are being written (`Journal.writers`), a durable batch of any
of them is written into its segment without a sync and added to the round as a journal
record. A round ends when the thread has no job left (or the round is full); its records
are then written and synced with one `fdatasync`, whatever the number of partitions that
wrote in them (as BookKeeper's journal, shared by every ledger of a bookie), and only then
is every answer of the round handed to the loop, in one call. A round that ends with no
job left is synced by the write thread itself: a job given meanwhile waits for that sync,
as it would for its own round's, and loses only the overlap of its write with it, where
the hand-off to the sync thread and back cost single PUBs on 16 to 1,000 topics 5-10% of
their msgs/s. A round that ends with jobs left (full, or a partition's second batch) goes to
the journal's sync thread, and the write thread goes on with the next jobs while the next
round grows: the rounds are pipelined, one being synced and one being written.
A partition writing alone syncs its own segment in the write's system call, as without a
journal; so does a round that ended with one record (nothing written twice). Jobs that
journaled nothing have their answers go at once.

On disk, in folder `journal/` of the node's data path: files `<number>.jnl` holding records
`[4 crc32][4 length][8 journal id][8 segment base][8 position][2 path length][path][data]`,
big-endian, one after another, then zeros (written ahead of the records, so that a round's
sync has no file size to commit: `_zero_ahead`); the CRC covers every byte after itself.
`path` is the partition's folder relative to the data path; `data` went into
`data/<segment base>.dat` at `position`.

Invariants:
- at most one batch of a partition is ever not durable: a round holds at most one batch of
  a partition (a second one ends the round first), and a batch of a partition whose batch
  the sync thread holds is written only once that round is synced; so after a power cut,
  replay leaves at most one unsynced batch at a partition's tail, as without a journal
  (diskqueue/recovery.py's rule);
- the thread that syncs a round touches only that round's segments, and the write thread
  writes none of those until the round is synced; a checkpoint starts, and retiring runs,
  on the write thread while the sync thread is idle; the checkpoint thread syncs segments
  through descriptors of its own and touches nothing else of theirs;
- a record is added only once its batch is written whole (a failed write is undone and
  never journaled); an answer that depends on a record reaches the loop only after the
  record is durable: its round synced in the journal, or, when the journal's write or
  sync failed, its segment synced on its own (an answer whose segment sync failed too
  carries that error: its queue fails, as after any failed sync);
- a failed journal write, sync or checkpoint turns the journal off for the rest of the
  process (`failed`): from then on each partition syncs its own segment, as without a
  journal; its files go once every segment they cover is synced (else they stay for the
  next start's replay);
- replay (at `Journal.open`, before any partition opens) writes each record back into its
  segment, in journal order, when the partition's `meta.json` holds the record's journal
  id and the segment file exists (a missing file was dropped by retention), up to the
  first torn or bad record or the zeros; then syncs what it wrote (REPLAY_SYNCS segments
  at a time) and starts a new journal file (a file is never reused: no record of an
  earlier one can follow its last);
- a partition whose log is cut or emptied while the journal holds its records first syncs
  its segment and takes a new journal id (`DiskQueue._leave_journal`), so no record is
  replayed over what follows; a partition opened again while the journal holds records of
  it does the same;
- a checkpoint (once the journal file passes `checkpoint_bytes`: nsqd's
  --journal-checkpoint-bytes, CHECKPOINT_BYTES by default) starts a new file at once;
  the checkpoint thread then syncs every segment journaled since the old file began (the
  one active when the checkpoint began: rotation syncs a segment before the next is
  made) and deletes the old files, while the rounds go on into the new one; one runs at a
  time, and until it is done `holds` counts the partitions its files cover.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import os
import resource
import struct
import threading
import time
import zlib

import structlog

from commitlog.log import fsync_dir

from .atomic import read_json
from .errors import _Unrecoverable
from .segments import pwrite_all, segment_name
from .worker import Worker

log = structlog.get_logger("diskqueue")

FOLDER = "journal"
SUFFIX = ".jnl"
HEAD = struct.Struct(">II")  # crc32, length of what follows
FIELDS = struct.Struct(">QQQH")  # journal id, segment base, position, path length
CHECKPOINT_BYTES = 64 * 1024 * 1024  # a journal file this long is checkpointed at a round's end
# Segments replay holds open at once (or a quarter of the process's descriptors, if fewer):
# past it, they are synced and closed.
REPLAY_OPEN = 256
# Segment syncs replay runs at once: the disk takes them together (10,000 segments of one
# record each after a kill -9: 0.97-1.29 s against 1.6-2.1 s one by one; diskqueue/README.md).
REPLAY_SYNCS = 16
OPEN_WAIT_S = 10.0  # a checkpoint waits this long for a free descriptor to sync a segment
ROUND_BYTES = 4 * 1024 * 1024  # a round this long is synced without waiting for the jobs to end
ROUND_POSTS = 1024  # nor for more answers than this
ZERO_AHEAD = 1024 * 1024  # zeros written past the records, so that rounds overwrite them
ALONE_SYNCS_ITS_SEGMENT = True  # a partition writing alone, and a round of one record, sync
# their segment instead of the journal
IDLE_WRITER_SYNCS = True  # a round that ends with no job left is synced by the write thread


def encode(journal_id: int, path: bytes, base: int, pos: int, data) -> bytes:
    body = FIELDS.pack(journal_id, base, pos, len(path)) + path + data
    return HEAD.pack(zlib.crc32(body), len(body)) + body


def decode(buf: bytes):
    """Yield (journal id, path, base, position, data) of each whole, valid record of `buf`,
    in order; stops at the first torn or bad one."""
    at = 0
    while at + HEAD.size <= len(buf):
        crc, length = HEAD.unpack_from(buf, at)
        body = buf[at + HEAD.size:at + HEAD.size + length]
        if length < FIELDS.size or len(body) < length or zlib.crc32(body) != crc:
            return
        journal_id, base, pos, path_len = FIELDS.unpack_from(body)
        path = body[FIELDS.size:FIELDS.size + path_len]
        yield journal_id, path.decode(), base, pos, body[FIELDS.size + path_len:]
        at += HEAD.size + length


def replay(root: str, files: list[str]) -> dict:
    """Write every record of `files` (in order) back into its segment, where the partition
    still holds the record's journal id and the segment exists; sync what was written.
    Returns counts for the log."""
    ids: dict[str, int | None] = {}
    fds: dict[str, int] = {}
    applied = skipped = 0
    written: set[str] = set()
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most_open = REPLAY_OPEN if soft == resource.RLIM_INFINITY else min(REPLAY_OPEN,
                                                                       max(1, soft // 4))
    pool = concurrent.futures.ThreadPoolExecutor(REPLAY_SYNCS, "diskqueue:replay-sync")
    try:
        for name in files:
            with open(name, "rb") as f:
                buf = f.read()
            for journal_id, path, base, pos, data in decode(buf):
                if path not in ids:
                    ids[path] = _journal_id(os.path.join(root, path))
                segment = os.path.join(root, path, "data", segment_name(base))
                if ids[path] != journal_id or not os.path.exists(segment):
                    skipped += 1
                    continue
                if segment not in fds:
                    if len(fds) >= most_open:
                        _sync_and_close(fds, pool)
                    fds[segment] = os.open(segment, os.O_WRONLY)
                pwrite_all(fds[segment], data, pos)
                written.add(segment)
                applied += 1
        _sync_and_close(fds, pool)
    finally:
        pool.shutdown()
        for fd in fds.values():
            os.close(fd)
    return {"applied": applied, "skipped": skipped, "segments": len(written)}


def _sync_and_close(fds: dict[str, int], pool: concurrent.futures.Executor) -> None:
    """Sync every segment replay wrote into, on `pool`'s threads (REPLAY_SYNCS at a time),
    then close them (`fds` emptied). Raises the first failed sync's error once every sync
    has ended."""
    syncs = [pool.submit(os.fdatasync, fd) for fd in fds.values()]
    try:
        for sync in syncs:
            sync.result()
    finally:
        concurrent.futures.wait(syncs)
        while fds:
            os.close(fds.popitem()[1])


def _sync_file(path: str) -> None:
    """fdatasync the file at `path` through a descriptor of its own; a file that is gone
    needs none. With every descriptor of the process in use it waits for one, at most
    OPEN_WAIT_S (a burst of connections must not turn the journal off)."""
    waited = 0.0
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
            break
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or waited >= OPEN_WAIT_S:
                raise
            time.sleep(0.01)
            waited += 0.01
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _journal_id(folder: str) -> int | None:
    meta = read_json(os.path.join(folder, "meta.json"))
    return None if meta is None else meta.get("journal_id", 0)


class Journal:
    """The journal of one node's data path (see the module docstring). Records are added,
    and rounds handed over, on its worker's thread; a round is written and synced on its
    sync thread, one round at a time, while the worker goes on with the next jobs."""

    def __init__(self, root: str, checkpoint_bytes: int | None = None):
        self.root = root
        self.checkpoint_bytes = checkpoint_bytes or CHECKPOINT_BYTES
        self.folder = os.path.join(root, FOLDER)
        self.worker = JournalWorker(self)
        self._syncer = Worker("diskqueue:journal-sync")
        self._checkpointer = Worker("diskqueue:journal-checkpoint")
        self._checkpointed = threading.Event()  # set: no checkpoint is running
        self._checkpointed.set()
        self._covering: dict = {}  # key -> segment file path, of a running checkpoint's files
        self.failed: _Unrecoverable | None = None
        self._retired = False
        self._fd = -1
        self._number = 0
        self._size = 0  # bytes of records in the current file: the next one goes there
        self._zeroed = 0  # the file's zeros, written ahead of the records, end here
        self._round: list[bytes] = []
        self._round_bytes = 0
        self._round_keys: dict = {}  # key -> Segments, of this round's records
        self._syncing: dict = {}  # key -> Segments, of the round the sync thread holds
        self._idle = threading.Event()  # set: the sync thread holds no round
        self._idle.set()
        self._dirty: dict = {}  # key -> Segments written since the journal file began
        self._lost: dict = {}  # key -> error: a record the journal failed and its segment too
        self.writers = 0  # partitions with a batch (or a raw append) given and not answered (loop)
        self.stats = {"syncs": 0, "records": 0, "bytes": 0, "checkpoints": 0,
                      "sync_seconds_total": 0.0, "alone": 0}

    @classmethod
    def open(cls, root: str, checkpoint_bytes: int | None = None) -> "Journal":
        """Replay what the journal holds, then start a new journal file (blocking: run it
        before any partition of `root` opens). A file of `checkpoint_bytes` (default
        CHECKPOINT_BYTES) is checkpointed."""
        j = cls(root, checkpoint_bytes)
        os.makedirs(j.folder, exist_ok=True)
        files = sorted(n for n in os.listdir(j.folder) if n.endswith(SUFFIX))
        paths = [os.path.join(j.folder, n) for n in files]
        if paths:
            counts = replay(root, paths)
            log.info("journal_replayed", files=len(paths), **counts)
            j._number = int(files[-1][:-len(SUFFIX)]) + 1
        j._start_file(paths)
        return j

    def key(self, queue_path: str, journal_id: int) -> tuple[bytes, int]:
        return os.path.relpath(queue_path, self.root).encode(), journal_id

    def holds(self, key) -> bool:
        """Whether a record of `key` may be in the journal (written since its file began,
        or in the files a running checkpoint has not deleted yet)."""
        return key in self._dirty or key in self._covering

    def begin(self, key, durable: bool) -> bool:
        """Before a batch of `key` is written: whether to journal it (a `durable` one, while
        the journal is on and another partition writes too or has a record in the round;
        else it syncs its own segment as its policy says). A batch of `key` in the round
        ends the round first, and one the sync thread holds is synced first: at most one
        batch of a partition is ever not durable. Raises the error of an earlier record of
        `key` that could not be made durable: nothing is written after it (its queue fails;
        opened again, it has a new key)."""
        if key in self._round_keys:
            self.flush()
        if key in self._syncing:
            self._idle.wait()
        if key in self._lost:
            raise self._lost[key]
        if not durable or self.failed is not None:
            return False
        if self.writers > 1 or self._round or not ALONE_SYNCS_ITS_SEGMENT:
            return True
        self.stats["alone"] += 1  # writing alone: its segment is synced by the write
        return False

    def record(self, key, segments, where: tuple[int, int], data) -> None:
        """Add a batch written whole at `where` (segment base, position) to this round."""
        path, journal_id = key
        rec = encode(journal_id, path, where[0], where[1], data)
        self._round.append(rec)
        self._round_bytes += len(rec)
        self._round_keys[key] = segments
        self._dirty[key] = segments
        self.worker.job_key = key

    @property
    def has_round(self) -> bool:
        return bool(self._round)

    @property
    def round_full(self) -> bool:
        return self._round_bytes >= ROUND_BYTES

    def flush(self, wait: bool = True, last: bool = False) -> None:
        """End the round (worker): hand its records and answers to the sync thread, once
        that holds no other round; or, when `last` (no job is left), write and sync it on
        this thread. With `wait` False and a round being synced, the round keeps growing
        instead (the sync thread wakes the worker when it is done). Answers of jobs that
        journaled nothing go to the loop at once when no record waits."""
        if not self._round:
            if posts := self.worker.take_posts():
                self.worker.deliver(posts, {})
            if self.failed is not None and self._idle.is_set():
                self._retire()
            return
        if not self._idle.is_set():
            if not wait:
                return
            self._idle.wait()
        if self.failed is not None:
            self._retire()
        elif self._size >= self.checkpoint_bytes:
            self._checkpoint()
        data = b"".join(self._round)
        records = len(self._round)
        keys, self._round_keys = self._round_keys, {}
        self._round.clear()
        self._round_bytes = 0
        alone = len(keys) == 1 and ALONE_SYNCS_ITS_SEGMENT  # nothing written twice
        if alone:
            self.stats["alone"] += 1
        self._syncing = keys
        self._idle.clear()
        posts = self.worker.take_posts()
        if last and IDLE_WRITER_SYNCS:
            self._sync_round(data, records, keys, alone, posts)
        else:
            self._syncer.call(self._sync_round, data, records, keys, alone, posts)

    def drain(self) -> None:
        """Hand the round over and wait until it is synced (worker)."""
        self.flush()
        self._idle.wait()

    def _sync_round(self, data: bytes, records: int, keys: dict, alone: bool,
                    posts: list) -> None:
        """(sync thread, or the write thread: `flush`) Write and sync a round (`alone`:
        sync its one record's segment instead), then hand its answers to the loop (with the
        journal's failure for those that needed a record, if it failed)."""
        failed: dict = {}
        try:
            failed = self._sync_alone(keys) if alone else self._write_round(data, records, keys)
        except BaseException as e:  # a bug: nothing of the round is taken as durable
            log.exception("journal_flush_failed")
            self._turn_off(f"a round failed: {e!r}")
            failed = {key: _Unrecoverable(f"the node journal failed: {e!r}") for key in keys}
            self._lost.update(failed)
        finally:
            self.worker.deliver(posts, failed)
            self._syncing = {}
            self._idle.set()
            self.worker.wake()

    def _write_round(self, data: bytes, records: int, keys: dict) -> dict:
        """Write and sync the round's records; returns {key: error} of those that are not
        durable (empty unless the journal failed and a segment's own sync did too)."""
        if self.failed is not None:  # turned off since the round began
            return self._sync_alone(keys)
        t0 = time.perf_counter()
        try:
            end = self._size + len(data)
            if end > self._zeroed:
                self._zero_ahead(end)
            pwrite_all(self._fd, data, self._size)
            os.fdatasync(self._fd)
        except OSError as e:
            self._turn_off(f"writing the journal failed: {e}")
            return self._sync_alone(keys)
        self._size += len(data)
        self.stats["syncs"] += 1
        self.stats["records"] += records
        self.stats["bytes"] += len(data)
        self.stats["sync_seconds_total"] += time.perf_counter() - t0
        return {}

    def _zero_ahead(self, end: int) -> None:
        """(the thread syncing a round) Before a round that ends at `end`, past the zeros
        written ahead: ZERO_AHEAD bytes of zeros from `end`, synced with the round. Later
        rounds then write over zeros already on disk, and their `fdatasync` has no file size
        to commit (0.11 against 0.25 ms a 40 KB round on this project's VM). Replay stops
        at the zeros as at the end of a file (a record of length 0). Without room for the
        zeros the file grows by each round, as before, and the zeros that did fit are cut
        off again (on a nearly full disk they would take the room the round needs)."""
        try:
            pwrite_all(self._fd, bytes(ZERO_AHEAD), end)
        except OSError:
            self._zeroed = self._size
            try:
                os.ftruncate(self._fd, self._size)  # past the records: zeros only
            except OSError:
                pass
        else:
            self._zeroed = end + ZERO_AHEAD

    def _sync_alone(self, keys: dict) -> dict:
        """Make each record of the round durable in its own segment instead (the journal
        failed, or the round has one record); returns {key: error} of those that are not."""
        failed = {}
        for key, segments in keys.items():
            try:
                segments.sync(force=True)
            except OSError as e:
                failed[key] = _Unrecoverable(f"sync failed: {e}")
        self._lost.update(failed)
        return failed

    def _retire(self) -> None:
        """The journal is off (worker, with the sync thread idle): once every segment it
        covers is synced, its files go (on a full disk their space is what is missing); if
        one cannot be, they stay. Once."""
        if self._retired:
            return
        self._retired = True
        self._checkpointed.wait()  # a running checkpoint's syncs first
        try:
            for segments in self._dirty.values():
                segments.sync(force=True)
            for path in self._covering.values():
                _sync_file(path)
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            for name in os.listdir(self.folder):
                if name.endswith(SUFFIX):
                    os.unlink(os.path.join(self.folder, name))
            fsync_dir(self.folder)
        except OSError as e:
            log.error("journal_kept", error=str(e), reason="a segment it covers could not be synced")
            return
        self._dirty.clear()
        self._covering = {}

    def _turn_off(self, reason: str) -> None:
        self.failed = _Unrecoverable(f"the node journal is off: {reason}")
        log.error("journal_off", reason=reason,
                  then="each partition syncs its own segment until the node restarts")

    def make_room(self) -> None:
        """The disk is full (worker): checkpoint now (the journal's files hold copies of
        data its segments can be synced to hold)."""
        if self.failed is None and (self._size or self._round):
            self.drain()  # the round's records first: the checkpoint needs them synced
            if self.failed is None:
                self._checkpoint()

    def _checkpoint(self) -> None:
        """Start a new file, and have the checkpoint thread sync the segments journaled
        since the old one began and then delete it (worker, with the sync thread idle): the
        rounds go on meanwhile (syncing 1,000 segments here held every partition's round
        for 0.23 s). One at a time: while one runs, the new file grows past
        `checkpoint_bytes`."""
        if not self._checkpointed.is_set():
            return
        try:
            old = [os.path.join(self.folder, n) for n in os.listdir(self.folder)
                   if n.endswith(SUFFIX)]
            self._start_file([])
        except OSError as e:
            self._turn_off(f"a checkpoint failed: {e}")
            self._retire()
            return
        self._covering = {key: segments.file(segments.active_base)
                          for key, segments in self._dirty.items()}
        self._dirty = {}
        self._checkpointed.clear()
        self._checkpointer.call(self._sync_covered, self._covering, old)

    def _sync_covered(self, covered: dict, old: list[str]) -> None:
        """(checkpoint thread) Sync each segment the `old` files cover, then delete them. A
        partition's records since a file began are in the segment active when the checkpoint
        began, or in ones its rotations synced; a segment is synced through a descriptor of
        its own, by path (the write thread's descriptors and flags stay the write thread's),
        and one deleted since (retention, a deleted topic) is skipped, as replay skips its
        records. A failure turns the journal off and keeps the files for the next start's
        replay (`_retire` tries again)."""
        try:
            for path in covered.values():
                _sync_file(path)
            for name in old:
                os.unlink(name)
            if old:
                fsync_dir(self.folder)
        except OSError as e:
            self._turn_off(f"a checkpoint failed: {e}")
        else:
            self._covering = {}
            self.stats["checkpoints"] += 1
        finally:
            self._checkpointed.set()

    def _start_file(self, old: list[str]) -> None:
        """A new, empty journal file (durable), then the `old` ones deleted."""
        fd = os.open(os.path.join(self.folder, f"{self._number:020d}{SUFFIX}"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        fsync_dir(self.folder)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._size, self._zeroed = fd, 0, 0
        self._number += 1
        for name in old:
            os.unlink(name)
        if old:
            fsync_dir(self.folder)

    def close(self) -> None:
        """Stop the worker once its jobs are done (the partitions are closed: their
        segments synced), then the sync thread once its round is, then close the file."""
        self.worker.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        self._checkpointer.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class JournalWorker(Worker):
    """The node's write thread: every journaled partition's write jobs, in the order given,
    in rounds (see the module docstring). The jobs given in one turn of the loop are handed
    over together at its end (one wake of the thread a turn, not one a batch); posts wait
    for their round's sync."""

    def __init__(self, journal: Journal):
        super().__init__("diskqueue:journal")
        self.journal = journal
        self.job_key: tuple[bytes, int] | None = None  # the key of the record the running
        # job added, if any
        self._posts: list = []
        self._turn: list = []  # jobs given in this turn of the loop, not handed over yet

    def call(self, fn, *args) -> None:
        """A job goes at once while at most one partition writes (as without a journal);
        else at the end of this turn of the loop, with the others given in it."""
        if self._shut:
            raise RuntimeError(f"worker {self.name} is shut down")
        if not self._turn:
            if self.journal.writers <= 1:
                self._put([(fn, args)])
                return
            try:
                asyncio.get_running_loop().call_soon(self._hand_over)
            except RuntimeError:  # no loop in this thread (a close): at once
                self._put([(fn, args)])
                return
        self._turn.append((fn, args))

    def _hand_over(self) -> None:
        if self._turn:
            jobs, self._turn = self._turn, []
            self._put(jobs)

    def wake(self) -> None:
        """(the thread that synced a round) Have the worker hand over the round that grew
        meanwhile, if it is waiting for jobs."""
        self._jobs.put([])

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._shut:
            self._hand_over()
        super().shutdown(wait, cancel_futures=cancel_futures)

    def post(self, loop, fn, *args) -> None:
        self._posts.append((loop, fn, args, self.job_key))

    def take_posts(self) -> list:
        posts, self._posts = self._posts, []
        return posts

    @staticmethod
    def deliver(posts: list, failed: dict) -> None:
        """Hand the posts to their loops, in order, one call a loop; a post whose record is
        not durable (`failed`: key -> error) carries that error as its last argument."""
        by_loop: dict = {}
        for loop, fn, args, key in posts:
            if key in failed:
                args = (*args[:-1], failed[key])
            by_loop.setdefault(loop, []).append((fn, args))
        for loop, calls in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # that loop is closed: no one waits for these answers
                pass

    def _run(self) -> None:
        get, queued = self._jobs.get, self._jobs
        journal = self.journal
        while (jobs := get()) is not None:
            for fn, args in jobs:
                self.job_key = None
                try:
                    fn(*args)
                except BaseException:
                    log.exception("worker_job_failed", worker=self.name)
                self.job_key = None
                if journal.round_full or len(self._posts) >= ROUND_POSTS:
                    journal.flush()
            if not journal.has_round or queued.empty():
                journal.flush(wait=False, last=True)  # a round being synced: this one grows
        journal.drain()


def _run_all(calls: list) -> None:
    """The answers of one round, on the loop, in order; one that raises never stops the rest."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:
            log.exception("journal_answer_failed")
