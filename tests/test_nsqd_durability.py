"""Every acknowledged PUB/MPUB survives kill -9 of nsqd; cursors survive restarts.

These tests really kill the nsqd process (SIGKILL) while producers publish.
"""

import asyncio
import random

import pytest

from nsqclient.conn import Connection
from servers import NsqdProcess


def body_of(producer: int, seq: int) -> bytes:
    return b"p%d-%d-" % (producer, seq) + b"x" * (seq % 300)


async def publish_until_killed(proc: NsqdProcess, topic: str, producers: int, acked: set,
                               kill_after: float):
    async def producer(n: int):
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        seq = 0
        try:
            while True:
                if seq % 5 == 4:
                    bodies = [body_of(n, seq + i) for i in range(10)]
                    await conn.mpub(topic, bodies)
                    acked.update(bodies)
                    seq += 10
                else:
                    body = body_of(n, seq)
                    await conn.pub(topic, body)
                    acked.add(body)
                    seq += 1
        except (ConnectionError, OSError):
            return
        finally:
            await conn.close()

    tasks = [asyncio.create_task(producer(n)) for n in range(producers)]
    await asyncio.sleep(kill_after)
    proc.kill()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def drain(port: int, topic: str, channel: str, expect: set, idle: float = 10) -> dict:
    """Consume until every body in `expect` was seen, or until nothing arrives for `idle`
    seconds; return body -> times seen. Linear in the messages consumed."""
    conn = await Connection("127.0.0.1", port).connect()
    await conn.sub(topic, channel, rdy=500)
    seen: dict[bytes, int] = {}
    missing = set(expect)
    try:
        while missing:
            try:
                msg = await asyncio.wait_for(conn.messages.get(), idle)
            except asyncio.TimeoutError:
                break
            seen[msg.body] = seen.get(msg.body, 0) + 1
            missing.discard(msg.body)
            msg.fin()
    finally:
        await conn.close()
    return seen


@pytest.mark.parametrize("round_", range(3))
async def test_acknowledged_messages_survive_kill_9(tmp_path, round_):
    proc = NsqdProcess(str(tmp_path / "n")).start()
    acked: set[bytes] = set()
    try:
        # a channel exists before publishing, so it must receive everything
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.sub("orders", "billing")
        await conn.close()
        await publish_until_killed(proc, "orders", 20, acked, random.uniform(0.3, 1.0))
        assert acked, "nothing was acknowledged before the kill"
        proc.start()
        seen = await drain(proc.tcp_port, "orders", "billing", acked)
        lost = acked - seen.keys()
        assert not lost, f"{len(lost)} acknowledged messages lost of {len(acked)}"
    finally:
        proc.kill()


async def test_a_channel_made_just_before_a_crash_keeps_what_was_published_for_it(tmp_path):
    """A second channel made by SUB, a publish it must see, then kill -9 before any cursor
    checkpoint: the channel is on disk from its SUB's OK, so after the restart it still
    starts where it was made, not at the topic's end."""
    proc = NsqdProcess(str(tmp_path / "n"), "--checkpoint-interval", "1h").start()
    try:
        first = await Connection("127.0.0.1", proc.tcp_port).connect()
        await first.sub("t", "first")
        await first.close()
        second = await Connection("127.0.0.1", proc.tcp_port).connect()
        await second.sub("t", "second")
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.pub("t", b"for both")
        proc.kill()
        await second.close()
        await pub.close()
        proc.start()
        for channel in ("first", "second"):
            seen = await drain(proc.tcp_port, "t", channel, {b"for both"})
            assert b"for both" in seen, f"channel {channel} lost an acknowledged message"
    finally:
        proc.kill()


async def test_confirmed_cursor_survives_clean_restart(tmp_path):
    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.sub("t", "c")
        await conn.close()
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.mpub("t", [b"m%d" % i for i in range(100)])
        await conn.close()
        seen = await drain(proc.tcp_port, "t", "c", {b"m%d" % i for i in range(60)})
        assert len(seen) >= 60
        await asyncio.sleep(0.3)  # let the last FINs arrive before the stop
        assert proc.stop() == 0, "SIGTERM must drain and exit 0"
        proc.start()
        rest = await drain(proc.tcp_port, "t", "c", {b"m%d" % i for i in range(100)} - seen.keys(),
                           idle=3)
        # FIN'd messages are not redelivered after a clean stop; the others all arrive
        assert not (rest.keys() & {k for k, v in seen.items()}), "finished messages came back"
        assert rest.keys() | seen.keys() == {b"m%d" % i for i in range(100)}
    finally:
        proc.kill()
