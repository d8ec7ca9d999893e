"""Durable file-system steps: atomic metadata files and folders made durably.

An atomic write: a reader sees the old content or the new, never a mix. Write to a
temporary file in the same folder, fsync it, rename it over the target, fsync the folder.

A folder is durable once its entry in its parent is synced: `make_dirs` syncs the parent
of every folder it creates, so a power cut cannot lose a folder that was there when it
returned (what is put in it later needs a sync of the folder itself).

Blocking: async callers run these off the event loop.
"""

from __future__ import annotations

import json
import os

from commitlog.log import fsync_dir  # noqa: F401  (one home for it, re-exported here)

READ_CHUNK = 64 * 1024


def write_atomic(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(folder)


def make_dirs(path: str) -> None:
    """Create folder `path` and its missing parents, each synced into its parent. If `path`
    already exists its parent is synced too: a crash may have left it made but not synced."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        make_dirs(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    fsync_dir(parent)


def write_json_atomic(path: str, value) -> None:
    write_atomic(path, json.dumps(value, sort_keys=True).encode())


def read_json(path: str, default=None):
    """The JSON in `path`, or `default` if the file does not exist. Through `os` calls: a
    small file takes four system calls, where `open` and `read` make nine (strace), and a
    node's start reads two such files a partition."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return default
    try:
        parts = []
        while part := os.read(fd, READ_CHUNK):
            parts.append(part)
    finally:
        os.close(fd)
    return json.loads(b"".join(parts))
