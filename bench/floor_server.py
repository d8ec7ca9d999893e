"""The floor: the least any Python asyncio server must do per PUB, for bench/floor.py.

Not a queue. It speaks just enough of the NSQ TCP protocol for bench/loadgen.py's
producers (the magic, `PUB <topic>\\n` or `MPUB <topic>\\n` with its 4-byte size and body,
kept as one blob, the `OK` answer), on uvloop with one asyncio.Protocol per connection, as
nsqd does. Its modes:

- `ack`: every PUB is answered at once; nothing is kept. What the protocol, uvloop and
  the kernel's loopback TCP cost a message, with none of nsqd's work.
- `sync`: the simplest durable group commit. Per topic one file and one thread of its
  own (as nsqd's partitions have); the PUBs that arrive while a batch is written wait and
  become the next batch; a batch is one `os.write` of the bodies joined, one
  `os.fdatasync`, then every PUB of it is answered. No records, no index, no checks.

- `journal`: the simplest node-wide group commit (nsqd's node journal, diskqueue/
  journal.py). One thread for every topic; the PUBs that arrive while a round is written
  wait and become the next round, each topic's part of it one `os.write` to its file
  (no sync), all of it one `os.write` to one journal file and one `os.fdatasync`, then
  every PUB of the round is answered (one `call_soon_threadsafe` a round).
- `behind`: `journal` with each topic's write made after the round's answers are handed
  to the loop (the journal holds the data until then): the writes leave the round's path.
- `bulk`: `journal` with each topic's data kept in memory and written to its file once
  BULK_BYTES of all topics wait (BookKeeper's write cache, flushed to its entry logs): one
  write a topic a flush, after that round's answers, instead of one a round.
- `once`: `journal` without the write per topic: the data written once, to the node's one
  file (RocketMQ's CommitLog, whose queues are indexes into it; the index costs nothing
  here). One `os.write` and one `os.fdatasync` a round.
- `index`: `once` with what a partition of that design must do at least, on the loop as
  nsqd does it: each message encoded as nsqd's record (diskqueue/record.py: CRC, id,
  offset) and given a commitlog entry (commitlog/entry.py), kept in memory as the
  partition's index (its file writes, one a MiB, are left out); each topic's part of a
  round one journal record (a CRC and a header); the partition's end, count, next log id
  and committed end kept and moved a round. The floor of a write-once design whose
  partitions are real, not of a queue: no futures, stats, readers or checks.

Whatever nsqd spends beyond `sync` (or `journal`) is its own; what they spend is the floor
that no Python design with a thread per partition (or one journal a node) goes under;
`once` is the floor of a design that writes a message once.

Replication (for bench/floor_replication.py): `--follow-port` also takes pushes, a thread
per connection with blocking sockets (a frame: 4-byte topic length, 4-byte batch length,
the topic, the batch; it appends the batch to its file of that topic, fdatasyncs, answers
one byte); `--followers host:port,...` makes every batch of `sync` go to each of them
(one connection per topic and follower) while it is synced here, and the PUBs wait for
every follower's answer too. No epochs, no offsets, no checks: the least a push costs.

    python bench/floor_server.py --mode ack|sync|journal --port P --dir D [--follow-port F]
                                 [--followers H:P,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import socket
import struct
import sys
import threading
import time
import zlib

import uvloop

sys.path[0] = os.path.dirname(sys.path[0])  # the repository: mode index uses nsqd's encoders
from commitlog.entry import encode_fields  # noqa: E402
from diskqueue.record import encode_records  # noqa: E402

MAGIC = b"  V2"
OK = struct.pack(">ii", 6, 0) + b"OK"
SIZE = struct.Struct(">i")
PUSH = struct.Struct(">ii")  # topic length, batch length
BULK_BYTES = 64 << 20  # mode bulk: the topics' data written once this much waits (nsqd's checkpoint)
HEAD = struct.Struct(">II")  # mode index, a journal record: crc32, length of what follows;
FIELDS = struct.Struct(">QQ")  # then partition and offset, then the records
INDEX_BYTES = 1 << 20  # mode index: a partition's index this long is dropped (written, in a queue)


class Partition:
    """Mode `index`: what a partition of a write-once design keeps (see the module
    docstring). Its round's records are encoded on the loop, before the round is handed
    to the journal thread; `committed` moves once the round is synced."""

    __slots__ = ("number", "prefix", "end", "count", "log_id", "committed", "index")

    def __init__(self, number: int):
        self.number = number
        self.prefix = number << 50  # nsqd's message ids: partition << 50 | sequence
        self.end = self.count = self.log_id = self.committed = 0
        self.index = bytearray()  # its commitlog entries

    def encode(self, batch: list, ts: int) -> bytes:
        """The batch's records, as one journal record; the index and the ends moved."""
        pieces: list = []
        add = pieces.append
        offset, seq, log_id, index = self.end, self.count, self.log_id, self.index
        for _transport, body in batch:
            first_id = self.prefix | seq
            start = offset
            offset = encode_records(add, [], offset, first_id, 0, ts, 0, b"", (body,))
            index += encode_fields(log_id, 1, first_id, start, seq, ts, offset - start, 1, 0)
            seq += 1
            log_id += 1
        if len(index) > INDEX_BYTES:
            del index[:]
        body = FIELDS.pack(self.number, self.end) + b"".join(pieces)
        self.end, self.count, self.log_id = offset, seq, log_id
        return HEAD.pack(zlib.crc32(body), len(body)) + body


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


