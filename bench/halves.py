"""What half messages cost (nsqd/halves.py). Our nsqd in a subprocess, over TCP.

    .venv/bin/python bench/halves.py [--quick]

- a transaction against a publish: CONNS connections, each with one request in flight,
  send PUB (the reference), HALF then COMMIT, or HALF then ROLLBACK, 200-byte bodies, a
  fresh durable nsqd each (every write synced before its answer): transactions a second
  and nsqd's CPU a transaction (its own CPU time), 3 alternated rounds, medians.
- the read-back a partition does when it opens here (a restart, a new leadership): a
  partition of REQUESTS single-message requests written within the read-back window (the
  worst case: it reads each one's record head), then nsqd SIGKILLed and started again: the
  time until GET /half answers (the read-back done) beside the time until it serves, with
  no half in the log and with halves waiting (median of 3 restarts).

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from bench.nsqd_server import _load_servers, pid_cpu_seconds  # noqa: E402
from nsqwire import protocol as p  # noqa: E402
from nsqwire.commands import FrameParser, cmd_decide, cmd_half, cmd_pub  # noqa: E402

BODY = b"x" * 200
CONNS = 50
URL = "http://127.0.0.1:9/check"  # never asked: every half is decided in time


class Conn:
    """One TCP connection, one command at a time: `call` returns the response's data."""

    def __init__(self, reader, writer):
        self.reader, self.writer, self.frames = reader, writer, FrameParser()

    @classmethod
    async def open(cls, tcp_address: str) -> "Conn":
        host, port = tcp_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(p.MAGIC_V2)
        return cls(reader, writer)

    async def call(self, command: bytes) -> bytes:
        self.writer.write(command)
        while True:
            for kind, data in self.frames.frames():
                if kind == p.FRAME_ERROR:
                    raise RuntimeError(data.decode())
                if kind == p.FRAME_RESPONSE and data != b"_heartbeat_":
                    return data
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                raise RuntimeError("nsqd closed the connection")
            self.frames.feed(chunk)

    def close(self) -> None:
        self.writer.close()


async def _transact(conn: Conn, kind: str) -> None:
    if kind == "pub":
        await conn.call(cmd_pub("t", BODY))
        return
    msg_id = (await conn.call(cmd_half("t", BODY, URL, 0)))[3:].decode()
    await conn.call(cmd_decide("t", msg_id, kind == "half+commit"))


async def _run(tcp_address: str, kind: str, count: int) -> None:
    conns = [await Conn.open(tcp_address) for _ in range(CONNS)]
    per = count // CONNS

    async def one(conn: Conn) -> None:
        for _ in range(per):
            await _transact(conn, kind)
    try:
        await asyncio.gather(*(one(c) for c in conns))
    finally:
        for c in conns:
            c.close()


def _node(servers, tmp: str, *flags: str):
    proc = servers.NsqdProcess(os.path.join(tmp, "nsqd"), *flags).start()
    servers.http(proc, "POST", "/topic/create?topic=t")
    return proc


def transactions(report: Report, servers, count: int) -> None:
    kinds = ("pub", "half+commit", "half+rollback")
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(3):
        for kind in kinds:
            with tempfile.TemporaryDirectory(prefix="bench-half-") as tmp:
                proc = _node(servers, tmp)
                try:
                    asyncio.run(_run(proc.tcp_address, kind, CONNS * 20))  # warm
                    cpu, t = pid_cpu_seconds(proc.proc.pid), time.perf_counter()
                    asyncio.run(_run(proc.tcp_address, kind, count))
                    elapsed = time.perf_counter() - t
                    runs[kind].append((count / elapsed,
                                       (pid_cpu_seconds(proc.proc.pid) - cpu) / count * 1e6))
                finally:
                    proc.kill()
    report.section(f"{count:,} transactions over {CONNS} connections, one in flight each, "
                   "durable (3 alternated rounds, medians)")
    for kind, values in runs.items():
        key = kind.replace("+", "_")
        report.add(f"{key}_per_s", statistics.median(v[0] for v in values),
                   f"{kind}: a second", fmt=",.0f")
        report.add(f"{key}_cpu_us", statistics.median(v[1] for v in values),
                   f"{kind}: nsqd CPU each (µs)", fmt=".1f")
    for kind in kinds[1:]:
        key = kind.replace("+", "_")
        report.add(f"{key}_cpu_ratio", report.figures[f"{key}_cpu_us"]
                   / report.figures["pub_cpu_us"], f"{kind} / pub (CPU)", fmt=".2f")


def _half_ready(servers, proc) -> bool:
    try:
        status, _ = servers.http(proc, "GET", "/half?topic=t")
    except OSError:
        return False
    return status == 200


async def _pipelined(tcp_address: str, count: int, conns: int = 8, depth: int = 200) -> None:
    """`count` single PUBs (one write request each), `depth` in flight a connection."""
    async def one(n: int) -> None:
        conn = await Conn.open(tcp_address)
        sent = 0
        try:
            while sent < n:
                batch = min(depth, n - sent)
                conn.writer.write(cmd_pub("t", BODY) * batch)
                got = 0
                while got < batch:
                    got += sum(1 for kind, data in conn.frames.frames()
                               if kind == p.FRAME_RESPONSE and data == b"OK")
                    if got < batch:
                        conn.frames.feed(await conn.reader.read(1 << 16))
                sent += batch
        finally:
            conn.close()
    await asyncio.gather(*(one(count // conns) for _ in range(conns)))


def read_back(report: Report, servers, requests: int) -> None:
    report.section(f"read back at open: a partition of {requests:,} single-message requests "
                   "within the window, SIGKILL, start (median of 3)")
    for label, halves in (("none", 0), ("waiting", 100)):
        with tempfile.TemporaryDirectory(prefix="bench-half-") as tmp:
            proc = _node(servers, tmp, "--half-check-timeout", "1h")
            try:
                asyncio.run(_pipelined(proc.tcp_address, requests))

                async def write_halves():
                    conn = await Conn.open(proc.tcp_address)
                    for _ in range(halves):
                        await conn.call(cmd_half("t", BODY, URL, 0))
                    conn.close()
                asyncio.run(write_halves())
                starts, reads = [], []
                for _ in range(3):
                    proc.kill()
                    t = time.perf_counter()
                    proc.start()  # returns once it serves HTTP
                    starts.append(time.perf_counter() - t)
                    while not _half_ready(servers, proc):
                        time.sleep(0.01)
                    reads.append(time.perf_counter() - t)
                status, body = servers.http(proc, "GET", "/half?topic=t")
                assert len(body["partitions"][0]["waiting"]) == halves, body
            finally:
                proc.kill()
        report.add(f"read_back_{label}_s", statistics.median(reads),
                   f"{halves} halves waiting: start to read back (s)", fmt=".2f")
        report.add(f"start_{label}_s", statistics.median(starts),
                   "reference: start to serving (s)", fmt=".2f")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer transactions and requests")
    args = ap.parse_args()
    servers = _load_servers()
    report = Report("halves")
    report.figures.update(common.machine_info())
    transactions(report, servers, 2_000 if args.quick else 10_000)
    read_back(report, servers, 20_000 if args.quick else 200_000)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
