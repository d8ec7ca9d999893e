"""Tracer: the node's side of message trace (the store and its writer are ../trace,
imported as `nsqtrace`).

It owns the switches (per topic, per topic + channel, `--trace-all`), stored in the
node's metadata under `trace/switches` so a restart keeps them, and it makes the events.
Topics and channels hold `trace`: this Tracer while their events are on, None while off,
so a switched-off hook costs one attribute test (`if self.trace is not None`). A topic's
switch covers its PUB and DROP events and the consumer events of all its channels; a
channel's switch covers that channel's consumer events (DELIVER, REQ, TIMEOUT, FIN,
DELAY_IN, DELAY_OUT, its DROP).

Making an event is building a tuple and appending it to the writer's deque (no I/O, no
await): a publish's PUB events are recorded when the log acknowledged it, by the code
that learns it (`published`), and its answer is never delayed by the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

from nsqtrace import events as ev
from nsqwire.ids import PARTITION_SHIFT
from nsqtrace import store as sqlite_store
from nsqtrace.process import ProcessStore
from nsqtrace.writer import EventWriter

SWITCHES_KEY = "trace/switches"
STORE_FILE = "trace.sqlite"
SEARCH_THREADS = 1  # searches run here, one at a time (see searching)


def es_access(o) -> dict:
    """es.client's keyword arguments from the --trace-es-* options (files read now, once)."""
    def secret(path: str) -> str | None:
        if not path:
            return None
        with open(path) as f:
            return f.read().strip()

    return {"ca_certs": o.trace_es_ca_certs or None, "username": o.trace_es_username or None,
            "password": secret(o.trace_es_password_file),
            "api_key": secret(o.trace_es_api_key_file)}


