"""MetaStore: changes noted on the loop, written in order by one flush (one transaction)."""

import asyncio
import os
import threading

from nsqd.metastore import MetaStore


async def test_a_flush_writes_the_changes_in_the_order_they_were_made(tmp_path):
    path = str(tmp_path / "meta.sqlite")
    meta = MetaStore(path)
    meta.put("topic/t", {"partitions": [0]})
    meta.put("channel/t/0/old", {"confirmed": 1})
    await meta.flush()
    meta.put("channel/t/0/a", {"confirmed": 2})
    meta.delete_prefix("channel/t/")  # removes old and a
    meta.put("channel/t/0/b", {"confirmed": 3, "finished": b"\x01" * 32})  # made after: kept
    meta.put("channel/t/0/b", {"confirmed": 4, "finished": b"\x02" * 32})  # the last one wins
    assert meta.channels("t") == {(0, "b"): {"confirmed": 4, "finished": b"\x02" * 32}}
    await asyncio.gather(meta.flush(), meta.flush())  # one at a time
    meta.close()
    again = MetaStore(path)
    assert again.topics() == {"t": {"partitions": [0]}}
    assert again.channels("t") == {(0, "b"): {"confirmed": 4, "finished": b"\x02" * 32}}
    again.close()


async def test_a_failed_flush_keeps_its_changes_under_newer_ones(tmp_path):
    meta = MetaStore(str(tmp_path / "meta.sqlite"))
    meta.put("channel/t/0/c", {"confirmed": 1})
    meta.put("channel/t/0/d", {"confirmed": 1})
    real = meta._write

    def failing(batch, prefixes):
        meta.put("channel/t/0/c", {"confirmed": 2})  # made while the flush ran
        raise OSError("disk full")

    meta._write = failing
    try:
        await meta.flush()
    except OSError:
        pass
    else:
        raise AssertionError("the failure must reach the caller")
    meta._write = real
    await meta.flush()
    assert meta.channels("t") == {(0, "c"): {"confirmed": 2}, (0, "d"): {"confirmed": 1}}
    meta.close()


async def test_what_a_flush_is_writing_is_read_back_meanwhile(tmp_path):
    """A read while a flush runs sees the flush's changes (before, they were neither
    pending nor in the database yet: a channel's state read then was missing)."""
    meta = MetaStore(str(tmp_path / "meta.sqlite"))
    meta.put("channel/t/0/gone", {"confirmed": 1})
    await meta.flush()
    meta.delete_prefix("channel/t/")
    meta.put("channel/t/0/c", {"confirmed": 2})
    real, started, release = meta._write, threading.Event(), threading.Event()

    def slow(batch, prefixes):
        started.set()
        release.wait(10)
        real(batch, prefixes)

    meta._write = slow
    flush = asyncio.ensure_future(meta.flush())
    await asyncio.to_thread(started.wait, 10)
    meta.put("channel/t/0/d", {"confirmed": 3})  # pending, after the flush began
    assert await asyncio.to_thread(meta.channels, "t") == {(0, "c"): {"confirmed": 2},
                                                          (0, "d"): {"confirmed": 3}}
    release.set()
    await flush
    assert meta.channels("t") == {(0, "c"): {"confirmed": 2}, (0, "d"): {"confirmed": 3}}
    meta.close()


async def test_a_flush_with_nothing_put_writes_nothing_but_waits_for_a_running_one(tmp_path):
    path = str(tmp_path / "meta.sqlite")
    meta = MetaStore(path)
    meta.put("topic/t", {"partitions": [0]})
    await meta.flush()
    written = os.stat(path).st_mtime_ns
    await meta.flush()
    assert os.stat(path).st_mtime_ns == written
    meta.put("topic/t", {"partitions": [0, 1]})
    real, started, release = meta._write, threading.Event(), threading.Event()

    def slow(batch, prefixes):
        started.set()
        release.wait(10)
        real(batch, prefixes)

    meta._write = slow
    running = asyncio.ensure_future(meta.flush())
    await asyncio.to_thread(started.wait, 10)
    empty = asyncio.ensure_future(meta.flush())  # nothing put since: it waits for `running`
    await asyncio.sleep(0.1)
    assert not empty.done()
    release.set()
    await empty
    assert running.done()
    assert MetaStore(path).topics() == {"t": {"partitions": [0, 1]}}
    meta.close()


async def test_all_channels_is_channels_of_every_topic(tmp_path):
    meta = MetaStore(str(tmp_path / "meta.sqlite"))
    meta.put("topic/t", {"partitions": [0, 1]})
    meta.put("channel/t/0/c", {"confirmed": 1})
    meta.put("channel/t/1/c", {"confirmed": 2})
    meta.put("channel/t.b/0/c#ephemeral", {"confirmed": 3})
    await meta.flush()
    meta.put("channel/u/3/d", {"confirmed": 4})  # not flushed yet: read all the same
    meta.delete("channel/t/1/c")
    assert meta.all_channels() == {"t": meta.channels("t"), "t.b": meta.channels("t.b"),
                                   "u": meta.channels("u")}
    assert meta.all_channels()["t"] == {(0, "c"): {"confirmed": 1}}
    meta.close()
