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
  written, so it is sent again to the partition's leader in the next view, until
  FORWARD_TIMEOUT_S; so is a request that could not be sent;
- anything else the leader said (not writable, its outcome unknown, failed), as it said it;
- no answer within FORWARD_TIMEOUT_S, or the connection lost after sending: the outcome
  is unknown (NotCommitted: the message may still be delivered), never retried here.

The request is the write request this node made of the command (`encode`/`decode`): the
bodies, and the ext and trace ids. A DPUB's due time is this node's clock's, as it is for a
publish written here (due times are wall-clock times every node compares with its own).
"""

from __future__ import annotations

import asyncio
import struct
from typing import NamedTuple

import structlog

from diskqueue.errors import NotCommitted
from isr.leader import NotWritable
from isr.peer import PeerError, Peers
from isr.wire import Frame, Kind

from .errors import PartitionNotLed

log = structlog.get_logger("nsqd.forward")

FORWARD_TIMEOUT_S = 10.0  # beyond a leader's commit deadline: its own answer comes first
RETRY_S = 0.05  # after NOT_LEADER or a failed send: the view may name the new leader
_LEN = struct.Struct(">I")
E_NOT_LEADER = "E_FAILED_ON_NOT_LEADER"
E_NOT_WRITABLE = "E_FAILED_ON_NOT_WRITABLE"
E_UNKNOWN = "E_OUTCOME_UNKNOWN"  # written (or maybe): NotCommitted
E_FAILED = "E_PUB_FAILED"


class Forwarded(NamedTuple):
    """What the leader wrote: ids first_id .. first_id + count - 1 at [offset, end_offset)
    of `partition` (what the TCP answers of PUB_TRACE read, as they read a local append)."""

    first_id: int
    count: int
    offset: int
    end_offset: int
    partition: int


class PublishRequest(NamedTuple):
    """One write request (Topic.publish's arguments), as forwarded."""

    bodies: list[bytes]
    ext: bytes = b""
    trace_id: int = 0
    trace_ids: tuple | None = None
    exts: tuple | None = None


def encode(topic: str, partition: int, req: PublishRequest, source: str) -> tuple[dict, bytes]:
    """The PUBLISH frame's header and payload: each body as [u32 length][bytes], then each
    ext likewise when there are per-message exts."""
    header = {"topic": topic, "partition": partition, "n": len(req.bodies), "source": source,
              "ext": req.ext.hex(), "trace_id": req.trace_id,
              "trace_ids": list(req.trace_ids) if req.trace_ids is not None else None,
              "exts": req.exts is not None}
    parts = []
    for item in (*req.bodies, *(req.exts or ())):
        parts.append(_LEN.pack(len(item)))
        parts.append(item)
    return header, b"".join(parts)


def decode(header: dict, payload: bytes) -> PublishRequest:
    """The write request of a PUBLISH frame; ValueError when it is not one."""
    n = header["n"]
    with_exts = header.get("exts") is True
    trace_ids = header.get("trace_ids")
    trace_id = header.get("trace_id", 0)
    if n < 1 or not isinstance(trace_id, int) or not 0 <= trace_id < 1 << 64:
        raise ValueError("PUBLISH: bad n or trace_id")
    if trace_ids is not None and (not isinstance(trace_ids, list) or len(trace_ids) != n
                                  or not all(isinstance(t, int) and 0 <= t < 1 << 64
                                             for t in trace_ids)):
        raise ValueError("PUBLISH: bad trace_ids")
    items, at = [], 0
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
    ext = bytes.fromhex(header.get("ext", ""))
    return PublishRequest(items[:n], ext, trace_id,
                          tuple(trace_ids) if trace_ids is not None else None,
                          tuple(items[n:]) if with_exts else None)


async def serve(nsqd, header: dict, payload: bytes) -> tuple[Kind, dict, bytes]:
    """The leader's side: write a forwarded request to the partition it names (Topic.publish,
    as an HTTP publish is written), answer OK with what was written, or ERROR with the NSQ
    error code a client would get here."""
    try:
        req = decode(header, payload)
    except (ValueError, KeyError, TypeError) as e:
        return _error(E_FAILED, str(e))
    topic = nsqd.topics.get(header["topic"])
    partition = header["partition"]
    if topic is None:
        return _error(E_NOT_LEADER, f"partition {partition} is not led here")
    try:
        appended = await topic.publish(req.bodies, partition, req.ext, trace_id=req.trace_id,
                                       trace_ids=req.trace_ids, exts=req.exts,
                                       source=header["source"])
    except PartitionNotLed:
        return _error(E_NOT_LEADER, f"partition {partition} is not led here")
    except NotCommitted as e:
        return _error(E_UNKNOWN, str(e))
    except NotWritable as e:
        return _error(E_NOT_WRITABLE, str(e))
    except Exception as e:  # a closed or failed log, a message too big for a record
        return _error(E_FAILED, f"{type(e).__name__}: {e}")
    return Kind.OK, {"first_id": appended.first_id, "count": appended.count,
                     "offset": appended.offset, "end_offset": appended.end_offset}, b""


def _error(code: str, message: str) -> tuple[Kind, dict, bytes]:
    return Kind.ERROR, {"code": code, "message": message}, b""


class Forwarder:
    """The sending side, one per node: `publish` picks the partition and its leader, sends,
    and returns what the leader wrote or raises what the client is told."""

    def __init__(self, replication):
        self.replication = replication
        self.peers = Peers(replication)  # connections of their own (see the docstring)
        self._next: dict[str, int] = {}
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

    def _pick(self, topic: str) -> tuple[int, str] | None:
        """The next partition round-robin whose leader is a live node other than this one."""
        view = self.replication.cluster.mirror.view
        tv = view.topics.get(topic) if view is not None else None
        if tv is None:
            return None
        numbers = sorted(tv.partitions)
        start = self._next.get(topic, 0)
        for i in range(len(numbers)):
            n = numbers[(start + i) % len(numbers)]
            leader = self.leader_of(topic, n)
            if leader is not None and leader != self.replication.node_id:
                self._next[topic] = start + i + 1
                return n, leader
        return None

    async def publish(self, topic: str, req: PublishRequest, source: str) -> Forwarded:
        """Forward one write request (see the module docstring). Raises PartitionNotLed (no
        leader to send it to until the deadline), NotWritable (what the leader said),
        NotCommitted (its outcome unknown) or RuntimeError (it failed there)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FORWARD_TIMEOUT_S
        last = "no partition of the topic has a live leader"
        while True:
            picked = self._pick(topic)
            if picked is not None:
                partition, leader = picked
                header, payload = encode(topic, partition, req, source)
                peer = self.peers.get(leader)
                try:
                    await asyncio.wait_for(peer.connect(), max(0.0, deadline - loop.time()))
                    sent = peer.send(Kind.PUBLISH, header, payload)
                except (PeerError, TimeoutError) as e:  # nothing sent: another try
                    last = f"{leader}: {e}"
                else:
                    frame = await self._answer(sent, leader, deadline)
                    if frame.kind is Kind.OK:
                        self.stats["forwarded"] += 1
                        h = frame.header
                        return Forwarded(h["first_id"], h["count"], h["offset"],
                                         h["end_offset"], partition)
                    code, message = frame.header.get("code"), frame.header.get("message", "")
                    if code != E_NOT_LEADER:
                        self.stats["forward_failed"] += 1
                        raise _refusal(code, f"forwarded to {leader}: {message}")
                    last = f"{leader}: {message}"
            if loop.time() + RETRY_S > deadline:
                self.stats["forward_failed"] += 1
                raise PartitionNotLed(None, detail=f"not forwarded within "
                                      f"{FORWARD_TIMEOUT_S:g} s: {last}")
            await asyncio.sleep(RETRY_S)

    async def _answer(self, sent: asyncio.Future, leader: str, deadline: float) -> Frame:
        """The leader's answer; NotCommitted when none comes (the request was sent)."""
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            return await asyncio.wait_for(asyncio.shield(sent), left)
        except TimeoutError:
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.stats["forward_failed"] += 1
            raise NotCommitted(f"forwarded to {leader}: no answer in {FORWARD_TIMEOUT_S:g} s; "
                               "it may still be written") from None
        except PeerError as e:
            self.stats["forward_failed"] += 1
            raise NotCommitted(f"forwarded to {leader}: {e}; it may still be written") from None

    async def close(self) -> None:
        await self.peers.close()


def _refusal(code: str | None, text: str) -> Exception:
    if code == E_UNKNOWN:
        return NotCommitted(text)
    if code == E_NOT_WRITABLE:
        return NotWritable(text)
    return RuntimeError(text)
