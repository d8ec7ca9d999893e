"""nsqwire (protocol.py, frames.py, ids.py, errors.py), with the client half nsqclient/commands.py,
against the nsqd v1.3.0 reference, by example and by property."""

import json
import re
import struct
import time
from typing import NamedTuple
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nsqwire import commands as c
from nsqwire import errors as e, ext, protocol as p
from nsqd.identify import IdentifyLimits, negotiate

REFERENCE = json.loads((Path(__file__).parent / "data" / "nsqd-v1.3.0.json").read_text())
TCP_CASES = {case["case"]: case for case in REFERENCE["tcp"]}
LIMITS = IdentifyLimits()
FRAME_NAMES = {"response": p.FRAME_RESPONSE, "error": p.FRAME_ERROR, "message": p.FRAME_MESSAGE}
# The reference exchanges that started from a subscribed connection.
SUBSCRIBED = {"rdy_negative", "rdy_too_big", "rdy_not_a_number", "fin_unknown_id", "fin_bad_id_length",
              "req_unknown_id", "req_bad_timeout", "touch_unknown_id", "cls_subscribed"}


def sent_bytes(sent: str) -> bytes:
    """The reference elides long payloads as '<prefix>... (N bytes)': repeat the last byte."""
    m = re.fullmatch(r"(.*)\.\.\. \((\d+) bytes\)", sent, re.S)
    if m is None:
        return sent.encode("latin-1")
    prefix = m[1].encode("latin-1")
    return prefix + prefix[-1:] * (int(m[2]) - len(prefix))


class MiniServer:
    """Just enough server to answer the reference exchanges: state gates through
    state_check, everything else from the parsed commands and the error helpers."""

    def __init__(self, subscribed: bool):
        self.subscribed = subscribed
        self.settings = None
        self.parser = p.CommandParser(state_check=self.check_state)

    def check_state(self, name: str) -> None:
        if name in ("IDENTIFY", "AUTH", "SUB") and self.subscribed:
            raise e.invalid_state(name)
        if name in ("RDY", "FIN", "REQ", "TOUCH", "CLS") and not self.subscribed:
            raise e.invalid_state(name)

    def handle(self, command) -> bytes | None:
        match command:
            case p.Identify(body=body):
                self.settings, reply = negotiate(body, LIMITS, self.settings)
                return reply
            case p.Sub():
                self.subscribed = True
                return b"OK"
            case p.Pub() | p.Mpub() | p.Dpub():
                return b"OK"
            case p.Rdy(count=count) if count > LIMITS.max_rdy_count:
                raise e.rdy_out_of_range(count, LIMITS.max_rdy_count)
            case p.Fin(msg_id=msg_id):
                raise e.fin_failed(msg_id)
            case p.Req(msg_id=msg_id):
                raise e.req_failed(msg_id)
            case p.Touch(msg_id=msg_id):
                raise e.touch_failed(msg_id)
            case p.Cls():
                return b"CLOSE_WAIT"
            case p.Auth():
                raise e.auth_disabled()
        return None

    def exchange(self, data: bytes) -> tuple[bytes, bool]:
        """Feed bytes; return the bytes written back and whether the connection closes."""
        self.parser.feed(data)
        out = []
        while True:
            try:
                for command in self.parser.commands():
                    reply = self.handle(command)
                    if reply is not None:
                        out.append(p.encode_response(reply))
                return b"".join(out), False
            except e.ProtocolError as exc:
                out.append(exc.frame)
                if exc.fatal:
                    return b"".join(out), True


def frames_of(data: bytes) -> list[tuple[int, bytes]]:
    parser = c.FrameParser()
    parser.feed(data)
    frames = list(parser.frames())
    assert parser.buffered == 0
    return frames


WIRE_CASES = sorted(name for name, case in TCP_CASES.items()
                    if all("connection_closed_after" in e for e in case["exchanges"]))


def test_reference_cases_are_all_covered():
    timer_driven = {"delivery", "requeue_redelivery", "heartbeat"}  # tested below with the encoders
    assert set(TCP_CASES) == set(WIRE_CASES) | timer_driven
    assert len(WIRE_CASES) == 37


@pytest.mark.parametrize("name", WIRE_CASES)
def test_reference_exchange(name):
    server = MiniServer(subscribed=name in SUBSCRIBED)
    if name != "bad_magic":
        server.parser.feed(p.MAGIC_V2)
    for exchange in TCP_CASES[name]["exchanges"]:
        written, closed = server.exchange(sent_bytes(exchange["sent"]))
        expected = [(FRAME_NAMES[f["frame"]], f["data"].encode("latin-1")) for f in exchange["frames"]
                    if f["data"] != "_heartbeat_"]  # heartbeats come from the server's timer
        assert frames_of(written) == expected
        assert closed == exchange["connection_closed_after"]


