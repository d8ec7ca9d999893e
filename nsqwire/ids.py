"""Message ids (ours, PROTOCOL.md): one 64-bit value, `partition << 50 | sequence`.

The sequence is the message's 0-based place in its partition's history, so an id
alone names its partition and its cumulative count. On the wire an id is 16
lowercase hex characters, which every NSQ client echoes back unchanged.
This is the only definition of the scheme: the storage engine, the server and
the clients all use it.
"""

from __future__ import annotations

PARTITION_SHIFT = 50
MAX_PARTITION = (1 << (64 - PARTITION_SHIFT)) - 1
MAX_SEQUENCE = (1 << PARTITION_SHIFT) - 1
SEQUENCE_MASK = MAX_SEQUENCE
MSG_ID_LENGTH = 16

_HEX_DIGITS = b"0123456789abcdef"


def make_msg_id(partition: int, sequence: int) -> int:
    if not 0 <= partition <= MAX_PARTITION or not 0 <= sequence <= MAX_SEQUENCE:
        raise ValueError(f"partition {partition} or sequence {sequence} out of range")
    return partition << PARTITION_SHIFT | sequence


def msg_id_partition(n: int) -> int:
    return n >> PARTITION_SHIFT


def msg_id_sequence(n: int) -> int:
    return n & SEQUENCE_MASK


def encode_msg_id(n: int) -> bytes:
    """64-bit id -> 16 lowercase hex characters."""
    return b"%016x" % n


def decode_msg_id(b: bytes) -> int:
    """16 lowercase hex characters -> id; ValueError for anything else."""
    # strip() leaves something behind exactly when a byte is not a hex digit.
    if len(b) != MSG_ID_LENGTH or b.strip(_HEX_DIGITS):
        raise ValueError(f"invalid message id {b!r}")
    return int(b, 16)
