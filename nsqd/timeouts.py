"""TimeoutScan: the channels something may come due in, and the node's scan over them.

Invariants:
- a channel with a message in flight at one of its clients, a message deferred in memory,
  or messages waiting in its delay store is in `channels`: it adds itself when the first
  of them appears (Channel.watch_timeouts), so the scan's cost follows the channels at
  work, never the channels held;
- a visit is Channel.process_timeouts, the whole of what the scan does to a channel; a
  channel leaves after a visit that finds none of the three (Channel.timing), or closed;
- one channel's failure is logged, and the scan goes on with the others (it stays in).
"""

from __future__ import annotations

import structlog

log = structlog.get_logger("nsqd")


class TimeoutScan:
    def __init__(self):
        self.channels: set = set()

    def watch(self, channel) -> None:
        self.channels.add(channel)

    def scan(self, now: float) -> int:
        """Process the timeouts of every channel in `channels` at monotonic time `now`;
        return how many were visited."""
        channels = self.channels
        visited = 0
        for channel in list(channels):
            if channel.closed:
                channels.discard(channel)
                continue
            visited += 1
            try:
                channel.process_timeouts(now)
            except Exception:  # one channel's bug must not stop every timeout
                log.exception("timeouts_failed", topic=channel.topic_name,
                              channel=channel.name)
                continue
            if not channel.timing:
                channels.discard(channel)
        return visited
