"""NSQLookupd: the discovery daemon. Owns the RegistrationDB (what every connected nsqd
registered), the TCP server nsqd registers through (tcp.py) and the HTTP server clients
look up through (http.py). In cluster mode (`--etcd-endpoints`) it also owns a Cluster
(cluster.py): the HTTP API then answers from etcd's mirror through cluster_http.py's
routes, and the V1 TCP port stays bound (it is part of the lookupd's id) but refuses
registrations: nsqd nodes in cluster mode register in etcd.

Lifecycle: `await start()` listens on both ports (TCP first; a port that cannot be
bound raises OSError with nothing left listening), then starts the cluster part (which
waits for no etcd: it retries on its own); `await stop()` resigns and unregisters from
the cluster, then closes the listeners and every nsqd connection. Nothing is stored: an
nsqd registers everything again when it reconnects, as with Go nsqlookupd.
"""

from __future__ import annotations

import structlog

from nsqwire import adminkey

from . import cluster_http, http, tracesearch
from .cluster import Cluster
from .http import start_http
from .options import Options
from .registry import RegistrationDB
from .tcp import start_tcp

log = structlog.get_logger("nsqlookupd")

VERSION = "1.3.0"


class NSQLookupd:
    def __init__(self, options: Options):
        self.options = options
        self.version = VERSION
        self.admin_secret = (adminkey.read_secret(options.admin_secret_file)
                             if options.admin_secret_file else "")  # nsqwire/adminkey.py
        self.db = RegistrationDB(inactive_timeout=options.inactive_producer_timeout,
                                 tombstone_lifetime=options.tombstone_lifetime)
        self.cluster = None
        routes = http.ROUTES
        if options.cluster_mode:
            self.cluster = Cluster(options, VERSION)
            routes = cluster_http.ROUTES
        self.routes = {**routes, **tracesearch.ROUTES}  # cluster-wide trace: both modes
        self.connections: set = set()
        self.tcp_server = None
        self.http_runner = None
        self.tcp_port = 0
        self.http_port = 0

    @property
    def directory(self):
        """What the HTTP API reads: the db nsqd feeds, or the cluster's current directory."""
        return self.db if self.cluster is None else self.cluster.directory

    async def start(self) -> None:
        self.tcp_server, self.tcp_port = await start_tcp(self)
        try:
            self.http_runner, self.http_port = await start_http(self)
        except OSError:
            self.tcp_server.close()
            raise
        if self.cluster is not None:
            o = self.options
            await self.cluster.start(o.broadcast_address, o.broadcast_tcp_port or self.tcp_port,
                                     o.broadcast_http_port or self.http_port)
        log.info("started", tcp_port=self.tcp_port, http_port=self.http_port,
                 broadcast_address=self.options.broadcast_address)

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.close()
        self.tcp_server.close()
        for conn in list(self.connections):
            conn.transport.close()
        await self.http_runner.cleanup()
        await self.tcp_server.wait_closed()
        log.info("stopped")
