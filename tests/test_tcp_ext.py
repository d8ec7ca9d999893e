"""The extension header end to end (issue 8, item 8): PUB_EXT and MPUB_EXT store it with the
trace id in the record's own field; MPUB_EXT is one atomic write request; a consumer that
IDENTIFYs `extend_support` receives `[version][length][JSON header]` after the id, and
never the server's own keys; every other consumer receives classic frames."""

from __future__ import annotations

import asyncio
import json

import pytest

from diskqueue.queue import DiskQueue
from nodes import connect
from nsqwire import commands as c
from nsqwire import protocol as p
from nsqwire.ext import EXT_VERSION_JSON, EXT_VERSION_NONE


async def read_records(queue) -> list:
    reader = queue.reader(queue.start_offset)
    try:
        return await reader.read(1000)
    finally:
        reader.close()


async def frames_until(reader, frames: c.FrameParser, count: int) -> list:
    got = []
    while len(got) < count:
        data = await asyncio.wait_for(reader.read(65536), 5)
        assert data, f"closed after {got}"
        frames.feed(data)
        got += [f for f in frames.frames() if f != (p.FRAME_RESPONSE, b"_heartbeat_")]
    return got


async def raw_consumer(port: int, identify: dict, topic: str, channel: str, count: int) -> list:
    """Message frames' data for a raw connection that IDENTIFYs, SUBs and takes `count`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2 + c.cmd_identify(identify) + c.cmd_sub(topic, channel)
                 + c.cmd_rdy(100))
    got = await frames_until(reader, frames, 2 + count)
    assert got[:2] == [(p.FRAME_RESPONSE, b"OK")] * 2
    assert all(kind == p.FRAME_MESSAGE for kind, _ in got[2:])
    writer.write(b"".join(c.cmd_fin(c.parse_message(data)[2]) for _, data in got[2:]))
    writer.close()
    return [data for _, data in got[2:]]


async def test_append_takes_a_trace_id_and_an_ext_header_per_message(tmp_path):
    q = await DiskQueue.open(str(tmp_path / "q"))
    try:
        log_before = q.commitlog.next_log_id
        done = await q.append([b"a", b"b", b"c"], trace_ids=[7, 0, 2**64 - 1],
                              exts=[b'{"k":1}', b"", b'{"k":3}'])
        assert (done.count, q.commitlog.next_log_id) == (3, log_before + 1)  # one request
        for bad in (dict(trace_ids=[1], exts=[b"", b""]), dict(trace_ids=[1, 2], exts=[b""]),
                    dict(trace_ids=[1, 2**64], exts=[b"", b""]),
                    dict(trace_ids=[1, 2], exts=[b"", b"x" * 70_000])):
            with pytest.raises(ValueError):
                q.append([b"d", b"e"], **bad)
        await q.append([b"f"], trace_id=5, ext=b'{"k":6}')
        recs = await read_records(q)
        assert [(r.body, r.trace_id, r.ext) for r in recs] == [
            (b"a", 7, b'{"k":1}'), (b"b", 0, b""), (b"c", 2**64 - 1, b'{"k":3}'),
            (b"f", 5, b'{"k":6}')]
        assert [r.msg_id for r in recs] == [done.first_id, done.first_id + 1, done.first_id + 2,
                                            done.first_id + 3]
    finally:
        await q.close()


async def test_mpub_ext_is_one_atomic_request(node):
    n = await node()
    pub = await connect(n)
    await pub.pub("t", b"first")
    q = n.topics["t"].partition(0).queue
    log_before, count_before = q.commitlog.next_log_id, q.committed_count
    await pub.command(c.cmd_mpub_ext("t", [({"##trace_id": "11", "a": "1"}, b"m1"),
                                           ({}, b"m2"),
                                           ({"##trace_id": 12, "##client_dispatch_tag": "x"}, b"m3")]))
    assert (q.commitlog.next_log_id, q.committed_count) == (log_before + 1, count_before + 3)
    recs = (await read_records(q))[1:]
    assert [(r.body, r.trace_id, r.ext) for r in recs] == [
        (b"m1", 11, b'{"a":"1"}'), (b"m2", 0, b""), (b"m3", 12, b'{"##client_dispatch_tag":"x"}')]
    # One bad header refuses the whole request: nothing of it is stored.
    bad = c.encode_command(b"MPUB_EXT", "t", body=c._mpub_body(
        [c._ext_body({"a": 1}, b"ok"), c._ext_body({"##trace_id": "x1"}, b"bad")]))
    reader, writer = await asyncio.open_connection("127.0.0.1", n.tcp_port)
    writer.write(p.MAGIC_V2 + bad + c.cmd_nop() + c.cmd_pub("t", b"after"))
    got = await frames_until(reader, c.FrameParser(), 2)
    assert got[0][0] == p.FRAME_ERROR and got[0][1].startswith(b"E_INVALID_JSON_HEADER MPUB_EXT")
    assert got[1] == (p.FRAME_RESPONSE, b"OK")  # not fatal: the connection goes on
    writer.close()
    assert [r.body for r in (await read_records(q))[4:]] == [b"after"]


async def test_extend_support_consumers_get_the_header_and_classic_ones_do_not(node):
    n = await node()
    for channel in ("ext", "classic"):
        await n.get_channel("t", channel)
    pub = await connect(n)
    await pub.command(c.cmd_pub_ext("t", {"##trace_id": "123", "k": "v"}, b"with header"))
    await pub.pub("t", b"plain")
    await pub.dpub("t", 1, b"deferred")  # stored with the server's ##defer_until_ms
    await pub.command(c.cmd_pub_ext("t", {"##trace_id": 9}, b"trace only"))
    await pub.command(c.cmd_mpub_ext("t", [({"a": [1, 2]}, b"m1"), ({}, b"m2")]))
    rec = (await read_records(n.topics["t"].partition(0).queue))[0]
    assert (rec.trace_id, rec.ext) == (123, b'{"k":"v"}')  # one home for the trace id

    extended = await raw_consumer(n.tcp_port, {"extend_support": True}, "t", "ext", 6)
    parsed = [c.parse_ext_message(data) for data in extended]
    got = {body: (version, json.loads(header) if header else None)
           for _, _, _, version, header, body in parsed}
    assert got == {
        b"with header": (EXT_VERSION_JSON, {"k": "v", "##trace_id": "123"}),
        b"plain": (EXT_VERSION_NONE, None),
        b"deferred": (EXT_VERSION_NONE, None),
        b"trace only": (EXT_VERSION_JSON, {"##trace_id": "9"}),
        b"m1": (EXT_VERSION_JSON, {"a": [1, 2]}),
        b"m2": (EXT_VERSION_NONE, None)}
    assert all(b"##defer" not in data for data in extended)

    classic = await raw_consumer(n.tcp_port, {"client_id": "classic"}, "t", "classic", 6)
    assert sorted(c.parse_message(data)[3] for data in classic) == sorted(got)
