"""One channel's deferred messages on disk: an LMDB environment polled by due time.

Synchronous and blocking: the channel calls it from worker threads, never on the event
loop; a lock makes the calls of several threads run one at a time. Every method that
changes something is one LMDB write transaction, committed with a sync before it returns,
so whatever a call returned from is on disk. See delayqueue/README.md for the layout and
the exact guarantee.

Sub-databases of the environment (keys and values encoded by delayqueue/entry.py):

    waiting   [8 due_ms][8 msg_id]  -> value     a cursor walks it in due-time order
    taken     [8 msg_id]            -> value     handed out by take_due, not finished yet
    due_of    [8 msg_id]            -> [8 due_ms][8 msg_id]   the waiting key of an id
    origins   [8 origin_offset][8 msg_id] -> b""  every log message held (origin >= 0)
    corrupt   [db name]:[key]       -> raw value entries that failed their checksum
    meta      b"format"             -> b"delaystore-2" (-1: made before `origins`)
              b"max_origin"         -> [8 signed]   the highest origin_offset ever put
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import threading
import time
from typing import Iterator

import lmdb

from delayqueue import footprint
from diskqueue.atomic import fsync_dir, make_dirs
from delayqueue.entry import (MAX_DUE_MS, U64, CorruptEntry, DelayedMessage, check_taken,
                              check_waiting, checked_tail, decode_value, encode_value,
                              held_fields, pack_due_key, pack_id, pack_origin_key, tail_due_ms,
                              unpack_origin_key, with_due)

FORMAT = b"delaystore-2"
FORMAT_1 = b"delaystore-1"  # no `origins`: built at open, then the format is FORMAT
DBS = ("waiting", "taken", "due_of", "origins", "corrupt", "meta")
MAX_ORIGIN_KEY = b"max_origin"
I64 = struct.Struct(">q")
DATA_FILE = "data.mdb"
LOCK_FILE = footprint.LOCK_FILE
MAX_DBS = 8
# Entries moved per write transaction by the whole-store operations (recovery at open,
# requeue_all_now): bounds the dirty pages LMDB holds in memory during one transaction.
CHUNK = 10_000
# The read-only map is dropped from this process's page tables (madvise MADV_DONTNEED,
# see _release_map) every this many entries handled, also inside a transaction (a random
# touch maps up to 64 KiB: kernel fault-around), and after this many transactions.
RELEASE_EVERY_ENTRIES = 64
RELEASE_EVERY_TXNS = 32

# Paths open in this process: LMDB forbids opening one environment twice in a process.
_open_paths: set[str] = set()
_open_paths_lock = threading.Lock()


class DelayStoreError(Exception):
    """The store cannot be opened or used; the message names the file and the cause."""


class DelayStoreCorruptError(DelayStoreError):
    """A stored value failed its checksum or framing. The entry was moved to the
    `corrupt` sub-database (kept, not deleted), so the next call goes on past it."""

    def __init__(self, path: str, db: str, key: bytes, reason: str):
        self.path = path
        self.db = db
        self.key = key
        self.reason = reason
        super().__init__(f"{path}: corrupt entry in '{db}' at key {key.hex()}: {reason}")


def _first_rows(cur, start: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
    """Up to `limit` (key, value) pairs from the first key >= start (or the first key).
    Collected before any change, so no cursor walks a tree while it is modified."""
    found = cur.first() if start is None else cur.set_range(start)
    rows = []
    if not found:
        return rows
    for row in cur.iternext():
        rows.append(row)
        if len(rows) >= limit:
            break
    return rows


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---- the store ------------------------------------------------------------------

class DelayStore:
    """One channel's delay queue: deferred messages in one LMDB environment (its folder).

    Blocking; safe for one thread at a time (a lock serializes calls anyway).
    """

    def __init__(self, path: str, env: lmdb.Environment, dbs: dict):
        self.path = path
        self.data_file = os.path.join(path, DATA_FILE)
        self._env = env
        self._waiting = dbs["waiting"]
        self._taken = dbs["taken"]
        self._due_of = dbs["due_of"]
        self._origins = dbs["origins"]
        self._corrupt = dbs["corrupt"]
        self._meta = dbs["meta"]
        self._lock = threading.Lock()
        self._closed = False
        self._txns_since_release = 0
        self._entries_since_release = 0
        self._can_release = sys.platform.startswith("linux")
        self._map: tuple[int, int] | None = None  # (address, length) of LMDB's map
        self.recovered = 0  # entries moved from taken back to waiting at open
        self.map_grows = 0
        self.commits = 0  # write transactions committed since open: a read that saw k
        # commits before it started shows every change they made (callers order reads by it)

    # -- open / create -----------------------------------------------------------

    @classmethod
    def open(cls, path: str, map_size: int = 1 << 30, *, now_ms: int | None = None) -> "DelayStore":
        """Open (or create) the store in folder `path`; taken entries come back as waiting,
        due at min(their due time, now). Raises DelayStoreError naming the file."""
        path = os.path.abspath(path)
        data = os.path.join(path, DATA_FILE)
        for leftover in (path + ".creating", path + ".deleting"):
            if os.path.isdir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise DelayStoreError(f"{path}: is not a folder (the delay store is a folder "
                                  f"holding {DATA_FILE})")
        try:
            if not os.path.lexists(path) or not os.listdir(path):
                cls._create(path, map_size)
        except (OSError, lmdb.Error) as e:
            raise DelayStoreError(f"{path}: cannot create the delay store: {e}") from e
        try:
            size = os.stat(data).st_size
        except FileNotFoundError:
            raise DelayStoreError(f"{data}: missing (the folder {path} exists but its LMDB "
                                  f"data file is gone)") from None
        except OSError as e:
            raise DelayStoreError(f"{data}: cannot stat: {e}") from e
        if size == 0:
            raise DelayStoreError(f"{data}: empty file (0 bytes): the data file was truncated")
        with _open_paths_lock:
            if path in _open_paths:
                raise DelayStoreError(f"{path}: already open in this process")
            _open_paths.add(path)
        env = None
        try:
            try:
                footprint.preallocate_lock(path)
            except OSError as e:
                raise DelayStoreError(f"{path}/{LOCK_FILE}: cannot allocate LMDB's lock file "
                                      f"(a full disk?): {e}") from e
            try:
                # Room to grow past what the file already holds (it is address space only).
                map_size = max(map_size, 2 * size)
                env = lmdb.open(path, map_size=map_size, subdir=True, max_dbs=MAX_DBS,
                                sync=True, metasync=True, readahead=False, create=False)
            except lmdb.Error as e:
                raise DelayStoreError(f"{data}: not a usable LMDB file: {e}") from e
            # Pages past the end of a truncated file would be SIGBUS on first touch.
            need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            if os.stat(data).st_size < need:
                raise DelayStoreError(f"{data}: truncated: {os.stat(data).st_size} bytes, "
                                      f"its last page needs {need}")
            try:
                # Handles live on only if their transaction commits; handles opened in a
                # read transaction are refused by later write transactions (py-lmdb 3).
                # A write transaction that changes nothing writes nothing at commit.
                txn = env.begin(write=True)
                try:
                    dbs = {name: env.open_db(name.encode(), txn=txn, create=False)
                           for name in DBS if name != "origins"}
                    fmt = txn.get(b"format", db=dbs["meta"])
                    if fmt in (FORMAT, FORMAT_1):  # a store of format 1 gets it now
                        dbs["origins"] = env.open_db(b"origins", txn=txn,
                                                     create=fmt == FORMAT_1)
                except BaseException:
                    txn.abort()
                    raise
                txn.commit()
            except lmdb.NotFoundError:
                raise DelayStoreError(f"{data}: not a delay store (a sub-database is "
                                      f"missing)") from None
            except lmdb.Error as e:
                raise DelayStoreError(f"{data}: corrupt LMDB file: {e}") from e
            if fmt not in (FORMAT, FORMAT_1):
                raise DelayStoreError(f"{data}: unknown format {fmt!r} (expected {FORMAT!r})")
            store = cls(path, env, dbs)
            if fmt == FORMAT_1:
                store._build_origins()
            store.recovered = store._recover(_now_ms() if now_ms is None else now_ms)
            return store
        except BaseException:
            if env is not None:
                env.close()
            with _open_paths_lock:
                _open_paths.discard(path)
            raise

    @staticmethod
    def _create(path: str, map_size: int) -> None:
        """Create the environment in a side folder and rename it into place, so a folder
        named `path` always holds a whole, initialized store. On failure nothing is left."""
        tmp = path + ".creating"
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        parent = os.path.dirname(path)
        make_dirs(parent)  # the rename below makes the store durable only in a durable parent
        footprint.check_free_space(parent)
        os.mkdir(tmp)
        try:
            footprint.preallocate_lock(tmp)
            env = lmdb.open(tmp, map_size=map_size, subdir=True, max_dbs=MAX_DBS, sync=True,
                            metasync=True, readahead=False)
            try:
                with env.begin(write=True) as txn:
                    for name in DBS[:-1]:
                        env.open_db(name.encode(), txn=txn)
                    txn.put(b"format", FORMAT, db=env.open_db(b"meta", txn=txn))
            finally:
                env.close()
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked by the caller)
        os.rename(tmp, path)
        fsync_dir(parent)

    def _build_origins(self) -> None:
        """Fill `origins` from every entry (a store made before it existed), in
        transactions of CHUNK entries; the last one sets the format. A crash part-way
        leaves format 1, and the next open builds again from the start."""
        self._write(lambda txn: txn.drop(self._origins, delete=False))
        for db in (self._waiting, self._taken):
            after = b""
            while True:
                def chunk(txn, db=db, after=after):
                    rows = _first_rows(txn.cursor(db=db), after, CHUNK)
                    for key, value in rows:
                        self._add_origin(txn, value, key[-8:])
                        self._tick()
                    return rows[-1][0] + b"\0" if len(rows) == CHUNK else None
                after = self._write(chunk)
                if after is None:
                    break
        self._write(lambda txn: txn.put(b"format", FORMAT, db=self._meta))

    def _recover(self, now_ms: int) -> int:
        moved = 0
        while True:
            n = self._write(lambda txn: self._recover_chunk(txn, now_ms))
            moved += n
            if n < CHUNK:
                return moved

    def _recover_chunk(self, txn, now_ms: int) -> int:
        rows = _first_rows(txn.cursor(db=self._taken), None, CHUNK)
        tick = self._tick
        for id8, value in rows:
            tick()
            due = tail_due_ms(value)
            # A bad tail is moved as it is (due now), for take_due to report and set aside.
            due = now_ms if due is None else min(due, now_ms)
            due_key = pack_due_key(due, U64.unpack(id8)[0])
            txn.delete(id8, db=self._taken)
            old = txn.get(id8, db=self._due_of)
            if old is not None:  # never both waiting and taken; but if so, keep one
                txn.delete(old, db=self._waiting)
            txn.put(due_key, with_due(value, due), db=self._waiting)
            txn.put(id8, due_key, db=self._due_of)
        return len(rows)

    # -- plumbing --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise DelayStoreError(f"{self.path}: delay store is closed")

    def _write(self, fn):
        """Run fn(txn) in one write transaction, committed (synced) before return.
        A full map is grown (doubled) and the transaction run again from the start."""
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    result = fn(txn)
                    self._trim_origins(txn)
                break
            except lmdb.MapFullError:
                size = self._env.info()["map_size"]
                self._map = None  # the map moves
                self._env.set_mapsize(size * 2)
                self.map_grows += 1
            except CorruptEntry:
                raise
            except lmdb.Error as e:
                raise DelayStoreError(f"{self.data_file}: write failed: {e}") from e
        self.commits += 1
        self._txns_since_release += 1
        if self._txns_since_release >= RELEASE_EVERY_TXNS:
            self._release_map()
        return result

    def _tick(self) -> None:
        """One entry handled (called in every loop over entries, inside transactions too)."""
        self._entries_since_release += 1
        if self._entries_since_release >= RELEASE_EVERY_ENTRIES:
            self._release_map()

    def _release_map(self) -> None:
        """Drop the map's pages from this process's page tables.

        LMDB reads through a read-only shared mmap of data.mdb; every page a lookup touched
        stays mapped, and is counted in VmRSS, until the kernel needs the memory. Over a
        million entries that is the whole file. MADV_DONTNEED on a shared file mapping only
        unmaps: the data stays in the page cache and the next access maps it again. Safe
        with readers open (they just fault the page in again)."""
        self._txns_since_release = 0
        self._entries_since_release = 0
        if not self._can_release:
            return
        try:
            # LMDB does not report its map's address: found in /proc/self/maps, kept while
            # the map keeps its size. Only set_mapsize (ours, under the lock, which forgets
            # it) moves the map; a stale address could by now be someone else's memory.
            size = self._env.info()["map_size"]
            if self._map is None or self._map[1] != size:
                maps = footprint.mappings_of(self.data_file)
                self._map = maps[0] if len(maps) == 1 and maps[0][1] == size else None
                if self._map is None:
                    return
            if not footprint.madvise_dontneed(*self._map):
                self._map = None
        except (OSError, AttributeError, lmdb.Error):
            self._can_release = False

    def _quarantine_and_raise(self, err: CorruptEntry):
        """Move the corrupt entry aside (kept in `corrupt`), then raise a clear error."""
        def move(txn):
            db = {"waiting": self._waiting, "taken": self._taken}.get(err.db)
            if db is None:
                return
            value = txn.pop(err.key, db=db)
            if value is not None:
                txn.put(err.db.encode() + b":" + err.key, value, db=self._corrupt)
                self._drop_origin(txn, value, err.key[-8:])
            if err.db == "waiting" and len(err.key) == 16:
                id8 = err.key[8:]
                if txn.get(id8, db=self._due_of) == err.key:
                    txn.delete(id8, db=self._due_of)
        self._write(move)
        raise DelayStoreCorruptError(self.data_file, err.db, err.key, err.reason) from None

    def _run(self, fn):
        with self._lock:
            self._check_open()
            try:
                return self._write(fn)
            except CorruptEntry as e:
                self._quarantine_and_raise(e)

    def _read(self, fn):
        with self._lock:
            self._check_open()
            try:
                with self._env.begin() as txn:
                    return fn(txn)
            except lmdb.Error as e:
                raise DelayStoreError(f"{self.data_file}: read failed: {e}") from e

    def _add_origin(self, txn, value: bytes, id8: bytes) -> None:
        """Index a stored value by its origin (log messages only: origin_offset >= 0; a
        value whose tail fails its checksum has no trusted origin and is not indexed)."""
        tail = checked_tail(value)
        if tail is not None and tail[1] >= 0:
            txn.put(pack_id(tail[1]) + id8, b"", db=self._origins)

    def _drop_origin(self, txn, value: bytes, id8: bytes) -> None:
        """Unindex a value being removed. Its tail is not checked: a key [any][id8] can only
        be this id's, so a wrong origin deletes nothing of another entry."""
        origin8 = value[-12:-4]  # the tail: [8 due_ms][8 origin_offset][4 crc32]
        if origin8[:1] < b"\x80":  # origin_offset >= 0 (-1: not from the log)
            txn.delete(origin8 + id8, db=self._origins)

    def _value_of(self, txn, id8: bytes) -> tuple[str, bytes, bytes] | None:
        """("waiting" | "taken", key, value) of the id's entry, None if the store does not
        hold it."""
        due_key = txn.get(id8, db=self._due_of)
        if due_key is not None:
            value = txn.get(due_key, db=self._waiting)
            if value is not None:
                return "waiting", due_key, value
        value = txn.get(id8, db=self._taken)
        return None if value is None else ("taken", id8, value)

    def _trim_origins(self, txn) -> None:
        """Drop index entries at the head of `origins` whose entry is gone or holds another
        origin (left by an entry set aside as corrupt), so the first key is always a held
        message. Run in every write transaction: O(log n) when nothing is stale."""
        cur = txn.cursor(db=self._origins)
        while cur.first():
            key = cur.key()
            found = self._value_of(txn, key[8:])
            if found is not None:
                tail = checked_tail(found[2])
                if tail is not None and pack_id(tail[1]) == key[:8]:
                    return
            cur.delete()

    def _unlink(self, txn, id8: bytes) -> bytes | None:
        """Remove id's entry from waiting or taken; return its value (None if absent)."""
        due_key = txn.pop(id8, db=self._due_of)
        if due_key is not None:
            value = txn.pop(due_key, db=self._waiting)
            if value is not None:
                return value
        return txn.pop(id8, db=self._taken)

    # -- the API ---------------------------------------------------------------------

    def put(self, items: list[DelayedMessage]) -> None:
        """Store `items` as waiting, one synced transaction. An id already waiting or
        taken is replaced."""
        if not items:
            return
        # ValueError here, before any write: nothing of the batch is stored.
        values = [encode_value(m) for m in items]
        # The last item of an id wins (replace semantics inside one batch too).
        by_id = {pack_id(m.msg_id): (m, v) for m, v in zip(items, values)}
        entries = sorted((pack_due_key(m.due_ms, m.msg_id), v) for m, v in by_id.values())
        del values
        ids = sorted(by_id)
        origins = sorted(pack_origin_key(m.origin_offset, m.msg_id)
                         for m, _ in by_id.values() if m.origin_offset >= 0)
        del by_id
        top = max(m.origin_offset for m in items)

        def fn(txn):
            old_top = txn.get(MAX_ORIGIN_KEY, db=self._meta)
            if old_top is None or top > I64.unpack(old_top)[0]:
                txn.put(MAX_ORIGIN_KEY, I64.pack(top), db=self._meta)
            waiting, taken, due_of = self._waiting, self._taken, self._due_of
            pop, put, tick = txn.pop, txn.put, self._tick
            # One sub-database at a time, each in key order: neighbouring keys share pages.
            olds = []
            for id8 in ids:
                old = pop(id8, db=due_of)
                if old is not None:
                    olds.append(old)
                old_value = pop(id8, db=taken)
                if old_value is not None:
                    self._drop_origin(txn, old_value, id8)
                tick()
            for old in sorted(olds):
                old_value = pop(old, db=waiting)
                if old_value is not None:
                    self._drop_origin(txn, old_value, old[8:])
            for due_key, value in entries:
                put(due_key, value, db=waiting)
                put(due_key[8:], due_key, db=due_of)
                tick()
            for key in origins:
                put(key, b"", db=self._origins)
                tick()
        self._run(fn)

    def take_due(self, now_ms: int, limit: int) -> list[DelayedMessage]:
        """Move up to `limit` waiting entries due at or before `now_ms` (in due order) to
        taken, and return them. One synced transaction."""
        if limit <= 0 or now_ms < 0:
            return []
        bound = pack_id(min(now_ms, MAX_DUE_MS))

        def fn(txn):
            out = []
            cur = txn.cursor(db=self._waiting)
            if not cur.first():
                return out
            put, delete, tick = txn.put, txn.delete, self._tick
            taken, due_of = self._taken, self._due_of
            key_of, value_of, remove = cur.key, cur.value, cur.delete
            while len(out) < limit:
                key = key_of()
                # An empty key: the cursor went past the last entry (LMDB keys are never empty).
                if not key or key[:8] > bound:
                    break
                value = value_of()
                m = decode_value(value, "waiting", key)
                check_waiting(key, m)
                out.append(m)
                id8 = key[8:]
                remove()  # this entry; the cursor moves on to the next
                delete(id8, db=due_of)
                put(id8, value, db=taken)
                tick()
            return out
        return self._run(fn)

    def finish(self, msg_ids: list[int]) -> int:
        """Delete these ids (taken or waiting), one synced transaction; how many existed."""
        if not msg_ids:
            return 0
        ids = [pack_id(i) for i in msg_ids]

        def fn(txn):
            n = 0
            pop, taken, unlink, tick = txn.pop, self._taken, self._unlink, self._tick
            drop_origin = self._drop_origin
            for id8 in ids:
                # taken first: what a FIN usually names (an id is never in both)
                value = pop(id8, db=taken)
                if value is None:
                    value = unlink(txn, id8)
                if value is not None:
                    drop_origin(txn, value, id8)
                    n += 1
                tick()
            return n
        return self._run(fn)

    def requeue(self, items: list[tuple[int, int, int]]) -> None:
        """(msg_id, new_due_ms, attempts): move taken (or waiting) entries back to waiting
        with the new due time and attempts, one synced transaction. Unknown ids are
        skipped (already finished)."""
        if not items:
            return
        for msg_id, due_ms, attempts in items:
            if not 0 <= due_ms <= MAX_DUE_MS:
                raise ValueError(f"due_ms out of range: {due_ms}")
            if not 0 <= attempts <= 0xFFFF:
                raise ValueError(f"attempts out of range (0..65535): {attempts}")
        self._requeue(items)

    def _requeue(self, items) -> int:
        def fn(txn):
            n = 0
            for msg_id, due_ms, attempts in items:
                id8 = pack_id(msg_id)
                due_key = txn.get(id8, db=self._due_of)
                value = None if due_key is None else txn.get(due_key, db=self._waiting)
                if value is not None:
                    db_name, key = "waiting", due_key
                else:
                    db_name, key = "taken", id8
                    value = txn.get(id8, db=self._taken)
                    if value is None:
                        continue  # finished already
                m = decode_value(value, db_name, key)
                (check_waiting if db_name == "waiting" else check_taken)(key, m)
                self._unlink(txn, id8)
                new_key = pack_due_key(due_ms, msg_id)
                txn.put(id8, new_key, db=self._due_of)
                txn.put(new_key, encode_value(m._replace(due_ms=due_ms, attempts=attempts)),
                        db=self._waiting)
                n += 1
                self._tick()
            return n
        return self._run(fn)

    def stats(self) -> tuple[int, int, int | None]:
        """(waiting count, taken count, oldest waiting due_ms or None), no scan."""
        def fn(txn):
            cur = txn.cursor(db=self._waiting)
            oldest = U64.unpack(cur.key()[:8])[0] if cur.first() else None
            return (txn.stat(self._waiting)["entries"], txn.stat(self._taken)["entries"],
                    oldest)
        return self._read(fn)

    def next_due_ms(self) -> int | None:
        """Due time of the first waiting entry, None if none waits."""
        def fn(txn):
            cur = txn.cursor(db=self._waiting)
            return U64.unpack(cur.key()[:8])[0] if cur.first() else None
        return self._read(fn)

    def requeue_all_now(self, now_ms: int) -> int:
        """Every waiting entry due later than `now_ms` becomes due at `now_ms`; returns how
        many moved. In transactions of CHUNK entries: after a crash part-way each entry
        is at its old or its new due time, never lost; calling again finishes the job."""
        now_ms = max(0, min(now_ms, MAX_DUE_MS))
        start = pack_id(now_ms + 1) if now_ms < MAX_DUE_MS else None
        if start is None:
            return 0

        def chunk(txn):
            rows = _first_rows(txn.cursor(db=self._waiting), start, CHUNK)
            now8 = pack_id(now_ms)
            for key, value in rows:
                id8 = key[8:]
                new_key = now8 + id8  # sorts before `start`: the next chunk never sees it
                txn.delete(key, db=self._waiting)
                # only the tail changes; the record is checked when taken
                txn.put(new_key, with_due(value, now_ms), db=self._waiting)
                txn.put(id8, new_key, db=self._due_of)
                self._tick()
            return len(rows)

        moved = 0
        while True:
            n = self._run(chunk)
            moved += n
            if n < CHUNK:
                return moved

    def empty(self) -> int:
        """Drop every entry (waiting and taken); returns how many there were."""
        def fn(txn):
            n = txn.stat(self._waiting)["entries"] + txn.stat(self._taken)["entries"]
            for db in (self._waiting, self._taken, self._due_of, self._origins):
                txn.drop(db, delete=False)
            self._release_map()  # the drop walked the trees' branch pages
            return n
        return self._run(fn)

    def max_origin_offset(self) -> int:
        """The highest origin_offset ever put (-1 if none): a log record past it was never
        moved here."""
        raw = self._read(lambda txn: txn.get(MAX_ORIGIN_KEY, db=self._meta))
        return -1 if raw is None else I64.unpack(raw)[0]

    def min_origin(self) -> tuple[int, int] | None:
        """The smallest (origin_offset, msg_id) of the log messages the store holds, waiting
        or taken (entries with origin_offset -1 do not count); None when it holds none.
        O(log n): the first key of `origins`."""
        def fn(txn):
            cur = txn.cursor(db=self._origins)
            return unpack_origin_key(cur.key()) if cur.first() else None
        return self._read(fn)

    def first_held(self, limit: int) -> list[tuple[int, int, int, int]]:
        """(origin_offset, msg_id, due_ms, attempts) of the first `limit` log messages the
        store holds (waiting or taken), in (origin_offset, msg_id) order; one read
        transaction, about 2.6 us an entry. An entry whose value fails its checks is left
        out (take_due sets it aside when it comes due)."""
        def fn(txn):
            out = []
            if limit <= 0:
                return out
            cur = txn.cursor(db=self._origins)
            if not cur.first():
                return out
            value_of, tick = self._value_of, self._tick
            for key in cur.iternext(values=False):
                found = value_of(txn, key[8:])
                fields = held_fields(found[2]) if found is not None else None
                tick()
                if fields is None or pack_id(fields[1]) != key[:8]:
                    continue
                origin, msg_id = unpack_origin_key(key)
                out.append((origin, msg_id, fields[0], fields[2]))
                if len(out) >= limit:
                    break
            return out
        return self._read(fn)

    def holding(self, msg_ids: list[int]) -> set[int]:
        """The ids among `msg_ids` the store holds (waiting or taken)."""
        def fn(txn):
            due_of, taken, get = self._due_of, self._taken, txn.get
            return {i for i in msg_ids
                    if get(pack_id(i), db=due_of) is not None
                    or get(pack_id(i), db=taken) is not None}
        return self._read(fn)

    # -- additions (not used by the channel's hot path) -----------------------------------

    def get(self, msg_id: int) -> tuple[str, DelayedMessage] | None:
        """("waiting" | "taken", message) for an id, None if the store does not hold it."""
        id8 = pack_id(msg_id)

        def fn(txn):
            found = self._value_of(txn, id8)
            if found is None:
                return None
            where, key, value = found
            return where, decode_value(value, where, key)
        try:
            return self._read(fn)
        except CorruptEntry as e:
            raise DelayStoreCorruptError(self.data_file, e.db, e.key, e.reason) from None

    def scan(self, batch: int = 1000) -> Iterator[tuple[str, DelayedMessage]]:
        """Every entry, ("waiting", m) in due order then ("taken", m) in id order, read in
        short read transactions of `batch` entries (a consistent view only per batch).
        Raises DelayStoreCorruptError on a corrupt value (without moving it)."""
        for name in ("waiting", "taken"):
            after = None
            while True:
                def fn(txn, name=name, after=after):
                    db = self._waiting if name == "waiting" else self._taken
                    cur = txn.cursor(db=db)
                    found = cur.set_range(after) if after is not None else cur.first()
                    out = []
                    while found and len(out) < batch:
                        key, value = cur.item()
                        if key != after:
                            out.append((key, value))
                        found = cur.next()
                        self._tick()
                    return out
                rows = self._read(fn)
                if not rows:
                    break
                for key, value in rows:
                    try:
                        m = decode_value(value, name, key)
                        (check_waiting if name == "waiting" else check_taken)(key, m)
                    except CorruptEntry as e:
                        raise DelayStoreCorruptError(self.data_file, e.db, e.key,
                                                     e.reason) from None
                    yield name, m
                after = rows[-1][0]

    def corrupt_count(self) -> int:
        """Entries set aside in the `corrupt` sub-database (see DelayStoreCorruptError)."""
        return self._read(lambda txn: txn.stat(self._corrupt)["entries"])

    def disk_bytes(self) -> int:
        try:
            return os.stat(self.data_file).st_size
        except OSError:
            return 0

    # -- lifecycle --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the environment (every commit is already synced). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._env.close()
            with _open_paths_lock:
                _open_paths.discard(self.path)

    def delete(self) -> None:
        """Close and remove the folder (renamed aside first, so a crash part-way never
        leaves a half-deleted store under the real name)."""
        self.close()
        if not os.path.isdir(self.path):
            return
        gone = self.path + ".deleting"
        if os.path.isdir(gone):
            shutil.rmtree(gone)
        os.rename(self.path, gone)
        parent = os.path.dirname(self.path)
        fsync_dir(parent)
        shutil.rmtree(gone)
        fsync_dir(parent)

    def __enter__(self) -> "DelayStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DelayStore({self.path!r}{', closed' if self._closed else ''})"
