"""Publish forwarding (cluster mode): a publish that names no partition, sent to a node that
leads none of its topic's partitions, is written by a leader of the topic instead of refused.

The node picks a partition round-robin over the topic's partitions whose leader is a live
node (as a classic PUB spreads over the partitions a node leads), sends the write request
to that leader over the replication port (`Kind.PUBLISH`, on connections of its own, so
forwarded publishes never queue behind or break a partition's replication), and answers
the client with the leader's answer once it has it:
- OK: the leader committed it (as for a publish written here; PUB_TRACE's reply carries
  the leader's id and offsets);
- E_FAILED_ON_NOT_LEADER (the leadership moved before the request got there): nothing was
  written, so it is sent again to the partition's leader in the next view, until the
  deadline; so is a request that could not be sent;
- anything else the leader said (not writable, its outcome unknown, failed), as it said it;
- no answer by the deadline, or the connection lost after sending: the outcome is unknown
  (NotCommitted: the message may still be delivered), never retried here.
The deadline is this node's `--commit-timeout`, as for a publish written here: the client
is answered within it whatever the leader does.

The request is the write request this node made of the command (`encode`/`decode`): the
bodies, and the ext and trace ids; the leader answers WRITTEN (ids and offsets) or ERROR. A DPUB's due time is this node's clock's, as it is for a
publish written here (due times are wall-clock times every node compares with its own).
"""

from __future__ import annotations

import asyncio
import struct
from typing import NamedTuple

from diskqueue.errors import NotCommitted
from isr.leader import NotWritable
from isr.peer import PeerError, Peers
from isr.wire import Kind

from nsqwire.ext import checked_producer
from nsqwire.partitioning import partition_of

from .errors import BadSequence, PartitionNotLed, ProducersLoading

RETRY_S = 0.05  # after NOT_LEADER or a failed send: the view may name the new leader
_LEN = struct.Struct(">I")
E_NOT_LEADER = "E_FAILED_ON_NOT_LEADER"
E_NOT_WRITABLE = "E_FAILED_ON_NOT_WRITABLE"
E_UNKNOWN = "E_OUTCOME_UNKNOWN"  # written (or maybe): NotCommitted
E_FAILED = "E_PUB_FAILED"
E_BAD_SEQUENCE = "E_BAD_SEQUENCE"  # an idempotent producer's request refused: BadSequence
_waiting: set[asyncio.Task] = set()  # serve()'s publishes waiting for a leadership to start


class Forwarded(NamedTuple):
    """What the leader wrote: ids first_id .. first_id + count - 1 at [offset, end_offset)
    of `partition` (what the TCP answers of PUB_TRACE read, as they read a local append)."""

    first_id: int
    count: int
    offset: int
    end_offset: int
    partition: int
    duplicate: bool = False  # an idempotent producer's retry, written before


class PublishRequest(NamedTuple):
    """One write request (Topic.publish's arguments), as forwarded."""

    bodies: list[bytes]
    ext: bytes = b""
    trace_id: int = 0
    trace_ids: tuple | None = None
    exts: tuple | None = None
    producer: tuple[str, int] | None = None  # an idempotent producer's (id, sequence)


def encode(topic: str, partition: int, req: PublishRequest, source: str) -> tuple[dict, bytes]:
    """The PUBLISH frame's header (isr.wire's binary layout) and payload: each message's
    trace id (u64) when the request has them, then each body as [u32 length][bytes], then
    each ext likewise when there are per-message exts."""
    header = {"topic": topic, "partition": partition, "n": len(req.bodies), "source": source,
              "ext": req.ext, "trace_id": req.trace_id, "trace_ids": req.trace_ids is not None,
              "exts": req.exts is not None, "producer": req.producer}
    parts = [struct.pack(f">{len(req.trace_ids)}Q", *req.trace_ids)] if req.trace_ids else []
    for item in (*req.bodies, *(req.exts or ())):
        parts.append(_LEN.pack(len(item)))
        parts.append(item)
    return header, b"".join(parts)


def decode(header: dict, payload: bytes) -> PublishRequest:
    """The write request of a PUBLISH frame; ValueError when it is not one."""
    n = header["n"]
    if n < 1:
        raise ValueError("PUBLISH: no message")
    trace_ids, at = None, 0
    if header["trace_ids"]:
        if len(payload) < 8 * n:
            raise ValueError("PUBLISH: payload cut short")
        trace_ids, at = struct.unpack_from(f">{n}Q", payload), 8 * n
    with_exts = header["exts"]
    items = []
    for _ in range(2 * n if with_exts else n):
        if at + 4 > len(payload):
            raise ValueError("PUBLISH: payload cut short")
        (size,) = _LEN.unpack_from(payload, at)
        at += 4
        if at + size > len(payload):
            raise ValueError("PUBLISH: payload cut short")
        items.append(payload[at:at + size])
        at += size
    if at != len(payload):
        raise ValueError("PUBLISH: bytes after the last message")
    producer = header.get("producer")
    if producer is not None:
        producer = checked_producer(*producer)
    return PublishRequest(items[:n], header["ext"], header["trace_id"], trace_ids,
                          tuple(items[n:]) if with_exts else None, producer)


