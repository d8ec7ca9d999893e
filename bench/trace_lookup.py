"""How long nsqlookupd's cluster-wide trace search takes, against asking one nsqd.

Real processes in classic mode (no etcd needed): one nsqlookupd and `--nodes` nsqd with
`--trace-all`, registered with it. Each nsqd takes `--messages` messages by HTTP /mpub
(one PUB event each in its own store). Then, one request at a time on one keep-alive
connection: `/trace/search?msg_id=` of random known ids on one nsqd directly, the same
through nsqlookupd (every nsqd asked in parallel, the answers merged), and a topic search
with limit=1000 through nsqlookupd (1,000 events from each node merged, the oldest 1,000
kept).

Figures: `node_msg_id_median_ms` / `_p99_ms`, `lookupd_msg_id_median_ms` / `_p99_ms`,
`lookupd_topic_1000_median_ms` / `_p99_ms`. Target: `lookupd_msg_id_p99_ms` < 50 (the
node's own search target is 20 ms; one more hop and the merge).

    .venv/bin/python bench/trace_lookup.py             # 3 nodes, 20,000 messages each
    .venv/bin/python bench/trace_lookup.py --quick     # 3 nodes, 2,000 each, fewer requests
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.common import Report, machine_info, percentile  # noqa: E402
from servers import NsqdProcess, NsqlookupdProcess  # noqa: E402

TOPIC = "bench_trace"
BATCH = 500


def request(conn: http.client.HTTPConnection, method: str, path: str,
            body: bytes | None = None) -> tuple[int, bytes]:
    conn.request(method, path, body=body)
    r = conn.getresponse()
    return r.status, r.read()


def connect(proc) -> http.client.HTTPConnection:
    host, port = proc.http_address.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=30)


def timed(conn, paths: list[str]) -> list[float]:
    """Milliseconds of each GET, in order; every answer must be 200."""
    out = []
    for path in paths:
        t0 = time.perf_counter()
        status, body = request(conn, "GET", path)
        out.append((time.perf_counter() - t0) * 1000)
        assert status == 200, (path, status, body[:200])
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--messages", type=int, default=20_000, help="per node")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.messages, a.requests = 2_000, 200
    report = Report("trace_lookup")
    report.figures.update(machine_info())
    root = tempfile.mkdtemp(prefix="bench-trace-lookup-")
    lookupd = NsqlookupdProcess(os.path.join(root, "logs")).start()
    nodes = [NsqdProcess(os.path.join(root, f"n{i}"), "--lookupd-tcp-address",
                         lookupd.tcp_address, "--trace-all").start() for i in range(a.nodes)]
    try:
        report.section(f"{a.nodes} nsqd, {a.messages:,} traced messages each")
        for node in nodes:
            conn = connect(node)
            for start in range(0, a.messages, BATCH):
                body = b"\n".join(b"m%d" % i for i in range(start, min(a.messages, start + BATCH)))
                status, _ = request(conn, "POST", f"/mpub?topic={TOPIC}", body)
                assert status == 200, status
            deadline = time.monotonic() + 120
            while json.loads(request(conn, "GET", "/stats?format=json")[1])["trace"][
                    "written"] < a.messages:
                assert time.monotonic() < deadline, "the trace writer did not catch up"
                time.sleep(0.1)
            conn.close()
        lconn = connect(lookupd)
        deadline = time.monotonic() + 30
        while len(json.loads(request(lconn, "GET", "/nodes")[1])["producers"]) < a.nodes:
            assert time.monotonic() < deadline, "the nsqd did not register"
            time.sleep(0.1)
        first = connect(nodes[0])
        found = json.loads(request(first, "GET", f"/trace/search?topic={TOPIC}&limit=10000")[1])
        ids = [m["msg_id"] for m in found["messages"]]
        rng = random.Random(1)
        paths = [f"/trace/search?msg_id={rng.choice(ids)}" for _ in range(a.requests)]
        for name, conn, ps in (
                ("node_msg_id", first, paths),
                ("lookupd_msg_id", lconn, paths),
                ("lookupd_topic_1000", lconn,
                 [f"/trace/search?topic={TOPIC}&limit=1000"] * max(20, a.requests // 10))):
            ms = timed(conn, ps)
            report.section(f"{name}: {len(ms)} searches")
            report.add(f"{name}_median_ms", statistics.median(ms), "median ms", ",.2f")
            target = ("< 50", percentile(ms, 99) < 50) if name == "lookupd_msg_id" else None
            report.add(f"{name}_p99_ms", percentile(ms, 99), "p99 ms", ",.2f", target=target)
        report.figures["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    finally:
        for p in nodes + [lookupd]:
            p.kill()
        shutil.rmtree(root, ignore_errors=True)
    report.emit_json()


if __name__ == "__main__":
    main()
