"""The channel's disk delay queue, through a real nsqd over real sockets.

Long delays are tested without waiting: the node's clock is injectable (`NSQD.clock`),
and only due times read it; in-flight timeouts keep the monotonic clock.
"""

import asyncio
import json
import os
import shutil
import urllib.request

import pytest

from nodes import connect, nothing_arrives, take, until
from nsqclient.conn import Connection, NSQError
from servers import NsqdProcess

DAY_MS = 86_400_000


class FakeClock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def channel_of(n, topic="t", name="c"):
    return n.topics[topic].partitions[0].channels[name]


async def one_message_requeued_for_half_an_hour(node, clock):
    """A node on `clock`, a consumer (RDY 5) of t/c, and one message it REQs for 30
    minutes: past the 60 s threshold, so to the delay store."""
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=5)
    pub = await connect(n)
    await pub.pub("t", b"retry-me")
    (m,) = await take(c)
    m.req(30 * 60_000)
    return n, c, channel_of(n)


async def test_long_req_goes_to_disk_and_comes_back_when_due(node):
    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=5)
    pub = await connect(n)
    await pub.mpub("t", [b"retry-me", b"next"])
    first, second = await take(c, 2)
    first.req(30 * 60_000)  # half an hour: past the 60 s threshold
    second.fin()
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1 and ch.cursor.window_size == 0)
    assert ch.cursor.confirmed == ch.queue.committed_end, "the moved message must count as confirmed"
    await nothing_arrives(c)
    clock.advance(29 * 60)
    await nothing_arrives(c)
    clock.advance(61)
    (back,) = await take(c)
    assert (back.body, back.attempts, back.id) == (b"retry-me", 2, first.id)
    back.fin()
    await until(lambda: ch.delayed_count == 0)


async def test_channel_empty_gives_a_delayed_message_in_flight_back_to_the_store(node):
    """Emptying a channel drops what it holds in memory; a message brought back from the
    delay store (still "taken" there) goes back to the store, due now, not stranded until
    a restart."""
    clock = FakeClock()
    n, c, ch = await one_message_requeued_for_half_an_hour(node, clock)
    await until(lambda: ch.delayed_count == 1 and ch.delay.waiting == 1)
    clock.advance(31 * 60)
    (back,) = await take(c)
    assert ch.delay.taken == 1
    ch.empty()
    await until(lambda: ch.delay.waiting == 1 and ch.delay.taken == 0)
    (again,) = await take(c)  # due now: it comes back
    assert again.body == b"retry-me"
    again.fin()
    await until(lambda: ch.delayed_count == 0)


async def test_a_store_whose_writes_keep_failing_is_given_up(node, monkeypatch):
    """Moves the store cannot write come back to the channel's memory after a few tries,
    and are delivered when due: nothing waits on a broken store (nor is lost)."""
    from delayqueue.store import DelayStore, DelayStoreError

    def broken_put(self, items):
        raise DelayStoreError(f"{self.data_file}: write failed: MDB_DISKFULL (simulated)")

    monkeypatch.setattr(DelayStore, "put", broken_put)
    clock = FakeClock()
    n, c, ch = await one_message_requeued_for_half_an_hour(node, clock)
    await until(lambda: len(ch.deferred) == 1, timeout=10)
    assert not ch.delay.available and "MDB_DISKFULL" in ch.delay.error
    assert ch.cursor.confirmed < ch.queue.committed_end, "never confirmed: it is not on disk"
    clock.advance(31 * 60)
    (back,) = await take(c)
    assert back.body == b"retry-me" and back.attempts == 2
    back.fin()
    await until(lambda: ch.cursor.confirmed == ch.queue.committed_end)


async def test_dpub_of_days_waits_on_disk(node):
    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=5)
    pub = await connect(n)
    await pub.dpub("t", 3 * DAY_MS, b"in three days")
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1)
    clock.advance(3 * 86_400 - 5)
    await nothing_arrives(c)
    clock.advance(6)
    (m,) = await take(c)
    assert m.body == b"in three days" and m.attempts == 1