class Msg(NamedTuple):
    """What the server's frame encoder reads of a message."""
    timestamp: int
    attempts: int
    wire_id: bytes
    body: bytes


def test_message_frame_attempts_saturate():
    [(_, data)] = frames_of(p.encode_messages([Msg(1, 70000, b"0" * 16, b"x")]))
    assert c.parse_message(data)[1] == 0xFFFF


class PlacedMsg(NamedTuple):
    """A message with its record's place (what a SUB_ADVANCED client's frames carry)."""
    timestamp: int
    attempts: int
    wire_id: bytes
    body: bytes
    ext: bytes
    trace_id: int
    offset: int
    end: int


def test_message_frames_with_offsets_round_trip():
    """A SUB_ADVANCED client's frames: [offset][size] after the id (and after the ext
    header), before the body; size 0 when the record's end is unknown (-1)."""
    msgs = [PlacedMsg(5, 1, b"0" * 16, b"body", b"", 0, 1 << 40, (1 << 40) + 80),
            PlacedMsg(6, 2, b"1" * 16, b"", b'{"k":"v"}', 7, 300, -1)]
    plain = [c.parse_offset_message(d) for _, d in frames_of(p.encode_messages(msgs, offsets=True))]
    assert plain == [(5, 1, b"0" * 16, b"", 1 << 40, 80, b"body"), (6, 2, b"1" * 16, b"", 300, 0, b"")]
    extended = [c.parse_offset_message(d, extended=True)
                for _, d in frames_of(p.encode_messages(msgs, extended=True, offsets=True))]
    assert [(m[4], m[5], m[6]) for m in extended] == [(1 << 40, 80, b"body"), (300, 0, b"")]
    assert extended[0][3] == b"" and json.loads(extended[1][3]) == {"k": "v", "##trace_id": "7"}
    with pytest.raises(ValueError):
        c.parse_offset_message(frames_of(p.encode_messages(msgs[:1]))[0][1][:30])


def test_reference_message_frames():
    for name, attempts in (("delivery", 1), ("requeue_redelivery", 2)):
        ref = TCP_CASES[name]["exchanges"][0]["frames"][0]
        msg_id, body = ref["id"].encode(), ref["body"].encode()
        assert ref["attempts"] == attempts
        timestamp = time.time_ns()
        [(frame_type, data)] = frames_of(p.encode_messages([Msg(timestamp, attempts, msg_id, body)]))
        assert frame_type == p.FRAME_MESSAGE
        assert c.parse_message(data) == (timestamp, attempts, msg_id, body)
        p.decode_msg_id(msg_id)  # nsqd's ids are 16 hex characters too


def test_reference_heartbeat_and_constants():
    [heartbeat, _] = TCP_CASES["heartbeat"]["exchanges"][0]["frames"]
    assert frames_of(p.HEARTBEAT) == [(p.FRAME_RESPONSE, heartbeat["data"].encode())]
    assert frames_of(p.OK) == [(p.FRAME_RESPONSE, b"OK")]
    assert p.CLOSE_WAIT == p.encode_response(b"CLOSE_WAIT")


# ---------------------------------------------------------------- parser details


def parse(data: bytes, **limits) -> list:
    parser = p.CommandParser(**limits)
    parser.feed(p.MAGIC_V2 + data)
    return list(parser.commands())


def error_of(data: bytes, **limits) -> e.ProtocolError:
    with pytest.raises(e.ProtocolError) as info:
        parse(data, **limits)
    return info.value


