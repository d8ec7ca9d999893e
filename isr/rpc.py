"""`RpcServer`: the node's replication port (`--rpc-address`).

Each connection is an `asyncio.Protocol` (`_Connection`): frames are decoded in
`data_received`, with no reader task. Every request runs as its own task as soon as it is
read (so requests of many partitions on one connection overlap), and each answer is
written as soon as it is ready, with its request's id (a slow partition never holds back
another's answers; the order of one partition's PUSHes is kept by its FollowerLog). At
most `MAX_IN_FLIGHT` requests of a connection are unanswered: the frames beyond wait, and
it stops reading until they are taken; it also stops reading while its unsent answers
pass `MAX_UNSENT` (bounded memory). The first frame must be HELLO of this cluster and of
`wire.VERSION` (else E_BAD_CLUSTER / E_BAD_VERSION, and the connection is closed), within
HELLO_S of the connection (else it is dropped, so a client that connects and sends nothing
holds a descriptor for HELLO_S at most). A frame that does not decode or a request that does not check is answered with one ERROR
E_BAD_FRAME, then the connection is closed. PUSH and CHANNELS go to `host.follower_log`,
FETCH, EPOCH_END and JOIN to `host.leader_log` (absent: E_NOT_REPLICA / E_NOT_LEADER);
each answers with `(kind, header, payload)`. PUBLISH, a node's forwarded publish, goes to
`host.publish_forwarded(frame, answer)` straight from `data_received`, as a PUSH does. A PUSH whose FollowerLog is open goes to
`FollowerLog.push(frame, answer)` straight from `data_received` (no task, no future: the
hot path; `answer` is called once with its answer). A handler that raises answers
E_FAILED; the server never dies of a request. A handler runs to its end even if its
connection closes (a JOIN's CAS is never cut in half); `stop` cancels them.
"""

from __future__ import annotations

import asyncio
import collections

import structlog

from . import wire
from .wire import BadFrame, Decoder, Frame, Kind

HELLO_S = 10.0  # a connection's HELLO comes within this, or the connection is dropped
ARRIVAL_S = 0.5  # how long a request waits for its partition's side to open (< repl timeout)
log = structlog.get_logger("isr.rpc")

MAX_IN_FLIGHT = 256
MAX_UNSENT = 16 * 1024 * 1024

Answer = tuple[Kind, dict, bytes]


async def _arrival(lookup, topic: str, partition: int):
    """`lookup(topic, partition)`, waiting up to ARRIVAL_S for it: a node that has not applied
    the view yet (a topic just created, a leader just elected) is given the time to open its
    side before the request is refused (the leader would drop a follower for that)."""
    target = lookup(topic, partition)
    deadline = asyncio.get_running_loop().time() + ARRIVAL_S
    while target is None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
        target = lookup(topic, partition)
    return target


def _call(handler, frame: Frame, answer) -> None:
    """`handler(frame, answer)`, which calls `answer` once; E_FAILED if it raises."""
    try:
        handler(frame, answer)
    except Exception as e:  # noqa: BLE001 - a request never takes the server down
        log.warning("rpc_request_failed", kind=frame.kind.name, error=repr(e))
        answer(error(wire.E_FAILED, repr(e)))


def error(code: str, message: str, **extra) -> Answer:
    return Kind.ERROR, {"code": code, "message": message, **extra}, b""


FOLLOWER_KINDS = frozenset({Kind.PUSH, Kind.CHANNELS})


