"""isr/etcd.py against a real etcd server: key operations, typed errors, leases, watches
that resume after etcd is SIGKILLed and restarted, and tell the caller when they cannot."""

import asyncio
import socket
import time

import pytest

from etcdserver import EtcdProcess
from servers import free_port
from isr.etcd import (Etcd, EtcdRefused, EtcdUnavailable, LeaseGone, WatchLost, absent,
                      put_op)


@pytest.fixture
async def etcd(etcd_server):
    client = Etcd(etcd_server.endpoint, timeout=2)
    yield client
    await client.close()


async def next_event(watch, timeout=5):
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_key_operations(etcd):
    rev = await etcd.put("/t/a", b"1")
    kv, read_rev = await etcd.get("/t/a")
    assert kv.value == b"1" and kv.mod_revision == rev and read_rev >= rev
    assert await etcd.create("/t/a", b"2") is None  # exists
    rev_b = await etcd.create("/t/b", b"2")
    assert rev_b > rev
    kvs, _ = await etcd.get_prefix("/t/")
    assert [(k.key, k.value) for k in kvs] == [("/t/a", b"1"), ("/t/b", b"2")]
    # compare-and-swap on the mod_revision
    assert await etcd.replace("/t/a", b"x", rev - 1) is None
    new_rev = await etcd.replace("/t/a", b"x", rev)
    assert new_rev and (await etcd.get("/t/a"))[0].value == b"x"
    assert await etcd.replace("/t/a", b"y", rev) is None  # the same old revision loses now
    ok, _ = await etcd.txn([absent("/t/c")], [put_op("/t/c", b"3"), put_op("/t/d", b"4")])
    assert ok
    ok, _ = await etcd.txn([absent("/t/c")], [put_op("/t/e", b"5")])
    assert not ok and (await etcd.get("/t/e"))[0] is None
    await etcd.put("/u", b"outside")
    assert await etcd.delete_prefix("/t/") == 4
    assert (await etcd.get_prefix("/t/"))[0] == []
    assert (await etcd.get("/u"))[0].value == b"outside"
    assert await etcd.delete("/u") == 1 and await etcd.delete("/u") == 0


