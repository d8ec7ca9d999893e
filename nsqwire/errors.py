"""Every error frame the server sends: its E_* code, its text, and whether it is fatal.

A ProtocolError is one error frame for the peer. Each function below builds
the one for one failure, with the code, the text and the fatal/non-fatal split
of classic nsqd v1.3.0 (tests/data/nsqd-v1.3.0.json); where we differ, the
difference is noted beside the code. Three groups: syntax errors (raised by
protocol.CommandParser), state errors (raised by the server), and the
partition extension's errors.
"""

from __future__ import annotations

from .frames import encode_error

NOT_IN_FLIGHT = "ID not in flight"


class ProtocolError(Exception):
    """An error frame for the peer.

    `text` is exactly what goes on the wire and starts with `code`; `fatal`
    means the server closes the connection after sending it. Raw client bytes
    quoted in `text` are kept with surrogateescape, so encode_error sends them
    back byte for byte.
    """

    def __init__(self, code: str, detail: str = "", *, fatal: bool = True) -> None:
        self.code = code
        self.text = f"{code} {detail}" if detail else code
        self.fatal = fatal
        super().__init__(self.text)

    @property
    def frame(self) -> bytes:
        return encode_error(self.text)


_GO_ESCAPES = {7: r"\a", 8: r"\b", 9: r"\t", 10: r"\n", 11: r"\v", 12: r"\f", 13: r"\r", 34: r"\"", 92: "\\\\"}


def _go_quote(s: str) -> str:
    """Go's %q: what nsqd prints for a bad topic or channel name."""
    out = []
    for ch in s:
        o = ord(ch)
        if o in _GO_ESCAPES:
            out.append(_GO_ESCAPES[o])
        elif 0xDC80 <= o <= 0xDCFF:  # an undecodable byte (surrogateescape)
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        elif o < 0x80:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def _raw(b: bytes) -> str:
    """Client bytes as text that encodes back to the same bytes."""
    return b.decode("utf-8", "surrogateescape")


# Syntax errors (raised by CommandParser; all fatal, as in nsqd).

def bad_protocol() -> ProtocolError:
    return ProtocolError("E_BAD_PROTOCOL")


def line_too_long(max_line_length: int) -> ProtocolError:
    # nsqd drops the connection silently once a line outgrows its 16 KiB read
    # buffer; we say why.
    return ProtocolError("E_INVALID", f"command line longer than {max_line_length} bytes")


def invalid_command(name: str) -> ProtocolError:
    return ProtocolError("E_INVALID", f"invalid command {name}")


def insufficient_parameters(command: str) -> ProtocolError:
    # nsqd spells it "params" for the commands that take a message id.
    word = "params" if command in ("FIN", "REQ", "TOUCH") else "parameters"
    return ProtocolError("E_INVALID", f"{command} insufficient number of {word}")


def invalid_parameter_count(command: str) -> ProtocolError:
    return ProtocolError("E_INVALID", f"{command} invalid number of parameters")


def bad_topic(command: str, name: str) -> ProtocolError:
    # nsqd v1.3.0 repeats the code in MPUB's text ("E_BAD_TOPIC E_BAD_TOPIC
    # MPUB ..."); we send it once, like every other command.
    return ProtocolError("E_BAD_TOPIC", f"{command} topic name {_go_quote(name)} is not valid")


def bad_channel(command: str, name: str) -> ProtocolError:
    return ProtocolError("E_BAD_CHANNEL", f"{command} channel name {_go_quote(name)} is not valid")


def bad_partition(command: str, partition: str) -> ProtocolError:
    return ProtocolError("E_BAD_PARTITION", f"{command} topic partition {partition} is not valid")


def invalid_msg_id() -> ProtocolError:
    return ProtocolError("E_INVALID", "invalid message ID")


def unparsable_number(command: str, what: str, raw: str) -> ProtocolError:
    """e.g. "RDY could not parse count abc", "DPUB could not parse timeout -5"."""
    return ProtocolError("E_INVALID", f"{command} could not parse {what} {raw}")


