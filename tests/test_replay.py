"""Replay: a channel's cursor moved by time, offset or count (POST /channel/setoffset,
SUB_ADVANCED), on real nsqd processes; and the locate search under it, on a DiskQueue.
"""

import asyncio
import json
import os
import random
import time
import urllib.error
import urllib.request

import pytest

from diskqueue.queue import DiskQueue, NotABoundary, QueueOptions
from nsqclient.conn import Connection, NSQError
from nsqwire import commands as c
from servers import NsqdProcess


# ---- locate, on a DiskQueue ----------------------------------------------------------


async def test_locate_every_kind_on_record_boundaries(tmp_path):
    """Requests of 1..4 messages over many small segments: every record is found by its
    offset and by its count; an offset inside a record is refused with its boundaries; a
    time finds the first request written at or after it; past the end is the end."""
    q = await DiskQueue.open(str(tmp_path), QueueOptions(segment_bytes=1000,
                                                          clog_entries_per_segment=7))
    try:
        records, stamps, n = [], [], 0
        for i in range(60):
            k = 1 + i % 4
            a = await q.append([b"m%05d" % (n + j) for j in range(k)])
            stamps.append((a.timestamp, a.offset, a.first_id))
            for j, off in enumerate(a.offsets):
                records.append((off, a.first_id + j))
            n += k
        assert len(q._segments.bases) > 5
        ends = [off for off, _ in records[1:]] + [q.committed_end]
        for (off, count), end in zip(records, ends):
            assert await q.locate("offset", off) == (off, count, None)
            assert await q.locate("count", count) == (off, count, None)
            with pytest.raises(NotABoundary) as e:
                await q.locate("offset", off + 1)
            assert (e.value.before, e.value.after) == (off, end)
        for ts, off, count in stamps:
            want = min((o, c) for t, o, c in stamps if t >= ts)
            assert tuple(await q.locate("timestamp", ts))[:2] == want
        end = (q.committed_end, q.committed_count)
        assert await q.locate("end") == (*end, None)
        assert await q.locate("timestamp", time.time_ns() + 10**12) == (*end, "end")
        assert await q.locate("count", n) == (*end, None)
        assert await q.locate("count", n + 5) == (*end, "end")
        assert await q.locate("offset", q.committed_end + 1) == (*end, "end")
        assert await q.locate("timestamp", 0) == (0, 0, None)
        # retention drops the first segments: earlier places are the oldest kept record
        start = await q.retain(before_offset=records[40][0])
        assert start > 0
        first = next((o, c) for o, c in records if o == start)
        for kind, value in (("offset", 0), ("count", 0), ("timestamp", 0),
                            ("timestamp", stamps[0][0])):
            assert await q.locate(kind, value) == (*first, "retention"), (kind, value)
    finally:
        await q.close()


# ---- on a real nsqd -------------------------------------------------------------------


