"""The TCP server (port 4160): nsqd nodes register over protocol V1, one
PeerConnection per socket.

Bytes in go to the sans-I/O LookupParser (nsqwire/lookupd.py); each command changes the
RegistrationDB and is answered in order. Every error is sent, then the connection is
closed (all V1 errors are fatal, as in Go nsqlookupd). In cluster mode IDENTIFY is
refused (E_INVALID): nodes register in etcd. When the connection closes, its
nsqd produces nothing any more: every registration of it is removed. Reading pauses
while the answers wait to be written, so a peer that does not read costs bounded memory.
A connection that has not identified within IDENTIFY_S gets E_INVALID and is closed (nsqd
identifies at once), so a client that connects and sends nothing holds a descriptor for
IDENTIFY_S at most.
"""

from __future__ import annotations

import asyncio
import socket
import time

import structlog

from nsqwire import lookupd as v1
from nsqwire.errors import ProtocolError
from nsqwire.httpapi import go_json

from .registry import PeerInfo

log = structlog.get_logger("nsqlookupd.tcp")

IDENTIFY_S = 10.0  # a connection identifies within this, or it is closed


def remote_address(transport) -> str:
    """`host:port` as Go prints a net.Addr (`[v6]:port` for IPv6)."""
    peer = transport.get_extra_info("peername") or ("?", 0)
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerConnection(asyncio.Protocol):
    """One nsqd's connection: its parser, and its PeerInfo once identified."""

    def __init__(self, lookupd) -> None:
        self.lookupd = lookupd
        self.parser = v1.LookupParser()
        self.peer: PeerInfo | None = None
        self.transport: asyncio.Transport | None = None
        self.address = ""
        self._identify_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.address = remote_address(transport)
        self.lookupd.connections.add(self)
        self._identify_due = asyncio.get_running_loop().call_later(IDENTIFY_S,
                                                                   self._not_identified)
        log.debug("peer_connected", remote_address=self.address)

    def _not_identified(self) -> None:
        self._identify_due = None
        if self.peer is None and not self.transport.is_closing():
            log.warning("peer_not_identified", remote_address=self.address, within_s=IDENTIFY_S)
            self.transport.write(v1.error_response(ProtocolError(
                "E_INVALID", f"IDENTIFY must come within {IDENTIFY_S:g} s")))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self._identify_due is not None:
            self._identify_due.cancel()
        self.lookupd.connections.discard(self)
        if self.peer is not None:
            self.lookupd.db.disconnected(self.peer)
            log.info("peer_closed", remote_address=self.address, node=self.peer.node)

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        out = []
        try:
            while (command := self.parser.next_command()) is not None:
                out.append(self._run(command))
        except ProtocolError as exc:
            out.append(v1.error_response(exc))
            log.warning("peer_error", remote_address=self.address, error=exc.text[:200])
            self.transport.write(b"".join(out))
            self.transport.close()  # after what is buffered is written
            return
        self.transport.write(b"".join(out))

    def _run(self, command: v1.Command) -> bytes:
        db = self.lookupd.db
        if isinstance(command, v1.Ping):
            if self.peer is not None:
                db.ping(self.peer, time.time())
            return v1.encode_response(v1.OK)
        if isinstance(command, v1.Identify):
            if self.lookupd.cluster is not None:
                raise ProtocolError("E_INVALID", "cluster mode: nsqd registers in etcd "
                                                 "(--etcd-endpoints), not over TCP")
            self.peer = PeerInfo(id=self.address, remote_address=self.address,
                                 last_update=time.time(), **command.info)
            if self._identify_due is not None:
                self._identify_due.cancel()
                self._identify_due = None
            db.identify(self.peer)
            log.info("peer_identified", remote_address=self.address, node=self.peer.node,
                     hostname=self.peer.hostname, version=self.peer.version)
            return v1.encode_response(go_json(self._identity()))
        if isinstance(command, v1.Register):
            db.register(self.peer, command.topic, command.channel)
            log.info("register", node=self.peer.node, topic=command.topic,
                     channel=command.channel)
        else:
            db.unregister(self.peer, command.topic, command.channel)
            log.info("unregister", node=self.peer.node, topic=command.topic,
                     channel=command.channel)
        return v1.encode_response(v1.OK)

    def _identity(self) -> dict:
        """The IDENTIFY answer: the lookupd's own info (keys sorted, as Go marshals a map)."""
        return {"broadcast_address": self.lookupd.options.broadcast_address,
                "hostname": socket.gethostname(), "http_port": self.lookupd.http_port,
                "tcp_port": self.lookupd.tcp_port, "version": self.lookupd.version}


async def start_tcp(lookupd):
    host, port = lookupd.options.tcp_host_port
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: PeerConnection(lookupd), host, port,
                                      reuse_address=True)
    return server, server.sockets[0].getsockname()[1]
