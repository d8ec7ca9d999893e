"""The TCP server: protocol V2 over asyncio, one ClientConnection per socket.

Bytes in go to the sans-I/O CommandParser; commands run in arrival order, one
at a time per connection, so responses keep the order of their commands.
Commands that need no waiting (RDY, FIN, REQ, TOUCH, NOP) run inline from
`data_received`; the others (IDENTIFY upgrades, AUTH, SUB, PUB, MPUB, DPUB)
run in a task while later commands wait in `pending`. Errors are sent as
E_* frames; fatal ones close the connection after the frame is written.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import time
import zlib
from collections import deque

import structlog

from nsqwire import errors, protocol as p
from .channel import defer_ext
from .client import Client
from .identify import IdentifyLimits, initial_settings, negotiate
from .topic import PartitionNotFound, StorageError

log = structlog.get_logger("nsqd.tcp")

_PUB_COMMANDS = {p.Pub: "PUB", p.Mpub: "MPUB", p.Dpub: "DPUB"}
MAX_PIPELINE = 64  # publishes of one connection in flight at once, answered in order

MAX_PENDING = 256  # commands queued behind a slow one before reading pauses
INFLATE_STEP = 256 * 1024  # deflate output taken per step: a small read may inflate a lot


def identify_limits(nsqd) -> IdentifyLimits:
    o = nsqd.options
    return IdentifyLimits(
        max_rdy_count=o.max_rdy_count, version=nsqd.version,
        max_heartbeat_interval_ms=o.max_heartbeat_interval_ms,
        max_output_buffer_size=o.max_output_buffer_size,
        min_output_buffer_timeout_ms=o.min_output_buffer_timeout_ms,
        max_output_buffer_timeout_ms=o.max_output_buffer_timeout_ms,
        msg_timeout_ms=o.msg_timeout_ms, max_msg_timeout_ms=o.max_msg_timeout_ms,
        max_deflate_level=o.max_deflate_level, tls_available=nsqd.tls_context is not None,
        snappy_available=o.snappy and _snappy_installed(), deflate_available=o.deflate,
        auth_required=bool(o.auth_http_address))


def _snappy_installed() -> bool:
    try:
        import snappy  # noqa: F401
    except ImportError:
        return False
    return True


class ClientConnection(asyncio.Protocol):
    INIT, SUBSCRIBED, CLOSING = range(3)

    def __init__(self, nsqd):
        self.nsqd = nsqd
        o = nsqd.options
        # DPUB's limit (ours) is --max-req-timeout, checked by the parser and again in _dpub.
        self.parser = p.CommandParser(max_msg_size=o.max_msg_size, max_body_size=o.max_body_size,
                                      max_defer_ms=o.max_req_timeout_ms,
                                      state_check=self._state_check)
        self._parse_state = self.INIT  # the state the next parsed command will run in
        self.pending: deque = deque()
        self.busy = False  # an awaited command runs
        self._publishing: deque[list] = deque()  # [done, error, topic, bodies, command] in order
        self.state = self.INIT
        self.transport = None
        self.client: Client | None = None
        self.limits = nsqd.identify_limits
        self._decompress = None  # snappy: a stream's decompress(data)
        self._inflater = None  # deflate: a zlib decompressobj, inflated in bounded steps
        self._deflated = b""  # deflate input not inflated yet (waits while reading is paused)
        self._last_read = time.monotonic()
        self._heartbeat = None
        self._read_deadline = None  # nsqd's read deadline: 2 heartbeat intervals of silence
        self._parser_dead = False
        self._paused = False  # too many commands queued: reading paused until they run
        self._write_blocked = False  # the client reads slower than we write: reading paused
        self._reading = True
        self._eof = False  # the client half-closed: close once its commands are answered
        self._write_watch = None  # while writing is paused: the progress check

    # ---- transport events ------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("", 0)
        host = str(peer[0])
        self.client = Client(self.nsqd.next_client_id(), f"{host}:{peer[1]}",
                             initial_settings(self.limits, host, host))
        self.client.attach(transport)
        self.nsqd.connections.add(self)
        self._schedule_heartbeat()

    def connection_lost(self, exc) -> None:
        self.nsqd.connections.discard(self)
        self.client.flush()  # nothing can go out now; this stops its flush timer
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        if self._write_watch is not None:
            self._write_watch.cancel()
        channel = self.client.channel
        if channel is not None:
            channel.remove_client(self.client)
            self.nsqd.client_left(channel)
        self.pending.clear()

    def pause_writing(self) -> None:
        self.client.writable = False  # the channel hands it nothing more until it drains
        # A client that does not read must not make us buffer answers to what it keeps
        # sending: stop reading it until it reads.
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
        if self.client.channel is not None:
            self.client.channel.wake()
        if self._write_watch is not None:
            self._write_watch.cancel()
            self._write_watch = None

    def _update_reading(self) -> None:
        want = not (self._paused or self._write_blocked)
        if want == self._reading or self.transport.is_closing():
            return
        self._reading = want
        if want:
            self.transport.resume_reading()
            self._inflate()
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
        # it sent; _drain closes the connection once the last one has run.
        self._eof = True
        self._drain()
        return not self.client.tls  # an SSL transport cannot stay half-open

    def data_received(self, data: bytes) -> None:
        self._last_read = time.monotonic()
        if self._parser_dead:
            return
        if self._inflater is not None:
            self._deflated += data
            self._inflate()
            return
        if self._decompress is not None:
            try:
                data = self._decompress(data)
            except Exception:
                self._fail(errors.ProtocolError("E_BAD_BODY", "failed to decompress"))
                return
        self._receive(data)

    def _inflate(self) -> None:
        """Inflate what waits, INFLATE_STEP bytes at a time, while reading is not paused:
        a few KiB of deflate can hold gigabytes of commands."""
        while self._deflated and self._reading and not self._parser_dead:
            try:
                data = self._inflater.decompress(self._deflated, INFLATE_STEP)
            except zlib.error:
                self._fail(errors.ProtocolError("E_BAD_BODY", "failed to decompress"))
                return
            self._deflated = self._inflater.unconsumed_tail
            if not data:
                return
            self._receive(data)

    def _receive(self, data: bytes) -> None:
        """Plain bytes from the client: parse them and run what can run."""
        if (data.startswith(b"FIN ") and self.state == self.SUBSCRIBED and not self.busy
                and not self.pending and not self._publishing and not self.parser.buffered):
            data = self._finish_run(data)
            if not data:
                return
        self.parser.feed(data)
        self._parse()
        self._drain()

    def _finish_run(self, data: bytes) -> bytes:
        """Finish a run of well-formed `FIN <id>\n` lines for in-flight ids at once and return
        the bytes after it; the first other line, and all that follows, is the parser's.

        A consumer sends thousands of FINs a second: this skips a command object and a
        dispatch per line, and wakes the channel once per run. In-flight messages are keyed
        by the id bytes we sent, so a line names one exactly when it echoes them."""
        in_flight = self.client.in_flight
        done = []
        pos = 0
        end = len(data)
        while end - pos >= 21 and data[pos + 20] == 10 and data.startswith(b"FIN ", pos):
            msg = in_flight.pop(data[pos + 4:pos + 20], None)
            if msg is None:  # not in flight here: the parser answers it
                break
            done.append(msg)
            pos += 21
        if done:
            self.client.finish_count += len(done)
            self.client.channel.finish_many(done)
        return data[pos:] if pos else data

    def _parse(self) -> None:
        while True:
            try:
                for cmd in self.parser.commands():
                    self.pending.append(cmd)
                    if isinstance(cmd, (p.Sub, p.SubOrdered, p.SubAdvanced)):
                        self._parse_state = self.SUBSCRIBED
                    elif isinstance(cmd, p.Cls):
                        self._parse_state = self.CLOSING
                return
            except errors.ProtocolError as e:
                self.pending.append(e)
                if e.fatal:
                    self._parser_dead = True
                    return

    def _state_check(self, name: str) -> None:
        """nsqd checks the state before the arguments: "RDY abc" before SUB is "cannot RDY
        in current state". Runs at parse time against the state the command will run in:
        SUB and CLS either succeed or fail fatally, so predicting their effect is exact.
        The handlers check the state again when the command runs."""
        state = self._parse_state
        if name in ("IDENTIFY", "AUTH", "SUB", "SUB_ORDERED", "SUB_ADVANCED"):
            ok = state == self.INIT
        elif name in ("RDY", "FIN", "REQ", "TOUCH"):
            ok = state != self.INIT
        elif name == "CLS":
            ok = state == self.SUBSCRIBED
        else:
            return
        if not ok:
            raise errors.invalid_state(name)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _fail(self, err: errors.ProtocolError) -> None:
        self.client.write(err.frame)
        if err.fatal:
            self._parser_dead = True
            self.pending.clear()
            self.transport.close()

    # ---- running commands ------------------------------------------------

    def _drain(self) -> None:
        while self.pending and not self.busy:
            if self.transport.is_closing():
                self.pending.clear()
                return
            cmd = self.pending[0]
            if (type(cmd) in _PUB_COMMANDS and len(self._publishing) < MAX_PIPELINE
                    and self._publish_now(cmd)):
                self.pending.popleft()
                continue
            if self._publishing:
                break  # its reply must follow the replies of the publishes before it
            self.pending.popleft()
            if isinstance(cmd, errors.ProtocolError):
                self._fail(cmd)
                continue
            handler = self._sync_handlers.get(type(cmd))
            if handler is not None:
                try:
                    handler(self, cmd)
                except errors.ProtocolError as e:
                    self._fail(e)
                continue
            self.busy = True
            asyncio.get_running_loop().create_task(self._run_async(cmd))
        if len(self.pending) > MAX_PENDING and not self._paused:
            self._paused = True
            self._update_reading()
        elif self._paused and len(self.pending) < MAX_PENDING // 2:
            self._paused = False
            self._update_reading()
        if self._eof and not self.busy and not self.pending and not self._publishing:
            self.transport.close()

    def _publish_now(self, cmd) -> bool:
        """PUB/MPUB/DPUB to an existing topic, answered from the append's callback: no task.
        Several may be in flight (a pipelining client); replies go out in command order.

        Returns False to leave the command to the general (awaited) path."""
        topic = self.nsqd.topics.get(cmd.topic)
        o = self.nsqd.options
        if topic is None or o.tls_required or o.auth_http_address:
            return False
        part = topic.partition(cmd.partition)
        if part is None or part.queue.closed or part.queue.failed is not None:
            return False
        kind = type(cmd)
        bodies = cmd.bodies if kind is p.Mpub else [cmd.body]
        ext = defer_ext(cmd.defer_ms, self.nsqd.clock()) if kind is p.Dpub else b""
        slot = [False, None, topic, bodies, _PUB_COMMANDS[kind]]
        self._publishing.append(slot)
        part.queue.append(bodies, ext=ext, callback=functools.partial(self._published, slot))
        return True

    def _published(self, slot: list, appended, exc) -> None:
        slot[0], slot[1] = True, exc
        publishing = self._publishing
        while publishing and publishing[0][0]:
            _, exc, topic, bodies, command = publishing.popleft()
            if exc is not None:
                publishing.clear()
                self._fail(errors.publish_failed(command, str(exc)))
                return
            topic.count_published(bodies)
            self._count_published(topic, len(bodies))
            self.client.write(p.OK)
        self._drain()

    def _count_published(self, topic, count: int) -> None:
        counts = self.client.pub_counts
        counts[topic.name] = counts.get(topic.name, 0) + count

    async def _run_async(self, cmd) -> None:
        try:
            await self._async_handlers[type(cmd)](self, cmd)
        except errors.ProtocolError as e:
            self._fail(e)
        except Exception as e:  # a bug must cost one connection, never the server
            log.exception("command_failed", command=type(cmd).__name__)
            self._fail(errors.ProtocolError("E_INVALID", f"internal error: {e}"))
        finally:
            self.busy = False
        self._drain()

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
        self.client.channel.wake()

    def _in_flight(self, name: str, raw_id: bytes, failed):
        if self.state not in (self.SUBSCRIBED, self.CLOSING):
            raise errors.invalid_state(name)
        msg = self.client.in_flight.get(raw_id)  # keyed by the id bytes we sent
        if msg is None:
            raise failed(raw_id)
        return msg

    def _fin(self, cmd: p.Fin) -> None:
        msg = self._in_flight("FIN", cmd.msg_id, errors.fin_failed)
        del self.client.in_flight[msg.wire_id]
        self.client.finish_count += 1
        self.client.channel.finish(msg)

    def _req(self, cmd: p.Req) -> None:
        msg = self._in_flight("REQ", cmd.msg_id, errors.req_failed)
        del self.client.in_flight[msg.wire_id]
        self.client.requeue_count += 1
        delay = min(max(cmd.timeout_ms, 0), self.nsqd.options.max_req_timeout_ms)
        self.client.channel.requeue(msg, delay)

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

    _sync_handlers = {p.Rdy: _rdy, p.Fin: _fin, p.Req: _req, p.Touch: _touch, p.Cls: _cls,
                      p.Nop: _nop}

    # ---- commands: identify, auth, subscribe, publish (awaited) -----------

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
        transport = await loop.start_tls(self.transport, self, self.nsqd.tls_context,
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

    async def _check_auth(self, command: str, topic: str, channel: str = "") -> None:
        if not self.nsqd.options.auth_http_address:
            return
        if self.client.authorizations is None:
            raise errors.auth_first(command)
        if time.monotonic() >= self.client.auth_expires:  # its ttl passed: ask again
            await self._ask_auth_server(self.client.auth_secret)
        from .auth import allowed

        permission = "subscribe" if channel else "publish"
        if not allowed(self.client.authorizations, topic, channel, permission):
            raise errors.unauthorized(command, topic, channel)

    def _check_tls(self, command: str) -> None:
        if self.nsqd.options.tls_required and not self.client.tls:
            raise errors.tls_required(command)

    async def _sub(self, cmd: p.Sub) -> None:
        if self.state != self.INIT:
            raise errors.invalid_state("SUB")
        if self.client.settings.heartbeat_interval_ms <= 0:  # as nsqd: no SUB without heartbeats
            raise errors.heartbeats_disabled()
        self._check_tls("SUB")
        await self._check_auth("SUB", cmd.topic, cmd.channel)
        try:
            channel = await self.nsqd.get_channel(cmd.topic, cmd.channel, cmd.partition)
        except StorageError as e:  # a full disk, or a partition that does not serve
            raise errors.sub_failed(str(e)) from None
        if channel is None:
            raise errors.bad_partition("SUB", str(cmd.partition))
        self.client.channel = channel
        self.client.topic_name = cmd.topic
        channel.add_client(self.client)
        self.state = self.SUBSCRIBED
        self.client.write(p.OK)

    async def _publish(self, command: str, topic_name: str, bodies: list[bytes],
                       partition: int | None, ext: bytes = b"", reply: bool = True) -> None:
        self._check_tls(command)
        await self._check_auth(command, topic_name)
        try:
            topic = await self.nsqd.get_topic(topic_name)
            await topic.publish(bodies, partition, ext)
        except PartitionNotFound:
            raise errors.bad_partition(command, str(partition)) from None
        except Exception as e:
            raise errors.publish_failed(command, str(e)) from None
        self._count_published(topic, len(bodies))
        if reply:
            self.client.write(p.OK)

    async def _pub(self, cmd: p.Pub) -> None:
        await self._publish("PUB", cmd.topic, [cmd.body], cmd.partition)

    async def _mpub(self, cmd: p.Mpub) -> None:
        await self._publish("MPUB", cmd.topic, cmd.bodies, cmd.partition)

    async def _pub_ext(self, cmd: p.PubExt) -> None:
        await self._publish("PUB_EXT", cmd.topic, [cmd.body], cmd.partition,
                            json.dumps(cmd.header).encode() if cmd.header else b"")

    async def _mpub_ext(self, cmd: p.MpubExt) -> None:
        for header, body in cmd.messages[:-1]:
            await self._publish("MPUB_EXT", cmd.topic, [body], cmd.partition,
                                json.dumps(header).encode() if header else b"", reply=False)
        header, body = cmd.messages[-1]
        await self._publish("MPUB_EXT", cmd.topic, [body], cmd.partition,
                            json.dumps(header).encode() if header else b"")

    async def _not_yet(self, cmd) -> None:
        name = {p.SubOrdered: "SUB_ORDERED", p.SubAdvanced: "SUB_ADVANCED",
                p.PubTrace: "PUB_TRACE"}[type(cmd)]
        raise errors.ProtocolError("E_INVALID", f"{name} is not supported by this node yet")

    async def _dpub(self, cmd: p.Dpub) -> None:
        max_ms = self.nsqd.options.max_req_timeout_ms
        if not 0 <= cmd.defer_ms <= max_ms:
            raise errors.dpub_timeout_out_of_range(cmd.defer_ms, max_ms)
        await self._publish("DPUB", cmd.topic, [cmd.body], cmd.partition, defer_ext(cmd.defer_ms, self.nsqd.clock()))

    _async_handlers = {p.Identify: _identify, p.Auth: _auth, p.Sub: _sub, p.Pub: _pub,
                       p.Mpub: _mpub, p.Dpub: _dpub, p.PubExt: _pub_ext, p.MpubExt: _mpub_ext,
                       p.SubOrdered: _not_yet, p.SubAdvanced: _not_yet, p.PubTrace: _not_yet}


async def start_tcp(nsqd):
    host, port = nsqd.options.tcp_host_port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: ClientConnection(nsqd), host, port,
                                      reuse_address=True)
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
