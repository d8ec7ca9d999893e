"""NSQLookupd: the discovery daemon in classic mode. Owns the RegistrationDB (what
every connected nsqd registered), the TCP server nsqd registers through (tcp.py) and
the HTTP server clients look up through (http.py).

Lifecycle: `await start()` listens on both ports (TCP first; a port that cannot be
bound raises OSError with nothing left listening); `await stop()` closes the listeners
and every nsqd connection. Nothing is stored: an nsqd registers everything again when it
reconnects, as with Go nsqlookupd.
"""

from __future__ import annotations

import structlog

from .options import Options
from .registry import RegistrationDB

log = structlog.get_logger("nsqlookupd")

VERSION = "1.3.0"


class NSQLookupd:
    def __init__(self, options: Options):
        self.options = options
        self.version = VERSION
        self.db = RegistrationDB(inactive_timeout=options.inactive_producer_timeout,
                                 tombstone_lifetime=options.tombstone_lifetime)
        # What the HTTP API reads and changes: in classic mode, the db nsqd feeds.
        self.directory = self.db
        self.connections: set = set()
        self.tcp_server = None
        self.http_runner = None
        self.tcp_port = 0
        self.http_port = 0

    async def start(self) -> None:
        from .http import start_http
        from .tcp import start_tcp

        self.tcp_server, self.tcp_port = await start_tcp(self)
        try:
            self.http_runner, self.http_port = await start_http(self)
        except OSError:
            self.tcp_server.close()
            raise
        log.info("started", tcp_port=self.tcp_port, http_port=self.http_port,
                 broadcast_address=self.options.broadcast_address)

    async def stop(self) -> None:
        self.tcp_server.close()
        for conn in list(self.connections):
            conn.transport.close()
        await self.http_runner.cleanup()
        await self.tcp_server.wait_closed()
        log.info("stopped")
