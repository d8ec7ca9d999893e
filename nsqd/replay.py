"""Replay: move a channel's cursor to a time, an offset, a message count or the end.

One rule for POST /channel/setoffset and SUB_ADVANCED: the place is found by the partition
log's search (DiskQueue.locate: the commitlog's binary search, snapped to a record
boundary), the channel seeks there (Channel.seek), and the new cursor is stored (one SQLite
commit, off the event loop) before the answer, so a move that was answered survives kill -9;
in a replicated partition every ISR follower stores it too before the answer (as an
ordered channel's FIN), so it survives a failover right after: sent with the next
checkpoint instead, a leader killed within that time took the move with it.

What a move does to the messages the channel holds (decided here, the issue left it open):
- in flight at clients, requeued, and deferred in memory (short REQ delays, a DPUB due
  soon): dropped, as /channel/empty drops them. A later FIN, REQ or TOUCH of one of them is
  E_FIN_FAILED / E_REQ_FAILED / E_TOUCH_FAILED (non-fatal); the ones at or after the new
  place are read again from the log and delivered again.
- in the channel's disk delay queue (long deferrals, often retried messages): kept, and
  delivered when due (`/channel/delay/empty` drops them).
- clients connected to the channel stay connected and get messages from the new place.

Places: `timestamp:<unix s>` is the first message written at or after that second (every
message of one write request carries the batch's timestamp, so this is exact); `offset:<n>`
must be a record boundary (else 400 with the nearest boundaries); `count:<n>` is the n-th
message (0-based) of the partition's history; `end` is the committed end. A place past the
end is the end (`"clipped": "end"`), one before the oldest record kept is that record
(`"clipped": "retention"`).
"""

from __future__ import annotations

import structlog

from diskqueue.queue import NotABoundary, QueueClosedError
from isr.leader import NotWritable
from nsqwire.errors import ProtocolError
from nsqwire.protocol import parse_consume_start

from .errors import PartitionNotFound, PartitionNotLed, StorageError, http_error

log = structlog.get_logger("nsqd.replay")

MAX_TARGET_BYTES = 64  # the longest body /channel/setoffset reads


class ReplayError(Exception):
    """An answer `{"message": code, **extra}` with an HTTP status (TCP: E_INVALID)."""

    def __init__(self, status: int, code: str, **extra):
        super().__init__(code)
        self.status, self.code, self.extra = status, code, extra


def parse_target(text: str) -> tuple[str, int | None]:
    """A setoffset body or SUB_ADVANCED start -> (kind, value): kind "timestamp" (unix s),
    "offset", "count" or "end"; Youzan's `virtual_queue:`, `msgcount:`, `special:-1` too."""
    try:
        return parse_consume_start(text.strip())
    except ValueError:
        raise ReplayError(400, "INVALID_OFFSET", expected="timestamp:<unix s> | offset:<n> | "
                          "count:<n> | end") from None


def channels_to_move(topic, number: int | None, channel_name: str) -> list:
    """The channel on `number` (every partition led here when None); a kind of place that is
    per partition (offset, count) needs one partition, checked by the caller."""
    if number is None:
        partitions = [topic.partitions[n] for n in sorted(topic.partitions)]
    else:
        try:
            topic.check_partition(number)
        except (PartitionNotFound, PartitionNotLed) as e:
            raise ReplayError(*http_error(e)) from None
        except StorageError:
            raise ReplayError(503, "PARTITION_FAILED") from None
        partitions = [topic.partitions[number]]
    channels = [p.channels[channel_name] for p in partitions if channel_name in p.channels]
    if not channels:
        raise ReplayError(404, "CHANNEL_NOT_FOUND")
    return channels


async def move(channel, kind: str, value: int | None) -> dict:
    """Seek `channel` to the place (not stored yet: see set_offsets). Returns the answer
    entry of its partition."""
    q = channel.queue
    search = value * 1_000_000_000 if kind == "timestamp" else value
    try:
        pos = await q.locate(kind, search)
    except NotABoundary as e:
        raise ReplayError(400, "OFFSET_NOT_A_RECORD_BOUNDARY", partition=channel.partition,
                          offset=e.offset, before=e.before, after=e.after) from None
    except QueueClosedError:
        raise ReplayError(503, "EXITING") from None
    channel.seek(pos.offset, pos.count)
    log.info("channel_set_offset", topic=channel.topic_name, partition=channel.partition,
             channel=channel.name, kind=kind, value=value, offset=pos.offset, count=pos.count,
             clipped=pos.clipped)
    return {"partition": channel.partition, "offset": pos.offset, "count": pos.count,
            "clipped": pos.clipped}


async def set_offsets(nsqd, channels: list, kind: str, value: int | None) -> dict:
    """Move every channel (one per partition), then store their cursors in one commit."""
    if kind in ("offset", "count") and len(channels) > 1:
        raise ReplayError(400, "MISSING_ARG_PARTITION")
    moved = [await move(c, kind, value) for c in channels]
    for c in channels:
        nsqd._store_channel(c)
    await nsqd.meta.flush()
    try:
        for c in channels:
            await nsqd.replicate_channel(c)
    except NotWritable as e:  # moved here, not known to the followers: a failover may undo it
        raise ReplayError(503, "NOT_REPLICATED", partitions=moved, detail=str(e)) from None
    return {"partitions": moved}


async def start_first(nsqd, cmd, channels: dict) -> bool:
    """SUB_ADVANCED's start (`cmd.start`), applied only when the client is the channel's
    first (no client on any partition it subscribes to). True when the channels moved (the
    caller asks for them again: the move awaited). Refused starts are E_INVALID (fatal, as
    every SUB error)."""
    if cmd.start is None or any(c.clients for c in channels.values()):
        return False
    kind, value = parse_consume_start(cmd.start)  # the parser checked it
    try:
        await set_offsets(nsqd, list(channels.values()), kind, value)
    except ReplayError as e:
        detail = " ".join(f"{k}={v}" for k, v in e.extra.items())
        raise ProtocolError("E_INVALID", f"SUB_ADVANCED {e.code} {detail}".rstrip()) from None
    return True
