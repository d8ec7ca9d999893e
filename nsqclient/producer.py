"""Producer: publishes to the leader of each message's partition, over one reused
connection per leader.

Routing: with a key, partition_of(key, partition_num) (partitioning.py); without, the
led partitions in turn. A classic topic (no partition map) is published without a
partition number to one of its producers (by key when there is one, else in turn).
A publish is done only at the server's OK. On E_FAILED_ON_NOT_LEADER,
E_FAILED_ON_NOT_WRITABLE, E_TOPIC_NOT_EXIST, E_BAD_PARTITION, a lost connection, a
timeout or a failed lookup, it looks up again and retries with exponential backoff, at
most `max_attempts` times within `max_retry_time`, then raises PublishError.

Idempotent (the default, on a topic with partitions): each partition has a `Lane`, one
request in flight at a time, named by the producer's id and the lane's next sequence
(`##producer_id`, `##sequence` in PUB_EXT / MPUB_EXT) and sent again under the same name
on every retry, so the partition writes it once (nsqd/producers.py) through leader
kills. What callers publish while a request is in flight goes as the next one, in one
MPUB_EXT, in call order (so a key's order holds). A request refused as a gap (nothing
of it written) is sent again under a new id; one given up leaves the lane a new id too.

Half messages (`half`, `commit`, `rollback`: nsqd/halves.py): a half goes to one
partition's leader like a publish and is retried the same way, so a retry after a lost
answer may leave a second half: the check-back decides it (answer it by the body's
business key). A decision goes to the leader of the half's partition (the node that took
it, on a topic without partitions) and is retried as a publish, and on E_HALF_FAILED;
the server answers one sent again as it answered the first.

Not idempotent (`idempotent=False`, or a classic topic without partitions): PUB and MPUB;
messages of one key are sent one at a time, in call order, each after the previous one's
answer (so retries never reorder a key); other keys and keyless messages proceed
meanwhile. Retries may duplicate a message whose answer was lost (at-least-once).
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from nsqclient.conn import Connection, NSQError
from nsqclient.lookup import LookupFailed, LookupSource, Node, TopicMap, lookup_source
from nsqwire.ids import PARTITION_SHIFT
from nsqwire.partitioning import key_bytes, partition_of
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


class Rerouted(Exception):
    """A lane's partition is not in the topic's map any more (a stale map fixed): its
    request, never written, goes where its calls' keys now route."""


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


