"""/topic/delete and /channel/delete are crash-safe, and a topic deleted and created again
never shares files with its old self.

Real nsqd processes, real kills: SIGKILL at random moments of a delete, then the node
must start, every other topic must be intact, and the deleted topic or channel must be
either fully gone or fully there. Publishers keep publishing through a delete; every
PUB sent after the delete answered must survive a clean restart and a kill -9.
"""

import asyncio
import json
import os
import random
import time
import urllib.request

import pytest

from nsqclient.conn import Connection
from servers import NsqdProcess

KEEP_MESSAGES = 200


def http(proc: NsqdProcess, method: str, path: str, timeout: float = 10):
    """(status, body) of one request; errors give their status."""
    req = urllib.request.Request(f"http://{proc.http_address}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stats(proc: NsqdProcess) -> dict:
    status, body = http(proc, "GET", "/stats?format=json")
    assert status == 200, body
    return {t["topic_name"]: t for t in json.loads(body)["topics"]}


def channel_stats(proc: NsqdProcess, topic: str, channel: str) -> dict | None:
    t = stats(proc).get(topic)
    if t is None:
        return None
    return next((c for c in t["channels"] if c["channel_name"] == channel), None)


async def fill(proc: NsqdProcess, topic: str, batches: int, size: int = 2000) -> None:
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    try:
        for i in range(batches):
            await conn.mpub(topic, [b"%d-%d-" % (i, j) + b"x" * size for j in range(50)])
    finally:
        await conn.close()


async def kill_during(proc: NsqdProcess, path: str, delay_s: float) -> None:
    """POST `path` and SIGKILL the node `delay_s` after sending it."""
    request = asyncio.create_task(asyncio.to_thread(http, proc, "POST", path))
    await asyncio.sleep(delay_s)
    proc.kill()
    try:
        await request
    except OSError:
        pass


def check_keep(proc: NsqdProcess) -> None:
    """The topic no delete touched is all there."""
    c = channel_stats(proc, "keep", "c")
    assert c is not None, "an untouched topic lost its channel"
    assert c["depth"] == KEEP_MESSAGES, c


async def setup_keep(proc: NsqdProcess) -> None:
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    await conn.sub("keep", "c", rdy=0)
    await conn.close()
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    await conn.mpub("keep", [b"k%d" % i for i in range(KEEP_MESSAGES)])
    await conn.close()


async def test_kill_during_topic_delete_never_stops_the_node(tmp_path):
    """10 kills at 0-20 ms into /topic/delete of a topic of many segments: every restart
    works, the other topic is intact, the deleted one is gone or whole, and no tombstone
    is left behind. (Before the tombstone rename, starts failed with MissingSegmentError.)"""
    proc = NsqdProcess(str(tmp_path / "n"), "--segment-bytes", "32768").start()
    try:
        await setup_keep(proc)
        deleted = kept = 0
        for trial in range(10):
            if "doomed" not in stats(proc):
                await fill(proc, "doomed", 24)  # about 2.4 MB: 75 segments
                conn = await Connection("127.0.0.1", proc.tcp_port).connect()
                await conn.sub("doomed", "c", rdy=0)
                await conn.close()
            depth = channel_stats(proc, "doomed", "c")["depth"]
            await kill_during(proc, "/topic/delete?topic=doomed", random.uniform(0, 0.02))
            proc.start()
            check_keep(proc)
            doomed = channel_stats(proc, "doomed", "c")
            if doomed is None:
                assert "doomed" not in stats(proc)
                deleted += 1
            else:
                assert doomed["depth"] == depth, f"trial {trial}: a half-deleted topic"
                kept += 1
            leftovers = [n for n in os.listdir(proc.data_path) if n.endswith(".deleted")]
            assert not leftovers, leftovers
        assert deleted, "no kill landed after the delete was durable"
    finally:
        proc.kill()


async def test_kill_during_channel_delete_leaves_it_gone_or_whole(tmp_path):
    """10 kills at 0-20 ms into /channel/delete of a channel whose delay store holds
    messages: the channel is gone, or back with its delay store and all it held."""
    proc = NsqdProcess(str(tmp_path / "n"), "--checkpoint-interval", "100ms").start()
    try:
        await setup_keep(proc)
        deleted = 0
        for trial in range(10):
            if channel_stats(proc, "t", "slow") is None:
                consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
                await consumer.sub("t", "slow", rdy=10)
                pub = await Connection("127.0.0.1", proc.tcp_port).connect()
                for i in range(20):
                    await pub.dpub("t", 3_600_000, b"later %d" % i)
                await pub.close()
                deadline = time.monotonic() + 10
                while channel_stats(proc, "t", "slow")["partitions"][0]["delayed_count"] < 20:
                    assert time.monotonic() < deadline, "messages never reached the delay store"
                    await asyncio.sleep(0.05)
                await consumer.close()
                await asyncio.sleep(0.3)  # past a checkpoint: the cursor knows of its store
            await kill_during(proc, "/channel/delete?topic=t&channel=slow",
                              random.uniform(0, 0.02))
            proc.start()
            check_keep(proc)
            slow = channel_stats(proc, "t", "slow")
            if slow is None:
                deleted += 1
            else:  # its delay store opens in the background: give it a moment
                deadline = time.monotonic() + 5
                while (part := channel_stats(proc, "t", "slow")["partitions"][0])[
                        "delayed_count"] != 20 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert part["delayed_count"] == 20 and not part["error"], (trial, part)
            delay = os.path.join(proc.data_path, "t.topic", "0", "delay")
            leftovers = [n for n in os.listdir(delay) if not n.endswith(".channel")]
            assert not leftovers, leftovers
        assert deleted, "no kill landed after the delete was durable"
    finally:
        proc.kill()


async def test_start_finishes_a_half_done_delete(tmp_path):
    """The state a kill leaves between the rename and the metadata commit: the topic and
    the channel are still in the metadata, their folders are tombstones. The node starts,
    finishes both deletes, removes the tombstones, and the other topic is intact."""
    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        await setup_keep(proc)
        await fill(proc, "doomed", 2)
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "slow", rdy=1)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.dpub("t", 3_600_000, b"later")
        await pub.close()
        while channel_stats(proc, "t", "slow")["partitions"][0]["delayed_count"] < 1:
            await asyncio.sleep(0.05)
        await consumer.close()
        assert proc.stop() == 0
        data = proc.data_path
        os.rename(os.path.join(data, "doomed.topic"), os.path.join(data, "doomed.topic.1.deleted"))
        delay = os.path.join(data, "t.topic", "0", "delay")
        os.rename(os.path.join(delay, "slow.channel"),
                  os.path.join(delay, "slow.channel.1.deleted"))
        proc.start()
        assert "doomed" not in stats(proc)
        assert channel_stats(proc, "t", "slow") is None
        check_keep(proc)
        assert not [n for n in os.listdir(data) if n.endswith(".deleted")]
        assert os.listdir(delay) == []
        assert "delete_finished" in proc.log()
    finally:
        proc.kill()