def post(proc: NsqdProcess, path: str, body: bytes = b"") -> tuple[int, dict | None]:
    req = urllib.request.Request(f"http://{proc.http_address}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    return status, json.loads(data) if data else None


def setoffset(proc, target: str, topic="t", channel="c", partition: int | None = 0):
    query = f"topic={topic}&channel={channel}" + (
        "" if partition is None else f"&partition={partition}")
    return post(proc, f"/channel/setoffset?{query}", target.encode())


def moved(proc, target: str, **kw) -> dict:
    status, answer = setoffset(proc, target, **kw)
    assert status == 200, (target, status, answer)
    (entry,) = answer["partitions"]
    return entry


def partition_stats(proc, topic="t") -> dict:
    with urllib.request.urlopen(f"http://{proc.http_address}/stats?format=json&topic={topic}",
                                timeout=5) as r:
        (t,) = json.loads(r.read())["topics"]
    return t["partitions"][0]


async def until_no_clients(proc, topic="t", timeout: float = 10) -> None:
    """Until the node has seen every client of `topic` go (a closed connection with FINs
    still buffered stays open, subscribed, until they are sent)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(
                f"http://{proc.http_address}/stats?format=json&topic={topic}", timeout=5) as r:
            (t,) = json.loads(r.read())["topics"]
        if not any(ch["client_count"] for ch in t["channels"]):
            return
        assert time.monotonic() < deadline, "a closed client is still subscribed"
        await asyncio.sleep(0.05)


async def take(conn: Connection, n: int, timeout: float = 30) -> list:
    """The next `n` messages, each finished; then nothing more for a while."""
    out = []
    for _ in range(n):
        msg = await asyncio.wait_for(conn.messages.get(), timeout)
        msg.fin()
        out.append(msg)
    await quiet(conn)
    return out


async def quiet(conn: Connection, seconds: float = 0.7) -> None:
    with pytest.raises(asyncio.TimeoutError):
        extra = await asyncio.wait_for(conn.messages.get(), seconds)
        pytest.fail(f"unexpected message {extra.body[:20]!r} at {extra.offset}")


def bodies(msgs) -> list[bytes]:
    return [m.body for m in msgs]


GROUPS, PER_GROUP = 5, 12


async def publish_groups(pub: Connection) -> list[list[bytes]]:
    """GROUPS groups of PER_GROUP messages (an MPUB of 8, then 4 PUBs), more than a second
    apart, so a whole second falls between any two groups."""
    groups = []
    for g in range(GROUPS):
        if g:
            await asyncio.sleep(1.2)
        group = [b"g%d-%03d-" % (g, i) + b"x" * 200 for i in range(PER_GROUP)]
        await pub.mpub("t", group[:8])
        for b in group[8:]:
            await pub.pub("t", b)
        groups.append(group)
    return groups


async def test_setoffset_replays_exactly_from_a_time_an_offset_a_count_or_the_end(tmp_path):
    """Five groups of messages a second apart over several 4 KiB segments, all consumed by
    a SUB_ADVANCED client (frames carry each record's offset and size, contiguous). A move
    to a time between two groups redelivers exactly the later groups, to the connected
    client; by count, offset (and their Youzan spellings) exactly from that message; an
    offset inside a record is a 400 naming its boundaries; `end` and a future time deliver
    nothing until the next publish. Bad input: 400/404 JSON. The move is stored when it is
    answered: after kill -9 (checkpoints 1 h apart) the channel starts where it was moved.
    (Retention 1 h apart too: finished segments would be dropped, and replay reaches only
    what is kept.)"""
    proc = NsqdProcess(str(tmp_path / "n"), "--segment-bytes", "4096", "--checkpoint-interval",
                       "1h", "--retention-check-interval", "1h").start()
    try:
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub_advanced("t", "c", 0, rdy=500)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        groups = await publish_groups(pub)
        every = [b for g in groups for b in g]
        msgs = await take(consumer, len(every))
        assert bodies(msgs) == every
        for a, b in zip(msgs, msgs[1:]):
            assert b.offset == a.offset + a.size  # contiguous records, sizes as framed
        assert msgs[0].offset == 0
        segments = sorted(os.listdir(tmp_path / "n" / "t.topic" / "0" / "data"))
        assert len([s for s in segments if s.endswith(".dat") or s[:1].isdigit()]) >= 4

        for g in range(1, GROUPS):
            before = max(m.timestamp for m in msgs[(g - 1) * PER_GROUP:g * PER_GROUP])
            second = before // 10**9 + 1
            assert msgs[g * PER_GROUP].timestamp >= second * 10**9  # a second between groups
            entry = moved(proc, f"timestamp:{second}")
            assert entry == {"partition": 0, "offset": msgs[g * PER_GROUP].offset,
                             "count": g * PER_GROUP, "clipped": None}
            assert bodies(await take(consumer, len(every) - g * PER_GROUP)) == every[g * PER_GROUP:]

        for target, k in (("count:17", 17), (f"offset:{msgs[33].offset}", 33), ("msgcount:50", 50),
                          (f"virtual_queue:{msgs[9].offset}", 9), ("timestamp:0", 0)):
            assert moved(proc, target) == {"partition": 0, "offset": msgs[k].offset, "count": k,
                                           "clipped": None}, target
            assert bodies(await take(consumer, len(every) - k)) == every[k:], target

        status, answer = setoffset(proc, f"offset:{msgs[33].offset + 5}")
        assert status == 400 and answer == {
            "message": "OFFSET_NOT_A_RECORD_BOUNDARY", "partition": 0,
            "offset": msgs[33].offset + 5, "before": msgs[33].offset, "after": msgs[34].offset}
        await quiet(consumer)

        end = msgs[-1].offset + msgs[-1].size
        assert moved(proc, "end") == {"partition": 0, "offset": end, "count": len(every),
                                      "clipped": None}
        assert moved(proc, f"timestamp:{int(time.time()) + 3600}") == {
            "partition": 0, "offset": end, "count": len(every), "clipped": "end"}
        await quiet(consumer)
        await pub.pub("t", b"after the end")
        (last,) = await take(consumer, 1)
        assert (last.body, last.offset) == (b"after the end", end)

        for args, want in (
                (("count:1", "t", "c", 1), (400, "BAD_PARTITION")),
                (("count:1", "t", "c", "x"), (400, "BAD_PARTITION")),
                (("bogus",), (400, "INVALID_OFFSET")),
                (("offset:-1",), (400, "INVALID_OFFSET")),
                (("count:1", "t", "nope"), (404, "CHANNEL_NOT_FOUND")),
                (("count:1", "nope", "c"), (404, "TOPIC_NOT_FOUND"))):
            status, answer = setoffset(proc, *args)
            assert (status, answer["message"]) == want, args

        # kill -9 right after an answered move: the channel starts there
        await consumer.close()
        assert moved(proc, "count:20")["count"] == 20
        proc.kill()
        proc.start()
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "c", rdy=500)
        assert bodies(await take(consumer, len(every) + 1 - 20)) == every[20:] + [b"after the end"]
        await consumer.close()
        await pub.close()
    finally:
        proc.kill()


async def test_a_time_before_retention_moves_to_the_oldest_record_kept(tmp_path):
    """Retention (by size) dropped the first segments: a move to a time, a count or an offset
    before them goes to the oldest record kept, and the answer says so."""
    proc = NsqdProcess(str(tmp_path / "n"), "--segment-bytes", "2048", "--retention-max-bytes",
                       "4096", "--retention-check-interval", "100ms").start()
    try:
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub_advanced("t", "c", 0, rdy=500)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        every = [b"m%03d-" % i + b"x" * 200 for i in range(60)]
        for b in every:
            await pub.pub("t", b)
        msgs = await take(consumer, len(every))
        deadline = time.monotonic() + 20
        while partition_stats(proc)["start_offset"] == 0:
            assert time.monotonic() < deadline, "retention dropped nothing"
            await asyncio.sleep(0.1)
        start = partition_stats(proc)
        k = next(i for i, m in enumerate(msgs) if m.offset == start["start_offset"])
        assert k == start["start_count"] > 0
        for target in ("timestamp:0", f"timestamp:{msgs[0].timestamp // 10**9}", "count:0",
                       "offset:0"):
            assert moved(proc, target) == {"partition": 0, "offset": msgs[k].offset, "count": k,
                                           "clipped": "retention"}, target
            assert bodies(await take(consumer, len(every) - k)) == every[k:]
        await consumer.close()
        await pub.close()
    finally:
        proc.kill()


async def test_sub_advanced_starts_the_first_client_at_each_start_form(tmp_path):
    """SUB_ADVANCED with each start form (ours and Youzan's spellings) moves a channel with
    no client yet, and its frames carry each record's offset and size; without a start a new
    channel starts at the end, as SUB's does. A second client's start is ignored (the channel
    has a client). A bad start is E_INVALID; a start inside a record is refused with its
    boundaries. A move made by SUB_ADVANCED is stored: after kill -9 the channel starts there."""
    proc = NsqdProcess(str(tmp_path / "n"), "--segment-bytes", "4096", "--checkpoint-interval",
                       "1h", "--retention-check-interval", "1h").start()
    conns = []

    async def connect() -> Connection:
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        conns.append(conn)
        return conn

    async def consumer(channel: str, start: str | None, rdy: int = 500) -> Connection:
        conn = await connect()
        await conn.sub_advanced("t", channel, 0, start, rdy=rdy)
        return conn

    try:
        assert post(proc, "/topic/create?topic=t")[0] == 200
        pub = await connect()
        groups = await publish_groups(pub)
        every = [b for g in groups for b in g]
        msgs = await take(await consumer("first", None), len(every))  # the topic's first channel
        assert bodies(msgs) == every
        second = msgs[PER_GROUP - 1].timestamp // 10**9 + 1
        k_time = next(i for i, m in enumerate(msgs) if m.timestamp >= second * 10**9)
        assert k_time == PER_GROUP
        for n, (start, k) in enumerate((
                (f"timestamp:{second}", k_time), (f"offset:{msgs[30].offset}", 30),
                (f"virtual_queue:{msgs[31].offset}", 31), ("count:7", 7), ("msgcount:8", 8),
                ("end", len(every)), ("special:-1", len(every)), (None, len(every)))):
            conn = await consumer(f"c{n}", start)
            got = await take(conn, len(every) - k)
            assert bodies(got) == every[k:], start
            assert [(m.offset, m.size) for m in got] == [(m.offset, m.size) for m in msgs[k:]]
            await conn.close()

        # a second client's start does not move the channel its first client reads
        a = await consumer("shared", "count:50", rdy=1)
        m50 = await asyncio.wait_for(a.messages.get(), 10)
        assert m50.body == every[50]
        await consumer("shared", "count:0", rdy=0)
        m50.fin()
        assert bodies(await take(a, len(every) - 51)) == every[51:]

        for start, error in (("bogus:1", "E_INVALID SUB_ADVANCED invalid consume start"),
                             (f"offset:{msgs[3].offset + 1}",
                              "E_INVALID SUB_ADVANCED OFFSET_NOT_A_RECORD_BOUNDARY")):
            conn = await connect()
            with pytest.raises(NSQError) as e:
                await conn.sub_advanced("t", "refused", 0, start)
            assert str(e.value).startswith(error), str(e.value)
        assert f"before={msgs[3].offset} after={msgs[4].offset}" in str(e.value)

        await consumer("kept", "count:40", rdy=0)
        proc.kill()
        proc.start()
        conn = await connect()
        await conn.sub("t", "kept", rdy=500)
        assert bodies(await take(conn, len(every) - 40)) == every[40:]
    finally:
        for conn in conns:
            await conn.close()
        proc.kill()


async def test_moves_while_delivering_never_mislabel_a_message(tmp_path):
    """A consumer at full speed while the channel is moved 100 times (random counts) and
    messages keep coming: every message delivered is the record at the offset its frame
    names (a move during a read must not hand out the bytes read for the old place), and
    after the last move the channel delivers everything from there."""
    proc = NsqdProcess(str(tmp_path / "n"), "--retention-check-interval", "1h").start()
    try:
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        got: list = []
        consumer = await Connection("127.0.0.1", proc.tcp_port, on_messages=got.extend).connect()
        await consumer.sub_advanced("t", "c", 0, rdy=2500)
        total = 3000
        sent = [b"%05d-" % i + b"y" * 4000 for i in range(total)]
        for i in range(0, 1500, 100):
            await pub.mpub("t", sent[i:i + 100])

        async def keep_publishing():
            for i in range(1500, total, 50):
                await pub.mpub("t", sent[i:i + 50])
                await asyncio.sleep(0.01)

        publishing = asyncio.create_task(keep_publishing())
        rng = random.Random(3)
        loop = asyncio.get_running_loop()
        finished = 0
        for _ in range(100):
            k = rng.randrange(1500)
            entry = (await loop.run_in_executor(None, moved, proc, f"count:{k}"))
            assert entry["count"] == k
            for m in got[finished:]:
                m.fin()
            finished = len(got)
            await asyncio.sleep(rng.random() * 0.02)
        await publishing
        offsets = {}
        for m in got:
            i = int(m.body[:5])
            assert m.body == sent[i], i
            assert offsets.setdefault(i, m.offset) == m.offset, (i, m.offset, offsets[i])
            assert m.size == len(sent[i]) + 36
        assert len(offsets) > 1500
        await consumer.close()
        await until_no_clients(proc)  # the node has let it go: its messages are back
        assert moved(proc, "count:1000")["count"] == 1000
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "c", rdy=2500)
        assert bodies(await take(consumer, total - 1000)) == sent[1000:]
        await consumer.close()
        await pub.close()
    finally:
        proc.kill()


async def test_a_move_with_tagged_consumers_replays_to_each_its_share(tmp_path):
    """While consumers have tags (the routed delivery of tags.py), a move drops what the
    router held and each consumer gets its share again from the new place, exactly once."""
    proc = NsqdProcess(str(tmp_path / "n"), "--retention-check-interval", "1h").start()
    try:
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        red = await Connection("127.0.0.1", proc.tcp_port).connect({"desired_tag": "red"})
        plain = await Connection("127.0.0.1", proc.tcp_port).connect()
        await red.sub("t", "c", rdy=100)
        await plain.sub("t", "c", rdy=100)
        reds = [b"red-%02d" % i for i in range(10)]
        plains = [b"plain-%02d" % i for i in range(10)]
        for r, p in zip(reds, plains):
            assert await pub.command(c.cmd_pub_ext("t", {"##client_dispatch_tag": "red"}, r, 0)) == b"OK"
            await pub.pub("t", p)
        assert sorted(bodies(await take(red, 10))) == reds
        assert sorted(bodies(await take(plain, 10))) == plains
        assert moved(proc, "count:10")["count"] == 10  # the second half again
        assert sorted(bodies(await take(red, 5))) == reds[5:]
        assert sorted(bodies(await take(plain, 5))) == plains[5:]
        for conn in (pub, red, plain):
            await conn.close()
    finally:
        proc.kill()


async def test_a_move_during_a_read_for_deferred_publishes_leaves_the_reader_at_the_cursor(
        node):
    """A channel with no client reads the head of its log for deferred publishes; a move
    (SUB_ADVANCED, /channel/setoffset) landing while that read is in flight makes it stale.
    Before: the stale read left the reader past the place the move set, every later pass
    failed (`take at X but next_read is Y`, once a second) and nothing was delivered again
    (found by Spark's benchmark: SUB_ADVANCED count:0 on a fresh channel after a restart).
    The read is held open here so that the move always lands in it."""
    from nsqd import replay

    n = await node()
    pub = await Connection("127.0.0.1", n.tcp_port).connect()
    sent = [b"%05d-" % i + b"w" * 100 for i in range(3000)]
    for i in range(0, len(sent), 500):
        await pub.mpub("t", sent[i:i + 500])
    channel = await n.get_channel("t", "c")
    await asyncio.sleep(0.1)  # its first look at the head is done
    reader, gate = channel._reader, asyncio.Event()
    real_read = reader.read

    async def held_open(count):  # as a pread in flight: the bytes come after the move
        await gate.wait()
        return await real_read(count)
    reader.read = held_open
    await replay.move(channel, "count", 1000)  # the head moves: the channel looks again...
    await asyncio.sleep(0.1)  # ...and its read is held open
    await replay.move(channel, "count", 1000)  # a move while that read is in flight
    gate.set()
    consumer = await Connection("127.0.0.1", n.tcp_port).connect()
    await consumer.sub("t", "c", rdy=2500)
    assert bodies(await take(consumer, 2000, timeout=5)) == sent[1000:]
    await consumer.close()
    await pub.close()