class TopicLog:
    """One topic's file and write thread; `append` answers each PUB once its batch is
    synced."""

    def __init__(self, loop, path: str, topic: bytes, followers: list[tuple[str, int]]):
        self.loop = loop
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.topic = topic
        self.followers = [socket.create_connection(a) for a in followers]
        for f in self.followers:
            f.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
            data = b"".join(body for _, body in batch)
            os.write(self.fd, data)
            for f in self.followers:  # sent before the local sync: both sync at once
                f.sendall(PUSH.pack(len(self.topic), len(data)) + self.topic + data)
            os.fdatasync(self.fd)
            for f in self.followers:
                recv_exactly(f, 1)
            self.loop.call_soon_threadsafe(self._done, batch)

    def _done(self, batch: list) -> None:
        self.busy = False
        if self.pending:
            self._submit()
        for transport, _ in batch:
            transport.write(OK)


class NodeJournal:
    """Every topic's file and one journal, written by one thread in rounds; `append`
    answers each PUB once its round's journal is synced. `topic_files`: "before" the sync,
    "after" the answers, "bulk" (after the answers, once BULK_BYTES wait) or "" for none
    (mode `once`), or "index" (mode `index`: `once` with its partitions encoded)."""

    def __init__(self, loop, data_dir: str, topic_files: str):
        self.loop, self.dir, self.topic_files = loop, data_dir, topic_files
        self.fds: dict[bytes, int] = {}
        self.cached: dict[bytes, list[bytes]] = {}  # bulk: each topic's data not written yet
        self.cached_bytes = 0
        self.journal = os.open(os.path.join(data_dir, "journal"),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pending: dict[bytes, list] = {}  # topic -> (transport, body) for the next round
        self.partitions: dict[bytes, Partition] | None = {} if topic_files == "index" else None
        self.busy = False
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def append(self, transport, topic: bytes, body: bytes) -> None:
        batch = self.pending.get(topic)
        if batch is None:
            batch = self.pending[topic] = []
        batch.append((transport, body))
        if not self.busy:
            self._submit()

    def _submit(self) -> None:
        batches, self.pending = self.pending, {}
        self.busy = True
        partitions = self.partitions
        if partitions is None:
            self.jobs.put((batches, None))
            return
        ts = time.time_ns()
        records = []
        for topic, batch in batches.items():
            part = partitions.get(topic)
            if part is None:
                part = partitions[topic] = Partition(len(partitions))
            records.append(part.encode(batch, ts))
        self.jobs.put((batches, records))

    def _run(self) -> None:
        while True:
            batches, parts = self.jobs.get()
            if parts is None:
                parts = [b"".join(body for _, body in batch) for batch in batches.values()]
            if self.topic_files == "before":
                self._write_topics(batches, parts)
            os.write(self.journal, b"".join(parts))
            os.fdatasync(self.journal)
            self.loop.call_soon_threadsafe(self._done, batches)
            if self.topic_files == "after":
                self._write_topics(batches, parts)
            elif self.topic_files == "bulk":
                for topic, data in zip(batches, parts):
                    self.cached.setdefault(topic, []).append(data)
                    self.cached_bytes += len(data)
                if self.cached_bytes >= BULK_BYTES:
                    cached, self.cached, self.cached_bytes = self.cached, {}, 0
                    self._write_topics(cached, [b"".join(c) for c in cached.values()])

    def _write_topics(self, batches: dict, parts: list) -> None:
        for topic, data in zip(batches, parts):
            fd = self.fds.get(topic)
            if fd is None:
                fd = self.fds[topic] = os.open(os.path.join(self.dir, topic.decode()),
                                               os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, data)

    def _done(self, batches: dict) -> None:
        self.busy = False
        if self.partitions is not None:
            partitions = self.partitions
            for topic in batches:
                part = partitions[topic]
                part.committed = part.end
        if self.pending:
            self._submit()
        for batch in batches.values():
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
            answer(self.transport, buf[buf.index(b" ", pos) + 1:nl], buf[start:start + size])
            pos = start + size
        self.buf = buf[pos:]


class FloorServer:
    def __init__(self, loop, mode: str, data_dir: str, followers: list[tuple[str, int]]):
        self.loop, self.mode, self.dir, self.followers = loop, mode, data_dir, followers
        self.logs: dict[bytes, TopicLog] = {}
        files = {"journal": "before", "behind": "after", "bulk": "bulk", "once": "",
                 "index": "index"}
        self.journal = NodeJournal(loop, data_dir, files[mode]) if mode in files else None
        self.answer = self._journal if mode in files else {"ack": self._ack,
                                                           "sync": self._sync}[mode]

    def _journal(self, transport, topic: bytes, body: bytes) -> None:
        self.journal.append(transport, topic, body)

    def _ack(self, transport, topic: bytes, body: bytes) -> None:
        transport.write(OK)

    def _sync(self, transport, topic: bytes, body: bytes) -> None:
        log = self.logs.get(topic)
        if log is None:
            log = self.logs[topic] = TopicLog(self.loop, os.path.join(self.dir, topic.decode()),
                                              topic, self.followers)
        log.append(transport, body)


def follow(conn: socket.socket, data_dir: str) -> None:
    """One leader connection's pushes: append, sync, answer; until it closes."""
    fds: dict[bytes, int] = {}
    try:
        while True:
            topic_len, size = PUSH.unpack(recv_exactly(conn, PUSH.size))
            topic = recv_exactly(conn, topic_len)
            data = recv_exactly(conn, size)
            fd = fds.get(topic)
            if fd is None:
                fd = fds[topic] = os.open(os.path.join(data_dir, "f-" + topic.decode()),
                                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, data)
            os.fdatasync(fd)
            conn.sendall(b"\x01")
    except ConnectionError:
        conn.close()


def accept_pushes(listener: socket.socket, data_dir: str) -> None:
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=follow, args=(conn, data_dir), daemon=True).start()


async def serve(mode: str, port: int, data_dir: str, follow_port: int,
                followers: list[tuple[str, int]]) -> None:
    loop = asyncio.get_running_loop()
    if follow_port:
        listener = socket.create_server(("127.0.0.1", follow_port))
        threading.Thread(target=accept_pushes, args=(listener, data_dir), daemon=True).start()
    server = FloorServer(loop, mode, data_dir, followers)
    srv = await loop.create_server(lambda: Connection(server), "127.0.0.1", port)
    print("ready", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ack", "sync", "journal", "behind", "bulk", "once",
                                                   "index"),
                        required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--follow-port", type=int, default=0)
    parser.add_argument("--followers", default="")
    args = parser.parse_args()
    followers = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in args.followers.split(",")
                                          if a)]
    uvloop.run(serve(args.mode, args.port, args.dir, args.follow_port, followers))


if __name__ == "__main__":
    main()
