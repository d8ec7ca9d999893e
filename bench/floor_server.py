"""The floor: the least any Python asyncio server must do per PUB, for bench/floor.py.

Not a queue. It speaks just enough of the NSQ TCP protocol for bench/loadgen.py's
producers (the magic, `PUB <topic>\\n` with its 4-byte size and body, the `OK` answer),
on uvloop with one asyncio.Protocol per connection, as nsqd does. Two modes:

- `ack`: every PUB is answered at once; nothing is kept. What the protocol, uvloop and
  the kernel's loopback TCP cost a message, with none of nsqd's work.
- `sync`: the simplest durable group commit. Per topic one file and one thread of its
  own (as nsqd's partitions have); the PUBs that arrive while a batch is written wait and
  become the next batch; a batch is one `os.write` of the bodies joined, one
  `os.fdatasync`, then every PUB of it is answered. No records, no index, no checks.

Whatever nsqd spends beyond `sync` is its own; what `sync` spends is the floor that no
Python design with a thread per partition goes under.

    python bench/floor_server.py --mode ack|sync --port P --dir D
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import struct
import threading

import uvloop

MAGIC = b"  V2"
OK = struct.pack(">ii", 6, 0) + b"OK"
SIZE = struct.Struct(">i")


class TopicLog:
    """One topic's file and write thread; `append` answers each PUB once its batch is
    synced."""

    def __init__(self, loop, path: str):
        self.loop = loop
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pending: list = []  # (transport, body) waiting for the next batch
        self.busy = False
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def append(self, transport, body: bytes) -> None:
        self.pending.append((transport, body))
        if not self.busy:
            self._submit()

    def _submit(self) -> None:
        batch, self.pending = self.pending, []
        self.busy = True
        self.jobs.put(batch)

    def _run(self) -> None:
        while True:
            batch = self.jobs.get()
            os.write(self.fd, b"".join(body for _, body in batch))
            os.fdatasync(self.fd)
            self.loop.call_soon_threadsafe(self._done, batch)

    def _done(self, batch: list) -> None:
        self.busy = False
        if self.pending:
            self._submit()
        for transport, _ in batch:
            transport.write(OK)


class Connection(asyncio.Protocol):
    def __init__(self, server: "FloorServer"):
        self.server = server
        self.buf = b""
        self.magic = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        if not self.magic:
            if len(buf) < 4:
                self.buf = buf
                return
            self.magic, pos = True, 4
        answer = self.server.answer
        while True:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                break
            start = nl + 1 + SIZE.size
            if len(buf) < start:
                break
            (size,) = SIZE.unpack_from(buf, nl + 1)
            if len(buf) < start + size:
                break
            answer(self.transport, buf[pos + 4:nl], buf[start:start + size])
            pos = start + size
        self.buf = buf[pos:]


class FloorServer:
    def __init__(self, loop, mode: str, data_dir: str):
        self.loop, self.mode, self.dir = loop, mode, data_dir
        self.logs: dict[bytes, TopicLog] = {}
        self.answer = self._ack if mode == "ack" else self._sync

    def _ack(self, transport, topic: bytes, body: bytes) -> None:
        transport.write(OK)

    def _sync(self, transport, topic: bytes, body: bytes) -> None:
        log = self.logs.get(topic)
        if log is None:
            log = self.logs[topic] = TopicLog(self.loop, os.path.join(self.dir, topic.decode()))
        log.append(transport, body)


async def serve(mode: str, port: int, data_dir: str) -> None:
    loop = asyncio.get_running_loop()
    server = FloorServer(loop, mode, data_dir)
    srv = await loop.create_server(lambda: Connection(server), "127.0.0.1", port)
    print("ready", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ack", "sync"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.mode, args.port, args.dir))


if __name__ == "__main__":
    main()
