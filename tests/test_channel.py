"""Channel behaviour through a real in-process nsqd over real sockets."""

import asyncio
import glob
import os


from nodes import connect, nothing_arrives, take, until


async def test_first_channel_gets_backlog_later_channel_starts_at_end(node):
    n = await node()
    pub = await connect(n)
    await pub.mpub("t", [b"early1", b"early2"])
    first = await connect(n)
    await first.sub("t", "first", rdy=10)
    assert [m.body for m in await take(first, 2)] == [b"early1", b"early2"]
    second = await connect(n)
    await second.sub("t", "second", rdy=10)
    await pub.pub("t", b"late")
    assert [m.body for m in await take(second, 1)] == [b"late"]
    assert [m.body for m in await take(first, 1)] == [b"late"]
    await nothing_arrives(second)


async def test_consumers_of_one_channel_share_the_messages(node):
    n = await node()
    a, b = await connect(n), await connect(n)
    await a.sub("t", "c", rdy=5)
    await b.sub("t", "c", rdy=5)
    pub = await connect(n)
    bodies = [b"m%d" % i for i in range(200)]
    await pub.mpub("t", bodies)
    seen_a, seen_b = [], []
    while len(seen_a) + len(seen_b) < 200:
        for conn, seen in ((a, seen_a), (b, seen_b)):
            while not conn.messages.empty():
                m = conn.messages.get_nowait()
                seen.append(m.body)
                m.fin()
        await asyncio.sleep(0.01)
    assert sorted(seen_a + seen_b) == sorted(bodies)
    assert seen_a and seen_b, "both consumers must receive some messages"
    await nothing_arrives(a, 0.3)


async def test_req_with_delay_redelivers_with_attempts(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"x")
    (m,) = await take(c, 1)
    assert m.attempts == 1
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    m.req(300)
    (again,) = await take(c, 1)
    assert again.body == b"x" and again.attempts == 2 and again.id == m.id
    assert loop.time() - t0 >= 0.29


async def test_timeout_requeues_and_touch_extends(node):
    n = await node()
    c = await connect(n, msg_timeout=1000)
    await c.sub("t", "c", rdy=2)
    pub = await connect(n)
    await pub.mpub("t", [b"touched", b"forgotten"])
    msgs = {m.body: m for m in await take(c, 2)}
    for _ in range(4):
        await asyncio.sleep(0.4)
        msgs[b"touched"].touch()
    (back,) = await take(c, 1, timeout=3)
    assert back.body == b"forgotten" and back.attempts == 2
    channel = n.topics["t"].partitions[0].channels["c"]
    assert (channel.timeout_count, channel.requeue_count) == (1, 0), "requeue_count counts REQ only"
    await c.close()  # a disconnect puts its in-flight messages back, uncounted too
    again = await connect(n)
    await again.sub("t", "c", rdy=2)
    held = await take(again, 2)
    assert {m.body for m in held} == {b"touched", b"forgotten"}
    assert (channel.timeout_count, channel.requeue_count) == (1, 0)
    held[0].req(0)
    await take(again, 1)
    assert channel.requeue_count == 1


async def test_touch_limit_counts_from_each_delivery(node):
    """TOUCH extends a message up to --max-msg-timeout after *this* delivery, as classic
    nsqd does: a redelivered message can be touched again."""
    n = await node(max_msg_timeout_ms=1500)
    c = await connect(n, msg_timeout=1000)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"slow")
    await take(c, 1)
    (again,) = await take(c, 1, timeout=3)  # timed out after 1 s, delivered again
    assert again.attempts == 2
    # 1.5 s after the first delivery has passed by the second TOUCH; counted from this
    # delivery the TOUCHes keep it in flight.
    for _ in range(2):
        await asyncio.sleep(0.4)
        again.touch()
    await nothing_arrives(c, 0.3)
    again.fin()


