"""Replay: a channel's cursor moved by time, offset or count (POST /channel/setoffset,
SUB_ADVANCED), on real nsqd processes; and the locate search under it, on a DiskQueue.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from diskqueue.queue import DiskQueue, NotABoundary, QueueOptions
from nsqclient.conn import Connection, NSQError
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