async def publish_through_delete(proc: NsqdProcess, topic: str, publishers: int = 4,
                                 channels: int = 4):
    """Publishers publish one PUB at a time while the topic, read by `channels` consumers,
    is deleted once. Returns the
    bodies whose PUB was sent after the delete answered and acknowledged."""
    must_survive: set[bytes] = set()
    deleted_at = [None]
    stop = asyncio.Event()

    async def publisher(n: int):
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        seq = 0
        try:
            while not stop.is_set():
                body = b"p%d-%d" % (n, seq)
                seq += 1
                sent_after = deleted_at[0] is not None
                try:
                    await conn.pub(topic, body)
                except Exception:  # E_PUB_FAILED from the topic being closed: not acked
                    if sent_after:
                        raise
                    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
                    continue
                if sent_after:
                    must_survive.add(body)
        finally:
            await conn.close()

    async def consumer(channel: str):
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.sub(topic, channel, rdy=100)
        while not stop.is_set() and not conn.closed.is_set():
            try:
                (await asyncio.wait_for(conn.messages.get(), 0.2)).fin()
            except asyncio.TimeoutError:
                pass
        await conn.close()

    tasks = [asyncio.create_task(publisher(n)) for n in range(publishers)]
    consumers = [asyncio.create_task(consumer(f"c{n}")) for n in range(channels)]
    await asyncio.sleep(0.5)
    status, body = await asyncio.to_thread(http, proc, "POST", f"/topic/delete?topic={topic}")
    assert status == 200, body
    deleted_at[0] = time.monotonic()
    await asyncio.sleep(0.7)
    stop.set()
    await asyncio.gather(*tasks)
    await asyncio.gather(*consumers, return_exceptions=True)
    return must_survive


async def drain(proc: NsqdProcess, topic: str, expect: set) -> set:
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    await conn.sub(topic, "check", rdy=1000)
    seen = set()
    try:
        while not expect <= seen:
            try:
                msg = await asyncio.wait_for(conn.messages.get(), 5)
            except asyncio.TimeoutError:
                break
            seen.add(msg.body)
            msg.fin()
    finally:
        await conn.close()
    return seen


@pytest.mark.parametrize("restart", ["clean", "kill"])
async def test_messages_published_after_a_delete_survive(tmp_path, restart):
    """Four TCP publishers publish through a /topic/delete. Every PUB sent after the delete
    answered is there after a restart (before the fix, the re-created topic wrote into the
    old folder while it was being removed, and all of them were lost)."""
    proc = NsqdProcess(str(tmp_path / "n"), "--segment-bytes", "65536").start()
    try:
        await setup_keep(proc)
        await fill(proc, "busy", 20)
        must_survive = await publish_through_delete(proc, "busy")
        assert len(must_survive) > 100, "too few publishes after the delete to prove much"
        if restart == "clean":
            assert proc.stop() == 0
        else:
            proc.kill()
        proc.start()
        check_keep(proc)
        lost = must_survive - await drain(proc, "busy", must_survive)
        assert not lost, f"{len(lost)} of {len(must_survive)} acknowledged messages lost"
    finally:
        proc.kill()