async def test_output_buffering_as_negotiated(node):
    """Message frames wait until output_buffer_size bytes are buffered, the client can
    take no more, or output_buffer_timeout passes; -1 sends each delivery at once."""
    n = await node()
    pub = await connect(n)
    buffered = await connect(n, output_buffer_timeout=1000, output_buffer_size=64 * 1024)
    await buffered.sub("t", "buffered", rdy=100)
    eager = await connect(n, output_buffer_timeout=-1)
    await eager.sub("t", "eager", rdy=100)
    single = await connect(n, output_buffer_timeout=1000, output_buffer_size=64 * 1024)
    await single.sub("t", "single", rdy=1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i in range(3):
        await pub.pub("t", b"m%d" % i)
    assert [m.body for m in await take(eager, 3, timeout=0.5)] == [b"m0", b"m1", b"m2"]
    (one,) = await take(single, 1, timeout=0.5)  # RDY 1: it can take no more, so out it goes
    await nothing_arrives(buffered, 0.5)
    got = await take(buffered, 3, timeout=2)
    assert [m.body for m in got] == [b"m0", b"m1", b"m2"]
    assert 0.9 <= loop.time() - t0 < 2.0
    for m in got:
        m.fin()
    # A full buffer goes out at once.
    t1 = loop.time()
    await pub.mpub("t", [b"x" * 1000] * 80)
    assert len(await take(buffered, 80, timeout=0.8)) == 80
    assert loop.time() - t1 < 0.8
    one.fin()


async def test_confirm_window_bounds_fresh_reads(node):
    n = await node(max_channel_window=10)
    c = await connect(n)
    await c.sub("t", "c", rdy=100)
    pub = await connect(n)
    await pub.mpub("t", [b"%d" % i for i in range(50)])
    first = await take(c, 10)
    await nothing_arrives(c, 0.4)
    for m in first[1:]:
        m.fin()  # the first stays unfinished: the window cannot move past it
    await nothing_arrives(c, 0.4)
    first[0].fin()
    more = await take(c, 10)
    assert [m.body for m in more] == [b"%d" % i for i in range(10, 20)]


async def test_retention_keeps_what_a_channel_needs(node, tmp_path):
    n = await node(segment_bytes=4096, retention_check_interval_ms=100)
    fast, slow = await connect(n), await connect(n)
    await fast.sub("t", "fast", rdy=500)
    await slow.sub("t", "slow", rdy=0)
    pub = await connect(n)
    for _ in range(20):  # a batch is never split, so 20 writes of ~2.4 KB: ~12 segments
        await pub.mpub("t", [b"y" * 200 for _ in range(10)])
    for m in await take(fast, 200):
        m.fin()
    seg_dir = os.path.join(str(tmp_path / "data"), "t.topic", "0", "data")
    await asyncio.sleep(0.5)
    assert len(glob.glob(os.path.join(seg_dir, "*.dat"))) > 10, "segments the slow channel needs were dropped"
    slow.rdy(500)
    for m in await take(slow, 200):
        m.fin()
    await asyncio.sleep(0.8)
    assert len(glob.glob(os.path.join(seg_dir, "*.dat"))) == 1, "confirmed segments were not dropped"


async def test_retention_min_age_keeps_finished_history_for_replay(node, tmp_path):
    n = await node(segment_bytes=4096, retention_check_interval_ms=100,
                   retention_min_age_ms=2000)
    c = await connect(n)
    await c.sub("t", "c", rdy=500)
    pub = await connect(n)
    for _ in range(20):
        await pub.mpub("t", [b"y" * 200 for _ in range(10)])
    for m in await take(c, 200):
        m.fin()
    seg_dir = os.path.join(str(tmp_path / "data"), "t.topic", "0", "data")
    await asyncio.sleep(0.6)
    assert len(glob.glob(os.path.join(seg_dir, "*.dat"))) > 10, "finished history went early"
    await until(lambda: len(glob.glob(os.path.join(seg_dir, "*.dat"))) == 1, timeout=6)


async def test_retention_by_size_passes_a_stalled_channel(node, tmp_path):
    """--retention-max-bytes bounds a partition's data even when a channel never reads:
    the oldest segments go, and the stalled channel goes on from the oldest one left."""
    n = await node(segment_bytes=4096, retention_check_interval_ms=100,
                   retention_max_bytes=3 * 4096)
    stalled = await connect(n)
    await stalled.sub("t", "stalled", rdy=0)
    pub = await connect(n)
    for i in range(20):  # ~12 segments of ~2.4 KB writes
        await pub.mpub("t", [b"%03d" % (i * 10 + k) + b"y" * 197 for k in range(10)])
    seg_dir = os.path.join(str(tmp_path / "data"), "t.topic", "0", "data")
    q = n.topics["t"].partitions[0].queue

    def kept() -> int:  # a segment listed may be gone by its stat: retention runs meanwhile
        total = 0
        for f in glob.glob(os.path.join(seg_dir, "*.dat")):
            try:
                total += os.path.getsize(f)
            except FileNotFoundError:
                pass
        return total

    await until(lambda: kept() <= 3 * 4096, timeout=5)  # retention runs every 100 ms
    assert q.start_offset > 0
    first_kept = q.start_count
    stalled.rdy(500)
    got = []
    while True:
        try:
            (m,) = await take(stalled, 1, timeout=0.5)
        except asyncio.TimeoutError:
            break
        got.append(int(m.body[:3]))
        m.fin()
    assert got and got[-1] == 199, "the newest messages are kept"
    assert got == list(range(got[0], 200)), "from the oldest kept on, nothing skipped"
    assert got[0] == first_kept > 0, "what retention dropped is not delivered"


async def test_sample_rate_delivers_about_that_share(node):
    """IDENTIFY sample_rate: the client gets about that percentage of the channel's
    messages; the rest are finished for it (the channel does not wait for them)."""
    n = await node()
    c = await connect(n, sample_rate=30)
    await c.sub("t", "c", rdy=2500)
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(2000)])
    ch = n.topics["t"].partitions[0].channels["c"]
    got = 0
    while True:
        try:
            (m,) = await take(c, 1, timeout=0.5)
        except asyncio.TimeoutError:
            break
        got += 1
        m.fin()
    assert 450 <= got <= 750, got  # 30% of 2000 is 600
    await until(lambda: ch.cursor.confirmed == ch.queue.committed_end)


