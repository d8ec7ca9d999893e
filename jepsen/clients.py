"""The workload: producers (keyed and unkeyed, through nsqclient), consumers (nsqclient),
and one classic client (pynsq, a plain PUB to one nsqd at a time), each recording every
operation in the History.

Each producer process does one operation at a time (as a Jepsen process does): invoke,
then ok, fail (refused: certainly not stored) or info (anything else: it may be stored).
A keyed process owns one key and numbers its messages 0, 1, 2, ... (`seq`), so the
order checker can see reorderings per key.

With `poison` N, every Nth message of each nsqclient producer is poison: every consumer
that gets it records a `reject` and fails it (nsqclient REQs it with the error), so the
channel, given `max_attempts` (dead_letters.setup), buries it among its dead letters,
which the runner collects at the end as `dead` operations (dead_letters.collect).

With `halves` N, every Nth message of each nsqclient producer is a half message whose
value names its kind (`half`, jepsen/halves.py): the producer sends the half to
`check_url`'s check-back, then commits it ("commit"), rolls it back ("rollback") or
leaves it to the check-back ("check-commit", "check-rollback"). The enqueue is `ok` when
its last call succeeded; a half refused on its first attempt is `fail`; a decision that
failed after the half was stored is `info` (the check-back decides it). A half is not
idempotent (a retried one may be stored twice), so its value is not `named`.
"""

from __future__ import annotations

import asyncio
import json
import threading

from jepsen.halves import kind_of, rolled_back
from jepsen.history import History
from nsqclient.consumer import Consumer
from nsqwire.partitioning import partition_of
from nsqclient.producer import Producer, PublishError

CHANNEL = "jepsen"
PUBLISH_TIMEOUT_S = 8.0
# what a node says of a publish it wrote but could not commit (nsqd: diskqueue NotCommitted):
# its outcome is unknown, so it is recorded as info, not fail
UNKNOWN = "may still be delivered"


def keys_for(partitions: int, per_partition: int = 1) -> list[str]:
    """Keys that cover every partition (`per_partition` each), so each one is written."""
    found: dict[int, list[str]] = {n: [] for n in range(partitions)}
    i = 0
    while any(len(v) < per_partition for v in found.values()):
        key = f"key-{i}"
        n = partition_of(key, partitions)
        if len(found[n]) < per_partition:
            found[n].append(key)
        i += 1
    return [k for n in range(partitions) for k in found[n]]


