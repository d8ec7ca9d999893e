"""A channel's checkpoint keeps what was finished beyond a gap, and the attempts of what was
not: after kill -9 only the unfinished messages come back, with their attempts carried on.

Real nsqd processes (tests/servers.py), real sockets, SIGKILL.
"""

import asyncio
import json
import urllib.request

from nsqclient.conn import Connection
from servers import NsqdProcess

TOTAL = 100_000
HELD = {10: 0, 50_000: 1, 90_000: 2}  # message number -> times REQ'd before it is held


def body(i: int) -> bytes:
    return b"m%06d" % i


def channel_stats(proc: NsqdProcess, topic: str, channel: str) -> dict:
    url = f"http://{proc.http_address}/stats?format=json&topic={topic}&channel={channel}"
    with urllib.request.urlopen(url, timeout=5) as r:
        stats = json.loads(r.read())
    (t,) = [t for t in stats["topics"] if t["topic_name"] == topic]
    (c,) = [c for c in t["channels"] if c["channel_name"] == channel]
    return c


async def until(check, timeout: float = 60, what: str = ""):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_after_kill_9_only_the_unfinished_come_back_with_their_attempts(tmp_path):
    """100,000 messages, all finished but 3 scattered ones (held in flight after 0, 1 and 2
    REQs); a checkpoint passes; kill -9; restart, and before any consumer comes, checkpoints
    and kill -9 again; restart: exactly those 3 come back, each with its attempts carried on
    (saved attempts + 1), and the channel's depth counts only them. Before the checkpoint
    saved finished ranges, everything after the first held message (99,990 messages) came
    back, each with attempts 1. A message published afterwards is delivered: reading goes
    on past the saved window (it once stalled when the last saved range was long)."""
    proc = NsqdProcess(str(tmp_path / "n"), "--checkpoint-interval", "100ms").start()
    try:
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "c", rdy=2500)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        for first in range(0, TOTAL, 2000):
            await pub.mpub("t", [body(i) for i in range(first, first + 2000)])
        await pub.close()
        held, finished = {}, 0
        while finished + len(held) < TOTAL or any(
                m.attempts <= HELD[int(b[1:])] for b, m in held.items()):
            msg = await asyncio.wait_for(consumer.messages.get(), 30)
            i = int(msg.body[1:])
            if i not in HELD:
                msg.fin()
                finished += 1
            elif msg.attempts <= HELD[i]:  # REQ'd this many times, then held in flight
                msg.req(0)
                held[msg.body] = msg
            else:
                held[msg.body] = msg
        assert finished == TOTAL - len(HELD)
        assert {b: m.attempts for b, m in held.items()} == {
            body(i): n + 1 for i, n in HELD.items()}
        await until(lambda: channel_stats(proc, "t", "c")["in_flight_count"] == len(HELD)
                    and channel_stats(proc, "t", "c")["depth"] == 0, what="every FIN")
        await asyncio.sleep(0.5)  # past a few checkpoint intervals
        proc.kill()
        await consumer.close()

        proc.start()
        assert channel_stats(proc, "t", "c")["depth"] == len(HELD), (
            "depth counts only what comes back")
        await asyncio.sleep(0.5)  # checkpoints of what was brought back and not read yet
        proc.kill()
        proc.start()
        assert channel_stats(proc, "t", "c")["depth"] == len(HELD)
        again = await Connection("127.0.0.1", proc.tcp_port).connect()
        await again.sub("t", "c", rdy=2500)
        back = {}
        try:
            while True:
                msg = await asyncio.wait_for(again.messages.get(), 3)
                back.setdefault(msg.body, []).append(msg.attempts)
        except asyncio.TimeoutError:
            pass
        assert back == {body(i): [n + 2] for i, n in HELD.items()}, (
            f"{len(back)} messages came back: {sorted(back)[:10]}...")
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.pub("t", b"after")  # reading goes on past the saved window
        await pub.close()
        msg = await asyncio.wait_for(again.messages.get(), 10)
        assert (msg.body, msg.attempts) == (b"after", 1)
        await again.close()
    finally:
        proc.kill()


async def test_a_checkpoint_without_a_window_is_read_as_no_finished_ranges(tmp_path):
    """State stored before the window was saved ({confirmed, confirmed_count, paused}) still
    opens: the channel starts at `confirmed` and delivers everything from there."""
    from nsqd.metastore import MetaStore, channel_key

    proc = NsqdProcess(str(tmp_path / "n")).start()
    try:
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.sub("t", "c")
        await conn.close()
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.mpub("t", [body(i) for i in range(5)])
        await pub.close()
        assert proc.stop() == 0
        meta = MetaStore(str(tmp_path / "n" / "nsqd.meta.sqlite"))
        key = channel_key("t", 0, "c")
        old = meta.channels("t")[(0, "c")]
        meta.put(key, {"confirmed": old["confirmed"], "confirmed_count": old["confirmed_count"],
                       "paused": False})
        meta.close()
        proc.start()
        conn = await Connection("127.0.0.1", proc.tcp_port).connect()
        await conn.sub("t", "c", rdy=10)
        got = [(await asyncio.wait_for(conn.messages.get(), 5)) for _ in range(5)]
        assert [(m.body, m.attempts) for m in got] == [(body(i), 1) for i in range(5)]
        await conn.close()
    finally:
        proc.kill()


async def test_a_dpub_not_due_keeps_attempts_0_across_kill_9(tmp_path):
    """A deferred message read into the window but never delivered is not counted as
    delivered after a crash; the in-flight message before it is (attempts 2)."""
    proc = NsqdProcess(str(tmp_path / "n"), "--checkpoint-interval", "100ms").start()
    try:
        consumer = await Connection("127.0.0.1", proc.tcp_port).connect()
        await consumer.sub("t", "c", rdy=10)
        pub = await Connection("127.0.0.1", proc.tcp_port).connect()
        await pub.pub("t", b"head")
        await pub.dpub("t", 4000, b"later")
        await pub.pub("t", b"done")
        await pub.close()
        got = {}
        while len(got) < 2:
            msg = await asyncio.wait_for(consumer.messages.get(), 10)
            got[msg.body] = msg
        assert set(got) == {b"head", b"done"}
        got[b"done"].fin()  # "head" stays in flight; "later" waits in memory
        await asyncio.sleep(0.5)
        proc.kill()
        await consumer.close()
        proc.start()
        again = await Connection("127.0.0.1", proc.tcp_port).connect()
        await again.sub("t", "c", rdy=10)
        back = []
        try:
            while True:
                msg = await asyncio.wait_for(again.messages.get(), 6)
                back.append((msg.body, msg.attempts))
                msg.fin()
        except asyncio.TimeoutError:
            pass
        assert back == [(b"head", 2), (b"later", 1)]
        await again.close()
    finally:
        proc.kill()
