"""An idle node's periodic work (nsqd/README.md "What an idle partition costs"): the
checkpoint writes nothing when nothing changed, retention leaves a log that is its active
segment alone to the loop, on real DiskQueues and a real in-process nsqd."""

import asyncio
import errno
import os

import pytest

from diskqueue.budget import FileBudget
from diskqueue.queue import AppendError, DiskQueue, QueueOptions
from nodes import connect, take, until
from nsqwire.commands import cmd_pub
from nsqd.nsqd import single_segment


async def test_single_segment_tells_whether_retention_could_drop_anything(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"), QueueOptions(segment_bytes=2048))
    try:
        assert single_segment(q)  # empty
        await q.append([b"x" * 100] * 10)
        assert single_segment(q)
        assert await q.retain(before_offset=10**9, min_age_s=0) == 0  # as retention says
        for _ in range(3):
            await q.append([b"x" * 100] * 10)
        assert not single_segment(q)  # a second segment: the first may go
        start = await q.retain(before_offset=10**9, min_age_s=0)
        assert start > 0 and single_segment(q)
    finally:
        await q.close()


async def test_retention_still_drops_what_a_channel_finished(node):
    n = await node(segment_bytes=4096, retention_check_interval_ms=100,
                   retention_min_age_ms=0)
    c = await connect(n)
    await c.sub("t", "c", rdy=100)
    pub = await connect(n)
    for _ in range(30):  # one write each: some 4 segments
        await pub.pub("t", b"x" * 500)
    for m in await take(c, 30):
        m.fin()
    q = n.topics["t"].partitions[0].queue
    await until(lambda: q.start_offset > 0 and single_segment(q))


async def test_an_idle_node_checkpoints_nothing(node):
    n = await node(checkpoint_interval_ms=100)
    c = await connect(n)
    await c.sub("t", "c", rdy=10)
    pub = await connect(n)
    await pub.mpub("t", [b"a", b"b"])
    first = (await take(c))[0]
    first.fin()
    path = os.path.join(n.options.data_path, "nsqd.meta.sqlite")
    await asyncio.sleep(0.5)  # the FIN's checkpoint is written
    written = os.stat(path).st_mtime_ns
    await asyncio.sleep(1)  # ten checkpoints with nothing changed: no write
    assert os.stat(path).st_mtime_ns == written
    assert not n._changed, "no channel to visit"
    (second,) = await take(c)
    second.fin()
    ch = n.topics["t"].partitions[0].channels["c"]
    await until(lambda: os.stat(path).st_mtime_ns != written)
    assert n.meta.channels("t")[(0, "c")]["confirmed"] == ch.cursor.confirmed
    assert not ch.dirty and not n._changed
    n.topics["t"].pause()  # a topic's state changed (not stored by this call): written too
    written = os.stat(path).st_mtime_ns
    await until(lambda: os.stat(path).st_mtime_ns != written)
    assert n.meta.topics()["t"]["paused"] is True


async def test_a_topic_state_is_made_again_only_when_what_it_is_made_of_changed(node):
    """The checkpoint asks every topic's state every second: the same dict while nothing
    changed; a new one, then stored, after a change (a floor, pause, sync, retention)."""
    n = await node(checkpoint_interval_ms=100)
    pub = await connect(n)
    await pub.mpub("t", [b"a", b"b"])
    t = n.topics["t"]
    state = t.state()
    assert t.state() is state and state["floors"]["0"] == [0, 0]
    await n.get_channel("t", "c")
    await n.delete_channel("t", "c")  # the last channel gone: the floor moves to the end
    end = t.partitions[0].queue.committed_end
    assert t.state() is not state and t.state()["floors"]["0"] == [end, 2]
    await until(lambda: n.meta.topics()["t"]["floors"]["0"][1] == 2)
    for change, stored in ((t.pause, ("paused", True)),
                           (lambda: t.set_sync((5, 100)), ("sync", [5, 100])),
                           (lambda: setattr(t, "retention_ms", 60_000), ("retention_ms", 60_000))):
        state = t.state()
        change()
        assert t.state() is not state and t.state()[stored[0]] == stored[1]
        await until(lambda: n.meta.topics()["t"].get(stored[0]) == stored[1])


async def test_a_restart_opens_every_partition_and_channel_as_stored(node, tmp_path):
    """Partitions open OPEN_AT_ONCE at a time over all topics: each topic ends with its
    partitions in number order, all writable, and every stored channel at its cursor."""
    n = await node()
    for name, count in (("a", 40), ("b", 3), ("c", 1)):
        topic = await n.create_topic(name, count)
        for i in range(count):
            await topic.publish([b"%s%d" % (name.encode(), i)] * (i % 3 + 1), i)
        for channel in ("x", "y"):
            for i in range(count):
                await n.get_channel(name, channel, i)
    c = await connect(n)
    await c.sub("a", "x", rdy=100)
    for m in await take(c, sum(i % 3 + 1 for i in range(40))):
        m.fin()
    await until(lambda: all(p.channels["x"].cursor.confirmed == p.queue.committed_end
                            for p in n.topics["a"].partitions.values()))
    await c.close()
    await n.stop()

    n = await node()
    assert list(n.topics) == ["a", "b", "c"]
    for name, count in (("a", 40), ("b", 3), ("c", 1)):
        topic = n.topics[name]
        assert list(topic.partitions) == list(range(count))
        assert list(topic.writable) == list(range(count)) and not topic.failed
        for i, p in topic.partitions.items():
            assert sorted(p.channels) == ["x", "y"]
            assert p.queue.committed_count == i % 3 + 1
            # x, the first channel, started at the backlog: consumed in "a" only; y
            # started at the end
            x_at = p.queue.committed_end if name == "a" else 0
            assert p.channels["x"].cursor.confirmed == x_at
            assert p.channels["y"].cursor.confirmed == p.queue.committed_end


def log_files_open(path: str) -> int:
    """Descriptors of this process open on files under `path`."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds
               if os.path.realpath(f"/proc/self/fd/{fd}").startswith(os.path.realpath(path)))


async def test_a_released_log_holds_no_descriptor_and_writes_again(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"), QueueOptions(segment_bytes=2048))
    try:
        await q.append([b"a" * 100] * 30)  # past one segment
        assert log_files_open(q.path) >= 2 and q.files_used_at is not None
        await q.release_files()
        assert log_files_open(q.path) == 0 and q.files_used_at is None
        await q.append([b"b"])  # opens its active segment and commitlog again
        assert q.files_used_at is not None
        r = q.reader(q.start_offset)
        bodies = []
        while recs := await r.read(100):
            bodies += [rec.body for rec in recs]
        r.close()
        assert bodies == [b"a" * 100] * 30 + [b"b"]
        await q.release_files()
        assert (await q.find("offset", q.start_offset)).log_id == 0  # the commitlog reads again
        assert log_files_open(q.path) == 0 and q.files_used_at is None  # and closes after
    finally:
        await q.close()
    q2 = await DiskQueue.open(str(tmp_path / "q"), QueueOptions(segment_bytes=2048))
    assert (q2.written_end, q2.written_count) == (q.written_end, q.written_count)
    await q2.close()


async def test_a_released_log_out_of_descriptors_fails_the_batch_not_the_log(tmp_path,
                                                                           monkeypatch):
    """A write to a released log while the process has no descriptor left (a burst to many
    partitions, before the release loop closes others) fails that batch only: its files
    could not open, nothing was written, nothing needs undoing; the next write works."""
    q = await DiskQueue.open(str(tmp_path / "q"), QueueOptions())
    try:
        await q.append([b"a"])
        await q.release_files()
        real_open = os.open

        def no_descriptor(path, *args, **kw):
            if str(path).startswith(q.path):
                raise OSError(errno.EMFILE, "Too many open files (injected)")
            return real_open(path, *args, **kw)

        monkeypatch.setattr(os, "open", no_descriptor)
        with pytest.raises(AppendError):
            await q.append([b"refused"])
        assert q.failed is None
        monkeypatch.setattr(os, "open", real_open)
        await q.append([b"b"])
        assert [rec.body for rec in await q.reader(q.start_offset).read(10)] == [b"a", b"b"]
    finally:
        await q.close()


async def test_an_idle_partition_closes_its_files(node, monkeypatch):
    monkeypatch.setattr("nsqd.openlogs.FILES_IDLE_S", 0.2)
    monkeypatch.setattr("nsqd.openlogs.RELEASE_INTERVAL", 0.1)
    n = await node()
    pub = await connect(n)
    await pub.pub("t", b"x")
    q = n.topics["t"].partitions[0].queue
    await until(lambda: q.files_used_at is None)
    assert log_files_open(q.path) == 0
    await pub.pub("t", b"y")
    assert q.written_count == 2 and q.files_used_at is not None


async def test_beyond_open_logs_the_least_recently_used_close_their_files(node, monkeypatch):
    """Partitions written faster than FILES_IDLE_S passes: past OPEN_LOGS logs with open
    files, the least recently used close theirs, the most recent keep them."""
    monkeypatch.setattr("nsqd.openlogs.OPEN_LOGS", 2)
    monkeypatch.setattr("nsqd.openlogs.RELEASE_INTERVAL", 0.1)
    n = await node()
    await n.create_topic("t", 6)
    pub = await connect(n)
    queues = [n.topics["t"].partitions[i].queue for i in range(6)]
    for i in range(6):
        await pub.command(cmd_pub("t", b"x", partition=i))
        await asyncio.sleep(0.02)
    await until(lambda: sum(q.files_used_at is not None for q in queues) <= 2)
    assert [q.files_used_at is not None for q in queues] == [False] * 4 + [True] * 2


async def test_the_release_loop_gives_the_write_thread_a_few_releases_at_a_time(node,
                                                                                monkeypatch):
    """A pass that closes many logs hands them over RELEASE_STEP at a time: each release
    may sync a segment, and a publish queued behind all of them at once waited for all."""
    monkeypatch.setattr("nsqd.openlogs.OPEN_LOGS", 2)
    monkeypatch.setattr("nsqd.openlogs.RELEASE_STEP", 3)
    monkeypatch.setattr("nsqd.openlogs.RELEASE_INTERVAL", 0.1)
    in_flight, most = [0], [0]
    release = DiskQueue.release_files

    async def counted(self):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            await release(self)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(DiskQueue, "release_files", counted)
    n = await node()
    await n.create_topic("t", 12)
    pub = await connect(n)
    await asyncio.gather(*(pub.command(cmd_pub("t", b"x", partition=i)) for i in range(12)))
    queues = [n.topics["t"].partitions[i].queue for i in range(12)]
    await until(lambda: sum(q.files_used_at is not None for q in queues) <= 2)
    assert most[0] == 3  # 10 to close, 3 at a time


async def test_a_log_without_a_place_waits_for_one_and_fails_nothing(tmp_path):
    """A budget of two logs, four written at once: two write; two wait, their files shut,
    nothing failed, and the host is asked to release (`on_full`); a release gives its place
    to the first waiting, a close to the next, in the order they asked."""
    asked = []
    files = FileBudget(2, on_full=lambda: asked.append(True))
    qs = [await DiskQueue.open(str(tmp_path / f"q{i}"), QueueOptions(files=files))
          for i in range(4)]
    try:
        writes = [q.append([b"m%d" % i]) for i, q in enumerate(qs)]
        await asyncio.wait_for(asyncio.gather(*writes[:2]), 5)
        await asyncio.sleep(0.05)
        assert not writes[2].done() and not writes[3].done() and asked
        assert list(files.holders) == qs[:2] and files.stats()["waiting"] == 2
        assert [log_files_open(q.path) > 0 for q in qs] == [True, True, False, False]
        await qs[0].release_files()
        await asyncio.wait_for(writes[2], 5)
        assert not writes[3].done() and log_files_open(qs[0].path) == 0
        await qs[1].close()
        await asyncio.wait_for(writes[3], 5)
        assert list(files.holders) == qs[2:] and files.stats()["waits"] == 2
        for i, q in enumerate(qs):
            if i != 1:
                assert [r.body for r in await q.reader(0).read(10)] == [b"m%d" % i]
    finally:
        for q in qs:
            await q.close()
    assert not files.holders


async def test_a_closing_log_writes_what_waits_for_a_place(tmp_path):
    """A log closed while its batch waits for a place writes it on its way out (over the
    limit: a close never waits for others to be released) and gives the place back."""
    files = FileBudget(1)
    a = await DiskQueue.open(str(tmp_path / "a"), QueueOptions(files=files))
    b = await DiskQueue.open(str(tmp_path / "b"), QueueOptions(files=files))
    await a.append([b"x"])
    waiting = b.append([b"y"])
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await asyncio.wait_for(b.close(), 5)
    assert (await waiting).count == 1 and list(files.holders) == [a]
    await a.close()
    b = await DiskQueue.open(str(tmp_path / "b"))
    assert [r.body for r in await b.reader(0).read(10)] == [b"y"]
    await b.close()


async def test_a_follower_without_a_place_writes_with_its_files_open_for_that_write(tmp_path):
    """A follower's push to a log without a place is written all the same, its files opened
    for that write alone and closed after; once given a place, its log keeps them open."""
    leader = await DiskQueue.open(str(tmp_path / "leader"))
    await leader.append([b"a"])
    await leader.append([b"b"])
    first = await leader.read_raw(0, 1)
    second = await leader.read_raw(first.offset + len(first.data), 1)
    await leader.close()
    files = FileBudget(1)
    other = await DiskQueue.open(str(tmp_path / "other"), QueueOptions(files=files))
    await other.append([b"x"])  # holds the one place
    follower = await DiskQueue.open(str(tmp_path / "follower"),
                                    QueueOptions(replicated=True, files=files))
    loop = asyncio.get_running_loop()

    async def push(raw):
        done = loop.create_future()
        follower.append_raw_then(raw.offset, raw.count, raw.entries, raw.data,
                                 done.set_result)
        return await asyncio.wait_for(done, 5)

    try:
        assert await push(first) is None and follower.written_count == 1
        assert log_files_open(follower.path) == 0 and follower not in files.holders
        await other.release_files()  # the place goes to the follower, which asked for it
        assert list(files.holders) == [follower]
        await asyncio.sleep(0.01)  # the writer the place kicked runs first
        assert await push(second) is None and follower.written_count == 2
        assert log_files_open(follower.path) > 0
    finally:
        await other.close()
        await follower.close()
