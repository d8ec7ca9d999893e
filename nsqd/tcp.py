"""The TCP server: protocol V2 over asyncio, one ClientConnection per socket.

Bytes in go to the sans-I/O CommandParser; commands run in arrival order, one
at a time per connection, so responses keep the order of their commands.
Each command has one path: RDY, FIN, REQ, TOUCH, NOP and CLS run inline;
every publish (PUB, MPUB, DPUB, PUB_EXT, MPUB_EXT) runs `_publish`, which
checks, appends with a callback and is answered from it, up to MAX_PIPELINE
of them in flight, answered in order; IDENTIFY, AUTH and SUB run in a task
while later commands wait. Errors are sent as E_* frames; fatal ones close
the connection after the frame is written.

One connection runs at most TURN_BUDGET commands (and inflates at most one
INFLATE_STEP) per turn of the event loop, then yields with its reading
paused, so a flood of commands, compressed or not, costs other clients one
budget per turn. Reading is paused whenever whole commands may wait unrun.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, cast

import structlog

from diskqueue.errors import NotCommitted
from isr.leader import NotWritable
from nsqwire import errors, ext, protocol as p
from nsqwire.frames import encode_response
from nsqwire.ids import decode_msg_id, msg_id_partition
from .forward import PublishRequest
from .deadletters import reason_of
from .message import defer_ext
from .client import Client, TurnFlush
from . import replay
from .errors import (BadSequence, ClusterUnavailable, HalfFailed, PartitionNotFound,
                     PartitionNotLed, ProducersLoading, StorageError, TopicNotFound, answer,
                     tcp_error)
from .identify import IdentifyLimits, initial_settings, negotiate

log = structlog.get_logger("nsqd.tcp")

_PUBLISH = {p.Pub: "PUB", p.Mpub: "MPUB", p.Dpub: "DPUB", p.PubExt: "PUB_EXT",
            p.MpubExt: "MPUB_EXT", p.PubTrace: "PUB_TRACE", p.MpubTrace: "MPUB_TRACE"}
_TRACE_REPLY = ("PUB_TRACE", "MPUB_TRACE")  # answered with the first message's id and trace id
MAX_PIPELINE: Final = 64  # publishes of one connection in flight at once, answered in order
TURN_BUDGET: Final = 256  # commands one connection runs per turn of the event loop
INFLATE_STEP: Final = 256 * 1024  # deflate output taken per turn: a small read may inflate a lot


def identify_limits(nsqd, tls: ssl.SSLContext | None) -> IdentifyLimits:
    o = nsqd.options
    return IdentifyLimits(
        max_rdy_count=o.max_rdy_count, version=nsqd.version,
        max_heartbeat_interval_ms=o.max_heartbeat_interval_ms,
        max_output_buffer_size=o.max_output_buffer_size,
        min_output_buffer_timeout_ms=o.min_output_buffer_timeout_ms,
        max_output_buffer_timeout_ms=o.max_output_buffer_timeout_ms,
        msg_timeout_ms=o.msg_timeout_ms, max_msg_timeout_ms=o.max_msg_timeout_ms,
        max_deflate_level=o.max_deflate_level, tls_available=tls is not None,
        snappy_available=o.snappy and _snappy_installed(), deflate_available=o.deflate,
        auth_required=bool(o.auth_http_address))


def _snappy_installed() -> bool:
    try:
        import snappy  # noqa: F401
    except ImportError:
        return False
    return True


class _Publish:
    """One publish of a connection, from its command until its answer: answers leave in
    command order, so each waits in `ClientConnection._publishing` until every one before
    it is answered. Called by the log (or the forwarder) with (appended, error) once it is
    written; `here`: it is written by this node (a forwarded one is its leader's to count
    and trace)."""

    __slots__ = ("conn", "done", "error", "topic", "bodies", "command", "trace_id",
                 "trace_ids", "appended", "here")

    def __init__(self, conn: ClientConnection, topic: Any, bodies: Sequence[bytes],
                 command: str, trace_id: int, trace_ids: Any) -> None:
        self.conn = conn
        self.done = False
        self.error: BaseException | None = None
        self.topic = topic
        self.bodies = bodies
        self.command = command
        self.trace_id = trace_id
        self.trace_ids = trace_ids
        self.appended: Any = None
        self.here = True

    def __call__(self, appended: Any, error: BaseException | None) -> None:
        self.done, self.error, self.appended = True, error, appended
        self.conn._published(self)


class ClientConnection(asyncio.Protocol):
    INIT: Final = 0
    SUBSCRIBED: Final = 1
    CLOSING: Final = 2
    _ALLOWED_STATES: ClassVar[dict[str, tuple[int, ...]]] = {**dict.fromkeys(("IDENTIFY", "AUTH", "SUB", "SUB_ORDERED", "SUB_ADVANCED"),
                                       (INIT,)),
                       **dict.fromkeys(("RDY", "FIN", "REQ", "TOUCH"), (SUBSCRIBED, CLOSING)),
                       "CLS": (SUBSCRIBED,)}

    def __init__(self, nsqd, limits: IdentifyLimits, tls: ssl.SSLContext | None = None,
                 turn_flush: TurnFlush | None = None):
        self.nsqd = nsqd
        self.tls_context = tls  # IDENTIFY's upgrade (tls_context); None without --tls-cert
        self.turn_flush = turn_flush  # the server's: answers leave once per turn of the loop
        o = nsqd.options
        # DPUB's limit (ours) is --max-req-timeout, checked by the parser.
        self.parser = p.CommandParser(max_msg_size=o.max_msg_size, max_body_size=o.max_body_size,
                                      max_defer_ms=o.max_req_timeout_ms,
                                      state_check=self._state_check)
        self.busy = False  # an awaited step runs (IDENTIFY, AUTH, SUB; a publish's await)
        self._held: p.Command | errors.ProtocolError | None = None  # a command (or parser error) that answers after the publishes
        self._publishing: deque[_Publish] = deque()  # in command order
        self._loading: Any = None  # the Partition whose producer table a publish waits for
        self._finished: list = []  # messages FIN'd in this run: handed to the channel at once
        # the loop's handles are Any: uvloop's Handle and TimerHandle are no asyncio.Handle,
        # and a compiled attribute checks its type on every assignment
        self._turn: Any = None  # the next turn of work (a Handle), when one is due
        self.state = self.INIT
        self.transport: Any = None  # uvloop's, asyncio's or a test's: duck-typed
        self.client: Client | None = None
        self.limits = limits
        self._decompress: Callable[[bytes], bytes] | None = None  # snappy: a stream's decompress(data)
        self._inflater: Any = None  # deflate: a zlib decompressobj, inflated in bounded steps
        self._deflated = b""  # deflate input not inflated yet
        self._last_read = time.monotonic()
        self._heartbeat: Any = None
        self._read_deadline: Any = None  # nsqd's read deadline: 2 heartbeat intervals of silence
        self._parser_dead = False  # no more commands run (a fatal error was met)
        self._backlog = False  # whole commands may wait unrun: reading paused until they run
        self._write_blocked = False  # the client reads slower than we write: reading paused
        self._reading = True
        self._eof = False  # the client half-closed: close once its commands are answered
        self._write_watch: Any = None  # while writing is paused: the progress check

    # ---- transport events ------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("", 0)
        host = str(peer[0])
        self.client = Client(self.nsqd.next_client_id(), f"{host}:{peer[1]}",
                             initial_settings(self.limits, host, host), self.turn_flush)
        self.client.attach(transport)
        self.nsqd.connections.add(self)
        self._schedule_heartbeat()

    def connection_lost(self, exc) -> None:
        self.nsqd.connections.discard(self)
        self.client.flush()  # nothing can go out now; this stops its flush timer
        for handle in (self._heartbeat, self._read_deadline, self._write_watch, self._turn):
            if handle is not None:
                handle.cancel()
        self._turn = None
        for channel in list(self.client.channels.values()):
            self.client.unsubscribe(channel)
            self.nsqd.client_left(channel)
        self._held = None

    def pause_writing(self) -> None:
        self.client.writable = False  # the channel hands it nothing more until it drains
        # A client that does not read must not make us buffer answers to what it keeps
        # sending: stop reading it (and inflating what it sent) until it reads.
        self._write_blocked = True
        self._update_reading()
        # nsqd drops a client whose write makes no progress for one heartbeat interval
        # (its write deadline); so do we, or a consumer that never reads would hold its
        # messages and our memory forever.
        self._check_write_progress(-1)

    def resume_writing(self) -> None:
        self.client.writable = True
        self._write_blocked = False
        self._update_reading()
        if self._deflated:
            self._again()
        self.client.wake_channels()
        if self._write_watch is not None:
            self._write_watch.cancel()
            self._write_watch = None

    def _update_reading(self) -> None:
        want = not (self._backlog or self._write_blocked)
        if want == self._reading or self.transport.is_closing():
            return
        self._reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def _check_write_progress(self, sent_before: int) -> None:
        self._write_watch = None
        sent = self.client.bytes_out - self.transport.get_write_buffer_size()
        if sent == sent_before:
            log.info("write_stalled", client=self.client.remote_address)
            self.transport.abort()
            return
        interval = self.client.settings.heartbeat_interval_ms
        if interval > 0:  # no heartbeats: no deadline, as in nsqd
            self._write_watch = asyncio.get_running_loop().call_later(
                interval / 1000, self._check_write_progress, sent)

    def eof_received(self) -> bool:
        # Like nsqd, a client that half-closes still gets the answer to every command
        # it sent; _work closes the connection once the last one has run.
        self._eof = True
        self._work()
        return not self.client.tls  # an SSL transport cannot stay half-open

    def data_received(self, data: bytes) -> None:
        self._last_read = time.monotonic()
        if self._parser_dead:
            return
        if self._inflater is not None:
            self._deflated += data  # inflated in steps by _work
        elif self._decompress is not None:
            try:
                self.parser.feed(self._decompress(data))
            except Exception:
                self._fail(errors.ProtocolError("E_BAD_BODY", "failed to decompress"))
                return
        else:
            self.parser.feed(data)
        self._work()

    def _inflate_step(self) -> bool:
        """Inflate at most INFLATE_STEP bytes of what waits into the parser (a few KiB of
        deflate can hold gigabytes of commands); False if the stream is bad."""
        try:
            data = self._inflater.decompress(self._deflated, INFLATE_STEP)
        except zlib.error:
            self._fail(errors.ProtocolError("E_BAD_BODY", "failed to decompress"))
            return False
        self._deflated = self._inflater.unconsumed_tail
        self.parser.feed(data)
        return True

    def _state_check(self, name: str) -> None:
        """nsqd checks the state before the arguments: "RDY abc" before SUB is "cannot RDY
        in current state". Runs at parse time; a command is parsed only once every command
        before it that can change the state (IDENTIFY, AUTH, SUB, CLS) has run. The
        handlers check the state again when the command runs."""
        allowed = self._ALLOWED_STATES.get(name)  # None: any state (PUB & co)
        if allowed is not None and self.state not in allowed:
            raise errors.invalid_state(name)

    def close(self) -> None:
        if self.transport is not None:
            self.client.flush()  # answers given in this turn go out before the close
            self.transport.close()

    def _fail(self, err: errors.ProtocolError) -> None:
        self.client.write(err.frame)
        if err.fatal:
            self._parser_dead = True
            self._held = None
            self.transport.close()

    def _fail_in_order(self, err: errors.ProtocolError) -> None:
        """Send an error after the answers of the publishes still in flight; a fatal one
        stops every later command at once."""
        if not self._publishing:
            self._fail(err)
            return
        failed = _Publish(self, None, (), "", 0, None)
        failed.done, failed.error, failed.here = True, err, False
        self._publishing.append(failed)
        if err.fatal:
            self._parser_dead = True
            self._held = None

    # ---- running commands ------------------------------------------------

    def _again(self) -> None:
        if self._turn is None:
            self._turn = asyncio.get_running_loop().call_soon(self._work)

    def _work(self) -> None:
        """Run the client's commands in order: at most TURN_BUDGET, then yield the loop.

        Stops while an awaited step runs, and holds a command that must answer after the
        publishes in flight (or waits for room in the pipeline). Reading stays paused
        while whole commands may wait in the parser, so the parser holds at most a read's
        worth (or one INFLATE_STEP) beyond what runs."""
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        budget = TURN_BUDGET
        inflated = False
        transport = self.transport
        while not self.busy and not self._parser_dead and not transport.is_closing():
            cmd = self._held
            if cmd is not None:
                self._held = None
            else:
                if budget <= 0:
                    self._again()
                    break
                try:
                    if self.state != self.INIT and not self._publishing:
                        ids = self.parser.next_fins(budget)  # a run of FIN lines, read at once
                        if ids:
                            budget -= len(ids)
                            self._finish(ids)
                            continue
                    cmd = self.parser.next_command()
                except errors.ProtocolError as e:
                    cmd = e
                if cmd is None:
                    if not self._deflated or self._write_blocked:
                        break  # the parser needs more bytes
                    if inflated:
                        self._again()
                        break
                    inflated = True
                    if not self._inflate_step():
                        break
                    continue
                budget -= 1
            kind = type(cmd)
            if kind in _PUBLISH:
                if len(self._publishing) >= MAX_PIPELINE:
                    self._held = cmd
                    break
                try:
                    if not self._publish(cmd):
                        self._run_async(self._publish_after(cmd))
                except errors.ProtocolError as e:
                    self._fail_in_order(e)
                continue
            if self._publishing:
                self._held = cmd  # its answer must follow the answers of the publishes
                break
            if kind is errors.ProtocolError:
                self._fail(cast(errors.ProtocolError, cmd))
                continue
            handler = _INLINE_HANDLERS.get(kind)
            if handler is not None:
                try:
                    handler(self, cmd)
                except errors.ProtocolError as e:
                    self._fail(e)
                continue
            self._run_async(_ASYNC_HANDLERS[kind](self, cmd))
        if self._finished:
            done, self._finished = self._finished, []
            self.client.finish_count += len(done)
            self.client.finish(done)
        backlog = self._backlog = self.busy or self._held is not None or self._turn is not None
        if (backlog or self._write_blocked) == self._reading:  # reading is not as it should be
            self._update_reading()
        if (self._eof and not self._backlog and not self._publishing and not self._deflated
                and not transport.is_closing()):
            self.client.flush()  # the answers of this turn go first
            transport.close()

    def _run_async(self, step) -> None:
        """Run an awaited step (a coroutine) while later commands wait, then go on."""
        self.busy = True
        asyncio.get_running_loop().create_task(self._awaited(step))

    async def _awaited(self, step) -> None:
        try:
            await step
        except errors.ProtocolError as e:
            self._fail_in_order(e)
        except Exception as e:  # a bug must cost one connection, never the server
            log.exception("command_failed")
            self._fail_in_order(errors.ProtocolError("E_INVALID", f"internal error: {e}"))
        finally:
            self.busy = False
        self._work()

    # ---- publishing: one path for PUB, MPUB, DPUB, PUB_EXT, MPUB_EXT -----

    def _publish(self, cmd, fresh_auth: bool = False, waited: bool = False) -> bool:
        """Every publish: the rules (TLS, auth, the topic), then one write request to the
        partition's log through Topic.publish (HTTP's too), written whole or not at all;
        its callback answers, in command order. Returns False, having appended nothing,
        when an await must come first (a missing topic, an authorization whose ttl passed,
        a leadership here still starting, unless `waited` for it): see `_publish_after`."""
        command = _PUBLISH[type(cmd)]
        nsqd = self.nsqd
        o = nsqd.options
        if o.tls_required and not self.client.tls:
            raise errors.tls_required(command)
        if o.auth_http_address and not self._authorized(command, cmd.topic, "", fresh_auth):
            return False
        topic = nsqd.topics.get(cmd.topic)
        if topic is None or not nsqd.serving.is_set():
            return False
        kind = type(cmd)
        trace_id, extension, producer = 0, b"", None
        trace_ids: Any = None
        exts: Any = None
        bodies: list[bytes]
        if kind is p.Pub:
            bodies = [cmd.body]
        elif kind is p.Mpub:
            bodies = cmd.bodies
        elif kind is p.MpubExt:
            bodies = [body for _, body in cmd.messages]
            trace_ids, exts = zip(*[ext.stored(header) for header, _ in cmd.messages])
            producer = cmd.producer
        elif kind is p.MpubTrace:
            trace_ids, traced = zip(*cmd.messages)
            bodies, exts, trace_id = list(traced), [b""] * len(traced), trace_ids[0]
        else:
            bodies = [cmd.body]
            if kind is p.Dpub:
                extension = defer_ext(cmd.defer_ms, nsqd.clock())
            elif kind is p.PubExt:
                trace_id, extension = ext.stored(cmd.header)
                producer = cmd.producer
            elif kind is p.PubTrace:
                trace_id = cmd.trace_id
        pub = _Publish(self, topic, bodies, command, trace_id, trace_ids)
        try:
            topic.publish(bodies, cmd.partition, extension, trace_id=trace_id,
                          trace_ids=trace_ids, exts=exts, producer=producer, callback=pub)
        except PartitionNotLed as e:
            forwarder = nsqd.cluster.forwarder if nsqd.cluster is not None else None
            if forwarder is None or cmd.partition is not None:
                if forwarder is not None:
                    forwarder.named(cmd.topic, e)
                raise tcp_error(command, e, cmd.partition) from None
            pub.here = False  # a leader writes it; its answer comes as a local one's does
            forwarder.send(cmd.topic, PublishRequest(bodies, extension, trace_id, trace_ids, exts,
                                                     producer),
                           self.client.remote_address, pub)
        except ProducersLoading as e:
            self._loading = e.partition
            return False
        except (BadSequence, NotCommitted) as e:  # a producer's retry refused, or not yet known
            raise tcp_error(command, e) from None
        except (PartitionNotFound, NotWritable) as e:
            if not waited and topic.starting(cmd.partition):
                return False
            raise tcp_error(command, e, cmd.partition) from None
        except Exception as e:  # a closed or failed log, a message too big for a record
            raise errors.publish_failed(command, str(e)) from None
        self._publishing.append(pub)
        if o.test_ack_before_sync:  # the broken build: OK now, whatever the write does
            pub(None, None)
        return True

    async def _publish_after(self, cmd) -> None:
        """What a publish awaits before `_publish` can take it: a cluster node's first view
        of etcd (NSQD.serving), the auth server asked again, the topic made, its leadership
        here started (bounded: NSQD.until_led), the partition's producer table read
        (Partition.load_producers). Later commands wait meanwhile."""
        fresh_auth = waited = False
        while True:
            if not self.nsqd.serving.is_set():
                await self.nsqd.serving.wait()
            if self.nsqd.options.auth_http_address and not fresh_auth and self._auth_expired():
                await self._ask_auth_server(self.client.auth_secret)
                fresh_auth = True
            elif cmd.topic not in self.nsqd.topics:
                await self._made_topic(cmd.topic, _PUBLISH[type(cmd)])
            elif not waited and (topic := self.nsqd.topics[cmd.topic]).starting(cmd.partition):
                await self.nsqd.until_led(topic, cmd.partition)
                waited = True
            elif self._loading is not None:  # an idempotent producer's first request here
                loading, self._loading = self._loading, None
                try:
                    await loading.load_producers()
                except Exception as e:  # its log could not be read: this publish fails
                    log.error("producers_unread", topic=cmd.topic, error=str(e))
                    raise errors.publish_failed(_PUBLISH[type(cmd)], f"the partition's "
                                                f"producers could not be read: {e}") from None
            if self._publish(cmd, fresh_auth, waited):
                return

    async def _made_topic(self, name: str, command: str):
        """The topic a publishing command names, made here (or in etcd) when missing."""
        try:
            topic = await self.nsqd.get_topic(name)
        except ClusterUnavailable as e:  # cluster mode: etcd could not make it
            raise errors.ProtocolError("E_TOPIC_NOT_EXIST", f"topic {name} does not exist: "
                                       f"{e}", fatal=False) from None
        except Exception as e:  # the topic could not be made (disk full, ...)
            log.error("topic_create_failed", topic=name, error=str(e))
            raise errors.publish_failed(command, str(e)) from None
        if topic is None:  # --disable-auto-create
            raise errors.topic_not_exist(name, command)
        return topic

    def _published(self, pub: _Publish) -> None:
        """A publish's append is done: answer every publish now done at the head, in order.
        Their OKs leave in one write: at once when no other publish of this connection is in
        flight, else at the end of the loop's turn (`Client.answer`), with the OKs of the
        others that this turn answers (pipelined publishes written by one batch)."""
        appended = pub.appended
        if pub.error is None and appended is not None:
            if appended.duplicate:
                pub.here = False  # written before: nothing new to trace or count here
            elif pub.here and pub.topic.trace is not None:  # a forwarded one: its leader's
                pub.topic.trace.published(pub.topic, appended, pub.trace_id, pub.trace_ids,
                                          self.client.remote_address)
        publishing = self._publishing
        oks = 0
        while publishing and publishing[0].done:
            pub = publishing.popleft()
            if pub.error is not None:
                if oks:
                    self.client.answer(p.OK * oks)  # they go first: `_fail` writes after them
                    oks = 0
                exc = pub.error
                err = (exc if isinstance(exc, errors.ProtocolError)
                       else tcp_error(pub.command, exc)
                       if isinstance(exc, (NotWritable, NotCommitted, PartitionNotLed))
                       else errors.publish_failed(pub.command, str(exc)))
                self._fail(err)
                if err.fatal:
                    publishing.clear()
                    return
                continue
            topic = pub.topic
            if pub.here:
                topic.count_published(pub.bodies)
            self._count_published(topic, len(pub.bodies))
            if pub.command in _TRACE_REPLY and pub.appended is not None:
                appended = pub.appended  # OK, id, trace id, offset, size
                self.client.answer(p.OK * oks + p.encode_response(p.pub_trace_reply(
                    appended.first_id, pub.trace_id, appended.offset,
                    appended.end_offset - appended.offset)))
                oks = 0
                continue
            oks += 1
        if oks:
            if publishing:
                self.client.answer(p.OK * oks)
            else:
                self.client.write(p.OK * oks)  # after any answers buffered earlier in the turn
        if self._backlog or self._eof:  # else the parser waits for bytes: nothing to run
            self._work()

    def _count_published(self, topic, count: int) -> None:
        counts = self.client.pub_counts
        counts[topic.name] = counts.get(topic.name, 0) + count

    # ---- heartbeats ------------------------------------------------------

    def _schedule_heartbeat(self) -> None:
        interval = self.client.settings.heartbeat_interval_ms
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        if interval > 0:
            self._heartbeat = asyncio.get_running_loop().call_later(
                interval / 1000, self._on_heartbeat)
        self._check_read_deadline()

    def _on_heartbeat(self) -> None:
        self.client.write(p.HEARTBEAT)
        self._schedule_heartbeat()

    def _check_read_deadline(self) -> None:
        """Drop a client two heartbeat intervals after the last byte it sent, as nsqd's
        read deadline does (checking only at heartbeat ticks let a silent client live
        up to three intervals)."""
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        interval = self.client.settings.heartbeat_interval_ms / 1000
        if interval <= 0 or self.transport is None or self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        remaining = self._last_read + 2 * interval - time.monotonic()
        if remaining <= 0 and (self.busy or not self._reading or self._publishing):
            # We are the slow side (a command still runs, or reading is paused behind
            # queued ones): nsqd only arms its deadline when it reads again.
            self._last_read = time.monotonic()
            remaining = 2 * interval
        if remaining > 0:
            self._read_deadline = loop.call_later(remaining, self._check_read_deadline)
            return
        # Like nsqd, a silent client still gets the heartbeat due at its deadline
        # (reference case "heartbeat": two heartbeats, then the close).
        tick = self._heartbeat
        if tick is not None and tick.when() - loop.time() < 0.1 * interval:
            tick.cancel()
            self._heartbeat = None
            self.client.write(p.HEARTBEAT)
        log.info("heartbeat_missed", client=self.client.remote_address)
        self.transport.abort()  # as nsqd: unsent data is dropped, not waited for

    # ---- commands: state and consumption (inline) ------------------------

    def _rdy(self, cmd: p.Rdy) -> None:
        if self.state == self.CLOSING:
            return  # classic nsqd ignores RDY while closing
        if self.state != self.SUBSCRIBED:
            raise errors.invalid_state("RDY")
        if not 0 <= cmd.count <= self.nsqd.options.max_rdy_count:
            raise errors.rdy_out_of_range(cmd.count, self.nsqd.options.max_rdy_count)
        self.client.ready_count = cmd.count
        if cmd.count <= len(self.client.in_flight):
            self.client.flush()  # it takes no more for now: what waits for it goes out
        self.client.wake_channels()

    def _in_flight(self, name: str, raw_id: bytes, failed):
        if self.state not in (self.SUBSCRIBED, self.CLOSING):
            raise errors.invalid_state(name)
        msg = self.client.in_flight.get(raw_id)  # keyed by the id bytes we sent
        if msg is None:
            raise self._not_in_flight(name, raw_id, failed)
        return msg

    def _not_in_flight(self, name: str, raw_id: bytes, failed) -> errors.ProtocolError:
        """The error for an id not in flight here: E_FAILED_ON_NOT_LEADER (fatal, as in
        Youzan's nsqd) when its partition is one of the topic's that this node no longer
        leads (its messages left this client when it was taken away); else `failed`."""
        topic = self.nsqd.topics.get(self.client.topic_name)
        try:
            number = msg_id_partition(decode_msg_id(raw_id))
        except ValueError:
            return failed(raw_id)
        if (topic is not None and topic.assignment.in_range(number)
                and number not in topic.assignment.leading):
            return errors.not_leader(name)
        return failed(raw_id)

    def _fin(self, cmd: p.Fin) -> None:
        self._finish((cmd.msg_id,))

    def _finish(self, ids) -> None:
        """FIN, the one path for one id or a run of them: each message leaves the client's
        in-flight table now (an id not in it gets E_FIN_FAILED, not fatal); the channel
        takes every message finished in a turn at once, at the end of `_work`."""
        if self.state not in (self.SUBSCRIBED, self.CLOSING):
            raise errors.invalid_state("FIN")
        in_flight = self.client.in_flight  # keyed by the id bytes we sent
        finished = self._finished
        for raw_id in ids:
            msg = in_flight.pop(raw_id, None)
            if msg is None:
                self._fail(self._not_in_flight("FIN", raw_id, errors.fin_failed))
            else:
                finished.append(msg)

    def _req(self, cmd: p.Req) -> None:
        msg = self._in_flight("REQ", cmd.msg_id, errors.req_failed)
        del self.client.in_flight[msg.wire_id]
        self.client.requeue_count += 1
        delay = min(max(cmd.timeout_ms, 0), self.nsqd.options.max_req_timeout_ms)
        self.client.channel_of(msg).requeue(msg, delay, reason_of(cmd.reason))

    def _touch(self, cmd: p.Touch) -> None:
        msg = self._in_flight("TOUCH", cmd.msg_id, errors.touch_failed)
        self.client.touch(msg, time.monotonic(), self.nsqd.options.max_msg_timeout_ms / 1000)

    def _cls(self, cmd: p.Cls) -> None:
        if self.state != self.SUBSCRIBED:
            raise errors.invalid_state("CLS")
        self.state = self.CLOSING
        self.client.ready_count = 0
        self.client.write(p.CLOSE_WAIT)

    def _nop(self, cmd: p.Nop) -> None:
        pass


    # ---- commands: identify, auth, subscribe (awaited) --------------------

    async def _identify(self, cmd: p.Identify) -> None:
        if self.state != self.INIT:
            raise errors.invalid_state("IDENTIFY")
        settings, reply = negotiate(cmd.body, self.limits, self.client.settings)
        self.client.settings = settings
        self.client.write(p.encode_response(reply))
        self._schedule_heartbeat()
        if settings.tls_v1:
            await self._upgrade_tls()
            self.client.write(p.OK)
        if settings.snappy:
            import snappy

            stream = snappy.StreamDecompressor()
            self._decompress = stream.decompress
            self.client.use_snappy()
            self.client.write(p.OK)
        elif settings.deflate:
            self._inflater = zlib.decompressobj(-15)
            self.client.use_deflate(settings.deflate_level)
            self.client.write(p.OK)

    async def _upgrade_tls(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport.pause_reading()
        transport = await loop.start_tls(self.transport, self,
                                         cast(ssl.SSLContext, self.tls_context),
                                         server_side=True)
        self.transport = transport
        self.client.attach(transport)
        self.client.tls = True

    async def _auth(self, cmd: p.Auth) -> None:
        if not self.nsqd.options.auth_http_address:
            raise errors.auth_disabled()
        if self.client.authorizations is not None:
            raise errors.auth_already_set()
        result = await self._ask_auth_server(cmd.secret)
        if not result.authorizations:
            raise errors.auth_no_authorizations()
        self.client.write(p.encode_response(json.dumps({
            "identity": result.identity, "identity_url": result.identity_url,
            "permission_count": len(result.authorizations)}).encode()))

    async def _ask_auth_server(self, secret: bytes):
        from .auth import authenticate

        result = await authenticate(self.nsqd.options.auth_http_address,
                                    self.client.remote_address.rsplit(":", 1)[0],
                                    self.client.tls, secret)
        if result is None:
            raise errors.auth_failed()
        c = self.client
        c.authorizations, c.auth_identity = result.authorizations, result.identity
        c.auth_secret, c.auth_expires = secret, time.monotonic() + result.ttl_s
        return result

    def _auth_expired(self) -> bool:
        return time.monotonic() >= self.client.auth_expires

    def _authorized(self, command: str, topic: str, channel: str = "",
                    fresh: bool = False) -> bool:
        """The auth rules (with --auth-http-address): raises when refused; False when the
        authorization's ttl passed (unless `fresh`: just asked) and the auth server must
        be asked again first."""
        c = self.client
        if c.authorizations is None:
            raise errors.auth_first(command)
        if not fresh and self._auth_expired():
            return False
        from .auth import allowed

        permission = "subscribe" if channel else "publish"
        if not allowed(c.authorizations, topic, channel, permission):
            raise errors.unauthorized(command, topic, channel)
        return True

    async def _sub(self, cmd: p.Sub | p.SubOrdered | p.SubAdvanced) -> None:
        """SUB, SUB_ORDERED (which makes the channels ordered: nsqd/ordered.py) and
        SUB_ADVANCED."""
        ordered = type(cmd) is p.SubOrdered
        if self.state != self.INIT:
            raise errors.invalid_state("SUB")
        if self.client.settings.heartbeat_interval_ms <= 0:  # as nsqd: no SUB without heartbeats
            raise errors.heartbeats_disabled()
        if self.nsqd.options.tls_required and not self.client.tls:
            raise errors.tls_required("SUB")
        if (self.nsqd.options.auth_http_address
                and not self._authorized("SUB", cmd.topic, cmd.channel)):
            await self._ask_auth_server(self.client.auth_secret)
            self._authorized("SUB", cmd.topic, cmd.channel, fresh=True)
        try:
            channels = await self.nsqd.subscription(cmd.topic, cmd.channel, cmd.partition)
            if isinstance(cmd, p.SubAdvanced) and await replay.start_first(self.nsqd, cmd, channels):
                channels = await self.nsqd.subscription(cmd.topic, cmd.channel, cmd.partition)
        except (TopicNotFound, PartitionNotFound, PartitionNotLed) as e:
            raise tcp_error("SUB", e, cmd.partition) from None
        except StorageError as e:  # a full disk, or a partition that does not serve
            raise errors.sub_failed(str(e)) from None
        # No await from here on: `channels` is what the node serves now (NSQD.subscription).
        if not ordered and self.nsqd.topics[cmd.topic].assignment.ordered:
            raise errors.sub_order_is_must()
        client = self.client
        client.topic_name, client.channel_name = cmd.topic, cmd.channel
        client.all_partitions = cmd.partition is None
        client.frame_offsets = isinstance(cmd, p.SubAdvanced)
        for channel in channels.values():
            if ordered:
                channel.set_ordered(True)
            client.subscribe(channel)
        self.state = self.SUBSCRIBED
        client.write(p.OK)

    def lose_partition(self) -> None:
        """The one partition this client consumed is no longer led here (NSQD's
        apply_assignment took it out of the client): E_FAILED_ON_NOT_LEADER, then close."""
        self._fail(errors.not_leader("SUB"))

    # ---- commands: half messages (awaited; nsqd/halves.py) ----------------------

    async def _half(self, cmd: p.Half) -> None:
        """HALF topic partition check_url + body: answered `OK <16 hex id>` once written."""
        part = await self._half_partition("HALF", cmd.topic, cmd.partition)
        try:
            appended = await part.halves.publish(cmd.body, cmd.check_url)
        except Exception as e:  # not written, or its outcome unknown: the producer may retry
            raise _half_error("HALF", e, part.number) from None
        self.client.write(encode_response(b"OK %016x" % appended.first_id))

    async def _decide(self, cmd: p.Decide) -> None:
        """COMMIT topic id / ROLLBACK topic id: answered `OK` once the decision is written
        (or was)."""
        name = "COMMIT" if cmd.commit else "ROLLBACK"
        try:
            msg_id = decode_msg_id(cmd.msg_id)
        except ValueError:
            raise errors.invalid_msg_id() from None
        part = await self._half_partition(name, cmd.topic, msg_id_partition(msg_id))
        try:
            await part.halves.decide(msg_id, cmd.commit)
        except Exception as e:
            raise _half_error(name, e, part.number) from None
        self.client.write(p.OK)

    async def _half_partition(self, command: str, topic_name: str, number: int | None):
        """The writable partition led here that a half command names (None: any), after a
        publish's rules (TLS, auth; HALF makes a missing topic); E_FAILED_ON_NOT_LEADER
        (non-fatal) when there is none."""
        nsqd = self.nsqd
        if not nsqd.serving.is_set():
            await nsqd.serving.wait()
        if nsqd.options.tls_required and not self.client.tls:
            raise errors.tls_required(command)
        if nsqd.options.auth_http_address and not self._authorized(command, topic_name):
            await self._ask_auth_server(self.client.auth_secret)
            self._authorized(command, topic_name, "", True)
        topic = nsqd.topics.get(topic_name)
        if topic is None and command == "HALF":
            topic = await self._made_topic(topic_name, command)
        if topic is not None and topic.starting(number):
            await nsqd.until_led(topic, number)
        led = [] if topic is None else [
            part for n, part in topic.partitions.items()
            if part.writable and number in (None, n)]
        if led:
            return random.choice(led)
        raise tcp_error(command, PartitionNotLed(number), number)



# The handlers of the commands that are not publishes, by command type: inline ones run in
# `_work`; awaited ones run in a task while later commands wait. Module tables (a compiled
# class's body holds no table of its own methods).
_INLINE_HANDLERS: Final[dict[type, Callable[[ClientConnection, Any], None]]] = {
    p.Rdy: ClientConnection._rdy, p.Fin: ClientConnection._fin,
    p.Req: ClientConnection._req, p.Touch: ClientConnection._touch,
    p.Cls: ClientConnection._cls, p.Nop: ClientConnection._nop}
_ASYNC_HANDLERS: Final[dict[type, Callable[[ClientConnection, Any], Any]]] = {
    p.Identify: ClientConnection._identify, p.Auth: ClientConnection._auth,
    p.Sub: ClientConnection._sub, p.SubOrdered: ClientConnection._sub,
    p.SubAdvanced: ClientConnection._sub, p.Half: ClientConnection._half,
    p.Decide: ClientConnection._decide}


def _half_error(command: str, e: Exception, partition: int) -> errors.ProtocolError:
    """The error frame of a half command that raised `e`: the table's (nsqd/errors.py),
    else E_HALF_FAILED with its text."""
    if answer(e) is None:
        e = HalfFailed((str(e) or type(e).__name__)[:200])
    return tcp_error(command, e, partition)


async def start_tcp(nsqd, tls: ssl.SSLContext | None = None):
    """Listen on --tcp-address; `tls`: the context a client's IDENTIFY upgrades with
    (tls_context: main.build makes it before the node opens anything). Returns the server
    and its port."""
    host, port = nsqd.options.tcp_host_port
    loop = asyncio.get_running_loop()
    turn_flush = TurnFlush()
    limits = identify_limits(nsqd, tls)
    # Any: uvloop's Server.sockets is a list, typeshed's a tuple (a compiled read checks it)
    server: Any = await loop.create_server(
        lambda: ClientConnection(nsqd, limits, tls, turn_flush), host, port, reuse_address=True)
    return server, server.sockets[0].getsockname()[1]


# --tls-min-version; Python's ssl has no SSL 3.0, so its oldest is the closest.
_TLS_MINIMUM = {"ssl3.0": ssl.TLSVersion.MINIMUM_SUPPORTED, "tls1.0": ssl.TLSVersion.TLSv1,
                "tls1.1": ssl.TLSVersion.TLSv1_1, "tls1.2": ssl.TLSVersion.TLSv1_2,
                "tls1.3": ssl.TLSVersion.TLSv1_3}


def tls_context(options) -> ssl.SSLContext | None:
    if not options.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(options.tls_cert, options.tls_key)
    if options.tls_root_ca_file:
        ctx.load_verify_locations(options.tls_root_ca_file)
    ctx.minimum_version = _TLS_MINIMUM[options.tls_min_version]
    if options.tls_client_auth_policy == "require":
        # Classic asks for any certificate and checks nothing; Python's ssl cannot require
        # a certificate without verifying it, so this asks for one and checks what comes.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    elif options.tls_client_auth_policy == "require-verify":
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
