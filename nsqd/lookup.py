"""Registration with nsqlookupd (classic mode, `--lookupd-tcp-address`, repeatable).

One LookupPeer per lookupd keeps a connection over protocol V1 (nsqwire/lookupd.py):
connect, `"  V1"`, IDENTIFY (broadcast address, TCP and HTTP ports, version, host name),
REGISTER every topic and channel the node has, then send each REGISTER/UNREGISTER as
topics and channels come and go, and a PING every 15 s. A lost connection (the lookupd
closed it, answered an error or anything unasked, or did not answer within 5 s) is
dialled again after a backoff (1 s doubling to 15 s; back to 1 s only after a session
that lasted 15 s, so a lookupd that drops every session is dialled at most every 15 s),
and everything is registered again: the lookupd dropped this node's registrations when
the connection closed.

A lookupd never slows publishing: the node only appends commands to an in-memory queue
(no await). While a peer is not connected its queue is not kept (the registration on
connect covers it); a queue that outgrows MAX_QUEUE (a lookupd that stopped answering)
drops its connection, which re-syncs everything on reconnect.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import deque

import structlog

from nsqwire import lookupd as v1

from .options import lookupd_host_port

log = structlog.get_logger("nsqd.lookup")

PING_INTERVAL = 15.0
TIMEOUT = 5.0  # to connect, and for each answer
BACKOFF_MIN, BACKOFF_MAX = 1.0, 15.0
MAX_QUEUE = 100_000


def registrations(nsqd) -> list[bytes]:
    """REGISTER commands for everything the node has: each channel (which registers its
    topic too), or the topic alone when it has none (as Go nsqd does)."""
    out = []
    for name, topic in list(nsqd.topics.items()):
        channels = sorted({c.name for c in topic.channels()})
        if channels:
            out.extend(v1.cmd_register(name, c) for c in channels)
        else:
            out.append(v1.cmd_register(name))
    return out


class LookupPeer:
    """One nsqlookupd: its connection task, the commands waiting to be sent, its state."""

    def __init__(self, nsqd, address: str) -> None:
        self.nsqd = nsqd
        self.address = address
        self.host, self.port = lookupd_host_port(address)
        self.queue: deque[bytes] = deque()
        self.connected = False
        self.info: dict = {}  # the lookupd's IDENTIFY answer
        self.last_error = ""
        self.connects = 0
        self._connected_at = 0.0  # monotonic
        self._wake = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def send(self, command: bytes) -> None:
        """Queue a command (never waits); dropped while not connected."""
        if not self.connected:
            return
        if len(self.queue) >= MAX_QUEUE:
            log.warning("lookupd_queue_full", lookupd=self.address)
            self._writer.close()  # the session fails, reconnects and registers everything
            self._wake.set()
            return
        self.queue.append(command)
        self._wake.set()

    def state(self) -> dict:
        return {"address": self.address, "connected": self.connected,
                "connects": self.connects, "queued": len(self.queue),
                "last_error": self.last_error, "version": self.info.get("version", "")}

    async def _run(self) -> None:
        backoff = BACKOFF_MIN
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure ends the session; it is dialled again
                error = f"{type(e).__name__}: {e}"
                if self.connected or error != self.last_error:
                    log.warning("lookupd_disconnected" if self.connected else
                                "lookupd_connect_failed", lookupd=self.address, error=error)
                self.last_error = error
                if self.connected and time.monotonic() - self._connected_at >= BACKOFF_MAX:
                    backoff = BACKOFF_MIN
            finally:
                self.connected = False
                self.queue.clear()
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _session(self) -> None:
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection(self.host, self.port)
        self._writer = writer
        responses = v1.ResponseReader()
        writer.write(v1.MAGIC_V1 + v1.cmd_identify(self._identity()))
        info = json.loads(v1.check_response(await self._answer(reader, responses)))
        if not isinstance(info, dict):
            raise ValueError(f"IDENTIFY answered {type(info).__name__}, not a JSON object")
        self.info = info
        # Snapshot and connect in one step (no await between): every later change is
        # queued behind the snapshot.
        self.queue.extend(registrations(self.nsqd))
        self.connected = True
        self._connected_at = time.monotonic()
        self.connects += 1
        log.info("lookupd_connected", lookupd=self.address, registrations=len(self.queue))
        next_ping = time.monotonic() + PING_INTERVAL
        while True:
            while self.queue:
                writer.write(self.queue.popleft())
                v1.check_response(await self._answer(reader, responses))
            if time.monotonic() >= next_ping:
                writer.write(v1.PING)
                v1.check_response(await self._answer(reader, responses))
                next_ping = time.monotonic() + PING_INTERVAL
                continue
            await self._idle(reader, responses, next_ping - time.monotonic())

    async def _idle(self, reader: asyncio.StreamReader, responses: v1.ResponseReader,
                    timeout: float) -> None:
        """Wait for a queued command or the timeout, watching the connection: a lookupd
        that closes it (or sends what was not asked for) ends the session at once."""
        if responses.buffered:  # read along with an answer, but nothing asked for it
            raise ConnectionError("the lookupd sent what was not asked for")
        self._wake.clear()
        wake = asyncio.ensure_future(self._wake.wait())
        unasked = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({wake, unasked}, timeout=max(0.0, timeout),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            unasked.cancel()
            await asyncio.wait({wake, unasked})  # the reader is free for the next read
        if unasked.done() and not unasked.cancelled():
            if unasked.result():  # a connection error raises here
                raise ConnectionError("the lookupd sent what was not asked for")
            raise ConnectionError("closed by the lookupd")

    async def _answer(self, reader: asyncio.StreamReader, responses: v1.ResponseReader) -> bytes:
        """The next answer, within TIMEOUT; ConnectionError when the lookupd closed."""
        deadline = time.monotonic() + TIMEOUT
        while (data := responses.next_response()) is None:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                chunk = await reader.read(65536)
            if not chunk:
                raise ConnectionError("closed by the lookupd")
            responses.feed(chunk)
        return data

    def _identity(self) -> dict:
        n = self.nsqd
        o = n.options
        return {"version": n.version, "tcp_port": o.broadcast_tcp_port or n.tcp_port,
                "http_port": o.broadcast_http_port or n.http_port,
                "hostname": socket.gethostname(), "broadcast_address": o.broadcast_address}


class Lookup:
    """The node's lookupd peers, and what the node tells them. The notifications never
    wait: they queue a command on every connected peer."""

    def __init__(self, nsqd) -> None:
        self.nsqd = nsqd
        self.peers: dict[str, LookupPeer] = {}

    def set_addresses(self, addresses: list[str]) -> None:
        """Dial the new addresses and drop the ones no longer listed (PUT
        /config/nsqlookupd_tcp_addresses): a dropped peer's task is cancelled, and its
        connection closes as the task ends."""
        for address in addresses:
            if address not in self.peers:
                peer = self.peers[address] = LookupPeer(self.nsqd, address)
                peer.start()
        for address in [a for a in self.peers if a not in addresses]:
            self.peers.pop(address).task.cancel()

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.peers.values()))
        self.peers.clear()

    def _send(self, command: bytes) -> None:
        for peer in self.peers.values():
            peer.send(command)

    def topic_created(self, topic: str) -> None:
        self._send(v1.cmd_register(topic))

    def topic_deleted(self, topic: str) -> None:
        self._send(v1.cmd_unregister(topic))

    def channel_created(self, topic: str, channel: str) -> None:
        self._send(v1.cmd_register(topic, channel))

    def channel_deleted(self, topic: str, channel: str) -> None:
        """UNREGISTER unless another partition of the topic still has the channel."""
        t = self.nsqd.topics.get(topic)
        if t is not None and any(c.name == channel for c in t.channels()):
            return
        self._send(v1.cmd_unregister(topic, channel))

    def state(self) -> list[dict]:
        return [p.state() for p in self.peers.values()]