async def test_often_retried_message_waits_on_disk_between_tries(node):
    n = await node(delay_after_attempts=3)
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.pub("t", b"flaky")
    ch = channel_of(n)
    for attempt in range(1, 6):
        (m,) = await take(c)
        assert m.attempts == attempt
        m.req(0)
        if attempt >= 3:
            await until(lambda: ch.delayed_count == 1)
    (m,) = await take(c)
    m.fin()
    await until(lambda: ch.delayed_count == 0 and not ch.deferred)


async def test_due_time_precision_under_no_load(node):
    n = await node(delay_threshold_ms=500)
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await pub.dpub("t", 1500, b"timed")
    (m,) = await take(c, timeout=5)
    elapsed = loop.time() - t0
    assert channel_of(n).delay is not None and channel_of(n).delay.available
    assert 1.5 <= elapsed <= 2.5, f"due at T+1.5 s, delivered at T+{elapsed:.2f} s"


async def test_http_actions_requeue_now_and_empty(node):
    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=10)
    pub = await connect(n)
    for i in range(4):
        await pub.dpub("t", DAY_MS, b"d%d" % i)
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 4)

    def post(path):
        req = urllib.request.Request(f"http://127.0.0.1:{n.http_port}{path}", data=b"",
                                     method="POST")
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    stats = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(
        f"http://127.0.0.1:{n.http_port}/stats?format=json").read()))
    cstats = stats["topics"][0]["channels"][0]
    assert cstats["partitions"][0]["delayed_count"] == 4 and cstats["deferred_count"] == 4
    assert await asyncio.to_thread(post, "/channel/delay/requeue?topic=t&channel=c") == {"count": 4}
    got = await take(c, 4)
    assert sorted(m.body for m in got) == [b"d0", b"d1", b"d2", b"d3"]
    for m in got:
        m.req(DAY_MS)
    await until(lambda: ch.delayed_count == 4 and ch.delay.taken == 0)
    assert await asyncio.to_thread(post, "/channel/delay/empty?topic=t&channel=c") == {"count": 4}
    assert ch.delayed_count == 0
    clock.advance(2 * 86_400)
    await nothing_arrives(c)


async def test_deleting_a_channel_deletes_its_delay_queue(node, tmp_path):
    n = await node()
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    pub = await connect(n)
    await pub.dpub("t", DAY_MS, b"x")
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1)
    path = ch.delay.path
    assert os.path.isdir(path)
    await c.close()
    await n.delete_channel("t", "c")
    assert not os.path.exists(path)


async def test_bad_delays(node):
    n = await node(max_req_timeout_ms=DAY_MS)
    pub = await connect(n)
    with pytest.raises(NSQError, match=r"E_INVALID DPUB timeout 86400001 out of range 0-86400000"):
        await pub.dpub("t", DAY_MS + 1, b"too late")
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    p2 = await connect(n)
    await p2.pub("t", b"m")
    (m,) = await take(c)
    # as classic nsqd: a negative REQ timeout is not a number (fatal); the message goes back
    m.conn.send(b"REQ " + m.id + b" -5\n")
    await asyncio.wait_for(c.closed.wait(), 5)
    assert c.errors == ["E_INVALID REQ could not parse timeout -5"]
    c2 = await connect(n)
    await c2.sub("t", "c", rdy=1)
    (again,) = await take(c2)
    assert again.attempts == 2
    # an absurd but numeric timeout is clamped to --max-req-timeout, as classic nsqd does
    again.conn.send(b"REQ " + again.id + b" 99999999999999\n")
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1)
    assert ch.delay.oldest_due_ms <= int(n.clock() * 1000) + DAY_MS


def test_max_req_timeout_is_bounded_by_seven_days():
    from nsqd.options import from_args

    assert from_args(["--max-req-timeout", "168h"]).max_req_timeout_ms == 7 * DAY_MS
    with pytest.raises(ValueError, match="7 days"):
        from_args(["--max-req-timeout", "169h"])


async def stopped_node_with_a_delayed_message(tmp_path):
    """An nsqd (stopped cleanly) whose channel t/c holds a day-long DPUB in its delay
    store; returns it and the store's folder."""
    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        c = await Connection("127.0.0.1", proc.tcp_port).connect()
        await c.sub("t", "c", rdy=1)  # a consumer makes the channel read (and defer) it
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.dpub("t", DAY_MS, b"later")
        await pub.close()
        await asyncio.sleep(0.5)
        await c.close()
        assert proc.stop() == 0
    except BaseException:
        proc.kill()
        raise
    return proc, os.path.join(proc.data_path, "t.topic", "0", "delay", "c.channel")


