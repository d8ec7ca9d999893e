"""A channel's delay store across a change of leader (replicated partitions).

- `replica_of(channel, state)`: what the followers get of a checkpoint `state`:
  replica.replica_state over the first held messages of the channel's delay store, read
  after `state` was taken (ChannelDelay.held).
- `opening_state(state, ...)`: the checkpoint a channel opens from, given its stored state
  (a replica state's `held_cursor` is its cursor: replica.checkpoint_of).
- `take_over(channel)`: a new leader's channel opened from a replica state with `held` (a
  promoted follower, or a follower restarted as leader). Before the channel delivers
  anything, each held message's record is read from this node's log at its origin and
  put, with the replicated due time and attempts, into the channel's delay store, emptied
  first of what an older term of this node left there.

Invariants:
- until the store committed them, `channel.held` stays set and every checkpoint of the
  channel carries it, so a crash at any moment runs the takeover again (the store is
  emptied and filled again: it dedupes by msg_id);
- a held message whose record is gone (retention) or holds another msg_id, and every one
  of them when the store cannot take them, is never lost in silence: the cursor goes back
  to it (replica.capped) and the channel reads the log again from there, as before
  `held` existed (duplicates; a record that is gone was gone either way). Messages the
  store did take are not delivered twice for it: reading skips a record the store holds.
"""

from __future__ import annotations

import structlog

from delayqueue.entry import DelayedMessage
from diskqueue.record import CorruptRecordError
from diskqueue.segments import MissingSegmentError
from nsqwire.ids import SEQUENCE_MASK

from .replica import MAX_HELD, Held, capped, checkpoint_of, decode_held, replica_state

log = structlog.get_logger("nsqd.handover")

MAX_READS = 32  # reads of one record (a record longer than a read grows the next one)


async def replica_of(channel, state: dict) -> dict | None:
    """What followers may store of `state`, a checkpoint of `channel` taken no later than
    now (see the module docstring); None while the channel's store is not open yet (what
    it holds is unknown, and the checkpoint may count it finished: the channel is saved
    again once it is open)."""
    d = channel.delay
    if d is not None and not d.opened and "held" not in state:
        return None
    rows = await d.held(MAX_HELD + 1) if d is not None and "held" not in state else []
    return replica_state(state, None if rows is None else [Held(*r) for r in rows],
                         d.min_origin if d is not None else None)


def opening_state(state: dict, topic: str, partition: int, channel: str) -> dict:
    """The checkpoint to open a channel from, its stored `state` (see the module docstring).
    A damaged `held` or `held_cursor` is dropped with one log line: the classic cursor
    stops at the first held message, so those are read from the log again."""
    try:
        return checkpoint_of(state)
    except ValueError as e:
        log.warning("held_messages_dropped", topic=topic, partition=partition,
                    channel=channel, reason=str(e))
        return {k: v for k, v in state.items() if k not in ("held", "held_cursor")}


async def take_over(channel) -> None:
    """Put the old leader's held messages (`channel.held`) into the channel's store, then
    clear `channel.held` (see the module docstring). Also opens the store."""
    q = channel.queue
    where = {"topic": channel.topic_name, "partition": channel.partition,
             "channel": channel.name}
    back_to = None  # (offset, count): the place the cursor must read again from
    try:
        held = decode_held(channel.held)
    except ValueError as e:
        log.error("held_messages_damaged", **where, error=str(e))
        held, back_to = [], (q.start_offset, q.start_count)
    try:
        items, missing = await read_held(q, held)
    except Exception:  # never a channel that does not start: read again from the first
        log.exception("held_messages_unread", **where)
        items, missing = [], (held[0] if held else None)
    delay = channel.delay
    stored = await delay.open(items) if delay is not None else not items
    if not stored and held:
        missing = held[0]
    elif stored and items and channel.trace is not None:
        channel.trace.taken_over(channel, items)
    if missing is not None:
        place = (missing.origin, missing.msg_id & SEQUENCE_MASK)
        back_to = min(back_to or place, place)
    if back_to is not None:
        channel.reopen_at(capped(channel.checkpoint(), *back_to))
    channel.held = None
    log.info("held_messages_taken_over", **where, held=len(held),
             stored=len(items) if stored else 0,
             read_again_from=back_to[0] if back_to is not None else None)


async def read_held(queue, held: list[Held]) -> tuple[list[DelayedMessage], Held | None]:
    """The held messages as DelayedMessages read from `queue` (their records, the replicated
    due time and attempts), and the first one whose record is gone or is another message
    (None when every one was found)."""
    items: list[DelayedMessage] = []
    missing = None
    if not held:
        return items, missing
    reader = queue.reader(queue.start_offset, read_ahead=4096)
    try:
        for h in held:
            rec = await record_at(queue, reader, h.origin)
            if rec is None or rec.msg_id != h.msg_id:
                missing = missing or h
                continue
            items.append(DelayedMessage(h.due_ms, rec.msg_id, rec.trace_id, rec.timestamp,
                                        h.attempts, rec.ext, rec.body, rec.offset))
    finally:
        reader.close()
    return items, missing


async def record_at(queue, reader, offset: int):
    """The record that starts at `offset`, or None (gone, not committed, not a record)."""
    if not queue.start_offset <= offset < queue.committed_end:
        return None
    reader.seek(offset)
    try:
        for _ in range(MAX_READS):
            records = await reader.read(1)
            if records:
                return records[0] if records[0].offset == offset else None
            if reader.offset != offset:
                return None
    except (MissingSegmentError, CorruptRecordError, OSError):
        return None
    return None
