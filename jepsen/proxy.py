"""User-space partitions for the loopback cluster: one TCP relay per advertised port.

Every port a host's daemon is known by (etcd client and peer, nsqd TCP/HTTP/RPC,
nsqlookupd TCP/HTTP) is a relay here, owned by that host, forwarding to the port the
daemon really listens on. Each accepted connection is attributed to the host whose
process opened it: the client socket's inode from /proc/net/tcp (its local address is the
peer address the relay accepted), then the daemon pid holding `socket:[inode]` among
`owners()` (our own children: no root needed). A connection nobody of `owners()` holds
(the harness's clients and checkers, a process gone already) has no owner and is never
cut, as the harness is never cut in the network-namespace cluster.

Invariant (what an iptables INPUT DROP does to TCP): while `drop(host, sources)` holds,
every connection between `host` and a source, whichever side opened it, moves no byte
either way (the relay stops reading both sides, so senders block once the socket buffers
are full; nothing is closed or dropped); a new connection between them is accepted but not
connected onward. `heal()` lets them all go on, with every byte held delivered in order.
A connection of a host to its own relays is never cut.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Callable

CHUNK = 1 << 16


def socket_owner(client_port: int, server_port: int, pids: dict[int, str],
                 attempts: int = 5) -> str | None:
    """The name in `pids` of the process holding the loopback TCP socket
    127.0.0.1:client_port -> 127.0.0.1:server_port, or None. /proc/net/tcp is read again
    (up to `attempts` times, 10 ms apart) while the socket is not in it: the kernel lists
    the table in pieces, and one that changes between them can skip an entry (a busy
    test run once lost a connection's owner that way)."""
    inode = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.01)
        inode = _socket_inode(client_port, server_port)
        if inode is not None:
            break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid, name in pids.items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return name
            except OSError:
                continue
    return None


def _socket_inode(client_port: int, server_port: int) -> str | None:
    """The inode of the open socket 127.0.0.1:client_port -> 127.0.0.1:server_port in
    /proc/net/tcp (an entry of inode 0, a closed connection of the same ports in
    TIME_WAIT, is passed over), or None."""
    local, remote = f"0100007F:{client_port:04X}", f"0100007F:{server_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f:
            fields = line.split()
            if (len(fields) > 9 and fields[1] == local and fields[2] == remote
                    and fields[9] != "0"):
                return fields[9]
    return None


class _Link:
    """One relayed connection: `client` (a host name or None) to the relay of `server`."""

    def __init__(self, client: str | None, server: str):
        self.client, self.server = client, server
        self.writers: list[asyncio.StreamWriter] = []
        self.held = False  # stalled by a cut at least once


class Relays:
    """The relays of one cluster, in an asyncio loop of their own (a daemon thread).
    `add`, `drop`, `heal`, `close` are called from any other thread and take effect
    before they return."""

    def __init__(self, owners: Callable[[], dict[int, str]]):
        self.owners = owners  # pid -> host name, the daemons running now
        self.drops: set[tuple[str, str]] = set()  # (host, source): host drops source
        self.links: set[_Link] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="jepsen relays",
                                       daemon=True)
        self.thread.start()
        self.changed = self._call(asyncio.Event)  # set and replaced on every drop or heal

    def _call(self, fn, *args):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ---- control (any thread) ----------------------------------------------------------

    def add(self, host: str, port: int, target: int) -> None:
        """Relay 127.0.0.1:port (owned by `host`) to 127.0.0.1:target."""
        async def start():
            server = await asyncio.start_server(
                lambda r, w: self._serve(r, w, host, port, target), "127.0.0.1", port,
                reuse_address=True, limit=CHUNK)
            self.servers.append(server)
        self._run(start())

    def drop(self, host: str, sources: list[str]) -> None:
        self._call(self._change, lambda: self.drops.update((host, s) for s in sources))

    def heal(self) -> int:
        """Cut nothing any more; returns how many connections were held since the last."""
        def clear():
            self.drops.clear()
            held = sum(link.held for link in self.links)
            for link in self.links:
                link.held = False
            return held
        return self._call(self._change, clear)

    def connections(self) -> list[tuple[str | None, str]]:
        """(client host or None, server host) of every open relayed connection."""
        return self._call(lambda: sorted(((x.client, x.server) for x in self.links),
                                         key=repr))

    def close(self) -> None:
        async def stop():
            for s in self.servers:
                s.close()
            for link in list(self.links):
                for w in link.writers:
                    w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_default_executor()
        if self.loop.is_running():
            self._run(stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()

    # ---- in the loop -------------------------------------------------------------------

    def _change(self, update):
        result = update()
        old, self.changed = self.changed, asyncio.Event()
        old.set()
        return result

    def cut(self, link: _Link) -> bool:
        a, b = link.client, link.server
        return a is not None and ((a, b) in self.drops or (b, a) in self.drops)

    async def _flowing(self, link: _Link) -> None:
        while self.cut(link):
            link.held = True
            await self.changed.wait()

    async def _serve(self, reader, writer, host: str, port: int, target: int) -> None:
        link = _Link(None, host)
        link.writers.append(writer)
        self.links.add(link)
        try:
            peer = writer.get_extra_info("peername")
            if peer is not None:  # None: the client is gone already
                link.client = await asyncio.to_thread(socket_owner, peer[1], port,
                                                      self.owners())
            await self._flowing(link)  # a SYN to a cut host is never answered
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target,
                                                                 limit=CHUNK)
            link.writers.append(up_writer)
            await asyncio.gather(self._pump(reader, up_writer, link),
                                 self._pump(up_reader, writer, link))
        except OSError:
            pass
        finally:
            self.links.discard(link)
            for w in link.writers:
                w.close()

    async def _pump(self, reader, writer, link: _Link) -> None:
        """Bytes one way until EOF (passed on as a half-close); an error closes both."""
        try:
            while True:
                await self._flowing(link)
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._flowing(link)  # read just before a cut: held, not lost
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            for w in link.writers:
                w.transport.abort()
