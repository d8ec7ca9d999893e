"""Server-side render time of nsqadmin's pages with a large cluster's metadata.

The metadata is generated, not served: 3 nsqd's `/stats?format=json` answers in cluster
mode (1,000 topics x 4 partitions x 5 channels by default, R=2: each partition led by one
node and followed by the next, every channel with 2 clients), plus an nsqlookupd's /nodes,
/topics and /info. They are fed DIRECTLY to the code a poll runs (`model.build`, then
`History.add` with 60 samples, as 5 minutes of 5 s polls), with no HTTP in between: the
bench measures OUR render time only, not the network or aiohttp. A page's time is what
app.py spends on a request: `views.X` (the dict, also the /api/ answer) + `pages.X` (the
HTML) + `pages.layout`, repeated `--repeat` times.

Figures per page: `<page>_render_median_ms`, `<page>_render_p99_ms`, `<page>_html_bytes`;
`snapshot_build_ms` (one poll's model.build, informational: it runs once per poll, not per
page). Target: every page's p99 < 300 ms.

    .venv/bin/python bench/nsqadmin_render.py            # 1,000 x 4 x 5, 50 renders a page
    .venv/bin/python bench/nsqadmin_render.py --quick    # the same metadata, 10 renders
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.common import Report, machine_info, percentile  # noqa: E402
from nsqadmin import model, pages, views  # noqa: E402
from nsqadmin.history import History  # noqa: E402

NODES = 3


def node_id(i: int) -> str:
    return f"10.0.0.{i + 1}:4150"


def http(i: int) -> str:
    return f"10.0.0.{i + 1}:4151"


def channel_part(p: int, n_clients: int) -> dict:
    return {"partition": p, "depth": 120 + p, "backend_depth": 120 + p, "in_flight_count": 3,
            "deferred_count": 1, "delayed_count": 2, "delay_oldest_due_ms": None,
            "delay_error": None, "requeued_count": 0, "message_count": 5000,
            "requeue_count": 4, "timeout_count": 1, "finish_count": 4880,
            "filtered_count": 0, "client_count": n_clients, "paused": False, "ordered": False,
            "confirmed": 400000, "confirmed_count": 4880, "next_read": 410000,
            "next_count": 4990, "window": 0, "error": None}


def client(i: int, c: int) -> dict:
    return {"client_id": f"worker-{c}", "hostname": f"app{c}.example", "version": "V2",
            "remote_address": f"10.1.0.{c}:{40000 + i}", "state": 3, "ready_count": 50,
            "in_flight_count": 3, "message_count": 9000, "finish_count": 8990,
            "requeue_count": 4, "connect_ts": int(time.time()) - 3600, "sample_rate": 0,
            "deflate": False, "snappy": False, "user_agent": "pynsq/0.9.1"}


def node_stats(i: int, topics: int, partitions: int, channels: int) -> dict:
    """One nsqd's /stats?format=json: the partitions it leads (p % NODES == i) and follows."""
    out_topics, leading, following = [], {}, {}
    for t in range(topics):
        name = f"topic_{t:04d}"
        led = [p for p in range((partitions)) if (p + t) % NODES == i]
        followed = [p for p in range(partitions) if (p + t + 1) % NODES == i]
        chans = []
        for c in range(channels):
            clients = [client(i, k) for k in range(2)] if led else []
            chans.append({"channel_name": f"ch{c}", "depth": 0, "backend_depth": 0,
                          "in_flight_count": 0, "deferred_count": 0, "message_count": 0,
                          "requeue_count": 0, "timeout_count": 0, "client_count": 2,
                          "clients": clients, "paused": False,
                          "e2e_processing_latency": {"count": 0, "percentiles": None},
                          "partitions": [channel_part(p, 2) for p in led]})
        parts = []
        for p in range(partitions):
            if p in led:
                parts.append({"partition": p, "leader": True,
                              "channels": [f"ch{c}" for c in range(channels)], "depth": 0,
                              "start_offset": 0, "start_count": 0,
                              "committed_offset": 2_000_000, "committed_count": 5000,
                              "written_offset": 2_000_000, "written_count": 5000,
                              "sync_every": 1, "sync_timeout_ms": 0, "error": None})
                leading[f"{name}/{p}"] = {
                    "epoch": 3, "isr": [node_id(i), node_id((i + 1) % NODES)],
                    "writable": True, "reason": "", "pushes": 10, "acks": 10}
            else:
                parts.append({"partition": p, "leader": False, "depth": 0, "channels": [],
                              "error": None})
        for p in followed:
            following[f"{name}/{p}"] = {"epoch": 3, "pushes": 10, "appends": 10}
        out_topics.append({"topic_name": name, "channels": chans, "depth": 0,
                           "backend_depth": 0, "message_count": 5000 * len(led),
                           "message_bytes": 0, "paused": False, "partition_num": partitions,
                           "ordered": False, "partitions": parts})
    return {"version": "1.3.0", "health": "OK", "start_time": int(time.time()) - 86400,
            "topics": out_topics, "client_count": 2 * channels * topics // NODES,
            "trace": {"trace_all": False, "topics": [], "channels": [], "sink": "sqlite"},
            "cluster": {"node_id": node_id(i), "cluster_id": "bench", "etcd_connected": True,
                        "lease_ok": True, "partitions_led": len(leading),
                        "replication": {"leading": leading, "following": following}}}


