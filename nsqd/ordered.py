"""Ordered delivery: the dispatch rule of an ordered channel of one partition.

A channel is ordered when a client subscribed to it with `SUB_ORDERED`, or when its topic
was created ordered (every channel then, and only `SUB_ORDERED` is taken); `POST
/channel/setorder?order=false` turns the rule off again. The flag is saved with the
channel's checkpoint (and so replicated with it), so a restart or a new leader keeps it.

The rule (`OrderedDispatch`, hooked into channel.py):
- at most one message of the channel is out at a time, whatever RDY says and however many
  clients consume it; the next one is released only after the one out is finished;
- on a replicated partition, a FIN counts only once every ISR follower stored the channel
  state it made (`confirm`, a direct push awaited, not the 200 ms checkpoint timer): a new
  leader then starts past it, so it never delivers that message again after a later one;
- a message that comes back (timeout, `REQ` with any delay, a consumer leaving) is the
  next one out, before anything read after it: a REQ's delay counts as 0, nothing goes to
  the delay queue, and a DPUB's due time is not waited for (the log's order rules);
- turning the rule on puts what already waits back in log order (requeued and deferred
  messages); messages already in the delay store stay there until due.

Invariant: while `confirming`, a message of the channel is in flight, or one is being
buried (its dead copy on its way: nsqd/deadletters.py), `room` is 0.
"""

from __future__ import annotations

import asyncio
from collections import deque
from operator import attrgetter

import structlog

log = structlog.get_logger("nsqd.ordered")

_offset = attrgetter("offset")
CONFIRM_RETRY_MAX = 1.0  # seconds between tries of a FIN the ISR did not take yet, at most


class OrderedDispatch:
    """The ordered rule of one channel. `confirm(channel)`: awaited after each FIN on a
    replicated partition, returns once the ISR holds the channel's state (raises when it
    could not: it is tried again until it works or the channel closes)."""

    __slots__ = ("channel", "confirm", "confirming", "_again", "_task")

    def __init__(self, channel, confirm=None):
        self.channel = channel
        self.confirm = confirm
        self.confirming = False  # a FIN's state is on its way to the ISR
        self._again = False  # a FIN came while one was on its way: send the state once more
        self._task: asyncio.Task | None = None
        channel.requeued = _in_log_order(channel.requeued, channel.deferred)
        channel.deferred.clear()

    def room(self, capacity: int) -> int:
        """The messages the channel may hand out now, of the clients' `capacity`: 0 or 1."""
        channel = self.channel
        if capacity <= 0 or self.confirming or channel.in_flight_count or channel.burying:
            return 0
        return 1

    def put_back(self, msgs) -> None:
        """Messages that came back: first in line, in log order."""
        self.channel.requeued.extendleft(sorted(msgs, key=_offset, reverse=True))
        self.channel.wake()

    def finished(self) -> None:
        """A FIN (or a sampled-out message): on a replicated partition the next message waits
        until the ISR stored the new state."""
        if self.confirm is None or not self.channel.queue.options.replicated:
            return
        self.confirming = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._confirm())
        else:
            self._again = True

    async def _confirm(self) -> None:
        channel = self.channel
        delay = 0.05
        while not channel.closed:
            self._again = False
            try:
                await self.confirm(channel)
            except Exception as e:  # not led any more, the ISR changing: tried again
                log.warning("ordered_confirm_failed", topic=channel.topic_name,
                            partition=channel.partition, channel=channel.name, error=str(e))
                await asyncio.sleep(delay)
                delay = min(delay * 2, CONFIRM_RETRY_MAX)
                continue
            if not self._again:
                break
        self.confirming = False
        channel.wake()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _in_log_order(requeued, deferred) -> deque:
    return deque(sorted([*requeued, *(entry[2] for entry in deferred)], key=_offset))
