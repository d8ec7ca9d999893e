"""The extension header of a message, sans-I/O: what a client sends, what is stored, what
an `extend_support` client receives.

A client sends a JSON object (PUB_EXT, MPUB_EXT); keys beginning `##` are reserved and
only RESERVED_HEADER_KEYS may come from a client. The trace id has ONE home, the record's
own trace-id field: `stored` takes `##trace_id` out of the header before it is stored,
and `delivered` puts it back, from the field, for an `extend_support` client (as a
decimal string, the form Youzan's clients send and read), so a consumer sees what the
producer sent. An idempotent producer's `##producer_id` and `##sequence` (`producer_of`)
name the request, not a message: `stored` leaves them out, and the server stores them
on the request's first record as its own `##producer` key. Every other `##` key is the
server's own (a DPUB's due time `##defer_until_ms`, `##producer`) and is never delivered.
A record whose header has `##dead` (`dead_control`) is not a message of the topic: it is
one of a channel's dead letters, or a change to them (nsqd/deadletters.py); a reader of a
topic's history skips it.
"""

from __future__ import annotations

import json
import re

TRACE_ID_KEY = "##trace_id"
PRODUCER_ID_KEY = "##producer_id"
SEQUENCE_KEY = "##sequence"
_REQUEST_KEYS = frozenset({PRODUCER_ID_KEY, SEQUENCE_KEY})
# Keys beginning "##" are the server's: only these may come from a client.
RESERVED_HEADER_KEYS = frozenset({TRACE_ID_KEY, "##partition_key", "##client_dispatch_tag",
                                  *_REQUEST_KEYS})
# A producer id: 1 to 64 of these characters.
_PRODUCER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_SEQUENCE = (1 << 63) - 1
DEAD_KEY = "##dead"
DEAD_MARKER = b'"##dead"'  # in the header of every `##dead` record (confirmed by parsing)
HALF_KEY = "##half"
HALF_MARKER = b'"##half"'  # in the header of every `##half` record (nsqd/halves.py)
MAX_CHECK_URL = 1024  # a half message's check-back URL, in bytes

# The 1-byte version before an extension header in a message frame sent to an
# extend_support client, Youzan's numbers (their internal/ext, go-nsq's DecodeMessageWithExt):
# 4 is a JSON header, then a 2-byte length and the header; 0 is none, and nothing follows
# it (no length). Their 2 is a bare tag (no JSON), which we never send.
EXT_VERSION_NONE = 0
EXT_VERSION_JSON = 4

_MAX_TRACE_ID = (1 << 64) - 1


def trace_id_of(header: dict) -> int:
    """The `##trace_id` of a client's header (an integer or a decimal string, 0..2**64-1),
    0 when absent. Raises ValueError for anything else."""
    value = header.get(TRACE_ID_KEY)
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError("##trace_id is not a number")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit() and len(value) <= 20):
            raise ValueError("##trace_id is not a decimal number")
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= _MAX_TRACE_ID:
        raise ValueError("##trace_id is not a number in 0..2**64-1")
    return value


def producer_of(header: dict) -> tuple[str, int] | None:
    """(producer id, sequence) of a client's header, None when it names no producer.
    Raises ValueError when only one of the two is there or either is malformed."""
    producer_id = header.get(PRODUCER_ID_KEY)
    sequence = header.get(SEQUENCE_KEY)
    if producer_id is None and sequence is None:
        return None
    return checked_producer(producer_id, sequence)


def checked_producer(producer_id, sequence) -> tuple[str, int]:
    """(producer id, sequence) checked: an id of 1-64 characters [A-Za-z0-9_.:-] and a
    sequence in 0..2**63-1 (an integer, or a decimal string as HTTP gives it); else
    ValueError."""
    if not isinstance(producer_id, str) or _PRODUCER_ID.fullmatch(producer_id) is None:
        raise ValueError(f"{PRODUCER_ID_KEY} must be 1-64 characters of [A-Za-z0-9_.:-]")
    if isinstance(sequence, str) and sequence.isascii() and sequence.isdigit():
        sequence = int(sequence)
    if (isinstance(sequence, bool) or not isinstance(sequence, int)
            or not 0 <= sequence <= MAX_SEQUENCE):
        raise ValueError(f"{SEQUENCE_KEY} must be a number in 0..2**63-1 beside "
                         f"{PRODUCER_ID_KEY}")
    return producer_id, sequence


def stored(header: dict) -> tuple[int, bytes]:
    """A client's header (already checked) as stored: (trace id, compact JSON without
    `##trace_id`, `##producer_id` and `##sequence`, or b"" when nothing else is left)."""
    trace_id = trace_id_of(header)
    if TRACE_ID_KEY in header or PRODUCER_ID_KEY in header or SEQUENCE_KEY in header:
        header = {k: v for k, v in header.items()
                  if k != TRACE_ID_KEY and k not in _REQUEST_KEYS}
    if not header:
        return trace_id, b""
    return trace_id, json.dumps(header, separators=(",", ":")).encode()


def delivered(ext: bytes, trace_id: int) -> bytes:
    """The header an extend_support client receives for a stored record: its client keys,
    plus `##trace_id` from the record's field when it is not 0; b"" when none is left."""
    header = {}
    if ext:
        try:
            stored_header = json.loads(ext)
        except ValueError:
            stored_header = None
        if isinstance(stored_header, dict):
            header = {k: v for k, v in stored_header.items()
                      if not k.startswith("##")
                      or (k in RESERVED_HEADER_KEYS and k not in _REQUEST_KEYS)}
    if trace_id:
        header[TRACE_ID_KEY] = str(trace_id)
    if not header:
        return b""
    return json.dumps(header, separators=(",", ":")).encode()


def dead_control(ext: bytes) -> dict | None:
    """The `##dead` value of a stored header, None when it has none (a message)."""
    return _control(ext, DEAD_KEY, DEAD_MARKER)


def half_control(ext: bytes) -> dict | None:
    """The `##half` value of a stored header, None when it has none."""
    return _control(ext, HALF_KEY, HALF_MARKER)


def check_url_ok(url: str) -> bool:
    """Whether `url` may be a half message's check-back URL: http or https, at most
    MAX_CHECK_URL bytes, no whitespace."""
    return (url.startswith(("http://", "https://")) and len(url.encode()) <= MAX_CHECK_URL
            and not any(c.isspace() for c in url))


def _control(ext: bytes, key: str, marker: bytes) -> dict | None:
    if not ext or marker not in ext:
        return None
    try:
        header = json.loads(ext)
    except ValueError:
        return None
    value = header.get(key) if isinstance(header, dict) else None
    return value if isinstance(value, dict) else None