async def test_corrupt_delay_store_names_the_file_and_the_node_still_serves(tmp_path):
    proc, folder = await stopped_node_with_a_delayed_message(tmp_path)
    try:
        data_mdb = os.path.join(folder, "data.mdb")
        assert os.path.exists(data_mdb)
        with open(data_mdb, "r+b") as f:
            f.write(os.urandom(8192))
        proc.start()
        stats = json.loads(urllib.request.urlopen(
            f"http://{proc.http_address}/stats?format=json").read())
        error = stats["topics"][0]["channels"][0]["partitions"][0]["delay_error"]
        assert error and "data.mdb" in error
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.pub("t2", b"still serving")
        c = await Connection("127.0.0.1", proc.tcp_port).connect()
        await c.sub("t2", "c", rdy=1)
        (m,) = await take(c)
        assert m.body == b"still serving"
    finally:
        proc.kill()


async def test_a_missing_delay_store_is_an_error_not_a_new_empty_store(tmp_path):
    """The store held messages whose log offsets count as confirmed: if its folder is gone
    at start, the channel says so (naming the folder) instead of starting an empty one."""
    import shutil

    proc, folder = await stopped_node_with_a_delayed_message(tmp_path)
    try:
        shutil.rmtree(folder)
        for _ in range(2):  # and it stays an error: no empty store is made in its place
            proc.start()
            stats = json.loads(urllib.request.urlopen(
                f"http://{proc.http_address}/stats?format=json").read())
            error = stats["topics"][0]["channels"][0]["partitions"][0]["delay_error"]
            assert error and folder in error and "missing" in error
            assert not os.path.exists(folder)
            assert proc.stop() == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("round_", range(4))
async def test_kill_9_while_messages_move_through_the_delay_queue(tmp_path, round_):
    """Guarantee: every acknowledged message is delivered again after a crash unless it was
    finished; a FIN older than the cursor checkpoint interval (1 s) never comes back."""
    import random
    import time

    proc = NsqdProcess(str(tmp_path / "n"), "--delay-threshold", "200ms").start()
    bodies = {b"k%d" % i for i in range(400)}
    finished_at: dict[bytes, float] = {}
    try:
        sub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await sub.sub("t", "c", rdy=50)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        for i in range(0, 400, 50):
            await pub.mpub("t", sorted(bodies)[i:i + 50])

        async def consume():
            while True:
                m = await sub.messages.get()
                if m.attempts == 1:
                    m.req(random.choice([250, 400, 600]))  # past the threshold: to disk
                else:
                    m.fin()
                    finished_at[m.body] = time.monotonic()

        task = asyncio.create_task(consume())
        await asyncio.sleep(random.uniform(0.3, 1.5))
        proc.kill()
        killed_at = time.monotonic()
        task.cancel()
        await sub.close()
        await pub.close()

        proc.start()
        again = await Connection("127.0.0.1", proc.tcp_port).connect()
        await again.sub("t", "c", rdy=100)
        seen: set[bytes] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not (bodies - finished_at.keys()) <= seen and loop.time() < deadline:
            try:
                m = await asyncio.wait_for(again.messages.get(), 1)
            except asyncio.TimeoutError:
                continue
            seen.add(m.body)
            m.fin()
        lost = bodies - finished_at.keys() - seen
        assert not lost, f"{len(lost)} unfinished messages lost after kill -9"
        old_fins = {b for b in seen & finished_at.keys() if killed_at - finished_at[b] > 1.5}
        assert not old_fins, f"{len(old_fins)} messages finished >1.5 s before the crash came back"
        await again.close()
    finally:
        proc.kill()


