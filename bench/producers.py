"""What idempotent producers cost a partition outside the publish path (nsqd/producers.py;
the per-publish cost is bench/nsqd.py's part (i)). Our nsqd in a subprocess, over TCP.

    .venv/bin/python bench/producers.py [--quick]

- rebuild: a partition filled with 32 MiB (4 MiB quick) of single 200-byte named PUB_EXTs
  (100 producers), nsqd SIGKILLed and started again; then the first named request (one
  sent again: answered from the table, nothing written) waits for the table to be read
  back from the log. Its latency, beside the reference: the first unnamed PUB after the
  same restart (no table read). Median of 3 restarts. Also what the most a rebuild reads
  (SCAN_REQUESTS, 500,000 requests) would take, at the measured requests a second.
- memory: 20,000 producers (2,000, the most a partition keeps, on each of 10 partitions),
  5 named PUBs each (the 5 answers a producer's entry keeps), against the same 100,000
  PUBs unnamed on a fresh nsqd: the RSS difference, per producer.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import os
import socket
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
from bench.nsqd_server import _load_servers, pid_rss_mb  # noqa: E402
from nsqwire import protocol as p  # noqa: E402
from nsqwire.commands import FrameParser, cmd_pub, cmd_pub_ext  # noqa: E402

BODY = b"x" * 200
SCAN_REQUESTS = 500_000  # nsqd/producers.py's: the most requests a partition reads back
KEPT = 5  # nsqd/producers.py's: the answers a producer's entry keeps
PIPELINE = 200  # requests sent before their answers are read


class Conn:
    """A blocking connection: send commands, read their answers (raising on an error)."""

    def __init__(self, tcp_address: str):
        host, port = tcp_address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.sock.sendall(p.MAGIC_V2)
        self.frames = FrameParser()

    def send(self, commands: list[bytes]) -> None:
        self.sock.sendall(b"".join(commands))
        got = 0
        while got < len(commands):
            data = self.sock.recv(1 << 20)
            if not data:
                raise RuntimeError("nsqd closed the connection")
            self.frames.feed(data)
            for kind, payload in self.frames.frames():
                if kind == p.FRAME_ERROR:
                    raise RuntimeError(payload.decode())
                if payload != b"_heartbeat_":
                    got += 1

    def close(self) -> None:
        self.sock.close()


def named(topic: str, producer: str, sequence: int, partition: int = 0) -> bytes:
    return cmd_pub_ext(topic, {"##producer_id": producer, "##sequence": sequence}, BODY,
                       partition)


def start(servers, path: str):
    proc = servers.NsqdProcess(path).start()
    return proc


def rebuild(report: Report, servers, size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-producers-") as tmp:
        proc = start(servers, os.path.join(tmp, "nsqd"))
        try:
            conn = Conn(proc.tcp_address)
            conn.send([cmd_pub("plain", BODY)])
            n, per_request = 0, len(BODY) + 36 + 40  # a record with its ##producer mark
            while n * per_request < size:
                conn.send([named("t", f"p{(n + i) % 100}", (n + i) // 100)
                           for i in range(PIPELINE)])
                n += PIPELINE
            conn.close()
            firsts, plains = [], []
            for _ in range(3):
                proc.kill()
                proc.start()
                conn = Conn(proc.tcp_address)
                t = time.perf_counter()
                conn.send([cmd_pub("plain", BODY)])
                plains.append(time.perf_counter() - t)
                last = n - 1
                t = time.perf_counter()
                conn.send([named("t", f"p{last % 100}", last // 100)])  # sent again
                firsts.append(time.perf_counter() - t)
                conn.close()
        finally:
            proc.kill()
    first, plain = statistics.median(firsts), statistics.median(plains)
    report.section(f"rebuild: the first named request after a restart, {size >> 20} MiB of "
                   f"named single PUBs in the partition ({n:,} requests)")
    report.add("rebuild_requests", n, "named requests in the partition", fmt=",d")
    report.add("first_named_s", first, "the first named request's answer (s, median of 3)",
               fmt=".3f")
    report.add("first_plain_s", plain, "reference: the first unnamed PUB's (s)", fmt=".3f")
    per_s = n / max(first - plain, 1e-6)
    report.add("rebuild_requests_per_s", per_s, "requests read back a second", fmt=",.0f")
    report.add("rebuild_max_s", SCAN_REQUESTS / per_s,
               f"the most a rebuild reads, {SCAN_REQUESTS:,} requests (s)", fmt=".2f")


def memory(report: Report, servers, producers: int, partitions: int) -> None:
    rss = {}
    for label in ("unnamed", "named"):
        with tempfile.TemporaryDirectory(prefix="bench-producers-") as tmp:
            proc = start(servers, os.path.join(tmp, "nsqd"))
            try:
                servers.http(proc, "POST", f"/topic/create?topic=t&partition_num={partitions}")
                conn = Conn(proc.tcp_address)
                for n in range(partitions):
                    conn.send([cmd_pub("t", BODY, n)])  # each partition open, its table read
                    if label == "named":
                        conn.send([named("t", "warm", 0, n)])
                time.sleep(0.5)
                before = pid_rss_mb(proc.proc.pid)
                for s in range(KEPT):
                    cmds = [named("t", f"{i:032x}", s, i % partitions) if label == "named"
                            else cmd_pub("t", BODY, i % partitions) for i in range(producers)]
                    for i in range(0, producers, PIPELINE):
                        conn.send(cmds[i:i + PIPELINE])
                conn.close()
                time.sleep(0.5)
                rss[label] = pid_rss_mb(proc.proc.pid) - before
            finally:
                proc.kill()
    report.section(f"memory: {producers:,} producers over {partitions} partitions, {KEPT} named "
                   "PUBs each, against as many unnamed PUBs")
    report.add("rss_named_mb", rss["named"], "RSS growth, named (MB)", fmt=",.1f")
    report.add("rss_unnamed_mb", rss["unnamed"], "RSS growth, unnamed (MB)", fmt=",.1f")
    report.add("table_bytes_per_producer", (rss["named"] - rss["unnamed"]) * common.MB
               / producers, "bytes a producer (the difference)", fmt=",.0f")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 MiB and 5,000 producers")
    args = ap.parse_args()
    servers = _load_servers()
    report = Report("producers")
    report.figures.update(common.machine_info())
    rebuild(report, servers, (4 if args.quick else 32) << 20)
    memory(report, servers, 5_000 if args.quick else 20_000, 10)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