SYNTAX_ERRORS = [
    (b"PUB\n", "E_INVALID PUB insufficient number of parameters"),
    (b"MPUB\n", "E_INVALID MPUB insufficient number of parameters"),
    (b"DPUB t\n", "E_INVALID DPUB insufficient number of parameters"),
    (b"SUB t\n", "E_INVALID SUB insufficient number of parameters"),
    (b"SUB_ORDERED t\n", "E_INVALID SUB_ORDERED insufficient number of parameters"),
    (b"FIN\n", "E_INVALID FIN insufficient number of params"),
    (b"REQ 0123456789abcdef\n", "E_INVALID REQ insufficient number of params"),
    (b"TOUCH\n", "E_INVALID TOUCH insufficient number of params"),
    (b"TOUCH 0123\n", "E_INVALID invalid message ID"),
    (b"AUTH x\n", "E_INVALID AUTH invalid number of parameters"),
    (b"MPUB bad*t\n", 'E_BAD_TOPIC MPUB topic name "bad*t" is not valid'),
    (b"SUB t bad*c\n", 'E_BAD_CHANNEL SUB channel name "bad*c" is not valid'),
    (b"SUB " + b"t" * 55 + b"#ephemeral c\n",
     'E_BAD_TOPIC SUB topic name "' + "t" * 55 + '#ephemeral" is not valid'),
    (b'PUB a\x00"\\\xff\xe2\x82\xac\n', r'E_BAD_TOPIC PUB topic name "a\x00\"\\\xff€" is not valid'),
    (b"PUB t 99999\n", "E_BAD_PARTITION PUB topic partition 99999 is not valid"),
    (b"SUB t c x\n", "E_BAD_PARTITION SUB topic partition x is not valid"),
    (b"SUB_ADVANCED t c 1 offset:x\n", "E_INVALID SUB_ADVANCED invalid consume start offset:x"),
    (b"REQ 0123456789abcdef 1.5\n", "E_INVALID REQ could not parse timeout 1.5"),
    (b"RDY 99999999999999999999\n", "E_INVALID RDY could not parse count 99999999999999999999"),
    (b"\n", "E_INVALID invalid command "),
    (b"IDENTIFY\n\x00\x00\x00\x00", "E_BAD_BODY IDENTIFY invalid body size 0"),
    (b"IDENTIFY\n\x80\x00\x00\x00", "E_BAD_BODY IDENTIFY invalid body size -2147483648"),
    (b"AUTH\n\x00\x50\x00\x01", "E_BAD_BODY AUTH body too big 5242881 > 5242880"),
    (b"DPUB t 5\n\xff\xff\xff\xff", "E_BAD_MESSAGE DPUB invalid message body size -1"),
    (b"MPUB t\n\x00\x00\x00\x00", "E_BAD_BODY MPUB invalid body size 0"),
    (b"MPUB t\n\x00\x50\x00\x01", "E_BAD_BODY MPUB body too big 5242881 > 5242880"),
    (b"MPUB t\n\x00\x00\x00\x09\x00\x10\x00\x00", "E_BAD_BODY MPUB invalid message count 1048576"),
    (b"MPUB t\n\x00\x00\x00\x09\x00\x00\x00\x01\x00\x10\x00\x01",
     "E_BAD_MESSAGE MPUB message too big 1048577 > 1048576"),
    (b"PUB_TRACE t\n\x00\x00\x00\x08" + bytes(8), "E_BAD_BODY PUB_TRACE invalid body size 8 with trace id enabled"),
    (b"MPUB_TRACE t\n\x00\x00\x00\x0c\x00\x00\x00\x01\x00\x00\x00\x04" + bytes(4),
     "E_BAD_BODY MPUB_TRACE invalid body size 4 with trace id enabled"),
    (b"PUB_EXT t\n\x00\x00\x00\x02\x00\x00", "E_BAD_BODY PUB_EXT invalid body size 2 with ext json header enabled"),
    (b"PUB_EXT t\n\x00\x00\x00\x04\x00\x02{}",
     "E_BAD_BODY PUB_EXT invalid body size 4 in ext json header content length"),
]


@pytest.mark.parametrize(("data", "text"), SYNTAX_ERRORS)
def test_syntax_errors_are_fatal_with_nsqd_texts(data, text):
    error = error_of(data)
    assert (error.text, error.fatal, error.code) == (text, True, text.split(" ")[0])


def test_dpub_limit_is_the_servers():
    assert parse(b"DPUB t 86400000\n\x00\x00\x00\x01x", max_defer_ms=7 * 86400000) == [p.Dpub("t", 86400000, b"x")]
    assert error_of(b"DPUB t 86400001\n", max_defer_ms=86400000).text == \
        "E_INVALID DPUB timeout 86400001 out of range 0-86400000"


def test_arguments_nsqd_reads_leniently():
    assert parse(b"RDY\nRDY \nPUB t \n\x00\x00\x00\x01x") == [p.Rdy(1), p.Rdy(0), p.Pub("t", b"x")]
    assert parse(b"SUB t c -1 extra\r\nRDY 5\r\n") == [p.Sub("t", "c", None), p.Rdy(5)]
    assert error_of(b"RDY 5\r\r\n").text == "E_INVALID RDY could not parse count 5\r"
    assert parse(b"REQ \xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xf7\xf6\xf5\xf4\xf3\xf2\xf1\xf0 \n") == \
        [p.Req(bytes(range(0xff, 0xef, -1)), 0)]  # any 16 bytes; an empty timeout reads as 0
    assert parse(b"NOP x\nCLS y\n") == [p.Nop(), p.Cls()]


def test_raw_client_bytes_go_back_unchanged():
    error = error_of(b"RDY \xff1\n")
    assert error.frame == p.encode_error(b"E_INVALID RDY could not parse count \xff1")
    assert e.fin_failed(b"\xfe" * 16).frame.endswith(b"FIN " + b"\xfe" * 16 + b" failed ID not in flight")


