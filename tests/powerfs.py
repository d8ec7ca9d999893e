"""PowerFS: a FUSE file system for tests that loses, on a power cut, what was not synced.

kill -9 leaves the kernel's page cache behind, so a kill test passes even when nothing was
ever synced. PowerFS holds the page cache itself, in this process, and a power cut drops it:
what is left is what a disk would hold after a power loss.

The model (strict POSIX, the worst a real file system may do):
- A file's synced state is its contents and size at its last `fsync` or `fdatasync` (the
  two are the same here). Writes and truncations after it are lost on a cut.
- A folder's synced state is its entries (name -> file or folder) at its last `fsync` of
  the folder itself. A new, renamed or unlinked entry is lost (the old one comes back) on a
  cut until its folder is synced; syncing a file never syncs its entry. A rename of a
  synced file over another name (the atomic metadata write) is durable only once the folder
  is synced: before that the old file is what a cut leaves.
- A rename between two folders is two entry changes, each durable with its own folder's
  sync (a cut between the two syncs may leave the file under both names, or neither).
- Nothing else is modeled: modes, owners and times are kept as they are; hard links,
  symbolic links and fallocate are not supported.
- With `dir_sync=False` (`--no-dir-sync`) a folder's `fsync` succeeds and syncs nothing:
  the mode the power-loss test uses to prove that it catches a missing folder sync. With
  `unsynced_suffix` (`--no-sync-suffix .jnl`) so does the `fsync` of a file whose name ends
  with it: the mode that proves it catches a node journal that is not synced.

The whole tree lives in this process's memory (tests hold a few MB). The backing folder is
the disk: read at mount; written with what survived at the cut itself (before `cut` is
answered), and with everything at a clean unmount (as a clean unmount flushes). So what a
cut kept never depends on how the process ends: one killed after a cut loses nothing (an
unmount never reaches the process while another mount namespace, made meanwhile by `ip
netns exec` or `unshare`, holds a copy of the mount; `unmount()` kills it after 10 s). A cut makes every later
operation fail with EIO until the unmount, so nothing the kernel still flushes (pages of a
shared memory map) comes back to life.

Run as a process (`python tests/powerfs.py BACKING MOUNTPOINT [--no-dir-sync] [--no-sync-suffix S]
[--fsname NAME]`): it mounts in the foreground (NAME, `powerfs` by default, is the mount's
source in /proc/mounts) and reads commands on stdin, one a line; `cut` drops everything
unsynced and answers `cut` on stdout. `PowerFS` below drives it: mount, `cut()` (cut,
unmount, mount again on what survived: a new mount also drops the kernel's caches) and
`unmount()`, which a test calls in its teardown whatever happened. jepsen's power-cut
nemesis uses it too (a mount per host, named `jep-nI`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

PAGE = 4096


class File:
    """A file: pages written since its last sync (`dirty`) over its synced pages.

    A page is PAGE bytes; None in `dirty` is a page dropped by a truncation (reads as zeros).
    """

    def __init__(self, mode: int, data: bytes = b""):
        self.mode = stat.S_IFREG | (mode & 0o7777)
        self.synced = {p // PAGE: bytearray(data[p:p + PAGE].ljust(PAGE, b"\0"))
                       for p in range(0, len(data), PAGE)}
        self.synced_size = self.size = len(data)
        self.dirty: dict[int, bytearray | None] = {}
        self.mtime = time.time_ns()

    def _page(self, p: int):
        return self.dirty[p] if p in self.dirty else self.synced.get(p)

    def _writable(self, p: int) -> bytearray:
        page = self.dirty.get(p)
        if page is None:
            old = self._page(p)
            page = self.dirty[p] = bytearray(old) if old is not None else bytearray(PAGE)
        return page

    def read(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        out = bytearray()
        while offset < end:
            p, start = divmod(offset, PAGE)
            stop = min(PAGE, end - p * PAGE)
            page = self._page(p)
            out += page[start:stop] if page is not None else bytes(stop - start)
            offset = (p + 1) * PAGE
        return bytes(out)

    def write(self, offset: int, data: bytes) -> None:
        view, done = memoryview(data), 0
        while done < len(data):
            p, start = divmod(offset + done, PAGE)
            n = min(PAGE - start, len(data) - done)
            self._writable(p)[start:start + n] = view[done:done + n]
            done += n
        self.size = max(self.size, offset + len(data))
        self.mtime = time.time_ns()

    def truncate(self, length: int) -> None:
        if length < self.size:
            first_gone = -(-length // PAGE)
            for p in {*self.synced, *self.dirty}:
                if p >= first_gone:
                    self.dirty[p] = None
            if length % PAGE:
                page = self._writable(length // PAGE)
                page[length % PAGE:] = bytes(PAGE - length % PAGE)
        self.size = length
        self.mtime = time.time_ns()

    def sync(self) -> None:
        for p, page in self.dirty.items():
            if page is None:
                self.synced.pop(p, None)
            else:
                self.synced[p] = page
        self.dirty = {}
        self.synced_size = self.size

    def cut(self) -> None:
        self.dirty = {}
        self.size = self.synced_size

    def contents(self) -> bytes:
        return self.read(0, self.size)


class Folder:
    """A folder: its entries now, and as they were at its last sync."""

    def __init__(self, mode: int):
        self.mode = stat.S_IFDIR | (mode & 0o7777)
        self.entries: dict[str, File | Folder] = {}
        self.synced: dict[str, File | Folder] = {}
        self.mtime = time.time_ns()

    def sync(self) -> None:
        self.synced = dict(self.entries)

    def cut(self) -> None:
        self.entries = dict(self.synced)


def load(path: str) -> Folder:
    """The tree in the backing folder `path`, everything synced."""
    folder = Folder(os.stat(path).st_mode)
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isdir(full):
            folder.entries[name] = load(full)
        else:
            with open(full, "rb") as f:
                folder.entries[name] = File(os.stat(full).st_mode, f.read())
    folder.sync()
    return folder


def save(root: Folder, path: str) -> None:
    """Write the live tree to the backing folder `path`, replacing what it held."""
    new, old = path + ".new", path + ".old"
    for leftover in (new, old):
        shutil.rmtree(leftover, ignore_errors=True)

    def write(folder: Folder, at: str) -> None:
        os.mkdir(at, folder.mode & 0o7777)
        for name, node in folder.entries.items():
            if isinstance(node, Folder):
                write(node, os.path.join(at, name))
            else:
                with open(os.path.join(at, name), "wb") as f:
                    f.write(node.contents())

    write(root, new)
    os.rename(path, old)
    os.rename(new, path)
    shutil.rmtree(old)


def fuse_operations(backing: str, dir_sync: bool = True, unsynced_suffix: str = ""):
    """The FUSE operations of a PowerFS over `backing` (mfusepy's high-level, path API)."""
    import mfusepy as fuse

    def failing(code: int):
        return fuse.FuseOSError(code)

    class Ops(fuse.Operations):
        use_ns = True

        def __init__(self):
            self.root = load(backing)
            self.mutex = threading.Lock()  # the stdin thread cuts while FUSE calls come in
            self.handles: dict[int, File | Folder] = {}
            self.next_handle = 1
            self.is_cut = False

        # -- the model ------------------------------------------------------

        def cut(self) -> None:
            """Everything unsynced is gone, and what survived is on the disk (the backing
            folder); from now on every call fails (EIO)."""
            with self.mutex:
                seen, todo = set(), [self.root]
                while todo:
                    node = todo.pop()
                    if id(node) in seen:
                        continue
                    seen.add(id(node))
                    if isinstance(node, Folder):
                        todo.extend(node.synced.values())
                    node.cut()
                save(self.root, backing)
                self.is_cut = True

        def _node(self, path: str | None, fh: int | None = None):
            if fh:
                return self.handles[fh]
            node = self.root
            for part in filter(None, path.split("/")):
                if not isinstance(node, Folder) or part not in node.entries:
                    raise failing(errno.ENOENT)
                node = node.entries[part]
            return node

        def _parent(self, path: str) -> tuple[Folder, str]:
            head, name = path.rsplit("/", 1)
            parent = self._node(head)
            if not isinstance(parent, Folder):
                raise failing(errno.ENOTDIR)
            return parent, name

        def _handle(self, node) -> int:
            self.next_handle += 1
            self.handles[self.next_handle] = node
            return self.next_handle

        # -- FUSE calls (each under the lock, see `locked` below) ---------------

        def getattr(self, path, fh=None):
            node = self._node(path, fh)
            size = node.size if isinstance(node, File) else PAGE
            nlink = 2 + sum(isinstance(n, Folder) for n in node.entries.values()) \
                if isinstance(node, Folder) else 1
            return {"st_mode": node.mode, "st_nlink": nlink, "st_size": size,
                    "st_blocks": -(-size // 512), "st_blksize": PAGE,
                    "st_uid": os.getuid(), "st_gid": os.getgid(),
                    "st_mtime": node.mtime, "st_ctime": node.mtime, "st_atime": node.mtime}

        def readdir(self, path, fh):
            return [".", "..", *self._node(path).entries]

        def mkdir(self, path, mode):
            parent, name = self._parent(path)
            if name in parent.entries:
                raise failing(errno.EEXIST)
            parent.entries[name] = Folder(mode)

        def rmdir(self, path):
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if not isinstance(node, Folder):
                raise failing(errno.ENOTDIR if node else errno.ENOENT)
            if node.entries:
                raise failing(errno.ENOTEMPTY)
            del parent.entries[name]

        def create(self, path, mode, fi=None):
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                node = parent.entries[name] = File(mode)
            return self._handle(node)

        def open(self, path, flags):
            return self._handle(self._node(path))

        def opendir(self, path):
            return self._handle(self._node(path))

        def release(self, path, fh):
            self.handles.pop(fh, None)

        def releasedir(self, path, fh):
            self.handles.pop(fh, None)

        def read(self, path, size, offset, fh):
            return self._node(path, fh).read(offset, size)

        def write(self, path, data, offset, fh):
            self._node(path, fh).write(offset, data)
            return len(data)

        def truncate(self, path, length, fh=None):
            self._node(path, fh).truncate(length)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            if not (unsynced_suffix and path.endswith(unsynced_suffix)):
                self._node(path, fh).sync()

        def fsyncdir(self, path, datasync, fh):
            if dir_sync:
                self._node(path, fh).sync()

        def unlink(self, path):
            parent, name = self._parent(path)
            if not isinstance(parent.entries.get(name), File):
                raise failing(errno.EISDIR if name in parent.entries else errno.ENOENT)
            del parent.entries[name]

        def rename(self, old, new):
            src, src_name = self._parent(old)
            dst, dst_name = self._parent(new)
            node = src.entries.get(src_name)
            if node is None:
                raise failing(errno.ENOENT)
            there = dst.entries.get(dst_name)
            if isinstance(there, Folder) and there.entries:
                raise failing(errno.ENOTEMPTY)
            del src.entries[src_name]
            dst.entries[dst_name] = node

        def chmod(self, path, mode):
            node = self._node(path)
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)

        def chown(self, path, uid, gid):
            return 0

        def utimens(self, path, times=None):
            node = self._node(path)
            node.mtime = times[1] if times else time.time_ns()

        def access(self, path, amode):
            self._node(path)

        def statfs(self, path):
            return {"f_bsize": PAGE, "f_frsize": PAGE, "f_blocks": 1 << 20, "f_bfree": 1 << 19,
                    "f_bavail": 1 << 19, "f_files": 1 << 20, "f_ffree": 1 << 19,
                    "f_namemax": 255}

        def destroy(self, path):
            with self.mutex:
                if not self.is_cut:  # else the cut saved what survived
                    save(self.root, backing)

    def locked(method):
        def call(self, *args):
            with self.mutex:
                if self.is_cut:
                    raise failing(errno.EIO)
                return method(self, *args)
        call.__name__ = method.__name__
        return call

    for name in ("getattr", "readdir", "mkdir", "rmdir", "create", "open", "opendir",
                 "release", "releasedir", "read", "write", "truncate", "flush", "fsync",
                 "fsyncdir", "unlink", "rename", "chmod", "chown", "utimens", "access",
                 "statfs"):
        setattr(Ops, name, locked(getattr(Ops, name)))
    return Ops()


def main(argv: list[str]) -> None:
    import mfusepy as fuse

    backing, mountpoint = argv[0], argv[1]
    fsname = argv[argv.index("--fsname") + 1] if "--fsname" in argv else "powerfs"
    suffix = argv[argv.index("--no-sync-suffix") + 1] if "--no-sync-suffix" in argv else ""
    ops = fuse_operations(backing, dir_sync="--no-dir-sync" not in argv, unsynced_suffix=suffix)

    def commands():
        for line in sys.stdin:
            if line.strip() == "cut":
                ops.cut()
                print("cut", flush=True)

    threading.Thread(target=commands, daemon=True).start()
    # One thread: calls are serialized anyway. hard_remove: an unlinked open file is
    # dropped at once, not renamed to .fuse_hidden (it lives on through its handle).
    fuse.FUSE(ops, mountpoint, foreground=True, nothreads=True, hard_remove=True,
              fsname=fsname)


class PowerFS:
    """A PowerFS process mounted at `mountpoint` over the backing folder `backing`; `fsname`
    is the mount's source, `env` more environment for the process."""

    def __init__(self, backing: str, mountpoint: str, dir_sync: bool = True,
                 fsname: str = "powerfs", env: dict[str, str] | None = None,
                 unsynced_suffix: str = ""):
        self.backing = backing
        self.mountpoint = mountpoint
        self.dir_sync = dir_sync
        self.unsynced_suffix = unsynced_suffix
        self.fsname = fsname
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = backing.rstrip("/") + ".log"
        self.cuts = 0

    def mount(self, timeout: float = 10) -> "PowerFS":
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mountpoint, exist_ok=True)
        args = [sys.executable, os.path.abspath(__file__), self.backing, self.mountpoint]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args + ([] if self.dir_sync else ["--no-dir-sync"])
                + (["--no-sync-suffix", self.unsynced_suffix] if self.unsynced_suffix else [])
                + ["--fsname", self.fsname],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "FUSE_LIBRARY_NAME": "fuse3", **self.env})
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):  # mounted and answering
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"powerfs did not mount: {self.log()}")
            time.sleep(0.02)
        return self

    def cut(self) -> None:
        """Power cut: drop everything unsynced, then mount again on what survived. Stop
        every process using the mount first (kill -9)."""
        self.proc.stdin.write("cut\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "cut", self.log()
        self.cuts += 1
        # what survived is in the backing folder already: a process that does not exit at
        # once (a copy of the mount in another mount namespace keeps it alive) loses nothing
        self.unmount(timeout=1)
        self.mount()

    def unmount(self, timeout: float = 10) -> None:
        """Unmount (lazily if busy) and wait for the process: safe to call at any time.
        A process that does not exit in time is killed (noted in its log): after a cut that
        loses nothing, the cut saved what survived; without one, what was written since the
        mount is lost."""
        if self.mounted():
            if subprocess.run(["fusermount3", "-u", self.mountpoint],
                              capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", self.mountpoint], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with open(self.log_path, "a") as log:
                    print(f"powerfs killed: it did not exit within {timeout} s of the unmount",
                          file=log)
                self.proc.kill()
                self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def mounted(self) -> bool:
        """In the mount table (also when its process died: then the mount no longer answers)."""
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == os.path.abspath(self.mountpoint) for line in f)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def __enter__(self) -> "PowerFS":
        return self.mount()

    def __exit__(self, *exc) -> None:
        self.unmount()


if __name__ == "__main__":
    main(sys.argv[1:])
