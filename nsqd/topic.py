"""Topic: a named stream of messages, stored as partitions, each with its channels.

A Partition owns one DiskQueue (the partition's log) and the channels that
read it. Publishing appends to the log through group commit and returns only
when the storage engine acknowledged it. A topic is one partition for now,
but partition numbers are in every name, path and stat.

Invariants:
- the first channel of a partition starts at `floor`: what was published
  while the partition had no channel (the oldest retained message at first);
  later channels start at the partition's end;
- retention never drops a segment some channel has not confirmed past.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import structlog

from diskqueue.queue import DiskQueue, QueueOptions, SyncPolicy

from .channel import Channel

log = structlog.get_logger("nsqd.topic")


def sync_policy(sync_every: int, sync_timeout_ms: int) -> SyncPolicy:
    """--sync-every / --sync-timeout as a SyncPolicy: 1 syncs every batch (durable)."""
    return SyncPolicy(every_messages=max(1, sync_every),
                      every_ms=sync_timeout_ms if sync_every > 1 else 0)


def topic_folder(data_path: str, name: str) -> str:
    """`<data-path>/<name>.topic`. The suffix keeps every name a plain folder name: `.` and
    `..` are legal NSQ names, and a bare `..` would be the data path's parent."""
    return os.path.join(data_path, f"{name}.topic")


def delay_folder(partition_path: str, channel: str) -> str:
    """A channel's delay queue: `<partition folder>/delay/<channel>.channel` (same reason)."""
    return os.path.join(partition_path, "delay", f"{channel}.channel")


class PartitionNotFound(LookupError):
    """A partition number this node does not hold for the topic."""


class Partition:
    def __init__(self, topic: "Topic", number: int, queue: DiskQueue, floor: tuple[int, int]):
        self.topic = topic
        self.number = number
        self.queue = queue
        self._floor = floor  # (offset, count) where a first channel would start
        self.channels: dict[str, Channel] = {}

    @property
    def floor(self) -> tuple[int, int]:
        q = self.queue
        if self._floor[0] < q.start_offset:
            self._floor = (q.start_offset, q.start_count)
        return self._floor

    def add_channel(self, name: str, state: dict | None, **settings) -> Channel:
        """Open a channel: from its stored state, or as a new one (see the module invariants).
        `settings` are Channel's keyword options; its delay store is in `delay_folder`."""
        if state is None:
            q = self.queue
            offset, count = self.floor if not self.channels else (q.committed_end,
                                                                  q.committed_count)
            state = {"confirmed": offset, "confirmed_count": count, "paused": False}
        channel = Channel(self.topic, name, self.queue, state["confirmed"],
                          state["confirmed_count"], paused=state.get("paused", False),
                          delay_path=delay_folder(self.queue.path, name),
                          delay_expected=state.get("delay_store", False), **settings)
        self.channels[name] = channel
        channel.start()
        return channel

    async def remove_channel(self, name: str) -> None:
        channel = self.channels.pop(name)
        await channel.close(delete=True)
        if not self.channels:
            self._floor = (self.queue.committed_end, self.queue.committed_count)

    async def empty(self) -> None:
        """Classic topic empty: drop what the partition holds for channels that do not exist
        yet (the backlog a first channel would start at, and its segments). Messages that
        channels already have are theirs: emptying a channel is a channel operation."""
        if self.channels:
            return
        await self.queue.empty()
        self._floor = (self.queue.start_offset, self.queue.start_count)

    def retention_floor(self) -> int:
        if not self.channels:
            return self.floor[0]
        return min(c.cursor.confirmed for c in self.channels.values())

    def depth(self) -> int:
        """Messages the emptiest channel has not read (classic nsqd reports the topic's own
        buffer; with cursors that is what the slowest channel still lacks)."""
        q = self.queue
        if not self.channels:
            return q.committed_count - self.floor[1]
        return q.committed_count - min(c.cursor.next_count for c in self.channels.values())


class Topic:
    def __init__(self, name: str, path: str, queue_options: QueueOptions):
        self.name = name
        self.path = path
        self.ephemeral = name.endswith("#ephemeral")
        self.queue_options = queue_options
        self.paused = False
        self.sync: tuple[int, int] | None = None  # its own (sync_every, sync_timeout_ms)
        self.partitions: dict[int, Partition] = {}
        self.message_count = 0  # messages published through this node since start
        self.message_bytes = 0

    async def open(self, partitions: list[int], floors: dict[str, list[int]]) -> None:
        for number in partitions:
            opts = dataclasses.replace(self.queue_options, partition=number)
            queue = await DiskQueue.open(os.path.join(self.path, str(number)), opts)
            floor = floors.get(str(number)) or (queue.start_offset, queue.start_count)
            self.partitions[number] = Partition(self, number, queue, tuple(floor))

    def state(self) -> dict:
        state = {"partitions": sorted(self.partitions), "paused": self.paused,
                 "floors": {str(n): list(p._floor) for n, p in self.partitions.items()}}
        if self.sync is not None:
            state["sync"] = list(self.sync)
        return state

    def set_sync(self, sync: tuple[int, int]) -> None:
        """Give the topic its own sync policy (messages per sync, ms), from now on."""
        self.sync = sync
        for p in self.partitions.values():
            p.queue.set_sync(sync_policy(*sync))

    async def close(self) -> None:
        for p in self.partitions.values():
            for c in p.channels.values():
                await c.close()
            await p.queue.close()

    async def delete_files(self) -> None:
        await self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, bodies: list[bytes], partition: int | None = None, ext: bytes = b"", *,
                trace_id: int = 0, trace_ids=None, exts=None, callback=None):
        """One write request (every TCP publish, HTTP /pub and /mpub) to a partition's log,
        written whole or not at all (DiskQueue.append's arguments). Raises PartitionNotFound,
        or what DiskQueue.append raises, at once. Without `callback`, returns an awaitable
        that ends (and counts the messages) once the log acknowledged the request; with one,
        the log calls `callback(appended, error)` and the caller counts them
        (`count_published`) when it answers: TCP's path, with no task per publish."""
        part = self.partition(partition)
        if part is None:
            raise PartitionNotFound(partition)
        appended = part.queue.append(bodies, trace_id, ext, callback=callback,
                                     trace_ids=trace_ids, exts=exts)
        if callback is None:
            return self._counted(appended, bodies)

    async def _counted(self, appended, bodies: list[bytes]) -> None:
        await appended
        self.count_published(bodies)

    def count_published(self, bodies: list[bytes]) -> None:
        self.message_count += len(bodies)
        self.message_bytes += sum(map(len, bodies))

    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        for c in self.channels():
            c.wake()

    async def empty(self) -> None:
        """See Partition.empty."""
        for p in self.partitions.values():
            await p.empty()

    def partition(self, number: int | None) -> Partition | None:
        return self.partitions.get(0 if number is None else number)

    def channels(self):
        for p in self.partitions.values():
            yield from p.channels.values()

    def depth(self) -> int:
        return sum(p.depth() for p in self.partitions.values())
