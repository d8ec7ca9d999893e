"""Hooks on the `os` calls a partition's files go through, for the files a test picks.

The partition's log is compiled (scripts/compile.py): a method patched on its classes is
not what their compiled callers call. Their calls of `os.pwrite`, `os.pwritev`,
`os.pread`, `os.fdatasync` and `os.unlink` look the function up on the `os` module at
each call, in both builds, so a test hooks them here instead."""

from __future__ import annotations

import os
from collections.abc import Callable


def fd_path(fd: int) -> str:
    """The path of the file open at `fd` in this process."""
    return os.readlink(f"/proc/self/fd/{fd}")


def hook(monkeypatch, name: str, picks: Callable[[str], bool], before: Callable) -> None:
    """Have `os.<name>` call `before(*args)` first when its file is one `picks(path)`
    accepts (its first argument is a descriptor, or a path for `unlink`); `before` may
    raise, as the call would. Undone with the test's monkeypatch."""
    real = getattr(os, name)

    def hooked(target, *args):
        path = target if isinstance(target, str) else fd_path(target)
        if picks(path):
            before(target, *args)
        return real(target, *args)

    monkeypatch.setattr(os, name, hooked)


def under(*folders) -> Callable[[str], bool]:
    """`picks` for the files inside any of `folders`."""
    roots = tuple(os.path.join(os.path.realpath(str(f)), "") for f in folders)
    return lambda path: os.path.realpath(path).startswith(roots)