class FakeSource:
    """What views.py reads from a Source: the Snapshot, the History, the last poll's time."""

    def __init__(self, snapshot, history):
        self.snapshot, self.history, self.poll_seconds = snapshot, history, 0.0


def trace_answer(messages: int) -> dict:
    """A search answer of `messages` timelines of 5 events each, bodies fetched."""
    now = time.time_ns()
    msgs = []
    for m in range(messages):
        evs = [{"node": node_id(k % NODES), "time_ns": now + k * 1_000_000, "kind": kind,
                "channel": "ch0", "what": f"{kind.lower()} on ch0", "since_first_ms": k}
               for k, kind in enumerate(("PUB", "DELIVER", "REQ", "DELIVER", "FIN"))]
        msgs.append({"msg_id": f"{m:016x}", "topic": "topic_0001", "partition": 0,
                     "trace_id": "0", "finished": True, "story": "published -> finished",
                     "events": evs, "body_text": "x" * 200, "body_hex": None})
    return {"status": 200, "messages": msgs, "count": messages * 5, "nodes": [http(0)],
            "unreachable": [], "message": "", "detail": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--channels", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=0, help="renders a page (50; 10 quick)")
    args = ap.parse_args()
    repeat = args.repeat or (10 if args.quick else 50)
    report = Report("nsqadmin_render")
    report.figures.update(machine_info())
    report.figures["loadavg_1m_start"] = round(os.getloadavg()[0], 2)

    report.section(f"metadata: {args.topics} topics x {args.partitions} partitions x "
                   f"{args.channels} channels on {NODES} nodes (fed directly, no HTTP)")
    stats = {http(i): node_stats(i, args.topics, args.partitions, args.channels)
             for i in range(NODES)}
    producers = [{"broadcast_address": f"10.0.0.{i + 1}", "tcp_port": 4150,
                  "http_port": 4151, "hostname": f"nsqd{i}", "version": "1.3.0",
                  "topics": [], "tombstones": []} for i in range(NODES)]
    lookupds = [{"address": "10.0.0.9:4161", "error": "", "info": {"version": "1.3.0",
                 "cluster": {"is_master": True, "master_http_address": "10.0.0.9:4161",
                             "etcd_connected": True, "view": "current", "leaderless": [],
                             "problems": []}}}]
    names = [f"topic_{t:04d}" for t in range(args.topics)]
    builds = []
    snap = None
    for _ in range(3):
        t0 = time.perf_counter()
        snap = model.build("cluster", time.time(), lookupds, producers, names, stats, {}, {},
                           None, "load reports not available")
        builds.append((time.perf_counter() - t0) * 1000)
    report.add("snapshot_build_ms", statistics.median(builds), "one poll's model.build (ms)",
               ".1f")
    history = History(300, 5)
    t0 = time.perf_counter()
    base = snap.taken_at - 300
    for k in range(60):  # 5 minutes of 5 s polls: counts grow, depths move
        snap.taken_at = base + 5 * k
        for t in snap.topics.values():
            t.messages += 50
            for p in t.partitions:
                p.messages += 12
                p.depth = (p.depth + 7 * k) % 500
        history.add(snap)
    report.add("history_add_ms", (time.perf_counter() - t0) * 1000 / 60,
               "one History.add (ms)", ".2f")
    source = FakeSource(snap, history)
    topic, channel = names[1], "ch0"
    node = http(0)
    ctx = {"csrf": "x" * 32, "auth": True, "user": "ops", "flash": "", "refresh": 5}
    page_funcs = {
        "cluster": lambda: pages.cluster_page(views.cluster_view(source), ctx),
        "topics": lambda: pages.topics_page(views.topics_view(source), ctx),
        "topic": lambda: pages.topic_page(views.topic_view(source, topic), ctx),
        "channel": lambda: pages.channel_page(views.channel_view(source, topic, channel), ctx),
        "node": lambda: pages.node_page(views.node_view(source, node), ctx),
        "trace": lambda: pages.trace_page(trace_answer(views.TRACE_BODIES),
                                          {"topic": topic}, "", ctx),
    }
    report.section(f"render: views + pages + layout, {repeat} times a page")
    worst = 0.0
    for name, fn in page_funcs.items():
        times, size = [], 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            title, main = fn()
            html = pages.layout(title, main, ctx)
            times.append((time.perf_counter() - t0) * 1000)
            size = len(html)
        times.sort()
        p99 = percentile(times, 99)
        worst = max(worst, p99)
        report.add(f"{name}_render_median_ms", statistics.median(times),
                   f"{name}: median (ms)", ".2f")
        report.add(f"{name}_render_p99_ms", p99, f"{name}: p99 (ms)", ".2f",
                   target=("< 300", p99 < 300))
        report.add(f"{name}_html_bytes", size, f"{name}: HTML size", ",d")
    report.check("every page p99 < 300 ms", worst < 300)
    report.figures["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    report.emit_json()


if __name__ == "__main__":
    main()
