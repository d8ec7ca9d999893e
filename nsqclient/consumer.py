"""Consumer: one subscription (`SUB topic channel <n>`) to the leader of every partition
of a topic, following leader changes.

It looks up the topic every `lookup_interval`, at once when a subscription is lost, and
again with a growing backoff (up to `max_backoff`) while a lookup fails or a partition has
no working subscription: subscriptions to nodes that no longer lead their partition are
closed, the new leaders are subscribed. Following never stops before `close()`: an
unexpected error is logged (`consumer_follow_failed`) and retried as a failed lookup. A
classic topic (no partition map) is subscribed without a partition number on each
producer. `max_in_flight` is spread as RDY over the subscriptions, at least 1 each. Each
message runs `handler(message)` (a function or a coroutine function) in its own task: FIN
when it returns, REQ when it raises (with the error's repr as the REQ's reason, which a
dead letter keeps). `close()` sends RDY 0, waits (up to `drain_timeout`) for the handlers
running, requeues what still arrives, then CLS and closes.

`ordered=True`: `SUB_ORDERED` (the server has one message of a partition out at a time,
whatever RDY says), and the handler runs for one message of a partition at a time, in
arrival order. An ordered partition's throughput is at most 1 / (handler time + round
trip): `partitions_needed` says how many partitions a rate needs.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import socket

import structlog

from nsqclient.conn import Connection, Message, NSQError
from nsqclient.lookup import LookupFailed, LookupSource, Node, TopicMap, lookup_source
from nsqclient.producer import USER_AGENT
from nsqwire import commands as c
from nsqwire.protocol import valid_channel_name, valid_topic_name

log = structlog.get_logger("nsqclient.consumer")

Target = tuple[Node, "int | None"]  # a leader and its partition (None: a classic topic)


def targets(tmap: TopicMap) -> set[Target]:
    """What to subscribe to for this view of the topic."""
    if tmap.partition_num is None:
        return {(node, None) for node in tmap.producers}
    return {(node, n) for n, node in tmap.leaders.items()}


def partitions_needed(messages_per_s: float, seconds_per_message: float) -> int:
    """Partitions an ordered topic needs to carry `messages_per_s`: an ordered partition has
    one message out at a time, so it carries at most 1 / `seconds_per_message` (the handler's
    time plus one round trip to nsqd, FIN to the next delivery; more on a replicated topic,
    whose FIN waits for the ISR). partitions = ceil(messages/s x seconds per message), >= 1."""
    if messages_per_s < 0 or seconds_per_message <= 0:
        raise ValueError("a rate >= 0 and a time per message > 0 are needed")
    return max(1, math.ceil(messages_per_s * seconds_per_message - 1e-9))


def spread_rdy(max_in_flight: int, count: int) -> list[int]:
    """max_in_flight split over `count` connections as evenly as can be, at least 1 each."""
    base, extra = divmod(max_in_flight, count)
    return [max(1, base + (i < extra)) for i in range(count)]


class Consumer:
    def __init__(self, topic: str, channel: str, lookupd_http_addresses: list[str] | None = None,
                 handler=None, max_in_flight: int = 1, *, lookup: LookupSource | None = None,
                 lookup_interval: float = 30.0, backoff: float = 0.1, max_backoff: float = 2.0,
                 requeue_delay_ms: int = 0, connect_timeout: float = 3.0,
                 drain_timeout: float = 10.0, identify: dict | None = None,
                 desired_tag: str = "", ext_filter: dict | None = None,
                 ordered: bool = False):
        if not valid_topic_name(topic) or not valid_channel_name(channel):
            raise ValueError(f"invalid topic or channel name: {topic!r} {channel!r}")
        if handler is None or max_in_flight < 1:
            raise ValueError("a handler and max_in_flight >= 1 are needed")
        self.topic, self.channel = topic, channel
        self.source = lookup_source(lookupd_http_addresses, lookup)
        self.handler = handler
        self.max_in_flight = max_in_flight
        self.lookup_interval = lookup_interval
        self.backoff, self.max_backoff = backoff, max_backoff
        self.requeue_delay_ms = requeue_delay_ms
        self.connect_timeout = connect_timeout
        self.drain_timeout = drain_timeout
        self.identify = {"hostname": socket.gethostname(), "user_agent": USER_AGENT,
                         **(identify or {})}
        self.ordered = ordered
        self._in_turn: dict[Connection, asyncio.Lock] = {}  # ordered: one handler a partition
        if desired_tag:  # only messages published with this ##client_dispatch_tag
            self.identify["desired_tag"] = desired_tag
        if ext_filter is not None:  # messages it does not match are finished unseen
            self.identify["ext_filter"] = ext_filter
        self.subscriptions: dict[Target, Connection] = {}
        self._rdy: dict[Connection, int] = {}
        self._handlers: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> "Consumer":
        """Starts following the topic; returns without waiting for any subscription."""
        self._task = asyncio.get_running_loop().create_task(self._follow_loop())
        return self

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        conns = list(self.subscriptions.values())
        for conn in conns:
            if not conn.closed.is_set():
                conn.rdy(0)
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=self.drain_timeout)
        for conn in conns:
            try:
                async with asyncio.timeout(1.0):
                    await conn.command(c.cmd_cls())
            except (OSError, TimeoutError, NSQError):
                pass
            await conn.close()
        self.subscriptions.clear()
        await self.source.close()

    async def _follow_loop(self) -> None:
        delay = self.backoff
        while True:
            self._wake.clear()
            try:
                complete = await self._follow(await self.source.lookup(self.topic, "r"))
            except LookupFailed as e:
                log.info("consumer_lookup_failed", topic=self.topic, error=str(e))
                complete = False
            except Exception:  # a bug here must not end the consumer without a word
                log.exception("consumer_follow_failed", topic=self.topic)
                complete = False
            if complete:
                delay, wait = self.backoff, self.lookup_interval
            else:
                wait, delay = delay, min(delay * 2, self.max_backoff)
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _follow(self, tmap: TopicMap) -> bool:
        """Subscribe to what `tmap` says, close what it no longer says; True when every
        partition has a leader and a working subscription."""
        wanted = targets(tmap)
        for target in [t for t in self.subscriptions if t not in wanted]:
            conn = self.subscriptions.pop(target, None)
            if conn is None:  # lost while an earlier one closed: _watch forgot it
                continue
            log.info("consumer_leader_moved", topic=self.topic, partition=target[1],
                     old=target[0].address)
            await conn.close()
        missing = [t for t in wanted if t not in self.subscriptions]
        if missing:
            await asyncio.gather(*(self._subscribe(t) for t in missing))
        self._spread_rdy()
        led = len(tmap.leaders) == tmap.partition_num if tmap.partition_num else bool(wanted)
        return led and all(t in self.subscriptions for t in wanted)

    async def _subscribe(self, target: Target) -> None:
        node, partition = target
        conn = Connection(node.host, node.tcp_port,
                          on_messages=lambda batch: self._on_messages(batch))
        try:
            sub = (c.cmd_sub_ordered(self.topic, self.channel, partition)
                   if self.ordered and partition is not None
                   else c.cmd_sub(self.topic, self.channel, partition))
            async with asyncio.timeout(self.connect_timeout):
                await conn.connect(self.identify)
            async with asyncio.timeout(self.connect_timeout):
                await conn.command(sub)
        except (OSError, TimeoutError, NSQError) as e:
            log.info("consumer_subscribe_failed", topic=self.topic, partition=partition,
                     node=node.address, error=str(e))
            await conn.close()
            return
        if self._closing:
            await conn.close()
            return
        self.subscriptions[target] = conn
        asyncio.get_running_loop().create_task(self._watch(target, conn))
        log.info("consumer_subscribed", topic=self.topic, channel=self.channel,
                 partition=partition, node=node.address)

    async def _watch(self, target: Target, conn: Connection) -> None:
        """A lost subscription is forgotten and the topic looked up again at once."""
        await conn.closed.wait()
        if self.subscriptions.get(target) is conn:
            del self.subscriptions[target]
            self._rdy.pop(conn, None)
            self._in_turn.pop(conn, None)
            log.info("consumer_subscription_lost", topic=self.topic, partition=target[1],
                     node=target[0].address, errors=conn.errors[-1:])
            self._spread_rdy()
            self._wake.set()

    def _spread_rdy(self) -> None:
        conns = [self.subscriptions[t] for t in sorted(self.subscriptions, key=_order)]
        self._rdy = {conn: self._rdy[conn] for conn in conns if conn in self._rdy}
        if not conns or self._closing:
            return
        for conn, count in zip(conns, spread_rdy(self.max_in_flight, len(conns))):
            if self._rdy.get(conn) != count and not conn.closed.is_set():
                conn.rdy(count)
                self._rdy[conn] = count

    def _on_messages(self, batch: list[Message]) -> None:
        for m in batch:
            if self._closing:
                m.req(0)
                continue
            task = asyncio.get_running_loop().create_task(self._handle(m))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _handle(self, m: Message) -> None:
        if self.ordered:  # tasks start in arrival order and the lock is fair: in order
            lock = self._in_turn.setdefault(m.conn, asyncio.Lock())
            async with lock:
                await self._run(m)
        else:
            await self._run(m)

    async def _run(self, m: Message) -> None:
        try:
            result = self.handler(m)
            if inspect.isawaitable(result):
                await result
        except Exception as e:
            log.info("consumer_handler_failed", topic=self.topic, error=repr(e))
            if not m.conn.closed.is_set():  # the error goes with it (a dead letter keeps it)
                m.req(self.requeue_delay_ms, repr(e)[:MAX_REASON])
        else:
            if not m.conn.closed.is_set():
                m.fin()


MAX_REASON = 256  # characters of a handler's error sent with its REQ (nsqd keeps 256 bytes)


def _order(target: Target):
    node, partition = target
    return (node, -1 if partition is None else partition)