async def test_ephemeral_topic_is_not_kept_across_a_restart(node):
    n = await node()
    c = await connect(n)
    await c.sub("e#ephemeral", "c", rdy=0)
    pub = await connect(n)
    await pub.mpub("e#ephemeral", [b"old1", b"old2"])
    await n.stop()
    n = await node()
    assert "e#ephemeral" not in n.topics
    c = await connect(n)
    await c.sub("e#ephemeral", "c", rdy=10)
    await nothing_arrives(c)
    await pub.close()
    pub = await connect(n)
    await pub.pub("e#ephemeral", b"new")
    assert [m.body for m in await take(c, 1)] == [b"new"]


async def test_ephemeral_channel_goes_with_its_last_client(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "tmp#ephemeral", rdy=1)
    assert "tmp#ephemeral" in n.topics["t"].partitions[0].channels
    await c.close()
    for _ in range(50):
        if "tmp#ephemeral" not in n.topics["t"].partitions[0].channels:
            break
        await asyncio.sleep(0.02)
    assert "tmp#ephemeral" not in n.topics["t"].partitions[0].channels


async def test_dpub_is_delivered_after_its_delay(node):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c", rdy=5)
    pub = await connect(n)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await pub.dpub("t", 400, b"later")
    await pub.pub("t", b"now")
    (first,) = await take(c, 1)
    assert first.body == b"now"
    (second,) = await take(c, 1)
    assert second.body == b"later" and loop.time() - t0 >= 0.39


async def test_pipelined_publishes_are_answered_in_order(node):
    from nsqwire.commands import FrameParser, cmd_dpub, cmd_mpub, cmd_pub
    from nsqwire import protocol as p

    n = await node()
    warm = await connect(n)
    await warm.pub("t", b"creates the topic")
    reader, writer = await asyncio.open_connection("127.0.0.1", n.tcp_port)
    writer.write(p.MAGIC_V2 + b"".join(
        cmd_pub("t", b"%d" % i) if i % 3 else cmd_mpub("t", [b"%da" % i, b"%db" % i])
        for i in range(150)) + cmd_dpub("t", 10, b"d") + b"RDY 1\n")
    frames = FrameParser()
    got = []
    while len(got) < 152:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, f"closed after {got[-3:]}"
        frames.feed(data)
        got += list(frames.frames())
    # 151 OKs in command order, then RDY before SUB: the fatal state error comes last
    assert got[:151] == [(p.FRAME_RESPONSE, b"OK")] * 151
    assert got[151] == (p.FRAME_ERROR, b"E_INVALID cannot RDY in current state")
    c = await connect(n)
    await c.sub("t", "c", rdy=300)
    bodies = [m.body for m in await take(c, 1 + 100 + 100 + 1)]
    expected = [b"creates the topic"]
    for i in range(150):
        expected += [b"%d" % i] if i % 3 else [b"%da" % i, b"%db" % i]
    assert bodies[:-1] == expected and bodies[-1] == b"d"
    writer.close()
