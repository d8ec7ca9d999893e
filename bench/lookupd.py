"""nsqlookupd in cluster mode: /lookup from cache, requests/s, latency, CPU per request.

A real etcd (tests/etcdserver.py) on loopback, three nodes' NodeInfo written in it (the
lookupd only reads them), one nsqlookupd process in cluster mode, one 16-partition topic
created through its /topic/create. Then N keep-alive HTTP/1.1 connections (one request in
flight each) from load-generator processes hammer `GET /lookup?topic=` for a fixed time.
Latency is per request, from write to the last byte of the answer, as the client sees it.
The lookupd's CPU is read from /proc/PID/stat over the measured span.

    .venv/bin/python bench/lookupd.py [--quick] [--connections 50] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench import common  # noqa: E402
from bench.nsqd_server import pid_cpu_seconds  # noqa: E402

TOPIC = "bench_lookup"
PARTITIONS = 16
TARGET_RPS = 5000


class LookupClient(asyncio.Protocol):
    """One keep-alive connection: a GET, wait for the whole answer, the next GET."""

    def __init__(self, request: bytes, job: "Job"):
        self.request = request
        self.job = job
        self.buffer = b""
        self.sent = 0.0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self) -> None:
        self.sent = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head, sep, rest = self.buffer.partition(b"\r\n\r\n")
        if not sep:
            return
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            return
        if not head.startswith(b"HTTP/1.1 200"):
            self.job.errors += 1
        self.buffer = rest[length:]
        self.job.done(self, time.perf_counter() - self.sent)


class Job:
    def __init__(self, address: str, connections: int, warmup: float, duration: float):
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.connections = connections
        self.warmup = warmup
        self.duration = duration
        self.count = 0
        self.errors = 0
        self.latencies: list[float] = []
        self.measuring = False
        self.stopping = False

    def done(self, conn: LookupClient, latency: float) -> None:
        if self.measuring:
            self.count += 1
            self.latencies.append(latency)
        if not self.stopping:
            conn.send()

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        request = (f"GET /lookup?topic={TOPIC} HTTP/1.1\r\nHost: {self.host}\r\n"
                   f"User-Agent: bench\r\n\r\n").encode()
        conns = []
        for _ in range(self.connections):
            _, conn = await loop.create_connection(lambda: LookupClient(request, self),
                                                   self.host, self.port)
            conns.append(conn)
        for c in conns:
            c.send()
        await asyncio.sleep(self.warmup)
        self.measuring = True
        start = time.monotonic()
        await asyncio.sleep(self.duration)
        self.measuring = False
        elapsed = time.monotonic() - start
        self.stopping = True
        await asyncio.sleep(0.2)
        for c in conns:
            c.transport.close()
        return {"count": self.count, "errors": self.errors, "elapsed": elapsed,
                "latencies": self.latencies}


def _worker(spec: dict, out) -> None:
    job = Job(spec["address"], spec["connections"], spec["warmup"], spec["duration"])
    out.put(asyncio.run(job.run()))


def hammer(address: str, connections: int, workers: int, warmup: float,
           duration: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per = [connections // workers + (i < connections % workers) for i in range(workers)]
    procs = [ctx.Process(target=_worker, args=({"address": address, "connections": n,
                                                "warmup": warmup, "duration": duration}, out))
             for n in per if n]
    for p in procs:
        p.start()
    results = [out.get(timeout=warmup + duration + 60) for _ in procs]
    for p in procs:
        p.join()
    latencies = sorted(x for r in results for x in r["latencies"])
    return {"count": sum(r["count"] for r in results),
            "errors": sum(r["errors"] for r in results),
            "elapsed": max(r["elapsed"] for r in results), "latencies": latencies}


def put_node(etcd, port: int) -> None:
    from isr import keys
    from isr.state import NodeInfo

    info = NodeInfo(id=f"127.0.0.1:{port}", tcp=f"127.0.0.1:{port}",
                    http=f"127.0.0.1:{port + 1}", rpc=f"127.0.0.1:{port + 2}",
                    hostname=f"node{port}", version="1.3.0")
    etcd.post("kv/put", {"key": base64.b64encode(keys.node("nsq", info.id).encode()).decode(),
                         "value": base64.b64encode(info.encode()).decode()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s measured instead of 10 s")
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2, help="load-generator processes")
    args = ap.parse_args()
    warmup, duration = (1.0, 3.0) if args.quick else (2.0, 10.0)

    from etcdserver import EtcdProcess
    from servers import NsqlookupdProcess

    report = common.Report("lookupd")
    report.figures.update(common.machine_info())
    with tempfile.TemporaryDirectory(prefix="bench_lookupd_") as base:
        etcd = EtcdProcess(os.path.join(base, "etcd")).start()
        lookupd = None
        try:
            for i in range(3):
                put_node(etcd, 41000 + 10 * i)
            lookupd = NsqlookupdProcess(base, "--etcd-endpoints", etcd.endpoint,
                                        "--log-level", "warning").start()
            url = f"http://{lookupd.http_address}"
            created = _until_created(url)
            with urllib.request.urlopen(f"{url}/lookup?topic={TOPIC}") as r:
                body = r.read()
            partitions = len(json.loads(body)["partitions"])
            report.section(f"/lookup?topic= of a {partitions}-partition topic: "
                           f"{args.connections} keep-alive connections, {args.workers} "
                           f"load processes, {duration:g} s measured")
            report.note(f"answer {len(body)} bytes; topic writable in the lookupd's view "
                        f"{created * 1000:.0f} ms after /topic/create was sent")
            report.add("topic_create_ms", created * 1000, "topic create -> in /lookup (ms)")
            cpu0 = pid_cpu_seconds(lookupd.proc.pid)
            with common.CpuWatch() as watch:
                result = hammer(lookupd.http_address, args.connections, args.workers,
                                warmup, duration)
            cpu1 = pid_cpu_seconds(lookupd.proc.pid)
        finally:
            if lookupd is not None:
                lookupd.kill()
            etcd.kill()
    rps = result["count"] / result["elapsed"]
    lat = result["latencies"]
    # the lookupd's CPU over warm-up + measured span, spread over every request answered
    lookupd_cpu = (cpu1 - cpu0) / watch.wall
    report.add("lookup_requests_per_s", rps, "requests/s", ",.0f",
               target=(f">= {TARGET_RPS:,}", rps >= TARGET_RPS))
    report.add("lookup_p50_ms", common.percentile(lat, 50) * 1000, "p50 latency (ms)", ".2f")
    report.add("lookup_p99_ms", common.percentile(lat, 99) * 1000, "p99 latency (ms)", ".2f")
    report.add("lookup_errors", result["errors"], "non-200 answers", ",d")
    report.add("lookupd_cpus", lookupd_cpu, "lookupd CPUs used", ".2f")
    report.add("lookupd_cpu_us_per_request", lookupd_cpu / rps * 1e6 if rps else float("nan"),
               "lookupd CPU per request (us)", ".1f")
    report.add("loadgen_cpus", watch.own_cpus, "load generators CPUs", ".2f")
    report.add("other_cpus", max(0.0, watch.other_cpus - lookupd_cpu),
               "other processes CPUs (noise)", ".2f")
    report.add("answer_bytes", len(body), "answer size (bytes)", ",d")
    report.add("partitions", partitions, "partitions", ",d")
    report.emit_json()


def _until_created(url: str) -> float:
    """Create the topic on the (only, hence master) lookupd; seconds until /lookup has it."""
    deadline = time.monotonic() + 15
    while True:  # wait for mastership
        with urllib.request.urlopen(f"{url}/info") as r:
            if json.loads(r.read())["cluster"]["is_master"]:
                break
        if time.monotonic() > deadline:
            raise RuntimeError("the lookupd never became master")
        time.sleep(0.05)
    start = time.monotonic()
    req = urllib.request.Request(f"{url}/topic/create?topic={TOPIC}&partition_num={PARTITIONS}",
                                 method="POST")
    urllib.request.urlopen(req, timeout=10).read()
    while True:
        try:
            with urllib.request.urlopen(f"{url}/lookup?topic={TOPIC}") as r:
                if len(json.loads(r.read())["partitions"]) == PARTITIONS:
                    return time.monotonic() - start
        except urllib.error.HTTPError:
            pass
        time.sleep(0.005)


if __name__ == "__main__":
    main()
