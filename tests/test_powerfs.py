"""PowerFS (tests/powerfs.py) loses exactly what was not synced, through a real FUSE mount.

Each test writes through the mount with plain system calls, cuts the power (the FUSE
process drops what is unsynced, unmounts, mounts again on what survived) and reads back.
"""

import os

import pytest

from powerfs import PowerFS


@pytest.fixture
def fs(tmp_path):
    with PowerFS(str(tmp_path / "disk"), str(tmp_path / "mnt")) as fs:
        yield fs


def path(fs, *parts):
    return os.path.join(fs.mountpoint, *parts)


def write(p, data: bytes, sync: bool = False, mode=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    fd = os.open(p, mode, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def test_a_written_file_not_synced_loses_its_contents(fs):
    write(path(fs, "f"), b"old", sync=True)
    sync_dir(fs.mountpoint)
    write(path(fs, "f"), b"new and longer", mode=os.O_WRONLY)
    assert read(path(fs, "f")) == b"new and longer"
    fs.cut()
    assert read(path(fs, "f")) == b"old"


def test_a_synced_file_in_a_synced_folder_survives(fs):
    write(path(fs, "f"), b"x" * 10_000, sync=True)
    sync_dir(fs.mountpoint)
    fs.cut()
    assert read(path(fs, "f")) == b"x" * 10_000


def test_fdatasync_counts_as_a_sync(fs):
    fd = os.open(path(fs, "f"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"data")
    os.fdatasync(fd)
    os.close(fd)
    sync_dir(fs.mountpoint)
    fs.cut()
    assert read(path(fs, "f")) == b"data"


def test_a_new_file_synced_is_lost_while_its_folder_is_not_synced(fs):
    write(path(fs, "f"), b"data", sync=True)
    fs.cut()
    assert not os.path.exists(path(fs, "f"))


def test_a_synced_folder_entry_without_a_synced_file_is_empty(fs):
    write(path(fs, "f"), b"data")
    sync_dir(fs.mountpoint)
    fs.cut()
    assert read(path(fs, "f")) == b""


def test_a_rename_into_place_is_durable_only_after_the_folder_sync(fs):
    write(path(fs, "meta"), b"v1", sync=True)
    sync_dir(fs.mountpoint)
    write(path(fs, "meta.tmp"), b"v2", sync=True)
    os.replace(path(fs, "meta.tmp"), path(fs, "meta"))
    fs.cut()
    assert read(path(fs, "meta")) == b"v1"
    assert not os.path.exists(path(fs, "meta.tmp"))
    write(path(fs, "meta.tmp"), b"v2", sync=True)
    os.replace(path(fs, "meta.tmp"), path(fs, "meta"))
    sync_dir(fs.mountpoint)
    fs.cut()
    assert read(path(fs, "meta")) == b"v2"
    assert os.listdir(fs.mountpoint) == ["meta"]


def test_an_unlink_not_synced_comes_back(fs):
    write(path(fs, "f"), b"data", sync=True)
    sync_dir(fs.mountpoint)
    os.unlink(path(fs, "f"))
    fs.cut()
    assert read(path(fs, "f")) == b"data"
    os.unlink(path(fs, "f"))
    sync_dir(fs.mountpoint)
    fs.cut()
    assert not os.path.exists(path(fs, "f"))


def test_a_new_folder_needs_its_parent_synced(fs):
    os.makedirs(path(fs, "a", "b"))
    write(path(fs, "a", "b", "f"), b"data", sync=True)
    sync_dir(path(fs, "a", "b"))
    sync_dir(path(fs, "a"))  # a/b is in a, but a is not in the root yet
    fs.cut()
    assert os.listdir(fs.mountpoint) == []
    os.makedirs(path(fs, "a", "b"))
    write(path(fs, "a", "b", "f"), b"data", sync=True)
    for folder in (("a", "b"), ("a",), ()):
        sync_dir(path(fs, *folder))
    fs.cut()
    assert read(path(fs, "a", "b", "f")) == b"data"


def test_a_truncation_not_synced_is_undone_and_a_synced_one_reads_zeros_when_extended(fs):
    data = bytes(range(256)) * 40  # 10,240 bytes: three pages
    write(path(fs, "f"), data, sync=True)
    sync_dir(fs.mountpoint)
    os.truncate(path(fs, "f"), 100)
    fs.cut()
    assert read(path(fs, "f")) == data
    fd = os.open(path(fs, "f"), os.O_RDWR)
    os.ftruncate(fd, 100)
    os.fsync(fd)
    os.pwrite(fd, b"end", 9000)
    os.fsync(fd)
    os.close(fd)
    fs.cut()
    assert read(path(fs, "f")) == data[:100] + bytes(8900) + b"end"


def test_writes_in_the_middle_keep_the_rest_of_the_page(fs):
    write(path(fs, "f"), b"a" * 5000, sync=True)
    sync_dir(fs.mountpoint)
    fd = os.open(path(fs, "f"), os.O_RDWR)
    os.pwrite(fd, b"bb", 4095)
    os.fsync(fd)
    os.pwrite(fd, b"cc", 10)  # not synced
    os.close(fd)
    fs.cut()
    assert read(path(fs, "f")) == b"a" * 4095 + b"bb" + b"a" * 903


def test_a_clean_unmount_keeps_everything(fs):
    os.mkdir(path(fs, "d"))
    write(path(fs, "d", "f"), b"never synced")
    fs.unmount()
    fs.mount()
    assert read(path(fs, "d", "f")) == b"never synced"


def test_what_survived_a_cut_is_on_the_disk_before_the_cut_is_answered(fs):
    """The cut writes the survivors to the backing folder itself: a PowerFS process that
    then has to be killed (an unmount that did not finish in time, on a loaded machine)
    loses nothing the cut kept. Before, only the process's clean exit wrote them, and a
    killed process left the previous mount's state: a whole round of synced data gone."""
    write(path(fs, "f"), b"synced", sync=True)
    sync_dir(fs.mountpoint)
    fs.proc.stdin.write("cut\n")
    fs.proc.stdin.flush()
    assert fs.proc.stdout.readline().strip() == "cut"
    fs.proc.kill()  # no clean exit: what the process did not write is gone
    fs.unmount()
    fs.mount()
    assert read(path(fs, "f")) == b"synced"


def test_without_dir_sync_a_folder_sync_syncs_nothing(tmp_path):
    with PowerFS(str(tmp_path / "disk"), str(tmp_path / "mnt"), dir_sync=False) as fs:
        write(path(fs, "f"), b"data", sync=True)
        sync_dir(fs.mountpoint)
        fs.cut()
        assert not os.path.exists(path(fs, "f"))


def test_sqlite_commits_survive_a_cut(fs):
    """SQLite as nsqd's metadata uses it (sqlitedict, DELETE journal): a committed
    transaction survives when the journal's unlink is synced (synchronous=EXTRA)."""
    import sqlite3

    db = sqlite3.connect(path(fs, "m.sqlite"))
    db.execute("PRAGMA synchronous=EXTRA")
    db.execute("CREATE TABLE t (k TEXT)")
    db.commit()
    for i in range(3):
        db.execute("INSERT INTO t VALUES (?)", (f"row{i}",))
        db.commit()
    db.close()  # the handle goes; nothing is synced by closing
    fs.cut()
    db = sqlite3.connect(path(fs, "m.sqlite"))
    assert [r[0] for r in db.execute("SELECT k FROM t")] == ["row0", "row1", "row2"]
    db.close()