class RpcServer:
    """Serves the replication requests of peers to this node's partitions."""

    def __init__(self, host, address: str = "0.0.0.0:4250"):
        self.host = host
        self.address = address
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._early: dict[tuple[str, int], list] = {}  # PUSHes waiting for their replica
        self.port = 0

    async def start(self) -> None:
        h, _, p = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), h, int(p))
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("rpc_listening", address=f"{h}:{self.port}", version=wire.VERSION)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in list(self._connections):
            c.transport.abort()
        tasks = list(self._handlers)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _wait_for_replica(self, key, frame: Frame, answer) -> None:
        """A PUSH before its partition's FollowerLog opened: kept, with every later PUSH of
        that partition, in arrival order, until it opens (then handed over in that order)
        or ARRIVAL_S passed (then each refused, in that order): no push overtakes another."""
        early = self._early.get(key)
        if early is not None:
            early.append((frame, answer))
            return
        self._early[key] = [(frame, answer)]
        task = asyncio.ensure_future(self._hand_over(key))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _hand_over(self, key) -> None:
        try:
            follower = await _arrival(self.host.follower_log, *key)
        finally:
            waiting = self._early.pop(key, [])
        for frame, answer in waiting:
            if follower is None:
                answer(error(wire.E_NOT_REPLICA, f"no replica of {key[0]}/{key[1]}"))
            else:
                _call(follower.push, frame, answer)

    async def _dispatch(self, frame: Frame) -> Answer:
        h = frame.header
        try:
            if frame.kind is Kind.PING:
                return Kind.OK, {}, b""
            if frame.kind is Kind.HELLO:
                return error(wire.E_BAD_FRAME, "HELLO twice")
            if frame.kind in FOLLOWER_KINDS:
                target = await _arrival(self.host.follower_log, h["topic"], h["partition"])
                if target is None:
                    return error(wire.E_NOT_REPLICA, f"no replica of {h['topic']}/{h['partition']}")
            else:
                target = await _arrival(self.host.leader_log, h["topic"], h["partition"])
                if target is None:
                    return error(wire.E_NOT_LEADER, f"not the leader of {h['topic']}/{h['partition']}")
            return await target.handle(frame)
        except Exception as e:  # noqa: BLE001 - a request never takes the server down
            log.warning("rpc_request_failed", kind=frame.kind.name, error=repr(e))
            return error(wire.E_FAILED, repr(e))


