"""The footprint of a delay store's LMDB files in this process and on disk: a new store
is made only with room on its file system, its lock file gets real blocks before LMDB maps
it (a page the disk cannot back would be SIGBUS, fatal to the process), and the pages of
its read-only map can be dropped from this process's page tables (RSS) without losing
anything (delayqueue/store.py's _release_map)."""

from __future__ import annotations

import ctypes
import os

LOCK_FILE = "lock.mdb"
# LMDB sizes its lock file (126 reader slots: 8 KiB) with ftruncate and writes it through a
# shared map: a page the disk cannot back is SIGBUS, which kills the process. The store
# allocates these bytes itself first (posix_fallocate), so a full disk is an error instead.
LOCK_BYTES = 8192
# A new store is not made with less free space than this on its file system: it would fail
# at its first writes anyway, and the error then names the cause.
MIN_FREE_BYTES = 1 << 20


def preallocate_lock(folder: str) -> None:
    """Give LMDB's lock file (created if missing) real blocks before LMDB maps it (see
    LOCK_BYTES). Raises OSError (ENOSPC on a full disk) instead of a later SIGBUS."""
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(LOCK_BYTES, os.fstat(fd).st_size))
    finally:
        os.close(fd)


def check_free_space(folder: str) -> None:
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise OSError(28, f"only {free} bytes free on the file system of {folder}, a new "
                          f"delay store needs at least {MIN_FREE_BYTES}")


_libc = None


def mappings_of(file_path: str) -> list[tuple[int, int]]:
    """(start, length) of this process's read-only shared mappings of `file_path`
    (Linux /proc/self/maps; [] elsewhere). Only such mappings are ever given to madvise:
    on a private or anonymous mapping MADV_DONTNEED would zero memory."""
    target = os.path.realpath(file_path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5].rstrip("\n") != target:
                    continue
                perms = fields[1]
                if "s" not in perms or "w" in perms:
                    continue
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16) - int(lo, 16)))
    except OSError:
        pass
    return out


def madvise_dontneed(addr: int, length: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _libc.madvise(addr, length, 4) == 0  # MADV_DONTNEED (Linux)