async def test_a_message_moved_to_the_store_keeps_its_delay_across_a_crash(tmp_path):
    """REQ'd for an hour, moved to the delay store, then kill -9 before the cursor was
    saved: after the restart the log record is read again, but the store owns it; it
    must not be delivered now as a fresh message."""
    proc = NsqdProcess(str(tmp_path / "n"), "--checkpoint-interval", "1h").start()
    try:
        sub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await sub.sub("t", "c", rdy=10)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.mpub("t", [b"later%d" % i for i in range(5)] + [b"now"])
        for _ in range(6):
            m = await asyncio.wait_for(sub.messages.get(), 5)
            if m.body == b"now":
                m.fin()
            else:
                m.req(3_600_000)
        stats = {}
        for _ in range(100):  # the moves are written in the background
            stats = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{proc.http_port}/stats?format=json&topic=t").read())
            if stats["topics"][0]["channels"][0]["partitions"][0]["delayed_count"] == 5:
                break
            await asyncio.sleep(0.05)
        assert stats["topics"][0]["channels"][0]["partitions"][0]["delayed_count"] == 5
        proc.kill()
        proc.start()
        again = await Connection("127.0.0.1", proc.tcp_port).connect()
        await again.sub("t", "c", rdy=10)
        seen = []
        try:
            while True:
                seen.append((await asyncio.wait_for(again.messages.get(), 1.5)).body)
        except asyncio.TimeoutError:
            pass
        assert all(not b.startswith(b"later") for b in seen), seen
        stats = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{proc.http_port}/stats?format=json&topic=t").read())
        assert stats["topics"][0]["channels"][0]["partitions"][0]["delayed_count"] == 5
        await again.close()
    finally:
        proc.kill()


async def test_deferred_messages_do_not_stall_reading_with_a_small_rdy(node):
    n = await node(FakeClock())
    c = await connect(n)
    await c.sub("t", "c", rdy=1)
    channel_of(n).pause()  # everything is published before the channel reads: one wake
    pub = await connect(n)
    for i in range(300):
        await pub.dpub("t", DAY_MS, b"later%d" % i)
    await pub.pub("t", b"now")
    channel_of(n).unpause()
    (m,) = await take(c, timeout=3)
    assert m.body == b"now"
    await until(lambda: channel_of(n).delayed_count == 300)
    assert channel_of(n).delay.flushes < 30, "moves to the store must share writes"


# ---- what followers get: handover.replica_of, and a new leader's takeover ----------------

async def log_records(queue) -> list:
    reader = queue.reader(queue.start_offset)
    try:
        return await reader.read(1000)
    finally:
        reader.close()


async def test_a_new_leader_puts_a_held_dpub_back_and_redelivers_nothing_finished(node,
                                                                                   tmp_path):
    """A DPUB deferred an hour among published messages, every other message FINed: the
    checkpoint passes the DPUB (the store holds it), and so does what followers get, which
    lists it in `held`. A node that opens the channel from that state over the same log,
    without the store (as a new leader does), puts the DPUB into its own store, delivers
    none of the finished messages again, and the DPUB when due, once."""
    from nsqd.handover import replica_of
    from nsqd.metastore import MetaStore, channel_key
    from nsqd.replica import Held, checkpoint_of, decode_held
    from nsqd.topic import delay_folder

    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(5)])
    await pub.dpub("t", 3_600_000, b"in an hour")
    await pub.mpub("t", [b"m%d" % i for i in range(6, 10)])
    for m in await take(c, 9):
        m.fin()
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1 and ch.cursor.confirmed == ch.queue.committed_end)
    records = await log_records(ch.queue)
    (dpub,) = [r for r in records if r.body == b"in an hour"]
    state = ch.checkpoint()
    assert state["confirmed"] == ch.queue.committed_end and state["delay_store"]
    replica = await replica_of(ch, state)
    assert replica == await replica_of(ch, state), "the same store, the same state"
    opened = checkpoint_of(replica)
    assert (opened["confirmed"], opened["next_read"]) == (state["confirmed"], state["next_read"])
    assert (replica["confirmed"], replica["next_read"]) == (dpub.offset, dpub.offset), \
        "the classic cursor (an nsqd without `held` reads it) stops at the held DPUB"
    assert replica["delay_store"] is False and "held" not in state
    due_ms = int(clock() * 1000) + 3_600_000
    assert decode_held(replica["held"]) == [Held(dpub.offset, dpub.msg_id, due_ms, 0)]
    await c.close()
    await pub.close()
    await n.stop()

    # The new leader: the same log, no delay store, the channel state followers got.
    partition_path = ch.queue.path
    meta = MetaStore(str(tmp_path / "data" / "nsqd.meta.sqlite"))
    meta.put(channel_key("t", 0, "c"), replica)
    meta.close()
    shutil.rmtree(delay_folder(partition_path, "c"))
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    ch = channel_of(n)
    await until(lambda: ch.held is None and ch.delayed_count == 1)
    assert "held" not in ch.checkpoint() and ch.checkpoint()["delay_store"] is True
    await nothing_arrives(c)
    clock.advance(3599)
    await nothing_arrives(c)
    clock.advance(2)
    (due,) = await take(c)
    assert (due.body, due.id, due.attempts) == (b"in an hour", b"%016x" % dpub.msg_id, 1)
    due.fin()
    await nothing_arrives(c)


