"""Helpers for tests that run an nsqd in the test's own event loop and talk to it
over real sockets with our client connection."""

from __future__ import annotations

import asyncio

from nsqclient.conn import Connection


async def connect(node, **identify) -> Connection:
    return await Connection("127.0.0.1", node.tcp_port).connect(identify or None)


async def take(conn: Connection, count: int = 1, timeout: float = 5.0) -> list:
    """The next `count` messages, or a TimeoutError."""
    return [await asyncio.wait_for(conn.messages.get(), timeout) for _ in range(count)]


async def nothing_arrives(conn: Connection, wait: float = 0.4) -> None:
    try:
        m = await asyncio.wait_for(conn.messages.get(), wait)
    except asyncio.TimeoutError:
        return
    raise AssertionError(f"unexpected delivery {m.body!r}")


async def until(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
