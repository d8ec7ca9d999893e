"""A fault stays inside its partition (issue 8, items 5 and 7): real nsqd processes on a
small tmpfs that the test fills (a real ENOSPC, not a mock), and partition folders
corrupted between runs. Each test names the bug it caught before the fix.

Needs root (mount). The node's log is written outside the tmpfs, so a full disk never
takes the log with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import types
import urllib.error
import urllib.request

import pytest

from nodes import take
from nsqclient.conn import Connection, NSQError
from servers import NsqdProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


# ---- a small disk ---------------------------------------------------------------


@pytest.fixture
def disk(tmp_path):
    """A mounted 8 MiB tmpfs (unmounted in teardown, after every node on it is killed)."""
    path = tmp_path / "disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], check=True)
    procs: list[NsqdProcess] = []
    yield path, procs
    for proc in procs:
        proc.kill()
    subprocess.run(["umount", "-l", str(path)], check=False)


def start_on(disk, tmp_path, *flags) -> NsqdProcess:
    path, procs = disk
    proc = NsqdProcess(str(path / "nsqd"), *flags)
    proc.log_path = str(tmp_path / f"nsqd-{len(procs)}.log")  # outside the full disk
    procs.append(proc)
    return proc.start()


def fill(disk) -> None:
    """Take every free block of the tmpfs."""
    path, _ = disk
    with open(path / "fill", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with open(path / "fill-small", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def free(disk) -> None:
    path, _ = disk
    for name in ("fill", "fill-small"):
        os.unlink(path / name)


def http(proc, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{proc.http_address}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stats(proc) -> dict:
    return json.loads(http(proc, "GET", "/stats?format=json")[1])


def topic_stats(proc, name: str) -> dict:
    return next(t for t in stats(proc)["topics"] if t["topic_name"] == name)


async def connect(proc) -> Connection:
    return await Connection("127.0.0.1", proc.tcp_port).connect()


async def refused(coro) -> str:
    """The error frame a command got (NSQError's text)."""
    with pytest.raises(NSQError) as info:
        await asyncio.wait_for(coro, 10)
    return str(info.value)


def log_lines(proc) -> list[str]:
    with open(proc.log_path, errors="replace") as f:
        return f.read().splitlines()


async def until_true(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


# ---- a full disk ------------------------------------------------------------------


async def test_a_new_channel_on_a_full_disk_is_an_error_not_a_sigbus(disk, tmp_path):
    """Before: SUB to a new channel on a full disk killed nsqd with SIGBUS (-7) in
    lmdb.open of the channel's delay store (LMDB's lock file is written through a map the
    disk cannot back). Now the store is made only when a message needs one, its lock file
    is preallocated, and the node lives on and serves."""
    proc = start_on(disk, tmp_path)
    pub = await connect(proc)
    await pub.pub("t", b"before")
    old = await connect(proc)
    await old.sub("t", "old")
    await old.close()
    fill(disk)
    sub = await connect(proc)
    try:
        await asyncio.wait_for(sub.sub("t", "new"), 10)
    except NSQError as e:  # or it succeeds without a store: both are fine
        assert str(e).startswith("E_SUB_FAILED"), e
    status, body = http(proc, "POST", "/channel/create?topic=t&channel=made")
    assert (status, body) in ((200, b""), (503, b'{"message":"CHANNEL_CREATE_FAILED"}'))
    await asyncio.sleep(0.5)
    assert proc.proc.poll() is None, f"nsqd died: {proc.proc.returncode}"
    c = await connect(proc)
    await c.sub("t", "old", rdy=1)
    (m,) = await take(c)
    assert m.body == b"before"
    m.fin()
    # A message that needs a store the full disk cannot hold waits in memory, and comes
    # back when due: the "store given up" path, no crash.
    await pub.pub("t", b"later")
    (m,) = await take(c)
    m.req(3_600_000)  # beyond --delay-threshold: a disk delay store would take it

    def old_channel():
        return next(x for x in topic_stats(proc, "t")["channels"] if x["channel_name"] == "old")

    await until_true(lambda: old_channel()["partitions"][0]["delay_error"] is not None)
    ch = old_channel()
    assert ch["deferred_count"] == 1
    assert "delay store" in ch["partitions"][0]["delay_error"]
    assert proc.proc.poll() is None
    assert proc.stop() in (0, 1)


async def test_publishing_on_a_full_disk_is_refused_then_works_once_space_is_back(
        disk, tmp_path):
    """Before: a PUB to a new topic answered `E_INVALID internal error: [Errno 28]` (and a
    traceback), /topic/create 500. Now: E_PUB_FAILED and 503, nothing half-made is left,
    and once space is back the same commands work, without a restart. A full disk on an
    existing topic (DiskFullError) leaves its log usable: every acknowledged message is
    delivered, nothing else."""
    proc = start_on(disk, tmp_path)
    pub = await connect(proc)
    await pub.pub("t", b"0")
    acked = [b"0"]
    assert http(proc, "POST", "/channel/create?topic=t&channel=admin")[0] == 200
    big = b"x" * 200_000
    error = None
    for i in range(1, 100):  # 8 MiB fills within ~40 of these
        body = b"%d" % i + big
        try:
            await asyncio.wait_for(pub.pub("t", body), 10)
        except NSQError as e:
            error = str(e)
            break
        acked.append(body)
    assert error is not None and error.startswith("E_PUB_FAILED PUB failed no space left"), error
    fill(disk)  # every last block
    assert (await refused((await connect(proc)).pub("new", b"x"))).startswith(
        "E_PUB_FAILED PUB failed topic new could not be created")
    assert http(proc, "POST", "/topic/create?topic=made") == (
        503, b'{"message":"TOPIC_CREATE_FAILED"}')
    assert http(proc, "POST", "/pub?topic=viahttp", b"x") == (503, b'{"message":"PUB_FAILED"}')
    names = [t["topic_name"] for t in stats(proc)["topics"]]
    assert names == ["t"], "nothing half-made stays"
    status, body = http(proc, "GET", "/ping")
    assert status == 500 and body.startswith(b"NOK - disk full: "), body
    assert stats(proc)["data_free_bytes"] < 1 << 20
    assert b"nsqd_up 0" in http(proc, "GET", "/metrics")[1]
    assert not os.path.exists(os.path.join(proc.data_path, "new.topic"))
    # admin actions whose state cannot be stored: 507 DISK_FULL, never a 500
    answers = {path: http(proc, "POST", path, body) for path, body in (
        ("/channel/pause?topic=t&channel=admin", b""),
        ("/channel/unpause?topic=t&channel=admin", b""),
        ("/channel/setoffset?topic=t&channel=admin", b"count:0"),
        ("/channel/empty?topic=t&channel=admin", b""))}
    assert all(a[0] == 200 or a == (507, b'{"message":"DISK_FULL"}')
               for a in answers.values()), answers
    assert any(a[0] == 507 for a in answers.values()), answers
    assert "Traceback" not in "\n".join(log_lines(proc))

    free(disk)  # a little: the acknowledged messages still fill most of it
    again = await connect(proc)
    await again.pub("t", b"after")
    acked.append(b"after")
    await again.pub("new", b"x")
    assert http(proc, "POST", "/topic/create?topic=made") == (200, b"")
    for path in ("/channel/unpause?topic=t&channel=admin",
                 "/channel/setoffset?topic=t&channel=admin"):  # the actions work again
        assert http(proc, "POST", path, b"count:0")[0] == 200, path
    c = await connect(proc)
    await c.sub("t", "admin", rdy=100)
    got = [m.body for m in await take(c, len(acked))]
    assert got == acked
    assert proc.stop() == 0


async def test_a_disk_that_hangs_gets_every_publish_answered_within_the_commit_timeout(
        tmp_path):
    """The node's data path is a FUSE file system (tests/powerfs.py) whose process is
    SIGSTOPped: every write and sync to it hangs, as on a stalled network disk. A PUB is
    answered E_FAILED_ON_NOT_WRITABLE within the commit timeout (1 s here), /stats still
    answers and /ping says the data path does not answer, and once the disk answers again
    publishing goes on with every acknowledged message there. (Before: the PUB waited as
    long as the disk did, and /stats or /ping froze the whole event loop in a statvfs.)"""
    from powerfs import PowerFS

    fs = PowerFS(str(tmp_path / "backing"), str(tmp_path / "mnt")).mount()
    proc = NsqdProcess(str(tmp_path / "mnt" / "data"), "--commit-timeout", "1s")
    proc.log_path = str(tmp_path / "nsqd.log")  # outside the hanging disk
    try:
        proc.start()
        pub = await connect(proc)
        await pub.pub("t", b"before")
        os.kill(fs.proc.pid, signal.SIGSTOP)
        try:
            t0 = asyncio.get_running_loop().time()
            error = await refused(pub.pub("t", b"during"))
            waited = asyncio.get_running_loop().time() - t0
            assert error.startswith("E_FAILED_ON_NOT_WRITABLE") and "1s" in error, error
            assert 0.9 < waited < 4, waited
            status, body = await asyncio.to_thread(http, proc, "GET", "/stats?format=json")
            assert status == 200, body  # the node still answers, and says why it is unwell
            status, body = await asyncio.to_thread(http, proc, "GET", "/ping")
            assert status == 500 and b"has not answered for" in body, body
        finally:
            os.kill(fs.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(pub.pub("t", b"after"), 10)
        assert http(proc, "GET", "/ping") == (200, b"OK")
        c = await connect(proc)
        await c.sub("t", "check", rdy=10)
        got = [m.body for m in await take(c, 2)]
        # `during` was being written when it was answered: it may still be there, once
        assert got in ([b"before", b"after"], [b"before", b"during"]), got
        assert proc.stop() == 0
    finally:
        proc.kill()
        fs.unmount()


async def test_sigterm_on_a_full_disk_closes_what_it_can_and_says_so(disk, tmp_path):
    """Before: SIGTERM on a full disk exited 1 from a traceback in the first checkpoint,
    with no topic closed. Now every step is tried: the logs are closed, one
    `stopped_with_errors` line names what failed, the exit code is 1 (something could not
    be persisted), and the node starts again with every acknowledged message."""
    proc = start_on(disk, tmp_path)
    pub = await connect(proc)
    for i in range(5):
        await pub.pub("t", b"%d" % i)
    c = await connect(proc)
    await c.sub("t", "c", rdy=5)
    for m in await take(c, 2):
        m.fin()  # the cursor moves: the checkpoint has something to write
    fill(disk)
    await asyncio.sleep(1.5)
    assert proc.stop() == 1
    lines = log_lines(proc)
    assert "stopped_with_errors" in lines[-1] and "disk is full" in lines[-1], lines[-5:]
    assert not any("partition_close_failed" in line for line in lines)
    # at most the first checkpoint failure's traceback (if one ran before the SIGTERM)
    assert sum(line.startswith("Traceback") for line in lines) <= 1
    free(disk)
    proc.start()
    c = await connect(proc)
    await c.sub("t", "c", rdy=5)
    got = [m.body for m in await take(c, 3)]
    while got[-1] != b"4":  # the cursor may lag (its last save failed): duplicates, no loss
        got.append((await take(c))[0].body)
    assert got[-3:] == [b"2", b"3", b"4"]
    assert proc.stop() == 0


async def test_a_failing_checkpoint_logs_a_line_not_a_flood_and_ping_tells(disk, tmp_path):
    """Before: the failing checkpoint logged ~80 lines of traceback a second (sqlitedict's
    own error log plus ours) and /ping said OK. Now: the first failure with its
    traceback, then at most one line a minute; /ping answers 500 `NOK - disk full: ...;
    checkpoint failing: ...` while it fails and OK once it works again."""
    proc = start_on(disk, tmp_path)
    pub = await connect(proc)
    await pub.pub("t", b"x")
    c = await connect(proc)
    await c.sub("t", "c", rdy=1)
    fill(disk)
    await until_true(lambda: any("checkpoint_failed" in line for line in log_lines(proc)))
    before = len(log_lines(proc))
    await asyncio.sleep(3)
    assert len(log_lines(proc)) - before <= 2, log_lines(proc)[before:]
    status, body = http(proc, "GET", "/ping")
    assert status == 500 and body.startswith(b"NOK - disk full: "), body
    assert b"; checkpoint failing: database or disk is full" in body
    assert "checkpoint failing" in stats(proc)["health"]
    assert b"nsqd_up 0" in http(proc, "GET", "/metrics")[1]
    free(disk)
    await until_true(lambda: http(proc, "GET", "/ping") == (200, b"OK"))
    assert any("checkpoint_recovered" in line for line in log_lines(proc))


# ---- partitions that do not open ----------------------------------------------------


async def stopped_node_with_two_topics(tmp_path) -> NsqdProcess:
    """A stopped node with topics `good` and `bad`, one message each, and channel c on each."""
    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        pub = await connect(proc)
        for name in ("good", "bad"):
            c = await connect(proc)
            await c.sub(name, "c")
            await c.close()
            await pub.pub(name, name.encode())
        assert proc.stop() == 0
    except BaseException:
        proc.kill()
        raise
    return proc


async def assert_bad_is_reported_and_good_serves(proc, reason: str) -> None:
    status, body = http(proc, "GET", "/ping")
    assert status == 500 and body.startswith(b"NOK - topic bad partition 0: open failed"), body
    assert reason.encode() in body
    bad = topic_stats(proc, "bad")
    assert bad["partitions"][0]["partition"] == 0
    assert reason in bad["partitions"][0]["error"]
    metrics = http(proc, "GET", "/metrics")[1].decode()
    assert 'nsqd_partition_up{topic="bad",partition="0"} 0' in metrics
    assert 'nsqd_partition_up{topic="good",partition="0"} 1' in metrics
    assert (await refused((await connect(proc)).pub("bad", b"x"))).startswith(
        "E_PUB_FAILED PUB failed topic bad partition 0 does not serve: open failed")
    assert http(proc, "POST", "/pub?topic=bad", b"x") == (503, b'{"message":"PUB_FAILED"}')
    assert (await refused((await connect(proc)).sub("bad", "c"))).startswith(
        "E_SUB_FAILED SUB failed topic bad partition 0 does not serve")
    assert http(proc, "POST", "/channel/create?topic=bad&channel=d") == (
        503, b'{"message":"CHANNEL_CREATE_FAILED"}')
    c = await connect(proc)
    await c.sub("good", "c", rdy=1)
    (m,) = await take(c)
    assert m.body == b"good"
    await (await connect(proc)).pub("good", b"more")


@pytest.mark.parametrize("damage", ["folder", "segment"])
async def test_a_partition_that_does_not_open_stays_inside_itself(tmp_path, damage):
    """Before: nsqd exited at start (Topic.open raised), every topic down. Now the node
    starts, reports the partition (log, /stats, /metrics, /ping 500), refuses its
    publishes (E_PUB_FAILED, 503) and SUBs (E_SUB_FAILED), and every other topic serves.
    `folder`: the partition's folder is gone (no new empty log is made in its place);
    `segment`: its newest segment is gone (MissingSegmentError)."""
    proc = await stopped_node_with_two_topics(tmp_path)
    part = os.path.join(proc.data_path, "bad.topic", "0")
    if damage == "folder":
        shutil.rmtree(part)
        reason = "folder is missing"
    else:
        for name in os.listdir(os.path.join(part, "data")):
            if name.endswith(".dat"):
                os.unlink(os.path.join(part, "data", name))
        reason = "MissingSegmentError"
    try:
        proc.start()
        await assert_bad_is_reported_and_good_serves(proc, reason)
        assert any("partition_open_failed" in line for line in log_lines(proc))
        if damage == "folder":
            assert not os.path.exists(part)
    finally:
        proc.kill()


async def test_reopen_brings_a_partition_back_without_a_restart(tmp_path):
    """POST /topic/reopen opens a failed partition again once its folder is back: its
    channel keeps its cursor (the stored metadata kept the partition while it was down),
    and /ping is OK again."""
    proc = await stopped_node_with_two_topics(tmp_path)
    part = os.path.join(proc.data_path, "bad.topic", "0")
    os.rename(part, part + ".away")
    try:
        proc.start()
        await assert_bad_is_reported_and_good_serves(proc, "folder is missing")
        await asyncio.sleep(1.5)  # checkpoints run while it is down
        assert http(proc, "POST", "/topic/reopen?topic=bad") == (503,
                                                                  b'{"message":"REOPEN_FAILED"}')
        assert http(proc, "POST", "/topic/reopen?topic=nope") == (
            404, b'{"message":"TOPIC_NOT_FOUND"}')
        assert http(proc, "POST", "/topic/reopen?topic=bad&partition=7") == (
            400, b'{"message":"BAD_PARTITION"}')
        os.rename(part + ".away", part)
        assert http(proc, "POST", "/topic/reopen?topic=bad") == (200, b"")
        assert http(proc, "GET", "/ping") == (200, b"OK")
        assert topic_stats(proc, "bad")["partitions"][0]["error"] is None
        c = await connect(proc)
        await c.sub("bad", "c", rdy=1)
        (m,) = await take(c)
        assert m.body == b"bad"
        m.fin()
        await (await connect(proc)).pub("bad", b"again")
        (m,) = await take(c)
        assert m.body == b"again"
        # a serving partition may be reopened too: consumers reconnect, cursors kept
        m.fin()
        await asyncio.sleep(1.2)
        assert http(proc, "POST", "/topic/reopen?topic=bad&partition=0") == (200, b"")
        c = await connect(proc)
        await c.sub("bad", "c", rdy=1)
        await (await connect(proc)).pub("bad", b"third")
        (m,) = await take(c)
        assert m.body == b"third"
        assert proc.stop() == 0
    finally:
        proc.kill()


# ---- a log that fails while running -------------------------------------------------


@pytest.mark.parametrize("journal", [True, False])
async def test_a_log_whose_sync_failed_is_reported_and_reopened(node, monkeypatch, journal):
    """A failed fdatasync fails the partition's log (QueueFailedError: the kernel may have
    dropped the unsynced pages). No file system here fails a sync on demand, so the
    system call itself fails (EIO) for this partition's files, in an in-process node;
    the rest is real. Before: the TCP fast path raised out of data_received (the client
    saw its connection dropped, no E_PUB_FAILED), /ping said OK. Now: E_PUB_FAILED,
    /stats `error`, /metrics nsqd_partition_up 0, /ping 500; POST /topic/reopen (once the
    disk is well again) brings it back with every acknowledged message. With journaling
    (the default) the same: a partition writing alone syncs its own segment, which fails."""
    import errno

    n = await node(journal=journal)
    pub = await Connection("127.0.0.1", n.tcp_port).connect()
    await pub.pub("t", b"kept")
    await pub.pub("other", b"fine")
    sick = {"on": True}
    real = os.fdatasync
    folder = os.path.join(n.options.data_path, "t.topic")
    journal_folder = os.path.join(n.options.data_path, "journal")

    def fdatasync(fd):
        if sick["on"] and os.readlink(f"/proc/self/fd/{fd}").startswith((folder, journal_folder)):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd)

    real_pwritev = os.pwritev

    def pwritev(fd, buffers, pos, flags=0):  # a durable batch's write + sync in one call
        if flags and sick["on"] and os.readlink(f"/proc/self/fd/{fd}").startswith(folder):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real_pwritev(fd, buffers, pos, flags)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "pwritev", pwritev)
    assert (await refused(pub.pub("t", b"lost"))).startswith("E_PUB_FAILED")
    pub = await Connection("127.0.0.1", n.tcp_port).connect()
    assert (await refused(pub.pub("t", b"again"))).startswith("E_PUB_FAILED")
    pub = await Connection("127.0.0.1", n.tcp_port).connect()
    await pub.pub("other", b"still serving")

    def get(path):
        return http(n_proc, "GET", path)

    n_proc = types.SimpleNamespace(http_address=f"127.0.0.1:{n.http_port}")
    status, body = await asyncio.to_thread(get, "/ping")
    assert status == 500 and body.startswith(b"NOK - topic t partition 0: ") and b"sync" in body
    doc = json.loads((await asyncio.to_thread(get, "/stats?format=json"))[1])
    t = next(x for x in doc["topics"] if x["topic_name"] == "t")
    assert "sync failed" in t["partitions"][0]["error"]
    metrics = (await asyncio.to_thread(get, "/metrics"))[1].decode()
    assert 'nsqd_partition_up{topic="t",partition="0"} 0' in metrics
    assert ("\nnsqd_journal_up 1\n" in metrics) == journal  # a round of one: its own sync
    sick["on"] = False
    status, _ = await asyncio.to_thread(
        http, n_proc, "POST", "/topic/reopen?topic=t")
    assert status == 200
    assert (await asyncio.to_thread(get, "/ping")) == (200, b"OK")
    await pub.pub("t", b"after")
    c = await Connection("127.0.0.1", n.tcp_port).connect()
    await c.sub("t", "c", rdy=10)
    got = [(await take(c))[0].body]
    while got[-1] != b"after":  # "lost" was written, its sync failed: it may be there
        got.append((await take(c))[0].body)
    assert got[0] == b"kept" and got[1:-1] in ([], [b"lost"])


def test_a_delay_store_made_on_a_full_disk_is_an_error_not_a_sigbus(disk):
    """The store alone, in a child process (a SIGBUS would kill pytest): before, LMDB's
    lock file, sized by ftruncate and written through its map, killed the process
    (-SIGBUS) on a full tmpfs. Now its blocks are allocated first: DelayStoreError."""
    import sys

    path, _ = disk
    fill(disk)
    code = ("import sys\nfrom delayqueue.store import DelayStore, DelayStoreError\n"
            "try:\n    DelayStore.open(sys.argv[1])\nexcept DelayStoreError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path / "store")],
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "cannot create the delay store" in done.stdout
    assert not os.path.exists(path / "store") and not os.path.exists(path / "store.creating")
    # an existing store whose lock file is gone, opened on a full disk: LMDB would make
    # the lock file again (ftruncate, then writes through its map): an error, no fault
    free(disk)
    from delayqueue.store import DelayStore

    DelayStore.open(str(path / "old")).close()
    os.unlink(path / "old" / "lock.mdb")
    fill(disk)
    done = subprocess.run([sys.executable, "-c", code, str(path / "old")],
                          capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "lock.mdb: cannot allocate" in done.stdout


# ---- the log of a repeating failure -------------------------------------------------


def test_a_repeating_failure_is_one_line_a_minute_with_its_count():
    """health.FailureLog, with an injected clock: the first failure with its traceback,
    then one `_again` line a minute at most (with the count), one line when it works."""
    from nsqd.health import FailureLog

    class Recorder:
        def __init__(self):
            self.lines = []

        def error(self, event, **kw):
            self.lines.append((event, kw))

        info = error

    now = [0.0]
    rec = Recorder()
    failures = FailureLog(rec, "checkpoint_failed", every_s=60, clock=lambda: now[0])
    for _ in range(120):  # two minutes of a failure a second
        failures.failed(OSError(28, "No space left on device"))
        now[0] += 1
    assert failures.error == "[Errno 28] No space left on device"
    events = [(e, kw.get("failures"), "exc_info" in kw) for e, kw in rec.lines]
    # t=0 with its traceback; t=60 counts the 60 since; t=61..119 wait for t=120
    assert events == [("checkpoint_failed", None, True), ("checkpoint_failed_again", 60, False)]
    failures.ok()
    failures.ok()
    assert rec.lines[-1] == ("checkpoint_recovered", {"failures_total": 120})
    assert len(rec.lines) == 3 and failures.error is None