class Tracer:
    def __init__(self, nsqd):
        o = nsqd.options
        self.nsqd = nsqd
        self.trace_all = o.trace_all
        self.topics: set[str] = set()
        self.channels: set[tuple[str, str]] = set()
        self._search_pool = concurrent.futures.ThreadPoolExecutor(
            SEARCH_THREADS, thread_name_prefix="trace-search")
        node = f"{o.broadcast_address}:{o.tcp_host_port[1]}"
        self.es_url, self.es_prefix = o.trace_es_url, o.trace_es_index_prefix
        if self.es_url:  # the store is Elasticsearch alone (README: why not both)
            from nsqtrace import es  # the client is imported only by nodes that use it
            self._es = es
            access = es_access(o)
            self.search_client = es.client(self.es_url, **access)
            self.path = None
            self.writer = EventWriter(
                None, node, bound=o.trace_buffer, sink="elasticsearch",
                open_store=lambda: ProcessStore("elasticsearch", {
                    "url": self.es_url, "node": self.writer.node, "prefix": self.es_prefix,
                    "id_base": es.id_base_of(self.writer.node), **access}),
                max_age_s=o.trace_retention_max_age_ms / 1000 or None)
        else:
            self.path = os.path.join(o.data_path, STORE_FILE)
            self.writer = EventWriter(
                self.path, node, bound=o.trace_buffer,
                max_age_s=o.trace_retention_max_age_ms / 1000 or None,
                max_bytes=o.trace_retention_max_bytes or None)

    # ---- lifecycle and switches -------------------------------------------------

    def start(self, meta) -> None:
        """Load the stored switches (the metadata store is open), before topics open."""
        stored = meta.get(SWITCHES_KEY) or {}  # read once, at start
        self.topics = set(stored.get("topics", []))
        self.channels = {tuple(tc) for tc in stored.get("channels", [])}

    def start_writer(self, tcp_port: int) -> None:
        """Start writing events (those of the start-up wait in the buffer), the node named
        by the port it listens on (the configured one is 0 for "any free port")."""
        if self.trace_all or self.topics or self.channels:
            self.writer.want_store()
        self.writer.start(f"{self.nsqd.options.broadcast_address}:{tcp_port}")

    async def close(self) -> None:
        await asyncio.to_thread(self.writer.close)
        self._search_pool.shutdown(wait=False, cancel_futures=True)
        if self.es_url:
            self.search_client.close()

    async def searching(self, fn, *args):
        """`fn(*args)` on the tracer's own search thread. A flood of searches waits for it
        alone: in the default executor it held every thread, and the consumers' disk
        reads, metadata writes and delay-queue work waited behind it. One thread, not two:
        each one's Python work takes the GIL from the event loop (bench/README.md)."""
        return await asyncio.get_running_loop().run_in_executor(self._search_pool, fn, *args)

    def search(self, **conditions) -> list[dict]:
        """The store's events matching `conditions` (store.search's); blocking: call it from
        a thread (`searching`). With Elasticsearch, StoreUnavailable while it cannot be
        reached."""
        if self.es_url:
            return self._es.search(self.search_client, self.es_prefix, **conditions)
        return sqlite_store.search(self.path, **conditions)

    def topic_on(self, topic: str) -> bool:
        return self.trace_all or topic in self.topics

    def channel_on(self, topic: str, channel: str) -> bool:
        return self.trace_all or topic in self.topics or (topic, channel) in self.channels

    def attach(self, topic) -> None:
        """Give a topic and its channels their `trace` (also `topic.tracer`, for channels
        opened later: Partition.add_channel asks `for_channel`)."""
        topic.tracer = self
        topic.trace = self if self.topic_on(topic.name) else None
        for c in topic.channels():
            c.trace = self.for_channel(topic.name, c.name)

    def for_channel(self, topic: str, channel: str):
        return self if self.channel_on(topic, channel) else None

    async def switch(self, topic: str, channel: str | None, on: bool) -> bool:
        """Switch tracing of a topic (channel None) or of one channel; stored before it
        returns, applied at once to what is open. In cluster mode the switch is etcd's
        (cluster.set_switch: False when etcd has no such topic or channel; raises
        ClusterUnavailable), and every leader follows it (`follow`)."""
        if self.nsqd.cluster is not None:  # applied by the apply loop's `follow`
            return await self.nsqd.cluster.set_switch(topic, channel, "trace", on)
        topics, channels = set(self.topics), set(self.channels)
        if channel is None:
            (topics.add if on else topics.discard)(topic)
        else:
            (channels.add if on else channels.discard)((topic, channel))
        await self._apply(topic, topics, channels)
        return True

    async def follow(self, topic: str, on: bool, traced_channels: set[str]) -> None:
        """Cluster mode: a topic's switches as etcd has them (cluster.py's apply loop);
        stored here too, so a restart while etcd is away keeps them."""
        if (topic in self.topics) == on and traced_channels == {
                c for t, c in self.channels if t == topic}:
            return  # every pass of the apply loop, for every topic: nothing new, nothing made
        topics = self.topics | {topic} if on else self.topics - {topic}
        channels = {tc for tc in self.channels if tc[0] != topic}
        channels |= {(topic, c) for c in traced_channels}
        await self._apply(topic, topics, channels)

    async def _apply(self, topic: str, topics: set[str], channels: set[tuple[str, str]]) -> None:
        """The switches become `topics` and `channels`, applied to the open topic at once
        (what /stats shows is what makes events), then stored (that write may wait behind
        another)."""
        self.topics, self.channels = topics, channels
        if topics or channels:
            self.writer.want_store()
        t = self.nsqd.topics.get(topic)
        if t is not None:
            self.attach(t)
        meta = self.nsqd.meta
        meta.put(SWITCHES_KEY, {"topics": sorted(topics),
                                "channels": sorted(list(tc) for tc in channels)})
        await meta.flush()

    def state(self) -> dict:
        """/stats `trace`."""
        return {"trace_all": self.trace_all, "topics": sorted(self.topics),
                "channels": [f"{t}/{c}" for t, c in sorted(self.channels)],
                "store": self.path or self.es_url, **self.writer.stats()}

    # ---- events -------------------------------------------------------------------

    def published(self, topic, appended, trace_id: int, trace_ids, source: str) -> None:
        """The PUB events of a publish the log acknowledged (diskqueue's Appended), called
        by its caller as it learns it (tcp.py's `_published`, Topic's `_counted`): no
        function made per publish."""
        first = appended.first_id
        if appended.count == 1:  # a PUB, the common case, as one expression: 0.9 µs, not 1.6
            self.writer.add((time.time_ns(), ev.PUB, topic.name, first >> PARTITION_SHIFT, "",
                             first, trace_id if trace_ids is None else trace_ids[0],
                             appended.offset, 0, source))
            return
        now, name, add = time.time_ns(), topic.name, self.writer.add
        offsets = appended.offsets
        number = first >> PARTITION_SHIFT
        for i in range(appended.count):
            add((now, ev.PUB, name, number, "", first + i,
                 trace_ids[i] if trace_ids is not None else trace_id, offsets[i], 0, source))

    def _event(self, channel, kind: str, msg, detail: str = "") -> tuple:
        return (time.time_ns(), kind, channel.topic_name, channel.partition, channel.name,
                msg.msg_id, msg.trace_id, msg.offset, msg.attempts, detail)

    # the events of every message (PUB above, DELIVER, FIN) are added one by one in a loop:
    # a list comprehension handed to add_many cost 0.3 µs more an event (its function)

    def delivered(self, channel, msgs, client) -> None:
        now, who, add = time.time_ns(), client.remote_address, self.writer.add
        t, n, c = channel.topic_name, channel.partition, channel.name
        for m in msgs:
            add((now, ev.DELIVER, t, n, c, m.msg_id, m.trace_id, m.offset, m.attempts, who))

    def finished(self, channel, msgs) -> None:
        now, add = time.time_ns(), self.writer.add
        t, n, c = channel.topic_name, channel.partition, channel.name
        for m in msgs:
            add((now, ev.FIN, t, n, c, m.msg_id, m.trace_id, m.offset, m.attempts, ""))

    def requeued(self, channel, msg, delay_ms: int) -> None:
        self.writer.add(self._event(channel, ev.REQ, msg, str(delay_ms)))

    def given_back(self, channel, msgs) -> None:
        """In flight at a client that left: requeued at once (a REQ the server made)."""
        self.writer.add_many([self._event(channel, ev.REQ, m, "client gone") for m in msgs])

    def timed_out(self, channel, msgs) -> None:
        self.writer.add_many([self._event(channel, ev.TIMEOUT, m) for m in msgs])

    def buried(self, channel, msg, cause: str) -> None:
        """Its dead copy committed (deadletters.py): `cause` says why it came back last."""
        self.writer.add(self._event(channel, ev.BURY, msg, cause))

    def delay_in(self, channel, msg, due_ms: int) -> None:
        self.writer.add(self._event(channel, ev.DELAY_IN, msg,
                                    str(max(0, due_ms - int(channel.clock() * 1000)))))

    def taken_over(self, channel, items) -> None:
        """Held messages a new leader put into its delay store (handover.take_over,
        DelayedMessages): a DELAY_IN each on this node, the delay left in ms."""
        now, now_ms = time.time_ns(), int(channel.clock() * 1000)
        t, n, c = channel.topic_name, channel.partition, channel.name
        self.writer.add_many([(now, ev.DELAY_IN, t, n, c, d.msg_id, d.trace_id, d.origin_offset,
                               d.attempts, str(max(0, d.due_ms - now_ms))) for d in items])

    def delay_out(self, channel, msg) -> None:
        self.writer.add(self._event(channel, ev.DELAY_OUT, msg))

    def emptied(self, channel, reason: str = "channel emptied") -> None:
        """A channel emptied (/channel/empty, a cursor moved) or deleted: a DROP for each
        message it held in memory (in flight, requeued, deferred), and one for the log it
        skips up to its end (NO_MESSAGE, offset = that end)."""
        held = [m for c in channel.clients for m in c.in_flight_of(channel.partition)]
        held += [*channel.requeued, *(entry[2] for entry in channel.deferred)]
        self.writer.add_many([self._event(channel, ev.DROP, m, reason) for m in held])
        self.range_dropped(channel.topic_name, channel.partition, channel.name,
                           channel.queue.committed_end, reason)

    def replayed(self, channel, offset: int) -> None:
        """A channel's cursor moved (/channel/setoffset): one event, NO_MESSAGE."""
        self.writer.add((time.time_ns(), ev.REPLAY, channel.topic_name, channel.partition,
                         channel.name, ev.NO_MESSAGE, 0, offset, 0, f"offset {offset}"))

    def range_dropped(self, topic: str, partition: int, channel: str, offset: int,
                      reason: str) -> None:
        """Messages dropped as a range (channel emptied or deleted, topic deleted, segments
        gone with retention): one event, NO_MESSAGE, `offset` where the range ends."""
        self.writer.add((time.time_ns(), ev.DROP, topic, partition, channel, ev.NO_MESSAGE, 0,
                         offset, 0, reason))