async def test_a_takeover_replaces_a_stale_store_and_runs_again_after_a_crash(node, tmp_path):
    """The state followers got lists a DPUB; this node's store also holds a message REQ'd
    after that state was taken (left from its own older term). Opened from that state, the
    channel's store holds exactly the DPUB, and the REQ'd message, which the state does not
    count as finished, is read from the log again and delivered at once. A crash before
    the checkpoint without `held` was saved (the state is the same, the store already
    filled) runs the takeover again: the DPUB is held once and delivered once, when due."""
    from nsqd.handover import replica_of
    from nsqd.metastore import MetaStore, channel_key

    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    pub = await connect(n)
    await pub.mpub("t", [b"m%d" % i for i in range(5)])
    await pub.dpub("t", 3_600_000, b"in an hour")
    for m in await take(c, 5):
        m.fin()
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1 and ch.cursor.confirmed == ch.queue.committed_end)
    replica = await replica_of(ch, ch.checkpoint())
    await pub.pub("t", b"late")
    (late,) = await take(c)
    late.req(30 * 60_000)
    await until(lambda: ch.delayed_count == 2 and ch.cursor.confirmed == ch.queue.committed_end)
    await c.close()
    await pub.close()
    await n.stop()

    def as_followers_got_it():
        meta = MetaStore(str(tmp_path / "data" / "nsqd.meta.sqlite"))
        meta.put(channel_key("t", 0, "c"), replica)
        meta.close()

    as_followers_got_it()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    (again,) = await take(c)
    assert (again.body, again.attempts) == (b"late", 1), "read from the log, not the stale store"
    again.fin()
    ch = channel_of(n)
    await until(lambda: ch.held is None and ch.delayed_count == 1)
    assert [(m.body, m.due_ms) for _, m in ch.delay.store.scan()] == [
        (b"in an hour", int(clock() * 1000) + 3_600_000)]
    await c.close()
    await n.stop()

    as_followers_got_it()  # the crash: the takeover's checkpoint never saved
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    (again,) = await take(c)
    assert again.body == b"late", "FINed after the state followers got: at least once"
    again.fin()
    ch = channel_of(n)
    await until(lambda: ch.held is None and ch.delayed_count == 1)
    clock.advance(3601)
    (due,) = await take(c)
    assert due.body == b"in an hour"
    due.fin()
    await nothing_arrives(c)


