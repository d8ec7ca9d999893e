"""The partition of a key: the one rule every client of a partitioned topic must share.

partition_of(key, n) = murmur3_x86_32(key bytes, seed 0) as an unsigned 32-bit integer,
mod n. A str key is its UTF-8 bytes. README.md gives test vectors for other languages.
"""

from __future__ import annotations

import mmh3


def key_bytes(key: bytes | str) -> bytes:
    """The bytes that are hashed: a str is UTF-8, bytes are taken as they are."""
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"a partition key is bytes or str, not {type(key).__name__}")


def partition_of(key: bytes | str, partition_num: int) -> int:
    """The partition (0..partition_num-1) of `key` in a topic of `partition_num` partitions."""
    if partition_num < 1:
        raise ValueError(f"partition_num must be at least 1, not {partition_num}")
    return mmh3.hash(key_bytes(key), 0, signed=False) % partition_num
