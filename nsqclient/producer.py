"""Producer: publishes to the leader of each message's partition, over one reused
connection per leader.

Routing: with a key, partition_of(key, partition_num) (partitioning.py); without, the
led partitions in turn. A classic topic (no partition map) is published without a
partition number to one of its producers (by key when there is one, else in turn).
A publish is done only at the server's OK. On E_FAILED_ON_NOT_LEADER,
E_TOPIC_NOT_EXIST, E_BAD_PARTITION, a lost connection, a timeout or a failed lookup,
it looks up again and retries with exponential backoff, at most `max_attempts` times
within `max_retry_time`, then raises PublishError. Messages of one key are sent one at
a time, in call order, each after the previous one's answer (so retries never reorder
a key); other keys and keyless messages proceed meanwhile. Retries may duplicate a
message whose answer was lost (at-least-once).
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager

import structlog

from nsqclient.conn import Connection, NSQError
from nsqclient.lookup import LookupFailed, LookupSource, Node, TopicMap, lookup_source
from nsqclient.partitioning import key_bytes, partition_of
from nsqwire import commands as c
from nsqwire.protocol import valid_topic_name

log = structlog.get_logger("nsqclient.producer")

RETRYABLE = ("E_FAILED_ON_NOT_LEADER", "E_FAILED_ON_NOT_WRITABLE", "E_TOPIC_NOT_EXIST",
             "E_BAD_PARTITION")
USER_AGENT = "durable-nsq-nsqclient/0.1.0"


class PublishError(Exception):
    """A publish that was refused, or still failed after the bounded retries."""


class NoLeader(Exception):
    """The partition a message must go to has no leader in the current lookup."""


class KeyOrder:
    """At most one holder per key at a time, served in the order they asked (asyncio.Lock
    wakes its waiters first in, first out); a key's entry lives only while in use."""

    def __init__(self):
        self._entries: dict[object, list] = {}  # key -> [lock, holders and waiters]

    @asynccontextmanager
    async def hold(self, key):
        entry = self._entries.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


def route(tmap: TopicMap, key: bytes | None, turn: int) -> tuple[int | None, Node]:
    """(partition or None for a classic topic, its leader) for one message."""
    if tmap.partition_num is None:
        if not tmap.producers:
            raise NoLeader(f"topic {tmap.topic!r} has no producers")
        i = turn if key is None else partition_of(key, len(tmap.producers))
        return None, tmap.producers[i % len(tmap.producers)]
    if key is not None:
        n = partition_of(key, tmap.partition_num)
        if n not in tmap.leaders:
            raise NoLeader(f"partition {n} of topic {tmap.topic!r} has no leader")
        return n, tmap.leaders[n]
    led = sorted(tmap.leaders)
    if not led:
        raise NoLeader(f"topic {tmap.topic!r} has no led partition")
    n = led[turn % len(led)]
    return n, tmap.leaders[n]