class Lane:
    """The requests of one producer to one partition (see the module docstring): callers'
    messages wait in `waiting` as (bodies, key, future); one task sends them, a request at
    a time."""

    MAX_MESSAGES = 1000  # what one request carries at most, from the calls waiting
    MAX_BYTES = 512 * 1024

    def __init__(self, producer: "Producer", topic: str, partition: int):
        self.producer = producer
        self.topic = topic
        self.partition = partition
        self.producer_id = uuid.uuid4().hex
        self.sequence = 0  # the next request's
        self.waiting: list[tuple[list[bytes], bytes | None, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    async def publish(self, bodies: list[bytes], key: bytes | None) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((bodies, key, fut))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_all())
        await fut

    def _take(self) -> list[tuple[list[bytes], bytes | None, asyncio.Future]]:
        """The calls the next request carries: the first one waiting, and those after it
        while they fit."""
        taken, count, size = [], 0, 0
        for call in self.waiting:
            n, b = len(call[0]), sum(map(len, call[0]))
            if taken and (count + n > self.MAX_MESSAGES or size + b > self.MAX_BYTES):
                break
            taken.append(call)
            count, size = count + n, size + b
        del self.waiting[:len(taken)]
        return taken

    async def _send_all(self) -> None:
        while self.waiting:
            taken = [call for call in self._take() if not call[2].done()]  # none cancelled
            if not taken:
                continue
            bodies = [body for call in taken for body in call[0]]
            try:
                await self.producer._send(self.topic, None, self._encoder(bodies),
                                          partition=self.partition, lane=self)
            except Rerouted:  # nothing written: each call is published again, in order
                for call_bodies, key, fut in taken:
                    _chain(self.producer._publish(self.topic, key, call_bodies), fut)
                continue
            except Exception as e:  # given up: its outcome may be unknown, a new name follows
                self.renew()
                for _, _, fut in taken:
                    if not fut.done():
                        fut.set_exception(e)
            else:
                self.sequence += 1
                for _, _, fut in taken:
                    if not fut.done():
                        fut.set_result(None)

    def _encoder(self, bodies: list[bytes]):
        def encode(partition: int | None) -> bytes:
            header = {"##producer_id": self.producer_id, "##sequence": self.sequence}
            if len(bodies) == 1:
                return c.cmd_pub_ext(self.topic, header, bodies[0], partition)
            return c.cmd_mpub_ext(self.topic, [(header, bodies[0])]
                                  + [({}, body) for body in bodies[1:]], partition)
        return encode

    def renew(self) -> None:
        """A new producer id, from sequence 0: the partition takes it as a new producer."""
        self.producer_id = uuid.uuid4().hex
        self.sequence = 0

    def close(self, error: Exception) -> None:
        waiting, self.waiting = self.waiting, []
        for _, _, fut in waiting:
            if not fut.done():
                fut.set_exception(error)


def _chain(coro, fut: asyncio.Future) -> None:
    """Run `coro`; its outcome becomes `fut`'s."""
    def done(task: asyncio.Task) -> None:
        if fut.done():
            return
        if task.exception() is not None:
            fut.set_exception(task.exception())
        else:
            fut.set_result(None)
    asyncio.ensure_future(coro).add_done_callback(done)


class Sent(NamedTuple):
    """A request's answer, and the partition (None: none named) and node that gave it."""
    answer: bytes
    partition: int | None
    node: Node


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


@dataclass(frozen=True)
class Half:
    """A half message the server took: its topic, id (16 hex characters), partition (None
    on a topic without partitions) and the node that took it."""
    topic: str
    id: str
    partition: int | None
    node: Node


class Producer:
    """`await publish(topic, body, key=None)`, `await publish_many(topic, bodies,
    key=None)` (one request, to one partition), `await half(topic, body, check_url,
    key=None)` then `await commit(half)` or `await rollback(half)`, `await close()`.
    `idempotent`: see the module docstring."""

    def __init__(self, lookupd_http_addresses: list[str] | None = None, *,
                 lookup: LookupSource | None = None, max_attempts: int = 40,
                 max_retry_time: float = 30.0, backoff: float = 0.05, max_backoff: float = 0.5,
                 connect_timeout: float = 3.0, response_timeout: float = 10.0,
                 idempotent: bool = True):
        self.source = lookup_source(lookupd_http_addresses, lookup)
        self.max_attempts = max_attempts
        self.max_retry_time = max_retry_time
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.connect_timeout = connect_timeout
        self.response_timeout = response_timeout
        self.identify = {"hostname": socket.gethostname(), "user_agent": USER_AGENT}
        self.order = KeyOrder()
        self.idempotent = idempotent
        self._lanes: dict[tuple[str, int], Lane] = {}
        self.retries = 0  # attempts after a first one, over the producer's life
        self._maps: dict[str, TopicMap] = {}
        self._lookups: dict[str, asyncio.Future] = {}
        self._turns: dict[str, int] = {}
        self._conns: dict[Node, Connection] = {}
        self._dialing: dict[Node, asyncio.Future] = {}
        self._closed = False

    async def publish(self, topic: str, body: bytes, key: bytes | str | None = None) -> None:
        await self._publish(topic, key, [body])

    async def publish_many(self, topic: str, bodies: list[bytes],
                           key: bytes | str | None = None) -> None:
        """All of `bodies` in one request to one partition: the key's, or the next in turn."""
        if not bodies:
            raise ValueError("publish_many needs at least one body")
        await self._publish(topic, key, list(bodies))

    async def half(self, topic: str, body: bytes, check_url: str,
                   key: bytes | str | None = None) -> Half:
        """A half message: stored by the partition's leader (the key's, or the next in
        turn), delivered by no channel until committed; nsqd POSTs {"topic", "partition",
        "id", "checks", "body" (base64)} to `check_url` when no decision comes in time and
        takes {"decision": "commit" | "rollback"} from the answer."""
        if self._closed:
            raise PublishError("the producer is closed")
        if not valid_topic_name(topic):
            raise PublishError(f"invalid topic name {topic!r}")
        sent = await self._send(topic, None if key is None else key_bytes(key),
                                lambda n: c.cmd_half(topic, body, check_url, n),
                                retryable=RETRYABLE + ("E_HALF_FAILED",))
        msg_id = sent.answer[3:].decode()
        partition = int(msg_id, 16) >> PARTITION_SHIFT if sent.partition is not None else None
        return Half(topic, msg_id, partition, sent.node)

    async def commit(self, half: Half) -> None:
        """Make `half` deliverable (once, however often it is sent)."""
        await self._decide(half, True)

    async def rollback(self, half: Half) -> None:
        """Drop `half`: no channel ever delivers it."""
        await self._decide(half, False)

    async def _decide(self, half: Half, commit: bool) -> None:
        if self._closed:
            raise PublishError("the producer is closed")
        try:
            await self._send(half.topic, None,
                             lambda n: c.cmd_decide(half.topic, half.id, commit),
                             partition=half.partition,
                             to=half.node if half.partition is None else None,
                             retryable=RETRYABLE + ("E_HALF_FAILED",))
        except Rerouted:
            raise PublishError(f"topic {half.topic!r} has no partition {half.partition} "
                               "now") from None

    async def close(self) -> None:
        self._closed = True
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close(PublishError("the producer is closed"))
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()
        await self.source.close()

    async def _publish(self, topic: str, key, bodies: list[bytes]) -> None:
        if self._closed:
            raise PublishError("the producer is closed")
        if not valid_topic_name(topic):
            raise PublishError(f"invalid topic name {topic!r}")
        if self.idempotent:
            partition = await self._partition(topic, None if key is None else key_bytes(key))
            if partition is not None:
                lane = self._lanes.get((topic, partition))
                if lane is None:
                    lane = self._lanes[(topic, partition)] = Lane(self, topic, partition)
                return await lane.publish(bodies, None if key is None else key_bytes(key))
        if len(bodies) == 1:
            encode = lambda n: c.cmd_pub(topic, bodies[0], n)  # noqa: E731
        else:
            encode = lambda n: c.cmd_mpub(topic, bodies, n)  # noqa: E731
        if key is None:
            return await self._send(topic, None, encode)
        kb = key_bytes(key)
        async with self.order.hold((topic, kb)):
            await self._send(topic, kb, encode)

    async def _partition(self, topic: str, key: bytes | None) -> int | None:
        """The partition an idempotent request goes to, kept through its retries: the
        key's, or the next led one in turn; None on a topic without partitions. Looks up
        again (bounded, as `_send`) while no partition of a keyless one has a leader."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_retry_time
        delay, refresh = self.backoff, False
        while True:
            try:
                tmap = await self._topic_map(topic, refresh)
                if tmap.partition_num is None:
                    return None
                if key is not None:
                    return partition_of(key, tmap.partition_num)
                turn = self._turns.get(topic, 0)
                self._turns[topic] = turn + 1
                return route(tmap, None, turn)[0]
            except (LookupFailed, NoLeader, OSError, TimeoutError) as e:
                last = e
            if self._closed or loop.time() + delay > deadline:
                raise PublishError(f"publish to topic {topic!r} found no partition: "
                                   f"{type(last).__name__}: {last}") from last
            refresh = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff)

    async def _send(self, topic: str, key: bytes | None, encode, partition: int | None = None,
                    lane: Lane | None = None, to: Node | None = None,
                    retryable: tuple[str, ...] = RETRYABLE) -> Sent:
        """Send one request (`encode(partition)`), retried as the module docstring says; to
        `partition`'s leader when given (a lane's), to the node `to` when given, else routed
        by key or in turn. Errors that start with one of `retryable` are retried."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_retry_time
        delay, refresh, attempt = self.backoff, False, 0
        while True:
            attempt += 1
            try:
                tmap = await self._topic_map(topic, refresh)
                if to is not None:
                    n, node = None, to
                elif partition is not None:
                    n = partition
                    if tmap.partition_num is None or n >= tmap.partition_num:
                        raise Rerouted()
                    node = tmap.leaders.get(n)
                    if node is None:
                        raise NoLeader(f"partition {n} of topic {topic!r} has no leader")
                else:
                    turn = 0 if key is not None else self._turns.get(topic, 0)
                    n, node = route(tmap, key, turn)
                    if key is None:
                        self._turns[topic] = turn + 1
                conn = await self._connection(node)
                return Sent(await self._request(conn, node, encode(n)), n, node)
            except NSQError as e:
                if lane is not None and str(e).startswith("E_BAD_SEQUENCE") and (
                        "leaves a gap" in str(e)):
                    lane.renew()  # refused, nothing written: sent again under a new name
                elif not str(e).startswith(retryable):
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

    async def _request(self, conn: Connection, node: Node, command: bytes) -> bytes:
        try:
            async with asyncio.timeout(self.response_timeout):
                return await conn.command(command)
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