async def test_a_held_message_not_in_the_log_sends_the_cursor_back_to_it(node, tmp_path):
    """A held entry whose record at its origin is another message (or none): never lost in
    silence: the channel reads the log again from there, as before `held` existed (the
    messages after it come again, the DPUB is deferred again by its ext header)."""
    from nsqd.handover import replica_of
    from nsqd.metastore import MetaStore, channel_key
    from nsqd.replica import decode_held, encode_held
    from nsqd.topic import delay_folder

    clock = FakeClock()
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    pub = await connect(n)
    await pub.dpub("t", 3_600_000, b"in an hour")
    await pub.mpub("t", [b"m%d" % i for i in range(3)])
    for m in await take(c, 3):
        m.fin()
    ch = channel_of(n)
    await until(lambda: ch.delayed_count == 1 and ch.cursor.confirmed == ch.queue.committed_end)
    replica = await replica_of(ch, ch.checkpoint())
    (h,) = decode_held(replica["held"])
    replica["held"] = encode_held([h._replace(msg_id=h.msg_id + 1)])
    partition_path = ch.queue.path
    await c.close()
    await pub.close()
    await n.stop()
    meta = MetaStore(str(tmp_path / "data" / "nsqd.meta.sqlite"))
    meta.put(channel_key("t", 0, "c"), replica)
    meta.close()
    shutil.rmtree(delay_folder(partition_path, "c"))
    n = await node(clock)
    c = await connect(n)
    await c.sub("t", "c", rdy=20)
    assert sorted(m.body for m in await take(c, 3)) == [b"m0", b"m1", b"m2"]
    ch = channel_of(n)
    await until(lambda: ch.held is None and ch.delayed_count == 1)
    clock.advance(3601)
    (due,) = await take(c)
    assert due.body == b"in an hour"


async def test_what_followers_get_lists_a_requeued_message_while_the_store_holds_it(node):
    """A message REQ'd past the threshold is in the store: what followers get lists it with
    its due time and attempts while it is there (waiting, then brought back and in flight),
    counting it finished, and no longer once it is FINed. A channel without a store gives
    followers its checkpoint with an empty list."""
    from nsqd.handover import replica_of
    from nsqd.replica import Held, checkpoint_of, decode_held

    clock = FakeClock()
    n, c, ch = await one_message_requeued_for_half_an_hour(node, clock)
    plain = await connect(n)
    await plain.sub("t", "plain", rdy=0)
    state = channel_of(n, name="plain").checkpoint()
    assert state["delay_store"] is False
    assert await replica_of(channel_of(n, name="plain"), state) == dict(state, held=b"")
    pub = await connect(n)
    await pub.pub("t", b"after")
    (after,) = await take(c)
    after.fin()
    await until(lambda: ch.delayed_count == 1 and ch.cursor.confirmed == ch.queue.committed_end)
    (held, _) = await log_records(ch.queue)
    due_ms = int(clock() * 1000) + 30 * 60_000
    replica = await replica_of(ch, ch.checkpoint())
    assert checkpoint_of(replica)["confirmed"] == ch.queue.committed_end
    assert replica["confirmed"] == held.offset, "the classic cursor stops at it"
    assert decode_held(replica["held"]) == [Held(held.offset, held.msg_id, due_ms, 1)]
    clock.advance(31 * 60)
    (back,) = await take(c)
    assert ch.delay.taken == 1 and back.attempts == 2
    replica = await replica_of(ch, ch.checkpoint())
    assert decode_held(replica["held"]) == [Held(held.offset, held.msg_id, due_ms, 1)], \
        "in flight: still held"
    back.fin()
    await until(lambda: ch.delayed_count == 0)
    state = ch.checkpoint()
    replica = await replica_of(ch, state)
    assert replica == dict(state, delay_store=False, held=b"") and state["delay_store"] is True
    assert replica["confirmed"] == ch.queue.committed_end


async def test_a_late_store_read_never_undoes_a_newer_one(tmp_path):
    """The poller's and the flusher's reads of the store run in two threads: a read that
    reaches the loop after a newer one is dropped, so `min_origin` never loses a message
    the cursor has already passed."""
    from types import SimpleNamespace

    from nsqd.delaying import ChannelDelay

    stored = []
    d = ChannelDelay(str(tmp_path / "c.channel"), stored.extend, lambda held: None)
    await d.open()

    def log_message(msg_id, offset):
        return SimpleNamespace(msg_id=msg_id, trace_id=0, timestamp=0, attempts=1, ext=b"",
                               body=b"x", offset=offset, delayed=False)

    d.move(log_message(2, 200), 10**13)
    await until(lambda: len(stored) == 1)
    assert d.min_origin == (200, 2)
    late = await asyncio.to_thread(d._read_state)  # read now, reaches the loop later
    d.move(log_message(1, 100), 10**13)
    await until(lambda: len(stored) == 2)
    assert d.min_origin == (100, 1)
    d._refresh(*late)
    assert d.min_origin == (100, 1) and d.waiting == 2
    await d.close()