class Producer:
    """`await publish(topic, body, key=None)`, `await publish_many(topic, bodies,
    key=None)` (one MPUB, to one partition), `await close()`."""

    def __init__(self, lookupd_http_addresses: list[str] | None = None, *,
                 lookup: LookupSource | None = None, max_attempts: int = 40,
                 max_retry_time: float = 30.0, backoff: float = 0.05, max_backoff: float = 0.5,
                 connect_timeout: float = 3.0, response_timeout: float = 10.0):
        self.source = lookup_source(lookupd_http_addresses, lookup)
        self.max_attempts = max_attempts
        self.max_retry_time = max_retry_time
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self.identify = {"hostname": socket.gethostname(), "user_agent": USER_AGENT}
        self.order = KeyOrder()
        self.retries = 0  # attempts after a first one, over the producer's life
        self._maps: dict[str, TopicMap] = {}
        self._lookups: dict[str, asyncio.Future] = {}
        self._turns: dict[str, int] = {}
        self._conns: dict[Node, Connection] = {}
        self._dialing: dict[Node, asyncio.Future] = {}
        self._closed = False

    async def publish(self, topic: str, body: bytes, key: bytes | str | None = None) -> None:
        await self._publish(topic, key, lambda n: c.cmd_pub(topic, body, n))

    async def publish_many(self, topic: str, bodies: list[bytes],
                           key: bytes | str | None = None) -> None:
        """All of `bodies` in one MPUB to one partition: the key's, or the next in turn."""
        if not bodies:
            raise ValueError("publish_many needs at least one body")
        await self._publish(topic, key, lambda n: c.cmd_mpub(topic, bodies, n))

    async def close(self) -> None:
        self._closed = True
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()
        await self.source.close()

    async def _publish(self, topic: str, key, encode) -> None:
        if self._closed:
            raise PublishError("the producer is closed")
        if not valid_topic_name(topic):
            raise PublishError(f"invalid topic name {topic!r}")
        if key is None:
            return await self._send(topic, None, encode)
        kb = key_bytes(key)
        async with self.order.hold((topic, kb)):
            await self._send(topic, kb, encode)

    async def _send(self, topic: str, key: bytes | None, encode) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_retry_time
        delay, refresh, attempt = self.backoff, False, 0
        while True:
            attempt += 1
            try:
                tmap = await self._topic_map(topic, refresh)
                turn = 0 if key is not None else self._turns.get(topic, 0)
                partition, node = route(tmap, key, turn)
                if key is None:
                    self._turns[topic] = turn + 1
                conn = await self._connection(node)
                await self._request(conn, node, encode(partition))
                return
            except NSQError as e:
                if not str(e).startswith(RETRYABLE):
                    raise PublishError(f"publish to topic {topic!r} refused: {e}") from e
                last = e
            except (LookupFailed, NoLeader, OSError, TimeoutError) as e:
                last = e
            if self._closed:
                raise PublishError("the producer is closed")
            if attempt >= self.max_attempts or loop.time() + delay > deadline:
                raise PublishError(f"publish to topic {topic!r} failed after {attempt} "
                                   f"attempts: {type(last).__name__}: {last}") from last
            log.info("publish_retry", topic=topic, attempt=attempt, error=str(last))
            self.retries += 1
            refresh = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff)

    async def _request(self, conn: Connection, node: Node, command: bytes) -> None:
        try:
            async with asyncio.timeout(self.response_timeout):
                await conn.command(command)
        except (OSError, TimeoutError):
            # unknown state (a lost answer would misalign the next ones): start afresh
            self._drop(node, conn)
            await conn.close()
            raise

    async def _topic_map(self, topic: str, refresh: bool) -> TopicMap:
        """The cached map, or one lookup shared by every caller that needs it now."""
        if not refresh and topic in self._maps:
            return self._maps[topic]
        fut = self._lookups.get(topic)
        if fut is None:
            fut = self._lookups[topic] = asyncio.ensure_future(self._lookup(topic))
            fut.add_done_callback(lambda f: self._lookups.pop(topic, None))
        return await asyncio.shield(fut)

    async def _lookup(self, topic: str) -> TopicMap:
        tmap = await self.source.lookup(topic, "w")
        self._maps[topic] = tmap
        return tmap

    async def _connection(self, node: Node) -> Connection:
        """The open connection to `node`, dialled once however many callers wait."""
        conn = self._conns.get(node)
        if conn is not None and not conn.closed.is_set():
            return conn
        fut = self._dialing.get(node)
        if fut is None:
            fut = self._dialing[node] = asyncio.ensure_future(self._dial(node))
            fut.add_done_callback(lambda f: self._dialing.pop(node, None))
        return await asyncio.shield(fut)

    async def _dial(self, node: Node) -> Connection:
        conn = Connection(node.host, node.tcp_port)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await conn.connect(self.identify)
        except BaseException:
            await conn.close()
            raise
        if self._closed:
            await conn.close()
            raise ConnectionError("the producer is closed")
        self._conns[node] = conn
        log.debug("producer_connected", node=node.address)
        return conn

    def _drop(self, node: Node, conn: Connection) -> None:
        if self._conns.get(node) is conn:
            del self._conns[node]