def test_line_length_is_bounded():
    assert error_of(b"NOP" + b" " * 30, max_line_length=32).text == "E_INVALID command line longer than 32 bytes"
    assert error_of(b"NOP" + b" " * 30 + b"\n", max_line_length=32).fatal
    assert parse(b"NOP" + b" " * 28 + b"\r\n", max_line_length=32) == [p.Nop()]


def test_newline_search_is_linear():
    parser = p.CommandParser(max_line_length=20_000_000)
    parser.feed(p.MAGIC_V2 + b"NOP")
    started = time.perf_counter()
    for _ in range(100_000):  # 10 MB in 100-byte reads
        parser.feed(b" " * 100)
        assert list(parser.commands()) == []
    parser.feed(b"\n")
    assert list(parser.commands()) == [p.Nop()]
    assert time.perf_counter() - started < 3  # rescanning the line per read: ~500 GB of memchr


def test_a_read_taken_as_the_buffer_is_never_the_callers_to_change():
    # A read at a command boundary becomes the buffer as it is (no copy for bytes); a
    # mutable one is copied, so a caller reusing its read buffer changes nothing parsed.
    parser = p.CommandParser()
    parser.feed(p.MAGIC_V2)
    assert list(parser.commands()) == []
    read = bytearray(b"PUB t\n\x00\x00\x00\x02ab" + b"PUB t\n\x00\x00")
    parser.feed(read)
    read[:] = b"x" * len(read)
    assert list(parser.commands()) == [p.Pub("t", b"ab")]
    parser.feed(b"\x00\x02cd")  # the rest of a command waits in the buffer, then completes
    read[:] = b"y" * len(read)
    assert list(parser.commands()) == [p.Pub("t", b"cd")]
    assert parser.buffered == 0


def test_declared_sizes_are_refused_before_buffering():
    parser = p.CommandParser()
    parser.feed(p.MAGIC_V2 + b"PUB t\n\x7f\xff\xff\xff")
    with pytest.raises(e.ProtocolError, match="PUB message too big 2147483647 > 1048576"):
        list(parser.commands())


def test_mpub_frames_by_count_and_caps_total_at_max_body_size():
    # Like nsqd: the count decides, so a short body waits for the next bytes...
    parser = p.CommandParser(max_body_size=40)
    parser.feed(p.MAGIC_V2 + b"MPUB t\n\x00\x00\x00\x09\x00\x00\x00\x02\x00\x00\x00\x01a")
    assert list(parser.commands()) == []
    parser.feed(b"\x00\x00\x00\x02bc")
    assert list(parser.commands()) == [p.Mpub("t", [b"a", b"bc"])]
    # ...but never past max_body_size.
    parser.feed(b"MPUB t\n\x00\x00\x00\x08\x00\x00\x00\x02\x00\x00\x00\x10" + b"x" * 16 + b"\x00\x00\x00\x10")
    with pytest.raises(e.ProtocolError, match="E_BAD_BODY MPUB body too big 44 > 40"):
        list(parser.commands())
    assert error_of(b"MPUB t\n\x00\x00\x00\x0d\x00\x00\x00\x02\x00\x00\x00\x01a\xff\xff\xff\xff").text == \
        "E_BAD_MESSAGE MPUB invalid message(1) body size -1"


def test_state_check_runs_before_the_arguments():
    def reject(name):
        if name != "NOP":
            raise e.invalid_state(name)
    parser = p.CommandParser(state_check=reject)
    parser.feed(p.MAGIC_V2 + b"NOP\nRDY abc\n")
    commands = parser.commands()
    assert next(commands) == p.Nop()
    with pytest.raises(e.ProtocolError, match="^E_INVALID cannot RDY in current state$"):
        next(commands)


def test_fatal_errors_are_sticky():
    parser = p.CommandParser()
    parser.feed(p.MAGIC_V2 + b"FOO\nNOP\n")
    for _ in range(2):
        with pytest.raises(e.ProtocolError, match="^E_INVALID invalid command FOO$"):
            list(parser.commands())


def test_bad_json_header_is_not_fatal_and_parsing_goes_on():
    parser = p.CommandParser()
    parser.feed(p.MAGIC_V2
                + c.encode_command(b"PUB_EXT", "t", body=b"\x00\x05[1,2]x") + c.cmd_nop()
                + c.encode_command(b"MPUB_EXT", "t", body=b'\x00\x00\x00\x01\x00\x00\x00\x09\x00\x06{"a":1x')
                + c.cmd_nop() + c.cmd_pub_ext("t", {"a ": 1}, b"x") + c.cmd_nop())
    seen, errors = [], []
    while True:
        try:
            for command in parser.commands():
                seen.append(command)
            break
        except e.ProtocolError as exc:
            errors.append((exc.text, exc.fatal))
    assert seen == [p.Nop(), p.Nop(), p.Nop()]
    assert errors == [("E_INVALID_JSON_HEADER PUB_EXT json header is not an object", False),
                      ("E_INVALID_JSON_HEADER MPUB_EXT json header is not valid JSON", False),
                      ('E_INVALID_JSON_HEADER PUB_EXT json header key "a " is not valid', False)]