async def test_a_hanging_etcd_never_blocks_the_loop():
    """An endpoint that accepts and never answers: the calls time out as EtcdUnavailable,
    and meanwhile the loop keeps running (the calls are in the pool's threads)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        client = Etcd(f"127.0.0.1:{silent.getsockname()[1]}", timeout=1)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(client.put(f"/p/{i}", b"v") for i in range(4)),
                                       return_exceptions=True)
        took = time.monotonic() - start
        t.cancel()
        assert all(isinstance(r, EtcdUnavailable) for r in results), results
        assert 0.9 < took < 3
        assert ticks > 50 * took  # about 100 a second: the loop was free all along
        await client.close()


async def test_too_many_ops_is_refused(etcd):
    with pytest.raises(EtcdRefused, match="too many operations"):
        await etcd.txn([], [put_op(f"/big/{i}", b"v") for i in range(3000)])


async def test_unavailable_is_typed_and_quick():
    client = Etcd(f"127.0.0.1:{free_port()}", timeout=1)
    start = time.monotonic()
    for call in (client.get("/k"), client.put("/k", b"v"), client.grant(2)):
        with pytest.raises(EtcdUnavailable, match="127.0.0.1"):
            await call
    assert time.monotonic() - start < 3
    await client.close()


async def test_second_endpoint_takes_over(etcd_server):
    client = Etcd([f"127.0.0.1:{free_port()}", etcd_server.endpoint], timeout=1)
    with pytest.raises(EtcdUnavailable):
        await client.put("/k", b"v")
    assert await client.put("/k", b"v") > 0
    await client.close()


async def test_lease_expiry_and_revoke(etcd):
    lease = await etcd.grant(2)
    await etcd.put("/lease/a", b"1", lease)
    kv, _ = await etcd.get("/lease/a")
    assert kv.lease == lease
    assert await etcd.refresh(lease) >= 2
    await asyncio.sleep(3.2)  # no refresh: etcd drops the lease and its key
    assert (await etcd.get("/lease/a"))[0] is None
    with pytest.raises(LeaseGone):
        await etcd.refresh(lease)
    with pytest.raises(LeaseGone):
        await etcd.put("/lease/b", b"1", lease)
    lease2 = await etcd.grant(30)
    await etcd.put("/lease/c", b"1", lease2)
    await etcd.revoke(lease2)
    assert (await etcd.get("/lease/c"))[0] is None
    await etcd.revoke(lease2)  # already gone: no error


async def test_watch_delivers_in_order_and_only_the_prefix(etcd):
    start = await etcd.put("/w/seed", b"0")
    async with etcd.watch_prefix("/w/", start + 1) as watch:
        await etcd.put("/w/a", b"1")
        await etcd.put("/w0", b"not under /w/")
        await etcd.put("/x", b"outside")
        await etcd.put("/w/b", b"2")
        await etcd.delete("/w/a")
        await etcd.txn([], [put_op("/w/c", b"3"), put_op("/w/d", b"4")])
        events = [await next_event(watch) for _ in range(5)]
        assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
            ("put", "/w/a", b"1"), ("put", "/w/b", b"2"), ("delete", "/w/a", b""),
            ("put", "/w/c", b"3"), ("put", "/w/d", b"4")]
        revisions = [e.kv.mod_revision for e in events]
        assert revisions == sorted(revisions) and revisions[3] == revisions[4]
        assert watch.pending() == 0
    with pytest.raises(StopAsyncIteration):
        await next_event(watch)


async def test_a_transaction_is_queued_whole(etcd):
    """The events of one revision reach the queue together: a consumer that acts once
    `pending()` is 0 (ClusterMirror) never sees half a transaction (a topic's meta without
    its partition states made nsqd lead nothing of a new topic for a moment)."""
    start = await etcd.put("/t/seed", b"0")
    async with etcd.watch_prefix("/t/", start + 1) as watch:
        for round_ in range(5):
            await etcd.txn([], [put_op(f"/t/{round_}/{i}", b"x") for i in range(50)])
            seen = 0
            while seen < 50:
                await next_event(watch)
                seen += 1
                assert watch.pending() == 50 - seen, (round_, seen)


async def test_watch_from_now_and_cancel(etcd):
    await etcd.put("/n/old", b"0")
    watch = etcd.watch_prefix("/n/")
    for _ in range(100):
        if watch.connected:
            break
        await asyncio.sleep(0.02)
    await etcd.put("/n/new", b"1")
    assert (await next_event(watch)).kv.key == "/n/new"
    watch.close()
    with pytest.raises(StopAsyncIteration):
        await next_event(watch)
    watch._thread.join(2)
    assert not watch._thread.is_alive()


async def test_an_idle_watch_reopens_quietly_and_misses_nothing(etcd_server):
    """A watch stream idle past watch_idle_timeout is reopened: one etcd_watch_started
    line for its start, none for each idle reopen (it was one line per idle timeout per
    watch), and an event put after the reopens still arrives."""
    from structlog.testing import capture_logs

    client = Etcd(etcd_server.endpoint, timeout=2, watch_idle_timeout=0.2)
    try:
        with capture_logs() as logs:
            watch = client.watch_prefix("/idle/")
            await asyncio.sleep(1.2)  # about 5 idle timeouts
            await client.put("/idle/k", b"1")
            assert (await next_event(watch)).kv.key == "/idle/k"
            watch.close()
        started = [e for e in logs if e["event"] == "etcd_watch_started"]
        assert len(started) == 1, logs
        assert not [e for e in logs if e["event"] == "etcd_watch_interrupted"], logs
    finally:
        await client.close()


async def test_watch_resumes_after_etcd_is_killed_and_restarted(tmp_path):
    server = EtcdProcess(str(tmp_path / "etcd")).start()
    client = Etcd(server.endpoint, timeout=1)
    try:
        start = await client.put("/r/a", b"1")
        watch = client.watch_prefix("/r/", start)
        assert (await next_event(watch)).kv.value == b"1"
        await client.put("/r/b", b"2")
        assert (await next_event(watch)).kv.value == b"2"
        server.kill()
        await asyncio.sleep(0.5)
        assert not watch.connected
        with pytest.raises(EtcdUnavailable):
            await client.put("/r/c", b"3")
        await asyncio.to_thread(server.start)
        await client.put("/r/c", b"3")
        await client.delete("/r/a")
        event = await next_event(watch, 10)
        assert (event.type, event.kv.key, event.kv.value) == ("put", "/r/c", b"3")
        event = await next_event(watch)
        assert (event.type, event.kv.key) == ("delete", "/r/a")
        assert watch.connected and watch.pending() == 0  # nothing repeated, nothing lost
        watch.close()
    finally:
        await client.close()
        server.kill()


async def test_watch_of_compacted_history_is_lost(etcd, etcd_server):
    first = await etcd.put("/c/a", b"1")
    for i in range(5):
        last = await etcd.put("/c/a", str(i).encode())
    etcd_server.post("kv/compaction", {"revision": last, "physical": True})
    watch = etcd.watch_prefix("/c/", first)
    with pytest.raises(WatchLost, match="compacted"):
        await next_event(watch)
    with pytest.raises(WatchLost):  # stays lost
        await next_event(watch)
    watch.close()


async def test_slow_consumer_is_told_to_resync(etcd):
    start = await etcd.put("/s/x", b"0")
    watch = etcd.watch_prefix("/s/", start + 1, max_pending=5)
    for i in range(10):
        await etcd.put(f"/s/{i}", b"v")
    await asyncio.sleep(0.5)
    with pytest.raises(WatchLost, match="behind"):
        for _ in range(10):
            await next_event(watch)
    watch.close()
