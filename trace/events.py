"""A trace event: one state change of one message, as a plain tuple (cheap to make on the
event loop, cheap to hand to the writer thread).

    (time_ns, kind, topic, partition, channel, msg_id, trace_id, offset, attempts, detail)

`channel` is "" for topic-level events (PUB, a topic's DROP); `msg_id` is NO_MESSAGE for
an event about a range rather than one message (a channel emptied, a topic deleted: `detail` says
what); `detail` is the client's address (PUB, DELIVER), the delay in ms (REQ, DELAY_IN)
or a reason (DROP, BURY). The node is the store's, not the event's (one store per node).
"""

from __future__ import annotations

PUB = "PUB"
DELIVER = "DELIVER"
REQ = "REQ"
TIMEOUT = "TIMEOUT"
FIN = "FIN"
DELAY_IN = "DELAY_IN"
DELAY_OUT = "DELAY_OUT"
REPLAY = "REPLAY"
DROP = "DROP"
BURY = "BURY"  # moved to its channel's dead letters (nsqd/deadletters.py); detail: the cause
NO_MESSAGE = (1 << 63) - 1  # never a message id: partition << 50 | sequence, partition <= 1023
KINDS = (PUB, DELIVER, REQ, TIMEOUT, FIN, DELAY_IN, DELAY_OUT, REPLAY, DROP, BURY)

FIELDS = ("time_ns", "kind", "topic", "partition", "channel", "msg_id", "trace_id", "offset",
          "attempts", "detail")


def msg_id_hex(msg_id: int) -> str:
    """A message id as clients see it on the wire: 16 hex characters ("" for NO_MESSAGE)."""
    return "" if msg_id == NO_MESSAGE else f"{msg_id:016x}"


def parse_msg_id(text: str) -> int:
    """A message id as 16 hex characters (the wire form); ValueError otherwise."""
    if len(text) != 16:
        raise ValueError("a message id is 16 hex characters")
    return int(text, 16)