def serve(nsqd, header: dict, payload: bytes, answer) -> None:
    """The leader's side: write a forwarded request to the partition it names (Topic.publish,
    as a TCP publish is written: no task, no future), then `answer((kind, header, payload))`
    once: OK with what was written, or ERROR with the NSQ error code a client would get."""
    try:
        req = decode(header, payload)
    except (ValueError, KeyError, TypeError) as e:
        answer(_error(E_FAILED, str(e)))
        return
    topic = nsqd.topics.get(header["topic"])
    partition = header["partition"]
    if topic is None:
        answer(_error(E_NOT_LEADER, f"partition {partition} is not led here"))
        return

    def written(appended, exc) -> None:
        if exc is not None:
            answer(_refused(exc, partition))
            return
        if not appended.duplicate:  # an idempotent producer's retry: written before
            if topic.trace is not None:
                topic.trace.published(topic, appended, req.trace_id, req.trace_ids,
                                      header["source"])
            topic.count_published(req.bodies)
        answer((Kind.WRITTEN, {"first_id": appended.first_id, "count": appended.count,
                               "offset": appended.offset, "end_offset": appended.end_offset,
                               "duplicate": appended.duplicate}, b""))

    def refuse(e: Exception) -> None:
        answer(_refused(e, partition))

    def publish() -> None:
        try:
            topic.publish(req.bodies, partition, req.ext, trace_id=req.trace_id,
                          trace_ids=req.trace_ids, exts=req.exts, callback=written,
                          producer=req.producer)
        except ProducersLoading as e:  # the partition's producer table is read first
            _later(e.partition.load_producers(), publish, refuse)
        except Exception as e:  # refused at once: not led, not writable, a message too big
            answer(_refused(e, partition))

    if not topic.starting(partition):
        publish()
        return

    _later(nsqd.until_led(topic, partition), publish, refuse)  # its leadership starting


def _later(first, then, refuse) -> None:
    """Await `first` (bounded), then call `then()`; `refuse(error)` when it fails: a
    request that waits for its partition."""
    async def waited() -> None:
        try:
            await first
        except Exception as e:
            refuse(e)
            return
        then()
    _waiting.add(task := asyncio.get_running_loop().create_task(waited()))
    task.add_done_callback(_waiting.discard)


def _refused(e: Exception, partition: int) -> tuple[Kind, dict, bytes]:
    if isinstance(e, PartitionNotLed):
        return _error(E_NOT_LEADER, f"partition {partition} is not led here")
    if isinstance(e, NotCommitted):
        return _error(E_UNKNOWN, str(e))
    if isinstance(e, NotWritable):
        return _error(E_NOT_WRITABLE, str(e))
    if isinstance(e, BadSequence):
        return _error(E_BAD_SEQUENCE, str(e))
    return _error(E_FAILED, f"{type(e).__name__}: {e}")  # a closed or failed log


def _error(code: str, message: str) -> tuple[Kind, dict, bytes]:
    return Kind.ERROR, {"code": code, "message": message}, b""


class Forwarder:
    """The sending side, one per node: `send` picks the partition and its leader, sends, and
    calls back with what the leader wrote or what the client is told."""

    def __init__(self, replication, timeout: float):
        self.replication = replication
        self.timeout = timeout  # s: every request is answered within it
        self.peers = Peers(replication)  # connections of their own (see the docstring)
        self._next: dict[str, int] = {}
        self._connects: set[asyncio.Task] = set()
        self.stats = {"forwarded": 0, "forward_failed": 0}  # requests; in /stats' cluster

    def leader_of(self, topic: str, partition: int) -> str | None:
        """The partition's leader in this node's view, if it is a live node."""
        view = self.replication.cluster.mirror.view
        tv = view.topics.get(topic) if view is not None else None
        state = tv.partitions.get(partition) if tv is not None else None
        leader = state.leader if state is not None else None
        return leader if leader and leader in view.nodes else None

    def named(self, topic: str, e: PartitionNotLed) -> PartitionNotLed:
        """`e` with the leader of its partition, as the client is told it."""
        if e.partition is not None and e.leader is None:
            e.leader = self.leader_of(topic, e.partition)
        return e

    def pick(self, topic: str, req: PublishRequest) -> tuple[int, str] | None:
        """The next partition round-robin whose leader is a live node other than this one;
        a named request's, its producer id's (Topic.publish's rule) when its leader is."""
        view = self.replication.cluster.mirror.view
        tv = view.topics.get(topic) if view is not None else None
        if tv is None:
            return None
        numbers = sorted(tv.partitions)
        if req.producer is not None:
            n = partition_of(req.producer[0], len(numbers))
            leader = self.leader_of(topic, n)
            ok = leader is not None and leader != self.replication.node_id
            return (n, leader) if ok else None
        start = self._next.get(topic, 0)
        for i in range(len(numbers)):
            n = numbers[(start + i) % len(numbers)]
            leader = self.leader_of(topic, n)
            if leader is not None and leader != self.replication.node_id:
                self._next[topic] = start + i + 1
                return n, leader
        return None

    def send(self, topic: str, req: PublishRequest, source: str, done) -> None:
        """Forward one write request (see the module docstring); `done(Forwarded, None)` or
        `done(None, error)` is called once, the error being PartitionNotLed (no leader
        took it before the deadline), NotWritable (what the leader said), NotCommitted (its
        outcome unknown) or RuntimeError (it failed there)."""
        _Forward(self, topic, req, source, done).attempt()

    async def publish(self, topic: str, req: PublishRequest, source: str) -> Forwarded:
        """`send`, awaited (HTTP's form)."""
        fut = asyncio.get_running_loop().create_future()
        self.send(topic, req, source,
                  lambda written, exc: fut.done() or (fut.set_exception(exc) if exc
                                                      else fut.set_result(written)))
        return await fut

    async def close(self) -> None:
        for task in list(self._connects):
            task.cancel()
        await self.peers.close()