def dpub_timeout_out_of_range(timeout_ms: int, max_ms: int) -> ProtocolError:
    return ProtocolError("E_INVALID", f"DPUB timeout {timeout_ms} out of range 0-{max_ms}")


def invalid_start(command: str, raw: str) -> ProtocolError:
    return ProtocolError("E_INVALID", f"{command} invalid consume start {raw}")


def invalid_body_size(command: str, size: int) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"{command} invalid body size {size}")


def body_too_big(command: str, size: int, max_size: int) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"{command} body too big {size} > {max_size}")


def invalid_message_size(command: str, size: int) -> ProtocolError:
    return ProtocolError("E_BAD_MESSAGE", f"{command} invalid message body size {size}")


def message_too_big(command: str, size: int, max_size: int) -> ProtocolError:
    return ProtocolError("E_BAD_MESSAGE", f"{command} message too big {size} > {max_size}")


def invalid_message_count(command: str, count: int) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"{command} invalid message count {count}")


def invalid_mpub_message_size(command: str, index: int, size: int) -> ProtocolError:
    return ProtocolError("E_BAD_MESSAGE", f"{command} invalid message({index}) body size {size}")


def invalid_ext_body(command: str, size: int, why: str) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"{command} invalid body size {size} {why}")


def invalid_json_header(command: str, why: str) -> ProtocolError:
    # Non-fatal, as in the partitioned fork: the body was read in full.
    return ProtocolError("E_INVALID_JSON_HEADER", f"{command} json header {why}", fatal=False)


# State errors (raised by the server).

def invalid_state(command: str) -> ProtocolError:
    return ProtocolError("E_INVALID", f"cannot {command} in current state")


def tls_required(command: str) -> ProtocolError:
    return ProtocolError("E_INVALID", f"cannot {command} in current state (TLS required)")


def heartbeats_disabled() -> ProtocolError:
    return ProtocolError("E_INVALID", "cannot SUB with heartbeats disabled")


def rdy_out_of_range(count: int, max_rdy_count: int) -> ProtocolError:
    # Fatal: otherwise client and server would disagree about the count.
    return ProtocolError("E_INVALID", f"RDY count {count} out of range 0-{max_rdy_count}")


def fin_failed(msg_id: bytes, reason: str = NOT_IN_FLIGHT) -> ProtocolError:
    return ProtocolError("E_FIN_FAILED", f"FIN {_raw(msg_id)} failed {reason}", fatal=False)


def req_failed(msg_id: bytes, reason: str = NOT_IN_FLIGHT) -> ProtocolError:
    return ProtocolError("E_REQ_FAILED", f"REQ {_raw(msg_id)} failed {reason}", fatal=False)


def touch_failed(msg_id: bytes, reason: str = NOT_IN_FLIGHT) -> ProtocolError:
    return ProtocolError("E_TOUCH_FAILED", f"TOUCH {_raw(msg_id)} failed {reason}", fatal=False)


def publish_failed(command: str, reason: str) -> ProtocolError:
    """E_PUB_FAILED, E_MPUB_FAILED or E_DPUB_FAILED (fatal, as in nsqd)."""
    code = {"MPUB": "E_MPUB_FAILED", "MPUB_EXT": "E_MPUB_FAILED", "DPUB": "E_DPUB_FAILED"}.get(command, "E_PUB_FAILED")
    return ProtocolError(code, f"{command} failed {reason}")


def sub_failed(reason: str) -> ProtocolError:
    return ProtocolError("E_SUB_FAILED", f"SUB failed {reason}")


def auth_disabled() -> ProtocolError:
    return ProtocolError("E_AUTH_DISABLED", "AUTH disabled")


def auth_already_set() -> ProtocolError:
    return ProtocolError("E_INVALID", "AUTH already set")


def auth_failed() -> ProtocolError:
    """The auth server refused or failed; the reason is for our log, not the client."""
    return ProtocolError("E_AUTH_FAILED", "AUTH failed")


