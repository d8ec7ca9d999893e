"""What dead letters cost (nsqd/deadletters.py). Our nsqd in a subprocess, over TCP.

    .venv/bin/python bench/deadletters.py [--quick]

- delivery: a backlog of 200-byte messages (MPUB), consumed and FINed by one connection
  (RDY 200), on a channel without `max_attempts` and on one with `max_attempts=5`: the
  messages a second and nsqd's CPU a message (its own CPU time), a fresh nsqd each, 3
  alternated rounds, medians. The feature's cost on the path every message takes.
- burying: the same backlog on a channel with `max_attempts=1`, every message REQed: the
  burials a second and nsqd's CPU a burial (a dead copy written and committed, the
  message finished), beside delivery's CPU a message.
- listing, read back, requeue: with those dead letters kept, a page of 1,000
  (`/channel/dead?limit=1000`); nsqd SIGKILLed and started again, the time until the
  channel's dead letters are read back (median of 3 restarts), with a backlog of
  messages written after them; every one requeued (`/channel/dead/requeue`).

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
from bench.nsqd_server import _load_servers, pid_cpu_seconds  # noqa: E402
from nsqwire import protocol as p  # noqa: E402
from nsqwire.commands import (FrameParser, cmd_fin, cmd_mpub, cmd_rdy, cmd_req,  # noqa: E402
                              cmd_sub, parse_message)

BODY = b"x" * 200
BATCH = 200  # messages an MPUB
RDY = 200


def publish(tcp_address: str, topic: str, count: int) -> None:
    sock = _connect(tcp_address)
    frames = FrameParser()
    for i in range(0, count, BATCH * 10):
        cmds = [cmd_mpub(topic, [BODY] * BATCH) for _ in range(min(10, (count - i) // BATCH))]
        sock.sendall(b"".join(cmds))
        got = 0
        while got < len(cmds):
            frames.feed(sock.recv(1 << 16))
            got += sum(1 for kind, data in frames.frames()
                       if kind == p.FRAME_RESPONSE and data == b"OK")
    sock.close()


def _connect(tcp_address: str) -> socket.socket:
    host, port = tcp_address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(p.MAGIC_V2)
    return sock


def consume(tcp_address: str, topic: str, channel: str, count: int, answer) -> None:
    """Take `count` messages, each answered by `answer(msg_id)` (the command's bytes)."""
    sock = _connect(tcp_address)
    frames = FrameParser()
    sock.sendall(cmd_sub(topic, channel) + cmd_rdy(RDY))
    got = 0
    while got < count:
        data = sock.recv(1 << 20)
        if not data:
            raise RuntimeError("nsqd closed the connection")
        frames.feed(data)
        out = []
        for kind, payload in frames.frames():
            if kind == p.FRAME_MESSAGE:
                out.append(answer(parse_message(payload)[2]))
                got += 1
            elif kind == p.FRAME_ERROR:
                raise RuntimeError(payload.decode())
        if out:
            sock.sendall(b"".join(out))
    sock.close()


def _node(servers, tmp: str):
    proc = servers.NsqdProcess(os.path.join(tmp, "nsqd")).start()
    servers.http(proc, "POST", "/topic/create?topic=t")
    servers.http(proc, "POST", "/channel/create?topic=t&channel=c")
    return proc


def _config(servers, proc, max_attempts: int) -> None:
    status, body = servers.http(proc, "POST", f"/channel/config?topic=t&channel=c"
                                              f"&max_attempts={max_attempts}")
    assert status == 200, body


def _dead_count(servers, proc) -> int:
    status, body = servers.http(proc, "GET", "/channel/dead?topic=t&channel=c&limit=1")
    return body["count"] if status == 200 and not body["loading"] else -1


def delivery(report: Report, servers, count: int) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "max_attempts=5": []}
    for _ in range(3):
        for label in runs:
            with tempfile.TemporaryDirectory(prefix="bench-dead-") as tmp:
                proc = _node(servers, tmp)
                try:
                    if label != "off":
                        _config(servers, proc, 5)
                    publish(proc.tcp_address, "t", count)
                    cpu, t = pid_cpu_seconds(proc.proc.pid), time.perf_counter()
                    consume(proc.tcp_address, "t", "c", count, cmd_fin)
                    elapsed = time.perf_counter() - t
                    runs[label].append((count / elapsed,
                                        (pid_cpu_seconds(proc.proc.pid) - cpu) / count * 1e6))
                finally:
                    proc.kill()
    report.section(f"delivery: {count:,} messages consumed and FINed, without and with "
                   "max_attempts (3 alternated rounds, medians)")
    for label, values in runs.items():
        key = label.replace("=", "_")
        report.add(f"deliver_{key}_msgs_per_s", statistics.median(v[0] for v in values),
                   f"{label}: msgs/s", fmt=",.0f")
        report.add(f"deliver_{key}_cpu_us", statistics.median(v[1] for v in values),
                   f"{label}: nsqd CPU a message (µs)", fmt=".2f")
    report.add("deliver_ratio", report.figures["deliver_max_attempts_5_msgs_per_s"]
               / report.figures["deliver_off_msgs_per_s"], "with / without (msgs/s)",
               fmt=".3f")


