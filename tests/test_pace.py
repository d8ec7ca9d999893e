"""The loop keeps running while /stats and /metrics walk every partition (nsqd/pace.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import aiohttp
import pytest

from nsqd import pace
from stalled import slow_link, stalled_client


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Ticker:
    """The longest the loop went without running this task (its turns' largest gap)."""

    def __init__(self):
        self.longest = 0.0
        self._last = time.perf_counter()
        self._task = asyncio.ensure_future(self._run())

    def _tick(self) -> None:
        now = time.perf_counter()
        self.longest = max(self.longest, now - self._last)
        self._last = now

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self._tick()

    async def stop(self) -> None:
        self._tick()  # the gap up to now counts too
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_collect_gives_the_loop_a_turn_between_slices():
    def pieces():
        for i in range(40):
            _busy(0.002)  # 80 ms of work in all
            yield i

    ticker = Ticker()
    await asyncio.sleep(0)
    got = await pace.collect(pieces())
    await ticker.stop()
    assert got == list(range(40))
    assert ticker.longest < 0.03, ticker.longest  # list(pieces()) holds the loop 80 ms


async def test_stats_and_metrics_of_2000_partitions_hold_the_loop_a_slice_at_a_time(node):
    n = await node()
    base = f"http://127.0.0.1:{n.http_port}"
    async with aiohttp.ClientSession() as http:
        for i in range(8):
            for path in (f"/topic/create?topic=p{i}&partition_num=250",
                         f"/channel/create?topic=p{i}&channel=c"):
                async with http.post(base + path) as r:
                    assert r.status == 200, await r.text()
        gc.collect()
        gc.freeze()  # as nsqd's tune_gc does once its start built what lives long: no full
        try:  # collection over the 2,000 partitions' objects is measured here
            await _measure(http, base)
        finally:
            gc.unfreeze()


async def _measure(http, base: str) -> None:
    for path in ("/stats?format=json", "/metrics"):
        ticker = Ticker()
        t = time.perf_counter()
        async with http.get(base + path) as r:
            assert r.status == 200
            body = await r.read()
        took = time.perf_counter() - t
        await ticker.stop()
        if path == "/metrics":
            assert body.count(b'nsqd_channel_depth{topic="p7",') == 250
        else:
            topics = json.loads(body)["topics"]
            assert [len(t["partitions"]) for t in topics] == [250] * 8
        # unpaced, the loop waits out the whole walk: its longest gap is most of `took`
        assert ticker.longest < took / 3, (path, ticker.longest, took)


async def test_reads_of_every_partition_walk_one_at_a_time(node, monkeypatch):
    """Paced walks would overlap, each holding its whole document: a flood of reads would
    multiply the memory. They take turns; one that waits too long is answered 503 BUSY."""
    import nsqd.statshttp as http_module

    walking, most, walks = [0], [0], [0]
    node_stats = http_module.node_stats

    async def counted(*args, **kwargs):
        walking[0] += 1
        walks[0] += 1
        most[0] = max(most[0], walking[0])
        try:
            return await node_stats(*args, **kwargs)
        finally:
            walking[0] -= 1

    monkeypatch.setattr(http_module, "node_stats", counted)
    monkeypatch.setattr(http_module, "WALK_WAIT_S", 2.0)  # a loaded machine: turns, not 503s
    n = await node()
    base = f"http://127.0.0.1:{n.http_port}"
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            async with http.post(base + f"/topic/create?topic=w{i}&partition_num=100") as r:
                assert r.status == 200

        async def read(path: str) -> int:
            async with http.get(base + path) as r:
                await r.read()
                return r.status

        paths = ["/stats?format=json", "/metrics", "/stats"] * 3
        assert await asyncio.gather(*map(read, paths)) == [200] * len(paths)
        assert walks[0] == len(paths) and most[0] == 1
        async with n.walking:  # a walk holds the node past the wait
            async with http.get(base + "/stats?format=json") as r:
                assert (r.status, (await r.json())["message"]) == (503, "BUSY")
        assert walks[0] == len(paths)


def test_chunks_join_whole_pieces_to_about_the_size():
    pieces = ["ab", "cdé", "f", "ghij", "k"]
    got = list(pace.chunks(pieces, 4))
    assert got == ["abcdé".encode(), "fghij".encode(), b"k"]


async def _make_m(http, base: str, partitions: int) -> None:
    """Topic `m` of `partitions` partitions, with channel `c`."""
    for path in (f"/topic/create?topic=m&partition_num={partitions}",
                 "/channel/create?topic=m&channel=c"):
        async with http.post(base + path) as r:
            assert r.status == 200


async def test_metrics_goes_out_in_chunks_and_a_slow_answer_is_cut_not_ended(node, monkeypatch):
    """/metrics is sent as it is made; one not taken within SEND_S, or whose making failed,
    has its connection closed without the last chunk (the reader sees an error, not a
    shorter exposition), and the walk is free again for the next read."""
    import nsqd.statshttp as http_module

    n = await node()
    base = f"http://127.0.0.1:{n.http_port}"
    async with aiohttp.ClientSession() as http:
        await _make_m(http, base, 20)
        async with http.get(base + "/metrics") as r:
            whole = await r.read()
            assert r.headers["Transfer-Encoding"] == "chunked"
        assert whole.count(b'nsqd_channel_depth{topic="m",') == 20
        monkeypatch.setattr(http_module, "CHUNK_CHARS", 1024)
        monkeypatch.setattr(http_module, "SEND_S", 0.2)
        chunks = pace.chunks

        def slow(pieces, size):
            for chunk in chunks(pieces, size):
                time.sleep(0.01)  # the loop's own time counts too: 0.2 s after ~20 chunks
                yield chunk

        monkeypatch.setattr(pace, "chunks", slow)
        async with http.get(base + "/metrics") as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # ended, it would look whole
                await r.read()
        def failing(pieces, size):
            yield from chunks(pieces, size)
            raise RuntimeError("a bug in the last piece")

        monkeypatch.setattr(pace, "chunks", failing)
        async with http.get(base + "/metrics") as r:  # cut too: never a whole-looking answer
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        monkeypatch.setattr(pace, "chunks", chunks)
        async with http.get(base + "/metrics") as r:  # the walk was let go
            assert r.status == 200
            assert (await r.read()).count(b'nsqd_channel_depth{topic="m",') == 20


async def test_a_metrics_reader_that_does_not_read_holds_back_no_stats(node, monkeypatch):
    """A client that asks for /metrics and reads nothing holds one /metrics answer for up to
    SEND_S: other /metrics reads wait for it (503 BUSY past WALK_WAIT_S), /stats does not,
    and once it is cut /metrics answers again. The node's sends go through a 4 KiB socket
    buffer, as on a slow link, so 100 partitions' exposition cannot all leave."""
    import nsqd.statshttp as http_module

    monkeypatch.setattr(http_module, "WALK_WAIT_S", 0.5)
    monkeypatch.setattr(http_module, "SEND_S", 3.0)
    slow_link(monkeypatch, http_module, "send_text")
    n = await node()
    base = f"http://127.0.0.1:{n.http_port}"
    async with aiohttp.ClientSession() as http:
        await _make_m(http, base, 100)
        stalled = await stalled_client(n.http_port, b"GET /metrics HTTP/1.1\r\nHost: n\r\n\r\n")
        try:
            await asyncio.sleep(0.3)  # its walk is done; its answer waits for the reader
            async with http.get(base + "/stats?format=json") as r:
                assert r.status == 200
                assert len((await r.json())["topics"][0]["partitions"]) == 100
            async with http.get(base + "/metrics") as r:
                assert (r.status, (await r.json())["message"]) == (503, "BUSY")
            async with asyncio.timeout(5):  # cut within SEND_S of its start
                while n.metrics_sending.locked():
                    await asyncio.sleep(0.1)
        finally:
            stalled.close()
        async with http.get(base + "/metrics") as r:
            assert r.status == 200
            assert (await r.read()).count(b'nsqd_channel_depth{topic="m",') == 100