class Workload:
    """Producers and consumers on one topic until `stop_producing()`, consumers until
    `close()`."""

    def __init__(self, history: History, topic: str, partitions: int,
                 lookupds: list[str], nsqds: list[str], unkeyed: int = 2,
                 pause_s: float = 0.05, consumers: int = 2, classic: bool = True,
                 ordered: bool = False, poison: int = 0, halves: int = 0,
                 check_url: str | None = None):
        self.history, self.topic, self.partitions = history, topic, partitions
        self.lookupds, self.nsqds = lookupds, nsqds
        self.keys = keys_for(partitions)
        self.unkeyed, self.pause_s, self.consumers_n = unkeyed, pause_s, consumers
        self.classic = classic
        self.ordered = ordered  # consumers SUB_ORDERED: one message of a partition at a time
        self.poison = poison  # every poison-th message of an nsqclient producer always fails
        self.halves = halves  # every halves-th message of an nsqclient producer is a half
        self.check_url = check_url  # the halves' check-back
        self.producing = True
        self.tasks: list[asyncio.Task] = []
        self.consumers: list[Consumer] = []
        self.acknowledged: set[str] = set()  # enqueue ids answered OK, for the drain
        self.poisoned: set[str] = set()  # the acknowledged ones that are poison: not awaited
        self.rolled_back: set[str] = set()  # ... and halves rolled back: never delivered
        # partition -> invoke time (history clock) of its latest acknowledged keyed publish
        self.last_ok_invoke: dict[int, float] = {}
        self.dequeued: set[str] = set()
        self._classic_thread: threading.Thread | None = None

    async def start(self) -> None:
        for i in range(self.consumers_n):
            name = f"c{i + 1}"
            c = Consumer(self.topic, CHANNEL, self.lookupds,
                         lambda m, name=name: self._dequeued(name, m), max_in_flight=50,
                         lookup_interval=2.0, max_backoff=1.0, ordered=self.ordered)
            self.consumers.append(await c.start())
        n = 0
        for key in self.keys:
            n += 1
            self.tasks.append(asyncio.create_task(self._produce(f"p{n}", key)))
        for _ in range(self.unkeyed):
            n += 1
            self.tasks.append(asyncio.create_task(self._produce(f"p{n}", None)))
        if self.classic:
            self._classic_thread = threading.Thread(target=self._classic, args=(f"p{n + 1}",),
                                                    daemon=True)
            self._classic_thread.start()

    async def stop_producing(self) -> None:
        self.producing = False
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._classic_thread is not None:
            await asyncio.to_thread(self._classic_thread.join, PUBLISH_TIMEOUT_S + 5)

    async def close(self) -> None:
        """Stop producers and consumers, also when the run was interrupted: a producer whose
        cancellation a client library swallowed still ends, at its loop's next turn (an
        interrupted run once published on for 3 minutes that way, through Python 3.11's
        asyncio.wait_for)."""
        self.producing = False
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.consumers:
            await c.close()

    # ---- producers ----------------------------------------------------------------------

    async def _produce(self, process: str, key: str | None) -> None:
        producer = Producer(self.lookupds, max_retry_time=5.0, response_timeout=3.0,
                            connect_timeout=2.0, max_backoff=0.5)
        partition = None if key is None else partition_of(key, self.partitions)
        seq = 0
        try:
            while self.producing:
                value = {"id": f"{process}-{seq}", "key": key, "seq": seq,
                         "partition": partition}
                kind = kind_of(seq, self.halves)
                if kind is None:
                    value["named"] = True  # idempotent: nsqclient's publishes
                else:
                    value["half"] = kind
                if self.poison and seq % self.poison == self.poison - 1:
                    value["poison"] = True
                invoked = self.history.now()
                self.history.record("invoke", "enqueue", process, value)
                body = json.dumps(value).encode()
                retries = producer.retries
                try:
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        if kind is None:
                            await producer.publish(self.topic, body, key=key)
                        else:
                            await self._half(producer, body, kind, key)
                    self.history.record("ok", "enqueue", process, value)
                    self.acknowledged.add(value["id"])
                    if value.get("poison"):
                        self.poisoned.add(value["id"])
                    if rolled_back(value):
                        self.rolled_back.add(value["id"])
                    if partition is not None:
                        self.last_ok_invoke[partition] = invoked
                except PublishError as e:
                    # refused: never stored; unless the node says it was written and may
                    # still be delivered (replicated, not committed: the outcome is unknown),
                    # or a half was sent again (an attempt whose answer was lost may have
                    # stored it)
                    refused = ("refused" in str(e) and UNKNOWN not in str(e)
                               and (kind is None or producer.retries == retries))
                    self.history.record("fail" if refused else "info", "enqueue", process,
                                        dict(value, error=str(e)[:200]))
                except (TimeoutError, OSError, Undecided) as e:
                    self.history.record("info", "enqueue", process,
                                        dict(value, error=repr(e)[:200]))
                seq += 1
                await asyncio.sleep(self.pause_s)
        finally:
            await producer.close()

    async def _half(self, producer: Producer, body: bytes, kind: str, key: str | None) -> None:
        """The half, then the producer's decision when `kind` has one; Undecided when the
        decision failed (the half is stored: the check-back decides it)."""
        half = await producer.half(self.topic, body, self.check_url, key=key)
        try:
            if kind == "commit":
                await producer.commit(half)
            elif kind == "rollback":
                await producer.rollback(half)
        except PublishError as e:
            raise Undecided(str(e)) from e

    def _classic(self, process: str) -> None:
        """pynsq's Writer on its own tornado loop in this thread: PUB without a partition
        number to whichever nsqd it is connected to (the node picks one it leads)."""
        import nsq
        import tornado.ioloop

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def run():
            writer = nsq.Writer(self.nsqds, reconnect_interval=1.0)
            seq = 0
            while self.producing:
                value = {"id": f"{process}-{seq}", "key": None, "seq": seq, "partition": None}
                self.history.record("invoke", "enqueue", process, value)
                done = asyncio.get_running_loop().create_future()

                def answered(conn, data, done=done):
                    if not done.done():
                        done.set_result((conn, data))

                writer.pub(self.topic, json.dumps(value).encode(), callback=answered)
                try:
                    async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                        conn, data = await done
                except TimeoutError:
                    self.history.record("info", "enqueue", process,
                                        dict(value, error="timeout"))
                    # pynsq matches answers to callbacks in order, and an E_* answer
                    # fails every callback queued: a late answer to this publish would
                    # be taken as the next one's. Closing the connections fails what
                    # is queued (their publishes are past) and starts them afresh.
                    for conn in list(writer.conns.values()):
                        conn.close()
                    seq += 1
                    continue
                node = getattr(conn, "id", None)
                if isinstance(data, nsq.Error):
                    # no connection at all, or an E_* answer: not stored; a closed
                    # connection: unknown
                    error = str(data)
                    sure = (conn is None and "no open connections" in error
                            or "E_" in error and UNKNOWN not in error)
                    self.history.record("fail" if sure else "info", "enqueue", process,
                                        dict(value, error=error[:200]), node)
                    await asyncio.sleep(0.2)
                else:
                    self.history.record("ok", "enqueue", process, value, node)
                    self.acknowledged.add(value["id"])
                seq += 1
                await asyncio.sleep(self.pause_s)
            for conn in list(writer.conns.values()):
                conn.close()

        try:
            tornado.ioloop.IOLoop.current()  # binds tornado to this thread's asyncio loop
            loop.run_until_complete(run())
        finally:
            loop.close()

    # ---- consumers ----------------------------------------------------------------------

    def _dequeued(self, process: str, message) -> None:
        try:
            value = json.loads(message.body)
        except ValueError:
            value = {"id": None, "raw": message.body[:100].decode(errors="replace")}
        conn = message.conn
        node = f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
        value["msg_id"] = message.id.decode()  # the stored copy delivered: write duplicates
        if value.get("poison"):
            self.history.record("ok", "reject", process, dict(value, attempts=message.attempts),
                                node)
            raise Poison(value["id"])
        self.history.record("ok", "dequeue", process, value, node)
        self.dequeued.add(value.get("id"))

    def missing(self) -> int:
        """Acknowledged enqueues not dequeued yet but poison ones and halves rolled back
        (the drain waits for 0)."""
        return len(self.acknowledged - self.dequeued - self.poisoned - self.rolled_back)


class Poison(Exception):
    """A poison message: its consumer fails it, always."""


class Undecided(Exception):
    """A half message stored whose producer's decision failed: the check-back decides it."""