class _Connection(asyncio.Protocol):
    """One peer's connection: decodes its requests as bytes arrive, writes each answer when
    it is ready (the answers ready in one turn of the loop in one write)."""

    def __init__(self, server: RpcServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = None
        self.decoder = Decoder()
        self.hello = False
        self.closing = False  # no more requests are taken (a bad frame, a refused HELLO)
        self.in_flight = 0  # requests taken, not answered
        self._waiting: collections.deque[Frame] = collections.deque()  # beyond MAX_IN_FLIGHT
        self._bad: BadFrame | None = None  # to answer once the frames before it are taken
        self._unsent: list[bytes] = []  # answers to write at the end of this loop turn
        self._writing_paused = False
        self._reading_paused = False
        self._hello_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        transport.set_write_buffer_limits(high=MAX_UNSENT)
        self.server._connections.add(self)
        self._hello_due = asyncio.get_running_loop().call_later(HELLO_S, self._no_hello)

    def connection_lost(self, exc) -> None:
        self.closing = True
        self._waiting.clear()
        self.server._connections.discard(self)
        if self._hello_due is not None:
            self._hello_due.cancel()

    def _no_hello(self) -> None:
        self._hello_due = None
        if not self.hello and not self.closing:
            log.warning("rpc_no_hello", peer=self.peer, within_s=HELLO_S)
            self.closing = True
            self.transport.abort()

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._reading()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            frames = self.decoder.feed(data)
        except BadFrame as e:
            frames, self._bad = e.frames, e
        self._waiting.extend(frames)
        self._take_waiting()

    def _take_waiting(self) -> None:
        """Take the frames that wait, while slots are free; then a bad frame's answer."""
        waiting = self._waiting
        while waiting and self.in_flight < MAX_IN_FLIGHT and not self.closing:
            self.in_flight += 1
            if not self._take(waiting.popleft()):
                self._close()
                return
        if not waiting and self._bad is not None and not self.closing:
            log.warning("rpc_bad_frame", peer=self.peer, reason=str(self._bad))
            self._answer(0, error(wire.E_BAD_FRAME, str(self._bad)), slot=False)
            self._close()
            return
        self._reading()

    def _reading(self) -> None:
        """Read while there are slots for what arrives and the answers are being sent."""
        if self.closing or self.transport.is_closing():
            return
        pause = bool(self._waiting) or self._writing_paused or self._bad is not None
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def _close(self) -> None:
        """Answer what is unsent, then close (after the transport's buffer is written)."""
        self.closing = True
        self._waiting.clear()
        self._flush()
        self.transport.close()

    def _take(self, frame: Frame) -> bool:
        """Answer one frame now or start its handler; False when the connection must close."""
        if not self.hello:
            return self._hello(frame)
        try:
            wire.check(frame)
        except BadFrame as e:
            log.warning("rpc_bad_frame", peer=self.peer, reason=str(e))
            self._answer(frame.rid, error(wire.E_BAD_FRAME, str(e)))
            return False
        if frame.kind is Kind.PUSH:  # the hot path: straight to its partition, no task
            h = frame.header
            key = (h["topic"], h["partition"])
            rid = frame.rid
            answer = lambda a: self._answer(rid, a)  # noqa: E731
            follower = self.server.host.follower_log(*key)
            early = self.server._early.get(key)
            if follower is None or early is not None:  # in arrival order behind the others
                self.server._wait_for_replica(key, frame, answer)
                return True
            _call(follower.push, frame, answer)
            return True
        if frame.kind is Kind.PUBLISH:  # a forwarded publish: answered when written, no task
            rid = frame.rid
            _call(self.server.host.publish_forwarded, frame, lambda a: self._answer(rid, a))
            return True
        task = asyncio.ensure_future(self.server._dispatch(frame))
        self.server._handlers.add(task)
        task.add_done_callback(lambda t: self._done(frame.rid, t))
        return True

    def _hello(self, frame: Frame) -> bool:
        """The first frame: HELLO of this wire version and this cluster, else refused."""
        if frame.kind is not Kind.HELLO:
            self._answer(frame.rid, error(wire.E_BAD_FRAME, "the first frame must be HELLO"))
            return False
        version = frame.header.get("version", 1)
        if version != wire.VERSION:
            log.warning("rpc_bad_version", peer=self.peer, version=version, ours=wire.VERSION,
                        node=frame.header.get("node"))
            self._answer(frame.rid, error(wire.E_BAD_VERSION, f"wire version {version!r}: this "
                                          f"node speaks version {wire.VERSION}",
                                          version=wire.VERSION))
            return False
        try:
            wire.check(frame)
        except BadFrame as e:
            self._answer(frame.rid, error(wire.E_BAD_FRAME, str(e)))
            return False
        cluster = self.server.host.cluster_id
        if frame.header["cluster"] != cluster:
            self._answer(frame.rid, error(wire.E_BAD_CLUSTER, f"this is cluster {cluster!r}"))
            return False
        self.hello = True
        if self._hello_due is not None:
            self._hello_due.cancel()
            self._hello_due = None
        self._answer(frame.rid, (Kind.OK, {"node": self.server.host.node_id,
                                           "version": wire.VERSION}, b""))
        return True

    def _done(self, rid: int, task: asyncio.Task) -> None:
        self.server._handlers.discard(task)
        if task.cancelled():
            self._release()
            return
        self._answer(rid, task.result())

    def _release(self) -> None:
        self.in_flight -= 1
        if self._waiting:
            self._take_waiting()

    def _answer(self, rid: int, answer: Answer, slot: bool = True) -> None:
        if not self.transport.is_closing():
            kind, header, payload = answer
            if not self._unsent:  # the answers ready in one turn of the loop go in one write
                asyncio.get_running_loop().call_soon(self._flush)
            self._unsent.append(wire.encode(kind, rid, header, payload))
        if slot:
            self._release()

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        if unsent and not self.transport.is_closing():
            self.transport.write(b"".join(unsent))
