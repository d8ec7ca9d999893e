"""Message: one message taken from a partition's log, with its delivery state; and the
ext header a deferred publish (DPUB) carries its due time in.

A Message is also its own cursor slot (offset, end, count, done: nsqd/cursor.py), so taking
a message from the log costs one object. Invariant: `delayed` messages live in the delay
store, never in a cursor's window (their `end` and `count` are -1).
"""

from __future__ import annotations

import json

from nsqwire.ids import SEQUENCE_MASK

DEFER_KEY = "##defer_until_ms"


class Message:
    """A message taken from the log, with its delivery state; also its own cursor Slot
    (offset, end, count, done), so taking a message costs one object."""

    __slots__ = ("offset", "end", "count", "done", "msg_id", "trace_id", "timestamp", "attempts",
                 "body", "ext", "deadline", "client", "delivered_at", "delayed", "wire_id", "route")

    def __init__(self, rec):
        self.offset = rec.offset
        self.end = rec.offset + rec.size
        self.count = rec.msg_id & SEQUENCE_MASK
        self.done = False
        self.msg_id = rec.msg_id
        self.trace_id = rec.trace_id
        self.timestamp = rec.timestamp
        self.attempts = rec.attempts
        self.body = rec.body
        self.ext = rec.ext
        self.deadline = 0.0
        self.client = None
        self.delivered_at = 0.0
        self.wire_id = b""  # the id as sent (16 hex characters), set at delivery
        self.delayed = False  # True: it lives in the delay store, not in the cursor's window
        self.route = None  # (tag, header) once a routed channel looked (tags.py)

    @classmethod
    def from_store(cls, d) -> "Message":
        """A message brought back from the delay store (its log offset is long confirmed)."""
        msg = cls.__new__(cls)
        msg.offset = d.origin_offset
        msg.end = msg.count = -1
        msg.done = True
        msg.msg_id, msg.trace_id, msg.timestamp, msg.attempts = (d.msg_id, d.trace_id,
                                                                 d.timestamp, d.attempts)
        msg.body, msg.ext = d.body, d.ext
        msg.deadline = msg.delivered_at = 0.0
        msg.client = None
        msg.delayed = True
        msg.wire_id = b""
        msg.route = None
        return msg


def defer_ext(defer_ms: int, now: float) -> bytes:
    """The ext header of a deferred publish (DPUB, HTTP /pub?defer=): due `now` (the node's
    clock, unix seconds) + defer_ms."""
    if not defer_ms:
        return b""
    return json.dumps({DEFER_KEY: int(now * 1000) + defer_ms}).encode()


def defer_until_ms(ext: bytes) -> int:
    """The due time (unix ms) a DPUB stored in the record's ext header, or 0."""
    try:
        return int(json.loads(ext).get(DEFER_KEY, 0))
    except (ValueError, AttributeError, TypeError):
        return 0
