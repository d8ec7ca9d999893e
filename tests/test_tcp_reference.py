"""Replay every TCP case of the nsqd v1.3.0 reference against our live nsqd.

tests/data/nsqd-v1.3.0.json records what classic Go nsqd v1.3.0 (default flags)
answered, byte for byte, to ~40 TCP exchanges. Each case runs here on a fresh
connection (the magic first, unless the case sends its own), its exchanges in
order, and we compare the frames (type + data) and whether the connection was
closed after each exchange.

Ignored, because they describe the capture run rather than the behaviour:
- message ids and timestamps in message frames (body and attempts are compared;
  our ids are 16 hex characters as well, and a requeue redelivers the same id);
- the version string inside the IDENTIFY negotiation JSON;
- when exactly a heartbeat lands: heartbeats come from a timer, so a heartbeat
  the reference caught in its read window must arrive here within one interval,
  and heartbeats the reference did not catch are not held against us.

Setup the reference implies but does not spell out (its captures of RDY/FIN/REQ/
TOUCH/CLS errors only make sense on a subscribed connection, the delivery cases
need a published message, the heartbeat case needs time) is derived per case
below.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from nsqwire import commands as c
from nsqwire import protocol as p
from servers import NsqdProcess

REFERENCE = json.loads((Path(__file__).parent / "data" / "nsqd-v1.3.0.json").read_text())
CASES = {case["case"]: case for case in REFERENCE["tcp"]}
FRAME_TYPES = {"response": p.FRAME_RESPONSE, "error": p.FRAME_ERROR, "message": p.FRAME_MESSAGE}
HEARTBEAT = b"_heartbeat_"

# Exchanges the reference captured on a subscribed connection: nsqd checks the
# state before the arguments, so "RDY -1" on a fresh connection would only say
# "cannot RDY in current state".
SUBSCRIBED = {"rdy_negative", "rdy_too_big", "rdy_not_a_number", "fin_unknown_id", "fin_bad_id_length",
              "req_unknown_id", "req_bad_timeout", "touch_unknown_id", "cls_subscribed"}
# Cases described in words (timers, a message to deliver): replayed by their own tests.
DESCRIBED = {"delivery", "requeue_redelivery", "heartbeat"}
WIRE_CASES = sorted(set(CASES) - DESCRIBED)

QUIET = 0.25  # how long "no answer and still open" is watched
TIMEOUT = 5.0  # an expected frame or close that takes longer is a failure


def sent_bytes(sent: str) -> bytes:
    """The reference stores bytes as latin-1 text and elides long payloads as
    '<prefix>... (N bytes)' (N the total length): repeat the last byte."""
    m = re.fullmatch(r"(.*)\.\.\. \((\d+) bytes\)", sent, re.S)
    if m is None:
        return sent.encode("latin-1")
    prefix = m[1].encode("latin-1")
    return prefix + prefix[-1:] * (int(m[2]) - len(prefix))


def expected_frames(exchange: dict) -> list[tuple[int, bytes]]:
    return [(FRAME_TYPES[f["frame"]], f["data"].encode("latin-1")) for f in exchange["frames"]]


def normalize(frame: tuple[int, bytes]) -> tuple[int, object]:
    """The IDENTIFY negotiation JSON without its version; everything else as is."""
    frame_type, data = frame
    if frame_type == p.FRAME_RESPONSE and data.startswith(b"{"):
        reply = json.loads(data)
        assert isinstance(reply.pop("version"), str)
        return frame_type, reply
    return frame_type, data


# ---------------------------------------------------------------- plumbing


@pytest.fixture(scope="module")
def server(module_dir):
    """One nsqd for the whole module, with classic nsqd's defaults where ours differ:
    --max-req-timeout is 72h by default here (the disk delay queue), 1h in nsqd v1.3.0."""
    proc = NsqdProcess(str(module_dir / "nsqd"),
                       "--max-req-timeout", "1h").start()
    yield proc
    proc.kill()


class Wire:
    """A raw client connection: bytes out, frames in, and whether the server closed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.parser = c.FrameParser()
        self.frames: list[tuple[int, bytes]] = []
        self.eof = False

    @classmethod
    async def open(cls, port: int, magic: bool = True) -> "Wire":
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        wire = cls(reader, writer)
        if magic:
            wire.send(p.MAGIC_V2)
        return wire

    def send(self, data: bytes) -> None:
        # The server may close while we still write (a fatal error in the middle
        # of a big body): what it answered is read below, the write error is not
        # the behaviour under test.
        try:
            self.writer.write(data)
        except (ConnectionError, OSError):
            pass

    async def _read_some(self, timeout: float) -> bool:
        """Read what arrives within `timeout`; False when nothing did."""
        if self.eof:
            return False
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 20), timeout)
        except asyncio.TimeoutError:
            return False
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return True
        self.parser.feed(data)
        self.frames.extend(self.parser.frames())
        return True

    async def until(self, done, timeout: float = TIMEOUT) -> None:
        """Read until done() or EOF, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not done() and not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._read_some(left)

    async def quiet(self, duration: float = QUIET) -> None:
        """Read whatever comes within `duration` (until EOF)."""
        deadline = time.monotonic() + duration
        while not self.eof and (left := deadline - time.monotonic()) > 0:
            await self._read_some(left)

    def take(self) -> list[tuple[int, bytes]]:
        frames, self.frames = self.frames, []
        return frames

    async def request(self, data: bytes, frames: int = 1) -> list[tuple[int, bytes]]:
        """Send and wait for `frames` frames that are not heartbeats."""
        self.send(data)
        await self.until(lambda: sum(f[1] != HEARTBEAT for f in self.frames) >= frames)
        got = [f for f in self.take() if f[1] != HEARTBEAT]
        assert len(got) == frames, (data[:80], got, self.eof)
        return got

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def replay_exchange(wire: Wire, exchange: dict) -> None:
    """Send one exchange and compare the frames and the close with the reference."""
    expected = expected_frames(exchange)
    want_hb = sum(data == HEARTBEAT for _, data in expected)
    want = [f for f in expected if f[1] != HEARTBEAT]

    def count(frames, heartbeat):
        return sum((data == HEARTBEAT) == heartbeat for _, data in frames)

    wire.send(sent_bytes(exchange["sent"]))
    # A heartbeat the reference caught must come within one (1 s) interval.
    await wire.until(lambda: count(wire.frames, False) >= len(want) and count(wire.frames, True) >= want_hb,
                     timeout=TIMEOUT if not want_hb else 2.5)
    if exchange["connection_closed_after"]:
        await wire.until(lambda: False)  # the close must follow
        assert wire.eof, "the server should have closed the connection"
    else:
        await wire.quiet()
        assert not wire.eof, "the server closed the connection"
    frames = wire.take()
    assert count(frames, True) >= want_hb
    got = [normalize(f) for f in frames if f[1] != HEARTBEAT]
    assert got == [normalize(f) for f in want]


# ---------------------------------------------------------------- the wire cases


def test_every_reference_case_is_replayed():
    assert len(CASES) == 40
    assert set(CASES) == set(WIRE_CASES) | DESCRIBED
    for name in WIRE_CASES:
        assert all("connection_closed_after" in e for e in CASES[name]["exchanges"]), name


@pytest.mark.parametrize("name", WIRE_CASES)
async def test_reference_case(server, name):
    case = CASES[name]
    own_magic = case["exchanges"][0]["sent"].startswith("  V")
    wire = await Wire.open(server.tcp_port, magic=not own_magic)
    try:
        if name in SUBSCRIBED:
            # Setup: a subscribed connection (a channel of its own, so nothing is delivered).
            assert await wire.request(c.cmd_sub("ref_t", f"setup_{name}")) == [(p.FRAME_RESPONSE, b"OK")]
        for exchange in case["exchanges"]:
            await replay_exchange(wire, exchange)
    finally:
        await wire.close()


# ---------------------------------------------------------------- the described cases


async def test_reference_delivery_and_requeue(server):
    """delivery: "SUB ref_deliver c, then RDY 1 after one PUB of payload-1" -> one message
    frame, attempts 1; requeue_redelivery: "REQ <id> 0" -> the same message, attempts 2."""
    [delivery] = CASES["delivery"]["exchanges"][0]["frames"]
    [redelivery] = CASES["requeue_redelivery"]["exchanges"][0]["frames"]
    body = delivery["body"].encode("latin-1")
    assert redelivery["body"] == delivery["body"] and redelivery["id"] == delivery["id"]

    consumer = await Wire.open(server.tcp_port)
    producer = await Wire.open(server.tcp_port)
    try:
        assert await consumer.request(c.cmd_sub("ref_deliver", "c")) == [(p.FRAME_RESPONSE, b"OK")]
        assert await producer.request(c.cmd_pub("ref_deliver", body)) == [(p.FRAME_RESPONSE, b"OK")]
        [(frame_type, data)] = await consumer.request(c.cmd_rdy(1))
        assert frame_type == FRAME_TYPES[delivery["frame"]]
        timestamp, attempts, msg_id, got_body = c.parse_message(data)
        assert (attempts, got_body) == (delivery["attempts"], body)
        # 16 hex characters like nsqd's; the value is ours (PROTOCOL.md): partition << 50 | sequence.
        assert p.msg_id_partition(p.decode_msg_id(msg_id)) == 0
        assert abs(timestamp - time.time_ns()) < 60 * 10**9  # nanoseconds since the epoch

        [(frame_type, data)] = await consumer.request(c.cmd_req(msg_id, 0))
        assert frame_type == FRAME_TYPES[redelivery["frame"]]
        _, attempts, again_id, got_body = c.parse_message(data)
        assert (attempts, again_id, got_body) == (redelivery["attempts"], msg_id, body)

        consumer.send(c.cmd_fin(msg_id))
        await consumer.quiet()
        assert consumer.take() == [] and not consumer.eof
    finally:
        await consumer.close()
        await producer.close()


async def test_reference_heartbeat(server):
    """heartbeat: "IDENTIFY heartbeat_interval 1000, then wait 1.3 s" -> two _heartbeat_
    frames. A client that does not answer still gets both before being dropped."""
    expected = expected_frames(CASES["heartbeat"]["exchanges"][0])
    assert expected == [(p.FRAME_RESPONSE, HEARTBEAT)] * 2
    wire = await Wire.open(server.tcp_port)
    try:
        started = time.monotonic()
        assert await wire.request(c.cmd_identify({"heartbeat_interval": 1000})) == [(p.FRAME_RESPONSE, b"OK")]
        arrivals = []
        while len(arrivals) < 2 and time.monotonic() - started < 3:
            await wire.until(lambda: wire.frames, timeout=3 - (time.monotonic() - started))
            arrivals += [time.monotonic() - started for _ in wire.frames]
            assert wire.take() in ([], [(p.FRAME_RESPONSE, HEARTBEAT)])
        assert len(arrivals) == 2, arrivals
        assert 0.8 < arrivals[0] < 2 and 0.7 < arrivals[1] - arrivals[0] < 1.6, arrivals
        # Two heartbeats missed: the server drops the connection soon after.
        await wire.until(lambda: False, timeout=2)
        assert wire.eof
    finally:
        await wire.close()


async def test_heartbeat_answered_keeps_the_connection(server):
    """A client that answers each heartbeat with NOP stays connected past two intervals."""
    wire = await Wire.open(server.tcp_port)
    try:
        assert await wire.request(c.cmd_identify({"heartbeat_interval": 1000})) == [(p.FRAME_RESPONSE, b"OK")]
        for _ in range(3):
            await wire.until(lambda: wire.frames, timeout=2)
            assert wire.take() == [(p.FRAME_RESPONSE, HEARTBEAT)]
            wire.send(c.cmd_nop())
        assert not wire.eof
    finally:
        await wire.close()


# ---------------------------------------------------------------- nsqd's order, beyond the captures


@pytest.mark.parametrize(("sent", "text"), [
    (b"RDY abc\n", b"E_INVALID cannot RDY in current state"),
    (b"FIN 123\n", b"E_INVALID cannot FIN in current state"),
    (b"REQ 0123456789abcdef abc\n", b"E_INVALID cannot REQ in current state"),
    (b"TOUCH\n", b"E_INVALID cannot TOUCH in current state"),
    (b"CLS\n", b"E_INVALID cannot CLS in current state"),
    # After SUB (pipelined in the same write): the state SUB leaves applies.
    (b"SUB ref_t order\nIDENTIFY\n\x00\x00\x00\x00", b"E_INVALID cannot IDENTIFY in current state"),
    (b"SUB ref_t order2\nSUB ref_t x\n", b"E_INVALID cannot SUB in current state"),
    (b"SUB ref_t order3\nAUTH\n\x00\x00\x00\x01x", b"E_INVALID cannot AUTH in current state"),
    (b"SUB ref_t order4\nCLS\nCLS\n", b"E_INVALID cannot CLS in current state"),
    (b'IDENTIFY\n\x00\x00\x00\x1a{"heartbeat_interval": -1}SUB ref_t c\n',
     b"E_INVALID cannot SUB with heartbeats disabled"),
])
async def test_state_is_checked_before_arguments(server, sent, text):
    """nsqd checks the connection state first ("cannot RDY in current state" wins over
    "RDY could not parse count abc"), fatally; commands pipelined behind a SUB see its state."""
    wire = await Wire.open(server.tcp_port)
    try:
        wire.send(sent)
        await wire.until(lambda: False)
        assert wire.eof
        frames = wire.take()
        assert frames[-1] == (p.FRAME_ERROR, text)
        assert all(f[0] == p.FRAME_RESPONSE for f in frames[:-1])
    finally:
        await wire.close()


async def test_pipelined_sub_rdy_fin(server):
    """SUB, RDY, FIN of an unknown id and NOP in one write run in order, as nsqd runs them."""
    wire = await Wire.open(server.tcp_port)
    try:
        wire.send(b"SUB ref_pipe c\nRDY 5\nFIN 0123456789abcdef\nNOP\nCLS\nRDY 1\n")
        await wire.until(lambda: len(wire.frames) >= 3)
        await wire.quiet()
        assert wire.take() == [(p.FRAME_RESPONSE, b"OK"),
                               (p.FRAME_ERROR, b"E_FIN_FAILED FIN 0123456789abcdef failed ID not in flight"),
                               (p.FRAME_RESPONSE, b"CLOSE_WAIT")]  # RDY while closing: ignored
        assert not wire.eof
    finally:
        await wire.close()


async def test_dpub_limit_is_max_req_timeout(tmp_path):
    """Deliberately different from nsqd v1.3.0 (PROTOCOL.md, **ours**): deferral is kept
    by the on-disk delay queue, so DPUB's limit is --max-req-timeout and may be days.
    Our default is 72 h; with --max-req-timeout 1h it is nsqd's (reference case dpub_too_long,
    replayed above)."""
    proc = NsqdProcess(str(tmp_path / "nsqd"), "--max-req-timeout", "48h").start()
    try:
        wire = await Wire.open(proc.tcp_port)
        assert await wire.request(c.cmd_dpub("ref_defer", 86_400_000, b"tomorrow")) == [(p.FRAME_RESPONSE, b"OK")]
        assert await wire.request(c.cmd_dpub("ref_defer", 172_800_000, b"in two days")) == [(p.FRAME_RESPONSE, b"OK")]
        assert await wire.request(c.cmd_dpub("ref_defer", 172_800_001, b"too late")) == \
            [(p.FRAME_ERROR, b"E_INVALID DPUB timeout 172800001 out of range 0-172800000")]
        await wire.until(lambda: False)
        assert wire.eof
        await wire.close()
    finally:
        proc.kill()