class _Forward:
    """One forwarded request until it is answered: each attempt sends it to the leader of
    the partition picked, with one timer for its deadline (no task, no future)."""

    __slots__ = ("fw", "topic", "req", "source", "done", "loop", "deadline", "timer",
                 "last", "sent_to", "partition", "finished")

    def __init__(self, fw: Forwarder, topic: str, req: PublishRequest, source: str, done):
        self.fw, self.topic, self.req, self.source, self.done = fw, topic, req, source, done
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + fw.timeout
        self.timer = self.loop.call_at(self.deadline, self._expired)
        self.last = "no partition of the topic has a live leader"
        self.sent_to: str | None = None  # the leader asked, while its answer is awaited
        self.partition = -1
        self.finished = False

    def attempt(self) -> None:
        if self.finished:
            return
        picked = self.fw.pick(self.topic, self.req)
        if picked is None:
            self._again()
            return
        self.partition, leader = picked
        peer = self.fw.peers.get(leader)
        if not peer.connected:
            task = self.loop.create_task(self._connect(peer))
            self.fw._connects.add(task)
            task.add_done_callback(self.fw._connects.discard)
            return
        header, payload = encode(self.topic, self.partition, self.req, self.source)
        try:
            peer.send_callback(Kind.PUBLISH, header, payload, self._answered)
        except PeerError as e:  # nothing sent
            self.last = f"{leader}: {e}"
            self._again()
            return
        self.sent_to = leader

    async def _connect(self, peer) -> None:
        try:
            await peer.connect()  # bounded by the peer's connect timeout
        except PeerError as e:
            self.last = str(e)
            self._again()
        else:
            self.attempt()

    def _again(self) -> None:
        if not self.finished:
            self.loop.call_later(RETRY_S, self.attempt)

    def _answered(self, frame) -> None:
        leader, self.sent_to = self.sent_to, None
        if self.finished:
            return
        if isinstance(frame, PeerError):
            self._finish(None, NotCommitted(f"forwarded to {leader}: {frame}; it may still be "
                                            "delivered"))
        elif frame.kind is Kind.WRITTEN:
            h = frame.header
            self._finish(Forwarded(h["first_id"], h["count"], h["offset"], h["end_offset"],
                                   self.partition, h["duplicate"]), None)
        elif frame.header.get("code") == E_NOT_LEADER:  # nothing written: another try
            self.last = f"{leader}: {frame.header.get('message', '')}"
            self._again()
        else:
            self._finish(None, _refusal(frame.header.get("code"),
                                        f"forwarded to {leader}: "
                                        f"{frame.header.get('message', '')}"))

    def _expired(self) -> None:
        if self.sent_to is not None:
            self._finish(None, NotCommitted(f"forwarded to {self.sent_to}: no answer in "
                                            f"{self.fw.timeout:g} s; it may still be delivered"))
        else:
            self._finish(None, PartitionNotLed(None, detail=f"not forwarded within "
                                               f"{self.fw.timeout:g} s: {self.last}"))

    def _finish(self, written: Forwarded | None, exc: Exception | None) -> None:
        self.finished = True
        self.timer.cancel()
        self.fw.stats["forwarded" if exc is None else "forward_failed"] += 1
        self.done(written, exc)


def _refusal(code: str | None, text: str) -> Exception:
    if code == E_UNKNOWN:
        return NotCommitted(text)
    if code == E_NOT_WRITABLE:
        return NotWritable(text)
    if code == E_BAD_SEQUENCE:
        return BadSequence(text)
    return RuntimeError(text)