def auth_no_authorizations() -> ProtocolError:
    return ProtocolError("E_UNAUTHORIZED", "AUTH no authorizations found")


def auth_first(command: str) -> ProtocolError:
    return ProtocolError("E_AUTH_FIRST", f"AUTH required before {command}")


def unauthorized(command: str, topic: str, channel: str = "") -> ProtocolError:
    return ProtocolError("E_UNAUTHORIZED", f"AUTH failed for {command} on {_go_quote(topic)} {_go_quote(channel)}")


def identify_bad_json() -> ProtocolError:
    return ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode JSON body")


def identify_rejected(reason: str) -> ProtocolError:
    """A setting out of range, e.g. "heartbeat interval (999999999) is invalid"."""
    return ProtocolError("E_BAD_BODY", f"IDENTIFY {reason}")


def compression_conflict() -> ProtocolError:
    return ProtocolError("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy compression")


def identify_failed(reason: str) -> ProtocolError:
    """An upgrade (TLS, snappy, deflate) failed after the negotiation."""
    return ProtocolError("E_IDENTIFY_FAILED", f"IDENTIFY failed {reason}")


# Partition extension errors. Publishing commands get the non-fatal form
# (the producer looks the leader up again and retries), the others the fatal one.

_PUBLISHING = frozenset({"PUB", "MPUB", "DPUB", "PUB_EXT", "MPUB_EXT", "PUB_TRACE", "MPUB_TRACE",
                         "HALF", "COMMIT", "ROLLBACK"})


def topic_not_exist(topic: str, command: str = "SUB") -> ProtocolError:
    return ProtocolError("E_TOPIC_NOT_EXIST", f"topic {_go_quote(topic)} does not exist",
                         fatal=command not in _PUBLISHING)


def not_leader(command: str, detail: str = "") -> ProtocolError:
    """`detail` (optional): the partition's leader, when known, or why nothing could lead."""
    return ProtocolError("E_FAILED_ON_NOT_LEADER", f"{command} failed: not the partition leader"
                         + (f": {detail}" if detail else ""), fatal=command not in _PUBLISHING)


def not_writable(command: str, reason: str = "") -> ProtocolError:
    """The partition takes no publish now; `reason` (optional) says more: a publish written
    but never committed says it may still be delivered (its outcome is unknown)."""
    detail = f": {reason}" if reason else ""
    return ProtocolError("E_FAILED_ON_NOT_WRITABLE",
                         f"{command} failed: partition not writable{detail}",
                         fatal=command not in _PUBLISHING)


def invalid_check_url(command: str) -> ProtocolError:
    """Ours: a half message's check-back URL that is not http(s), too long, or has space."""
    return ProtocolError("E_INVALID", f"{command} invalid check_url")


def half_failed(command: str, code: str, reason: str) -> ProtocolError:
    """Ours, half messages (non-fatal): E_HALF_NOT_FOUND (no such half message in the
    partition), E_HALF_DECIDED (decided the other way), E_HALF_FAILED (not written)."""
    return ProtocolError(code, f"{command} failed: {reason}", fatal=False)


def bad_sequence(command: str, reason: str) -> ProtocolError:
    """An idempotent producer's request refused, nothing of it written: its sequence leaves
    a gap after the last one the partition took, or is older than the ones it keeps."""
    return ProtocolError("E_BAD_SEQUENCE", f"{command} failed: {reason}", fatal=False)


def pub_too_much_waiting(waiting_bytes: int) -> ProtocolError:
    return ProtocolError("E_PUB_TOO_MUCH_WAITING", f"pub too much waiting in the queue: {waiting_bytes}")


def sub_order_is_must() -> ProtocolError:
    return ProtocolError("E_SUB_ORDER_IS_MUST", "this topic is configured only allow ordered sub")


def ext_not_supported(topic: str) -> ProtocolError:
    return ProtocolError("E_EXT_NOT_SUPPORT", f"ext content not supported in topic {topic}", fatal=False)
