"""A client that stops reading, for the tests of answers that must not wait for it forever
(/metrics, /topic/read): the node's answer goes through a 4 KiB socket send buffer, as on a
slow link, and the client's own receive buffer is 4 KiB, so a few kilobytes fill both."""

from __future__ import annotations

import asyncio
import socket

BUFFER = 4096


def slow_link(monkeypatch, module, name: str) -> None:
    """Make `module.name(request, ...)` send through a BUFFER-byte socket send buffer."""
    send = getattr(module, name)

    async def narrowed(request, *args):
        request.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
        return await send(request, *args)

    monkeypatch.setattr(module, name, narrowed)


async def stalled_client(port: int, request: bytes) -> socket.socket:
    """A connection to 127.0.0.1:`port` that has sent `request` and reads nothing (the
    caller closes it)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request)
    except BaseException:
        sock.close()
        raise
    return sock