def test_unknown_reserved_header_keys_are_refused():
    """A client must not smuggle in server-side keys such as the DPUB due time."""
    assert error_of(c.cmd_pub_ext("t", {"##defer_until_ms": 1}, b"x")).text == \
        'E_INVALID_JSON_HEADER PUB_EXT json header key "##defer_until_ms" is reserved'
    assert error_of(c.cmd_mpub_ext("t", [({"##x": 1}, b"x")])).code == "E_INVALID_JSON_HEADER"
    parser = p.CommandParser()
    header = {"##trace_id": 7, "##client_dispatch_tag": "a", "#own": 1}
    parser.feed(p.MAGIC_V2 + c.cmd_pub_ext("t", header, b"x"))
    assert list(parser.commands()) == [p.PubExt("t", header, b"x", None)]


def test_json_nested_too_deeply_is_a_value_error():
    with pytest.raises(ValueError):
        p.decode_json(b"[" * 100_000)
    with pytest.raises(ValueError):
        p.decode_json(b"NaN")
    deep = b"[" * 30_000 + b"]" * 30_000
    assert error_of(c.encode_command(b"PUB_EXT", "t", body=struct.pack(">H", len(deep)) + deep + b"x")).code == \
        "E_INVALID_JSON_HEADER"


def test_consume_start():
    assert p.parse_consume_start("end") == ("end", None)
    assert p.parse_consume_start("timestamp:1700000000") == ("timestamp", 1700000000)
    assert p.parse_consume_start("special:-1") == ("end", None)
    assert p.parse_consume_start("virtual_queue:5") == ("offset", 5)
    assert p.parse_consume_start("msgcount:7") == ("count", 7)
    for bad in ("", "end:1", "offset:", "count:-1", "count:1 ", "virtual_queue:x", "special:0",
                "special:1", "msgcount:"):
        with pytest.raises(ValueError):
            p.parse_consume_start(bad)


def test_names():
    for good in ("a", "t.-_9", "x" * 64, "x" * 54 + "#ephemeral"):
        assert p.valid_topic_name(good) and p.valid_channel_name(good)
    for bad in ("", "x" * 65, "x" * 55 + "#ephemeral", "#ephemeral", "a b", "a*", "é", "a#ephemera", "a\n"):
        assert not p.valid_topic_name(bad)


def test_state_error_helpers():
    assert e.invalid_state("SUB").text == "E_INVALID cannot SUB in current state"
    assert e.tls_required("PUB").text == "E_INVALID cannot PUB in current state (TLS required)"
    assert e.heartbeats_disabled().text == "E_INVALID cannot SUB with heartbeats disabled"
    assert e.rdy_out_of_range(9999999, 2500).text == "E_INVALID RDY count 9999999 out of range 0-2500"
    assert e.req_failed(b"0123456789abcdef", "client does not own message").text == \
        "E_REQ_FAILED REQ 0123456789abcdef failed client does not own message"
    assert e.unauthorized("SUB", "t", "c").text == 'E_UNAUTHORIZED AUTH failed for SUB on "t" "c"'
    assert e.auth_first("PUB").text == "E_AUTH_FIRST AUTH required before PUB"
    assert [e.publish_failed(command, "disk full").text for command in ("PUB", "MPUB", "DPUB")] == [
        "E_PUB_FAILED PUB failed disk full", "E_MPUB_FAILED MPUB failed disk full",
        "E_DPUB_FAILED DPUB failed disk full"]
    assert e.sub_failed("consumers for channel c exceeds limit of 1").code == "E_SUB_FAILED"
    assert not e.not_leader("PUB").fatal and e.not_leader("SUB").fatal and e.not_writable("FIN").fatal
    non_fatal = [e.fin_failed(b"x" * 16), e.req_failed(b"x" * 16), e.touch_failed(b"x" * 16),
                 e.ext_not_supported("t"), e.not_writable("MPUB")]
    assert not any(err.fatal for err in non_fatal)
    fatal = [e.auth_disabled(), e.auth_already_set(), e.auth_failed(), e.auth_no_authorizations(),
             e.topic_not_exist("t"), e.pub_too_much_waiting(1), e.sub_order_is_must(), e.identify_failed("tls")]
    assert all(err.fatal for err in fatal)
    assert [err.code for err in fatal] == ["E_AUTH_DISABLED", "E_INVALID", "E_AUTH_FAILED", "E_UNAUTHORIZED",
                                       "E_TOPIC_NOT_EXIST", "E_PUB_TOO_MUCH_WAITING", "E_SUB_ORDER_IS_MUST",
                                       "E_IDENTIFY_FAILED"]


