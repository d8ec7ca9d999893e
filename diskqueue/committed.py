"""The persisted committed end of a replicated partition (file `committed`, beside its
data): 20 bytes, the end offset and count and a CRC of them, rewritten in place by the write
worker and never synced on its own. It is never ahead of the queue's `committed_end`; a torn
or lost one fails its check or lags, and a queue opens with min(persisted, written)."""

from __future__ import annotations

import os
import struct
import zlib

import structlog

log = structlog.get_logger("diskqueue")

COMMITTED_FILE = "committed"
_POSITION = struct.Struct(">QQI")  # committed end offset, count, crc32 of the first 16 bytes


def encode_position(end_offset: int, count: int) -> bytes:
    head = _POSITION.pack(end_offset, count, 0)[:16]
    return head + zlib.crc32(head).to_bytes(4, "big")


def decode_position(buf: bytes) -> tuple[int, int] | None:
    """(offset, count), or None for a short or bad record."""
    if len(buf) < _POSITION.size:
        return None
    end_offset, count, crc = _POSITION.unpack_from(buf)
    return (end_offset, count) if zlib.crc32(buf[:16]) == crc else None


class CommittedFile:
    """The persisted committed end of one partition: 20 bytes rewritten in place, never synced
    on its own (a torn or stale one fails its checksum or lags: both are safe)."""

    def __init__(self, path: str):
        self.path = path
        self._fd = -1
        self._failed = False

    def load(self) -> tuple[int, int] | None:
        try:
            with open(self.path, "rb") as f:
                return decode_position(f.read(_POSITION.size))
        except FileNotFoundError:
            return None

    def store(self, position: tuple[int, int]) -> None:
        """Write it (write worker); a failure is logged once and costs only laziness."""
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._fd, encode_position(*position), 0)
        except OSError as e:
            if not self._failed:
                log.warning("committed_end_not_stored", path=self.path, error=str(e))
            self._failed = True

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            self.release()

    def release(self) -> None:
        """Close it unsynced (a released log's files: a lagging one is safe); the next
        store opens it again."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
