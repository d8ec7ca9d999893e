"""NSQD: the data node. Owns the topics of this node, their metadata, and the
background loops (timeouts, checkpoints, retention); starts and stops the TCP
and HTTP servers.

Lifecycle: `await start()` opens every stored topic and channel and listens;
`await stop()` stops accepting, closes client connections (their in-flight
messages go back to their channels), writes what is pending, persists every
cursor, and closes the logs.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import structlog

from diskqueue.atomic import make_dirs
from diskqueue.queue import QueueOptions

from .channel import Channel
from .metastore import MetaStore, channel_key, topic_key
from .options import Options
from nsqwire.protocol import valid_channel_name, valid_topic_name
from .topic import (TOMBSTONE, Topic, bury, buried_path, remove_grave, sync_policy,
                    topic_folder)

log = structlog.get_logger("nsqd")

VERSION = "1.3.0"
SCAN_INTERVAL = 0.1


class NameError_(ValueError):
    """A topic or channel name that NSQ refuses."""


def find_tombstones(data_path: str) -> list[tuple[str, str, int | None, str | None]]:
    """(tombstone, topic, partition, channel) of every buried topic folder and channel delay
    store under `data_path` (see topic.bury); partition and channel are None for a topic."""
    out = []
    for entry in os.scandir(data_path):
        if entry.name.endswith(TOMBSTONE):
            name = os.path.basename(buried_path(entry.path))
            if name.endswith(".topic"):
                out.append((entry.path, name[:-len(".topic")], None, None))
        elif entry.name.endswith(".topic") and entry.is_dir():
            for part in os.scandir(entry.path):
                delay = os.path.join(part.path, "delay")
                if not part.name.isdigit() or not os.path.isdir(delay):
                    continue
                for store in os.scandir(delay):
                    name = os.path.basename(buried_path(store.path))
                    if store.name.endswith(TOMBSTONE) and name.endswith(".channel"):
                        out.append((store.path, entry.name[:-len(".topic")], int(part.name),
                                    name[:-len(".channel")]))
    return out


class NSQD:
    def __init__(self, options: Options):
        self.options = options
        self.topics: dict[str, Topic] = {}
        self.start_time = time.time()
        self.health = "OK"
        self.meta: MetaStore | None = None
        self._create_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.tcp_server = None
        self.http_runner = None
        self.tcp_port = 0
        self.http_port = 0
        self.connections: set = set()
        self._next_client_id = 0
        self._stopping = False
        self.version = VERSION
        self.clock = time.time  # wall clock of due times; tests inject their own
        from .tcp import identify_limits, tls_context

        self.tls_context = tls_context(options)
        self.identify_limits = identify_limits(self)

    # ---- lifecycle -------------------------------------------------------

    def queue_options(self, sync: tuple[int, int] | None = None) -> QueueOptions:
        """Options of a topic's partitions: the node's sync policy, or the topic's own
        (`sync`: messages per sync, ms; see Topic.sync)."""
        o = self.options
        every, ms = sync or (o.sync_every, o.sync_timeout_ms)
        return QueueOptions(segment_bytes=o.segment_bytes, sync=sync_policy(every, ms))

    def channel_settings(self) -> dict:
        o = self.options
        return {"max_window": o.max_channel_window, "delay_threshold_ms": o.delay_threshold_ms,
                "max_attempts_in_memory": o.delay_after_attempts, "clock": self.clock}

    async def start(self) -> None:
        await asyncio.to_thread(make_dirs, self.options.data_path)
        self.meta = MetaStore(os.path.join(self.options.data_path, "nsqd.meta.sqlite"))
        await self._finish_deletes()
        for name, state in (await asyncio.to_thread(self.meta.topics)).items():
            await self._open_topic(name, state)
        from .http import start_http
        from .tcp import start_tcp

        self.tcp_server, self.tcp_port = await start_tcp(self)
        self.http_runner, self.http_port = await start_http(self)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._scan_loop()),
                       loop.create_task(self._checkpoint_loop()),
                       loop.create_task(self._retention_loop())]
        log.info("started", tcp_port=self.tcp_port, http_port=self.http_port,
                 data_path=self.options.data_path, topics=len(self.topics))

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.tcp_server.close()
        for conn in list(self.connections):
            conn.close()
        await self.http_runner.cleanup()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.checkpoint()
        for topic in list(self.topics.values()):
            await topic.close()
        await self.checkpoint()
        self.meta.close()
        log.info("stopped")

    def next_client_id(self) -> int:
        self._next_client_id += 1
        return self._next_client_id

    # ---- topics and channels ---------------------------------------------

    async def _open_topic(self, name: str, state: dict) -> Topic:
        path = topic_folder(self.options.data_path, name)
        sync = state.get("sync")
        topic = Topic(name, path, self.queue_options(tuple(sync) if sync else None))
        topic.sync = tuple(sync) if sync else None
        if topic.ephemeral:  # never stored: what a run before this one left is not ours
            await asyncio.to_thread(shutil.rmtree, path, True)
        topic.paused = state.get("paused", False)
        await topic.open(state.get("partitions", [0]), state.get("floors", {}))
        channels = await asyncio.to_thread(self.meta.channels, name)
        for (partition, channel_name), cstate in channels.items():
            p = topic.partitions.get(partition)
            if p is not None:
                p.add_channel(channel_name, cstate, **self.channel_settings())
        self.topics[name] = topic
        return topic

    async def get_topic(self, name: str, create: bool = True) -> Topic | None:
        topic = self.topics.get(name)
        if topic is not None or not create:
            return topic
        if not valid_topic_name(name):
            raise NameError_(name)
        async with self._create_lock:
            topic = self.topics.get(name)
            if topic is None:
                topic = await self._open_topic(name, {"partitions": [0]})
                self._store_topic(topic)
                await self.meta.flush()  # on disk before the PUB or SUB that made it is answered
                log.info("topic_created", topic=name)
        return topic

    async def get_channel(self, topic_name: str, channel_name: str,
                          partition: int | None = None, create: bool = True) -> Channel | None:
        while True:
            topic = await self.get_topic(topic_name, create)
            if topic is None:
                return None
            p = topic.partition(partition)
            if p is None:
                return None
            channel = p.channels.get(channel_name)
            if channel is not None or not create:
                return channel
            if not valid_channel_name(channel_name):
                raise NameError_(channel_name)
            async with self._create_lock:  # waits for a delete of this channel or topic
                if self.topics.get(topic_name) is not topic:
                    continue  # deleted meanwhile: the channel goes to its successor
                channel = p.channels.get(channel_name)
                if channel is None:
                    channel = p.add_channel(channel_name, None, **self.channel_settings())
                    self._store_channel(channel)
                    # On disk before SUB's OK: a channel lost in a crash would come back
                    # starting at the topic's end, past what was published for it in between.
                    await self.meta.flush()
                    log.info("channel_created", topic=topic_name, partition=p.number,
                             channel=channel_name)
                return channel

    # A delete is crash-safe at every point and never shares files with what is made after
    # it: under the create lock, close, bury the folder (rename to a tombstone, fsync the
    # parent), forget the metadata (flushed), then remove the tombstone. A crash before the
    # rename leaves it whole; after it, start() finishes it (_finish_deletes). A topic or
    # channel of the same name made later waits for the lock and gets a fresh folder.

    async def delete_topic(self, name: str) -> bool:
        async with self._create_lock:
            topic = self.topics.pop(name, None)
            if topic is None:
                return False
            for c in topic.channels():
                self._disconnect_clients(c)
            grave = await topic.close_and_bury()
            self.meta.delete(topic_key(name))
            self.meta.delete_prefix(f"channel/{name}/")
            await self.meta.flush()
        log.info("topic_deleted", topic=name)
        if grave is not None:  # a big topic: after the lock, so publishers need not wait
            await asyncio.to_thread(remove_grave, grave)
        return True

    async def delete_channel(self, topic_name: str, channel_name: str,
                             partition: int | None = None) -> bool:
        async with self._create_lock:
            topic = self.topics.get(topic_name)
            p = topic.partition(partition) if topic else None
            if p is None or channel_name not in p.channels:
                return False
            self._disconnect_clients(p.channels[channel_name])
            folder = await p.remove_channel(channel_name)
            # The partition's new floor first (unused while the channel is stored), so a
            # delete finished by start() leaves the floor a normal delete would.
            self._store_topic(topic)
            await self.meta.flush()
            grave = await asyncio.to_thread(bury, folder)
            self.meta.delete(channel_key(topic_name, p.number, channel_name))
            await self.meta.flush()
            # Within the lock: a channel made again may have no store folder, and start()
            # must not take it for the one this tombstone was.
            if grave is not None:
                await asyncio.to_thread(remove_grave, grave)
        log.info("channel_deleted", topic=topic_name, partition=p.number, channel=channel_name)
        if topic.ephemeral and not any(True for _ in topic.channels()):
            await self.delete_topic(topic_name)
        return True

    async def _finish_deletes(self) -> None:
        """At start, before any topic opens: a tombstone whose topic or channel is still in
        the metadata while nothing is under its name is a delete a crash interrupted:
        forget the metadata (flushed); then remove every tombstone."""
        graves = await asyncio.to_thread(find_tombstones, self.options.data_path)
        if not graves:
            return
        for grave, topic, partition, channel in graves:
            if os.path.exists(buried_path(grave)):
                continue  # made again after the delete: the tombstone is all that is left
            if channel is not None:
                self.meta.delete(channel_key(topic, partition, channel))
            else:
                self.meta.delete(topic_key(topic))
                self.meta.delete_prefix(f"channel/{topic}/")
            log.warning("delete_finished", topic=topic, partition=partition, channel=channel)
        await self.meta.flush()
        for grave, *_ in graves:
            await asyncio.to_thread(remove_grave, grave)

    def client_left(self, channel: Channel) -> None:
        """An ephemeral channel goes when its last client does."""
        if channel.ephemeral and not channel.clients:
            asyncio.get_running_loop().create_task(
                self.delete_channel(channel.topic_name, channel.name, channel.partition))

    def _disconnect_clients(self, channel: Channel) -> None:
        for conn in list(self.connections):
            if conn.client.channel is channel:
                conn.close()

    def _store_topic(self, topic: Topic) -> None:
        if not topic.ephemeral:
            self.meta.put(topic_key(topic.name), topic.state())

    def _store_channel(self, channel: Channel) -> None:
        if not channel.ephemeral and not channel.topic.ephemeral:
            self.meta.put(channel_key(channel.topic_name, channel.partition, channel.name),
                          channel.checkpoint())

    async def checkpoint(self) -> None:
        """Persist every changed cursor and topic state in one transaction."""
        for topic in self.topics.values():
            self._store_topic(topic)
            for channel in topic.channels():
                if channel.dirty:
                    self._store_channel(channel)
        await self.meta.flush()

    # ---- background loops ------------------------------------------------

    async def _scan_loop(self) -> None:
        while True:
            await asyncio.sleep(SCAN_INTERVAL)
            now = time.monotonic()
            for topic in list(self.topics.values()):
                for channel in list(topic.channels()):
                    try:
                        channel.process_timeouts(now)
                    except Exception:  # one channel's bug must not stop every timeout
                        log.exception("timeouts_failed", topic=topic.name, channel=channel.name)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.checkpoint_interval_ms / 1000)
            try:
                await self.checkpoint()
            except Exception:  # a failed checkpoint is retried; the cursor only lags
                log.exception("checkpoint_failed")

    async def _retention_loop(self) -> None:
        o = self.options
        while True:
            await asyncio.sleep(o.retention_check_interval_ms / 1000)
            for topic in list(self.topics.values()):
                for p in topic.partitions.values():
                    try:
                        await p.queue.retain(
                            before_offset=p.retention_floor(),
                            max_age_s=o.retention_max_age_ms / 1000 if o.retention_max_age_ms
                            else None,
                            max_bytes=o.retention_max_bytes or None)
                    except Exception:
                        log.exception("retention_failed", topic=topic.name, partition=p.number)