def test_pub_trace_reply():
    reply = p.pub_trace_reply(p.make_msg_id(3, 9), 77, 4096, 30)
    assert reply == b"OK" + struct.pack(">QQqI", 3 << 50 | 9, 77, 4096, 30)


# ---------------------------------------------------------------- message ids


@given(st.integers(0, p.MAX_PARTITION), st.integers(0, p.MAX_SEQUENCE))
def test_msg_id_round_trip(partition, sequence):
    n = p.make_msg_id(partition, sequence)
    wire = p.encode_msg_id(n)
    assert len(wire) == 16 and wire == wire.lower()
    assert p.decode_msg_id(wire) == n
    assert (p.msg_id_partition(n), p.msg_id_sequence(n)) == (partition, sequence)


@pytest.mark.parametrize("bad", [b"", b"0" * 15, b"0" * 17, b"0123456789ABCDEF", b"0x23456789abcdef",
                                 b"+123456789abcdef", b" 123456789abcdef", b"0_23456789abcdef", b"g" * 16])
def test_decode_msg_id_refuses(bad):
    with pytest.raises(ValueError):
        p.decode_msg_id(bad)


def test_make_msg_id_refuses_out_of_range():
    for partition, sequence in ((p.MAX_PARTITION + 1, 0), (0, p.MAX_SEQUENCE + 1), (-1, 0)):
        with pytest.raises(ValueError):
            p.make_msg_id(partition, sequence)


# ---------------------------------------------------------------- properties

names = st.from_regex(r"[.a-zA-Z0-9_-]{1,54}(#ephemeral)?", fullmatch=True)
bodies = st.binary(min_size=1, max_size=40)
partitions = st.none() | st.integers(0, p.MAX_PARTITION)
msg_ids = st.integers(0, 2**64 - 1).map(p.encode_msg_id)
# Keys starting with "##" are reserved (refused unless known); tested by name above.
headers = st.dictionaries(st.from_regex(r"[0-9a-zA-Z_#-]{1,8}", fullmatch=True).filter(lambda k: not k.startswith("##")),
                          st.text(max_size=6) | st.integers() | st.booleans(), max_size=3)
starts = st.none() | st.just("end") | st.just("special:-1") | st.builds("{}:{}".format, st.sampled_from(["timestamp", "offset", "count", "virtual_queue", "msgcount"]),
                                                st.integers(0, 10**15))


def pair(encode, expect):
    return lambda *args: (encode(*args), expect(*args))


commands = st.one_of(
    st.builds(pair(c.cmd_pub, p.Pub), names, bodies, partitions),
    st.builds(pair(c.cmd_mpub, p.Mpub), names, st.lists(bodies, min_size=1, max_size=4), partitions),
    st.builds(pair(c.cmd_dpub, p.Dpub), names, st.integers(0, 3_600_000), bodies, partitions),
    st.builds(pair(c.cmd_pub_ext, p.PubExt), names, headers, bodies, partitions),
    st.builds(pair(c.cmd_mpub_ext, p.MpubExt), names, st.lists(st.tuples(headers, bodies), min_size=1, max_size=3),
              partitions),
    st.builds(pair(c.cmd_pub_trace, p.PubTrace), names, st.integers(0, 2**64 - 1), bodies, partitions),
    st.builds(pair(c.cmd_mpub_trace, p.MpubTrace), names,
              st.lists(st.tuples(st.integers(0, 2**64 - 1), bodies), min_size=1, max_size=3), partitions),
    st.builds(pair(c.cmd_sub, p.Sub), names, names, partitions),
    st.builds(pair(c.cmd_sub_ordered, p.SubOrdered), names, names, st.integers(0, p.MAX_PARTITION)),
    st.builds(pair(c.cmd_sub_advanced, p.SubAdvanced), names, names, st.integers(0, p.MAX_PARTITION), starts),
    st.builds(pair(c.cmd_rdy, p.Rdy), st.integers(0, 10**12)),
    st.builds(pair(c.cmd_fin, p.Fin), msg_ids),
    st.builds(pair(c.cmd_req, p.Req), msg_ids, st.integers(0, 10**12)),
    st.builds(pair(c.cmd_touch, p.Touch), msg_ids),
    st.builds(lambda d: (c.cmd_identify(d), p.Identify(json.dumps(d).encode())), headers),
    st.builds(pair(c.cmd_auth, p.Auth), bodies),
    st.just((c.cmd_cls(), p.Cls())),
    st.just((c.cmd_nop(), p.Nop())),
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(commands, min_size=1, max_size=8), st.data())
def test_client_encoders_round_trip_through_the_parser(pairs, data):
    stream = p.MAGIC_V2 + b"".join(encoded for encoded, _ in pairs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    parser = p.CommandParser()
    parsed = []
    for chunk in chunked(stream, cuts):
        parser.feed(chunk)
        parsed += parser.commands()
    assert parsed == [expected for _, expected in pairs]
    assert parser.buffered == 0


SMALL = {"max_msg_size": 48, "max_body_size": 160, "max_line_length": 40}
BOUND = max(SMALL.values()) + 4


@settings(max_examples=300)
@given(st.lists(commands.map(lambda c: c[0]) | st.binary(max_size=24), max_size=10), st.booleans(), st.data())
def test_any_bytes_give_commands_or_protocol_errors_in_bounded_memory(pieces, magic, data):
    stream = (p.MAGIC_V2 if magic else b"") + b"".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    parser = p.CommandParser(**SMALL)
    for chunk in chunked(stream, cuts):
        parser.feed(chunk)
        while True:
            try:
                for _ in parser.commands():
                    assert parser.buffered <= BOUND + len(chunk)
                break
            except e.ProtocolError as exc:
                assert exc.text.startswith(exc.code + " ") or exc.text == exc.code
                if exc.fatal:
                    return
        assert parser.buffered <= BOUND


frames = st.one_of(
    st.builds(lambda d: ((p.FRAME_RESPONSE, d), p.encode_response(d)), st.binary(max_size=30)),
    st.builds(lambda d: ((p.FRAME_ERROR, d), p.encode_error(d)), st.binary(max_size=30)),
    st.builds(lambda ts, n, i, b: ((p.FRAME_MESSAGE, (ts, n, i, b)), p.encode_messages([Msg(ts, n, i, b)])),
              st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535), msg_ids, st.binary(max_size=30)),
)