def burying(report: Report, servers, count: int, backlog: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-dead-") as tmp:
        proc = _node(servers, tmp)
        try:
            _config(servers, proc, 1)
            publish(proc.tcp_address, "t", count)
            cpu, t = pid_cpu_seconds(proc.proc.pid), time.perf_counter()
            consume(proc.tcp_address, "t", "c", count, lambda i: cmd_req(i, 0, "failing"))
            while _dead_count(servers, proc) < count:
                time.sleep(0.01)
            elapsed = time.perf_counter() - t
            cpu = (pid_cpu_seconds(proc.proc.pid) - cpu) / count * 1e6
            report.section(f"burying: {count:,} messages REQed once on max_attempts=1")
            report.add("buried_per_s", count / elapsed, "burials a second", fmt=",.0f")
            report.add("bury_cpu_us", cpu, "nsqd CPU a burial (delivery and REQ included, µs)",
                       fmt=".1f")

            t = time.perf_counter()
            status, page = servers.http(proc, "GET", "/channel/dead?topic=t&channel=c"
                                                     "&limit=1000")
            assert status == 200 and len(page["dead_letters"]) == min(1000, count), page
            report.section(f"with {count:,} dead letters kept")
            report.add("list_1000_s", time.perf_counter() - t, "a page of 1,000 (s)",
                       fmt=".3f")
            publish(proc.tcp_address, "t", backlog)  # written after them: read back too
            reads, starts = [], []
            for _ in range(3):
                proc.kill()
                t = time.perf_counter()
                proc.start()  # returns once it serves HTTP
                starts.append(time.perf_counter() - t)
                while _dead_count(servers, proc) != count:
                    time.sleep(0.01)
                reads.append(time.perf_counter() - t)
            report.add("read_back_s", statistics.median(reads),
                       f"start to read back, {backlog:,} messages after them (s, median of 3)",
                       fmt=".2f")
            report.add("start_s", statistics.median(starts), "reference: start to serving (s)",
                       fmt=".2f")
            t = time.perf_counter()
            status, body = servers.http(proc, "POST", "/channel/dead/requeue?topic=t&channel=c")
            assert status == 200 and body["count"] == count, body
            report.add("requeued_per_s", count / (time.perf_counter() - t),
                       "requeued a second (each a revived copy written)", fmt=",.0f")
        finally:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20,000 messages, not 200,000")
    args = ap.parse_args()
    servers = _load_servers()
    report = Report("deadletters")
    report.figures.update(common.machine_info())
    count = 20_000 if args.quick else 200_000
    delivery(report, servers, count)
    burying(report, servers, count // 10, count)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