@given(st.lists(frames, max_size=8), st.data())
def test_frame_parser_round_trip(items, data):
    stream = b"".join(encoded for _, encoded in items)
    messages = [frame[1] for frame, _ in items if frame[0] == p.FRAME_MESSAGE]
    assert p.encode_messages([Msg(*m) for m in messages]) == b"".join(
        e for f, e in items if f[0] == p.FRAME_MESSAGE)
    parser = c.FrameParser()
    parsed = []
    for chunk in chunked(stream, data.draw(st.lists(st.integers(0, len(stream)), max_size=8))):
        parser.feed(chunk)
        parsed += [(t, c.parse_message(d) if t == p.FRAME_MESSAGE else d) for t, d in parser.frames()]
    assert parsed == [frame for frame, _ in items]


def test_frame_parser_refuses_bad_sizes():
    for size in (3, 65):
        parser = c.FrameParser(max_frame_size=64)
        parser.feed(struct.pack(">ii", size, 0))
        with pytest.raises(ValueError):
            list(parser.frames())
    with pytest.raises(ValueError):
        c.parse_message(bytes(25))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(commands | st.builds(lambda i: (c.cmd_fin(i), p.Fin(i)), msg_ids), min_size=1,
                max_size=12), st.integers(1, 4), st.data())
def test_fin_runs_read_at_once_are_the_commands_read_one_by_one(pairs, limit, data):
    """next_fins (what the server tries first once subscribed) and next_command together
    give exactly the commands that commands() gives."""
    stream = p.MAGIC_V2 + b"".join(encoded for encoded, _ in pairs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    parser = p.CommandParser()
    parsed = []
    for chunk in chunked(stream, cuts):
        parser.feed(chunk)
        while True:
            ids = parser.next_fins(limit)
            assert len(ids) <= limit
            if ids:
                parsed += [p.Fin(i) for i in ids]
                continue
            command = parser.next_command()
            if command is None:
                break
            parsed.append(command)
    assert parsed == [expected for _, expected in pairs]


def test_fin_runs_leave_odd_ids_and_state_errors_to_the_general_path():
    parser = p.CommandParser()
    parser.feed(p.MAGIC_V2)
    assert parser.next_command() is None  # reads the magic; next_fins reads only commands
    parser.feed(c.cmd_fin(b"0123456789abcdef") + c.cmd_fin(b"0123456789abcde ")
                + b"FIN 0123456789abcde\r\n")
    assert parser.next_fins(10) == [b"0123456789abcdef"]
    assert parser.next_fins(10) == []  # a space in the id: the general path's error
    with pytest.raises(e.ProtocolError, match="invalid message ID"):
        parser.next_command()

    def refuse(name):
        raise e.invalid_state(name)

    parser = p.CommandParser(state_check=refuse)
    parser.feed(p.MAGIC_V2)
    parser.next_command()
    parser.feed(c.cmd_fin(b"0123456789abcdef"))
    for _ in range(2):  # fatal, and sticky
        with pytest.raises(e.ProtocolError, match="cannot FIN in current state"):
            parser.next_fins(10)
        assert parser.buffered == 21  # nothing consumed


def outcomes(parser: p.CommandParser, chunks) -> list:
    """Every command and error the parser gives for `chunks`, fed one after another, up to
    the first fatal error."""
    out = []
    for chunk in chunks:
        parser.feed(chunk)
        while True:
            try:
                command = parser.next_command()
            except e.ProtocolError as exc:
                out.append(exc.text)
                if exc.fatal:
                    return out
                continue
            if command is None:
                break
            out.append(command)
    return out


pub_lines = st.builds(
    lambda cmd, topic, rest, cr, size, body: (cmd + b" " + topic + rest + cr + b"\n"
                                              + struct.pack(">i", size) + body),
    st.sampled_from([b"PUB", b"PUB_EXT", b"PUBX"]),
    st.sampled_from([b"t", b"t.1#ephemeral", b"bad!", b"", b"t" * 65, b"t" * 64]),
    st.sampled_from([b"", b" 3", b" -1", b" x", b" 3 4", b" "]),
    st.sampled_from([b"", b"\r"]),
    st.integers(-2, 50),
    st.binary(max_size=50))


@settings(max_examples=300)
@given(st.lists(pub_lines | st.binary(max_size=12), min_size=1, max_size=6))
def test_a_pub_read_whole_is_the_pub_read_byte_by_byte(pieces):
    """The whole-PUB step (a PUB all buffered, read at once) gives the commands and errors
    the general path gives reading the same bytes one at a time."""
    stream = p.MAGIC_V2 + b"".join(pieces)
    limits = {"max_msg_size": 40, "max_line_length": 80}
    whole = outcomes(p.CommandParser(**limits), [stream])
    by_byte = outcomes(p.CommandParser(**limits), [stream[i:i + 1] for i in range(len(stream))])
    assert whole == by_byte


def test_a_pub_read_whole_still_runs_the_state_check():
    checked = []
    parser = p.CommandParser(state_check=checked.append)
    parser.feed(p.MAGIC_V2 + c.cmd_pub("t", b"hi"))
    assert parser.next_command() == p.Pub("t", b"hi")
    assert checked == ["PUB"]


class ExtMsg(NamedTuple):
    timestamp: int
    attempts: int
    wire_id: bytes
    body: bytes
    ext: bytes
    trace_id: int


def test_ext_header_has_one_home_for_the_trace_id():
    assert ext.stored({"##trace_id": "42", "k": 1}) == (42, b'{"k":1}')
    assert ext.stored({"##trace_id": 2**64 - 1}) == (2**64 - 1, b"")
    assert ext.stored({}) == (0, b"")
    for bad in ("-1", "1e3", " 1", "", str(2**64), True, 1.5, -1, 2**64, [1]):
        with pytest.raises(ValueError):
            ext.trace_id_of({"##trace_id": bad})
    assert error_of(c.cmd_pub_ext("t", {"##trace_id": "x"}, b"m")).code == "E_INVALID_JSON_HEADER"
    # Delivered: the client's keys, the trace id from the field, never the server's own keys.
    assert json.loads(ext.delivered(b'{"k":1,"##defer_until_ms":5,"##client_dispatch_tag":"a"}', 7)) == {
        "k": 1, "##client_dispatch_tag": "a", "##trace_id": "7"}
    assert ext.delivered(b'{"##defer_until_ms":5}', 0) == b""
    assert ext.delivered(b"", 0) == b""


@given(st.lists(st.tuples(st.integers(0, 65535), msg_ids, st.binary(max_size=20),
                          st.sampled_from([b"", b'{"k":"v"}', b'{"##defer_until_ms":1}']),
                          st.integers(0, 2**64 - 1)), max_size=5))
def test_extended_message_frames_round_trip(messages):
    msgs = [ExtMsg(123, a, i, b, x, t) for a, i, b, x, t in messages]
    assert p.encode_messages(msgs, extended=False) == p.encode_messages(
        [Msg(123, a, i, b) for a, i, b, _, _ in messages])
    parser = c.FrameParser()
    parser.feed(p.encode_messages(msgs, extended=True))
    for (kind, data), m in zip(parser.frames(), msgs, strict=True):
        assert kind == p.FRAME_MESSAGE
        ts, attempts, msg_id, version, header, body = c.parse_ext_message(data)
        assert (ts, attempts, msg_id, body) == (123, m.attempts, m.wire_id, m.body)
        assert header == ext.delivered(m.ext, m.trace_id)
        assert version == (ext.EXT_VERSION_JSON if header else ext.EXT_VERSION_NONE)
